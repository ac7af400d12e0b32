"""``resilient-ckpt``: demo | bench | serve | status | ls | drop | export | inspect."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _demo(argv: List[str]) -> int:
    from .demo import orchestrator

    return orchestrator.main(argv)


def _bench(argv: List[str]) -> int:
    from .bench import runner

    return runner.main(argv) or 0


COMMANDS = {
    "demo": (_demo, "run the main job: lose a node mid-training, restore, prove bit-exactness"),
    "bench": (_bench, "side-by-side benchmark against nvidia-resiliency-ext + Megatron-core"),
}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        p = argparse.ArgumentParser(prog="resilient-ckpt", description="In-memory local checkpoints for PyTorch")
        sub = p.add_subparsers(dest="command", metavar="command")
        for name, (_, help_) in COMMANDS.items():
            sub.add_parser(name, help=help_, add_help=False)
        if argv and argv[0] not in ("-h", "--help"):
            p.error(f"unknown command {argv[0]!r}")
        p.print_help()
        return 0 if argv else 2
    fn, _ = COMMANDS[argv[0]]
    return int(fn(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
