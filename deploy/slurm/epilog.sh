#!/usr/bin/env bash
# Slurm Epilog: stop the job's resilient_ckpt daemon on this node and drop the job's
# checkpoints from memory, unless they are to be kept (RESILIENT_CKPT_KEEP_SESSIONS=1, or the
# job created $RESILIENT_CKPT_RUN_DIR/$SLURM_JOB_ID/keep, e.g. before a requeue).
#
# It always exits 0: a failing epilog drains the node, and nothing here is worth that. What
# went wrong is logged (stderr and syslog).
set -uo pipefail

conf=${RESILIENT_CKPT_CONF:-/etc/resilient-ckpt/slurm.conf}
if [[ -r $conf ]]; then
    # shellcheck source-path=SCRIPTDIR source=resilient-ckpt.conf
    . "$conf"
fi
bin=${RESILIENT_CKPT_BIN:-/opt/resilient-ckpt/bin/resilient-ckpt}
store_root=${RESILIENT_CKPT_STORE_ROOT:-/dev/shm/resilient_ckpt}
run_dir=${RESILIENT_CKPT_RUN_DIR:-/run/resilient-ckpt}
keep_sessions=${RESILIENT_CKPT_KEEP_SESSIONS:-0}

job=${SLURM_JOB_ID:?the epilog runs under slurmd, which sets SLURM_JOB_ID}
session="slurm-$job"
run="$run_dir/$job"
unit="resilient-ckpt-job$job"

log() {
    echo "resilient-ckpt epilog (job $job): $*" >&2
    logger -t resilient-ckpt "epilog job $job: $*" 2>/dev/null || true
}

# 1. Stop the daemon (SIGTERM: it stops serving and exits; the store stays).
if command -v systemctl >/dev/null && systemctl is-active --quiet "$unit" 2>/dev/null; then
    systemctl stop "$unit" || log "systemctl stop $unit failed"
fi
if [[ -f $run/daemon.pid ]]; then
    pid=$(cat "$run/daemon.pid")
    # Only the process the prolog started: same pid *and* still our daemon (pids are reused).
    if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "serve .*--session $session "; then
        kill -TERM "$pid"
        for _ in $(seq 1 60); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "daemon $pid ignored SIGTERM for 30 s; killing it"
            kill -KILL "$pid" 2>/dev/null
        fi
    fi
fi

# 2. Drop the job's checkpoints from this node's memory, unless kept.
if [[ $keep_sessions == 1 || -e $run/keep ]]; then
    log "keeping session $session in $store_root (drop it later: $bin drop --store-root $store_root --session $session --all)"
elif [[ -d $store_root/$session ]]; then
    "$bin" drop --store-root "$store_root" --session "$session" --all --yes >/dev/null ||
        log "could not drop session $session from $store_root"
fi

# 3. The job's runtime files (peers, secret, endpoint, pid, log).
rm -rf -- "$run"
exit 0
