#!/usr/bin/env bash
# Launch this node's share of a training job under torchrun, set up for resilient_ckpt.
#
#   srun --nodes=4 --ntasks-per-node=1 deploy/torchrun/launch.sh train.py --your --args
#   NNODES=2 NPROC_PER_NODE=8 RDZV_ENDPOINT=node0:29400 JOB_ID=run7 launch.sh -m my_pkg.train
#
# Everything after the options goes to torchrun as the training script and its arguments.
# What it guarantees the trainer:
#   TORCHELASTIC_RUN_ID = JOB_ID (torchrun's --rdzv-id): CheckpointManager's default session,
#       so every restart of the job finds the checkpoints of the previous attempt;
#   LOCAL_WORLD_SIZE = NPROC_PER_NODE (set by torchrun): ranks per node, which places each
#       rank's replica on another node;
#   GROUP_RANK = this node's index in the LOCAL_ADDR order of all nodes (c10d rendezvous):
#       under Slurm the same number the prolog gave this node's daemon;
#   RESILIENT_CKPT_STORE_ROOT, and in service mode RESILIENT_CKPT_ENDPOINT and
#       RESILIENT_CKPT_SECRET_FILE (from the Slurm prolog's files when a daemon runs for the job);
#   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, without which a restart after a failure dies in
#       init_process_group (see below).
set -euo pipefail

slurm_hosts() { scontrol show hostnames "$SLURM_JOB_NODELIST" | LC_ALL=C sort; }

NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-1}}
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
# Restarts of the whole local worker group after a rank fails (each one restores from memory).
MAX_RESTARTS=${MAX_RESTARTS:-3}
MONITOR_INTERVAL=${MONITOR_INTERVAL:-1}
if [[ -n ${SLURM_JOB_ID:-} ]]; then
    JOB_ID=${JOB_ID:-slurm-$SLURM_JOB_ID}
    RDZV_ENDPOINT=${RDZV_ENDPOINT:-$(slurm_hosts | head -n 1):29400}
    LOCAL_ADDR=${LOCAL_ADDR:-${SLURMD_NODENAME:-$(hostname -s)}}
fi
JOB_ID=${JOB_ID:?set JOB_ID: the job id that names its checkpoints (torchrun --rdzv-id)}
if [[ -z ${RDZV_ENDPOINT:-} ]]; then
    if ((NNODES == 1)); then
        RDZV_ENDPOINT=127.0.0.1:29400
    else
        echo "set RDZV_ENDPOINT=HOST:PORT (a node every node can reach) for $NNODES nodes" >&2
        exit 2
    fi
fi
# The node's address in the rendezvous: nodes are numbered in the sorted order of these.
LOCAL_ADDR=${LOCAL_ADDR:-$(hostname)}
read -r -a TORCHRUN <<<"${TORCHRUN:-torchrun}"

# torchrun (torch >= 2.4) hands its rendezvous TCPStore to the workers without a per-attempt
# key prefix, so after a restart gloo's init_process_group reads the failed attempt's addresses
# and fails ("Gloo connectFullMesh failed ... Connection refused", pytorch/pytorch#135712).
# This makes the c10d rendezvous give every attempt a store of its own. The static rendezvous
# backend has the same problem and no such switch: use c10d (below).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

export RESILIENT_CKPT_STORE_ROOT=${RESILIENT_CKPT_STORE_ROOT:-/dev/shm/resilient_ckpt}
run_dir=${RESILIENT_CKPT_RUN_DIR:-/run/resilient-ckpt}
if [[ -z ${RESILIENT_CKPT_ENDPOINT:-} && -n ${SLURM_JOB_ID:-} && -r $run_dir/$SLURM_JOB_ID/endpoint ]]; then
    # Service mode: the prolog started a daemon for this job on this node.
    RESILIENT_CKPT_ENDPOINT=$(cat "$run_dir/$SLURM_JOB_ID/endpoint")
    export RESILIENT_CKPT_ENDPOINT
    export RESILIENT_CKPT_SECRET_FILE=${RESILIENT_CKPT_SECRET_FILE:-$run_dir/$SLURM_JOB_ID/secret}
fi

exec "${TORCHRUN[@]}" \
    --nnodes "$NNODES" \
    --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$RDZV_ENDPOINT" \
    --rdzv-id "$JOB_ID" \
    --local-addr "$LOCAL_ADDR" \
    --max-restarts "$MAX_RESTARTS" \
    --monitor-interval "$MONITOR_INTERVAL" \
    "$@"
