"""Control-plane benchmark (issue 11, item 1): per phase (structure walk, fingerprint,
distribution, hollow encoding, header, agreement, holdings gather, retrieval planning, exchange
planning, template fill) time and bytes exchanged per rank, on 2 real ranks for several tensor
counts and on simulated world sizes; our saves and restores against Megatron-core +
nvidia-resiliency-ext in the same run.

Same as ``resilient-ckpt bench --control-plane``; see docs/control-plane.md. Example:

    python benchmarks/control_plane.py --tensors 1000,10000,50000 --world-sizes 64,1024,4096 \\
        --shards-per-rank 1000 --reps 1 --json out.json --plot out.png
"""

import sys

from resilient_ckpt.bench.control_plane import main

if __name__ == "__main__":
    sys.exit(main())
