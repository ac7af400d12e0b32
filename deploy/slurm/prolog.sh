#!/usr/bin/env bash
# Slurm Prolog: start this node's resilient_ckpt daemon for the job, as the job's user.
#
# slurm.conf:  Prolog=/etc/resilient-ckpt/prolog.sh  Epilog=/etc/resilient-ckpt/epilog.sh
#              PrologFlags=Alloc   (run at allocation, on every node, before any step)
# Settings:    /etc/resilient-ckpt/slurm.conf ($RESILIENT_CKPT_CONF), see resilient-ckpt.conf.
#
# What it sets up for job J on node N (N = index of this node in the job's node names sorted
# bytewise, which is the GROUP_RANK torchrun's c10d rendezvous gives the node when launched
# with --local-addr $SLURMD_NODENAME, as deploy/torchrun/launch.sh does):
#   /run/resilient-ckpt/J/peers     every node's daemon, "ID tcp://HOST:PORT"
#   /run/resilient-ckpt/J/secret    the job secret (0600, owned by the job's user), derived from
#                                   the cluster key and the job id: the same on every node
#   /run/resilient-ckpt/J/endpoint  where trainers reach this node's daemon
#   a daemon serving session "slurm-J" only, its log in the journal (systemd-run) or
#   /run/resilient-ckpt/J/daemon.log (setsid)
# A non-zero exit makes Slurm drain the node and requeue the job: it happens only when the
# daemon cannot be started for a job that asked for it.
set -euo pipefail

conf=${RESILIENT_CKPT_CONF:-/etc/resilient-ckpt/slurm.conf}
if [[ -r $conf ]]; then
    # shellcheck source-path=SCRIPTDIR source=resilient-ckpt.conf
    . "$conf"
fi
bin=${RESILIENT_CKPT_BIN:-/opt/resilient-ckpt/bin/resilient-ckpt}
store_root=${RESILIENT_CKPT_STORE_ROOT:-/dev/shm/resilient_ckpt}
run_dir=${RESILIENT_CKPT_RUN_DIR:-/run/resilient-ckpt}
cluster_key=${RESILIENT_CKPT_CLUSTER_KEY:-/etc/resilient-ckpt/cluster.key}
port_base=${RESILIENT_CKPT_PORT:-7465}
port_span=${RESILIENT_CKPT_PORT_SPAN:-1}
metrics_port=${RESILIENT_CKPT_METRICS_PORT:-}
keep_last=${RESILIENT_CKPT_KEEP_LAST:-2}
memory_budget=${RESILIENT_CKPT_MEMORY_BUDGET:-}
jobs=${RESILIENT_CKPT_JOBS:-all}
launcher=${RESILIENT_CKPT_LAUNCHER:-auto}
start_timeout=${RESILIENT_CKPT_START_TIMEOUT:-60}

job=${SLURM_JOB_ID:?the prolog runs under slurmd, which sets SLURM_JOB_ID}
session="slurm-$job"
run="$run_dir/$job"

log() {
    echo "resilient-ckpt prolog (job $job): $*" >&2
    logger -t resilient-ckpt "prolog job $job: $*" 2>/dev/null || true
}

wants_daemon() {
    case $jobs in
        all) return 0 ;;
        none) return 1 ;;
        comment)
            local comment=${SLURM_JOB_COMMENT:-}
            if [[ -z $comment ]]; then
                comment=$(scontrol --oneliner show job "$job" 2>/dev/null | sed -n 's/.*Comment=\([^ ]*\).*/\1/p')
            fi
            [[ $comment == *resilient-ckpt* ]]
            ;;
        *)
            log "RESILIENT_CKPT_JOBS=$jobs is not all, comment or none; starting no daemon"
            return 1
            ;;
    esac
}

if ! wants_daemon; then
    exit 0
fi

# Node names sorted bytewise: torchrun's c10d rendezvous numbers nodes in this order.
mapfile -t hosts < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?slurmd sets SLURM_JOB_NODELIST}" | LC_ALL=C sort)
me=${SLURMD_NODENAME:-$(hostname -s)}
node_id=
for i in "${!hosts[@]}"; do
    if [[ ${hosts[$i]} == "$me" ]]; then
        node_id=$i
    fi
