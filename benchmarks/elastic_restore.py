"""Resharded restore (4 ranks on 2 nodes -> 2 ranks on the surviving node) against a same-size
restore and torch DCP resharding from disk, in one run (see resilient_ckpt/bench/elastic.py).

    .venv/bin/python benchmarks/elastic_restore.py --mib 256 --json elastic.json
"""

import sys

from resilient_ckpt.bench.elastic import main

if __name__ == "__main__":
    sys.exit(main())
