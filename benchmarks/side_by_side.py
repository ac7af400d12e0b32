"""Side-by-side benchmark: resilient_ckpt (embedded and service mode) against Megatron-core's
MCoreTensorAwareStateDict + nvidia-resiliency-ext's LocalCheckpointManager with
CliqueReplicationStrategy, plus the machine's limits, in one run.

Same as ``resilient-ckpt bench``; see docs/benchmarks.md. Example:

    python benchmarks/side_by_side.py --sizes 256M,1G --world-sizes 2 --reps 3 --json out.json --plot out.png
"""

import sys

from resilient_ckpt.bench.main import main

if __name__ == "__main__":
    sys.exit(main())