done
if [[ -z $node_id ]]; then
    log "this node ($me) is not in the job's node list (${hosts[*]})"
    exit 1
fi

offset=$((job % port_span))
port=$((port_base + offset))
addr=${RESILIENT_CKPT_BIND_ADDR:-$(getent ahostsv4 "$me" | awk 'NR == 1 {print $1}')}
if [[ -z $addr ]]; then
    log "cannot resolve $me to an IPv4 address to bind to; set RESILIENT_CKPT_BIND_ADDR"
    exit 1
fi
endpoint="tcp://$addr:$port"

uid=${SLURM_JOB_UID:?slurmd sets SLURM_JOB_UID}
gid=${SLURM_JOB_GID:-$(id -g "$uid")}
install -d -m 0755 "$run_dir"
install -d -m 0700 -o "$uid" -g "$gid" "$run"
for i in "${!hosts[@]}"; do
    printf '%d tcp://%s:%d\n' "$i" "${hosts[$i]}" "$port"
done >"$run/peers"
"$bin" secret "$run/secret" --derive-from "$cluster_key" --label "$session" --force >/dev/null
echo "$endpoint" >"$run/endpoint"
chown "$uid:$gid" "$run/peers" "$run/secret" "$run/endpoint"
# Shared by the jobs of every user, like /tmp: each job's session directory is its user's.
if [[ ! -d $store_root ]]; then
    install -d -m 1777 "$store_root"
fi

args=(serve --store-root "$store_root" --bind "$endpoint" --node-id "$node_id" --peers "$run/peers"
      --secret-file "$run/secret" --session "$session" --keep-last "$keep_last" --log-format json)
if [[ -n $metrics_port ]]; then
    args+=(--metrics-port "$((metrics_port + offset))")
fi
if [[ -n $memory_budget ]]; then
    args+=(--memory-budget "$memory_budget")
fi

if [[ $launcher == auto ]]; then
    if [[ -d /run/systemd/system ]] && command -v systemd-run >/dev/null; then
        launcher=systemd-run
    else
        launcher=setsid
    fi
fi
unit="resilient-ckpt-job$job"
case $launcher in
    systemd-run)
        # A transient unit: supervised (restarted if it crashes), logs in `journalctl -u $unit`.
        systemd-run --quiet --collect --unit "$unit" --uid "$uid" --gid "$gid" \
            -p LimitMEMLOCK=infinity -p Restart=on-failure -p RestartSec=1 \
            -p KillSignal=SIGTERM -p TimeoutStopSec=30 "$bin" "${args[@]}"
        ;;
    setsid)
        # Own session, every descriptor redirected: slurmd must not wait for the daemon.
        ulimit -l unlimited 2>/dev/null || true
        setpriv --reuid "$uid" --regid "$gid" --init-groups \
            setsid "$bin" "${args[@]}" >>"$run/daemon.log" 2>&1 </dev/null &
        echo $! >"$run/daemon.pid"
        ;;
    *)
        log "RESILIENT_CKPT_LAUNCHER=$launcher is not auto, systemd-run or setsid"
        exit 1
        ;;
esac

alive() {
    if [[ $launcher == systemd-run ]]; then
        systemctl is-active --quiet "$unit"
    else
        kill -0 "$(cat "$run/daemon.pid")" 2>/dev/null
    fi
}

deadline=$((SECONDS + start_timeout))
until "$bin" status --endpoint "$endpoint" --secret-file "$run/secret" --session "$session" --timeout 1 >/dev/null 2>&1; do
    if ! alive || ((SECONDS >= deadline)); then
        log "the daemon did not answer at $endpoint within ${start_timeout}s; see $run/daemon.log or journalctl -u $unit"
        if [[ $launcher == systemd-run ]]; then
            systemctl stop "$unit" 2>/dev/null || true
        else
            kill -TERM "$(cat "$run/daemon.pid")" 2>/dev/null || true
        fi
        exit 1
    fi
    sleep 0.5
done
log "daemon for session $session is node $node_id of ${#hosts[@]} at $endpoint"
