"""``resilient-ckpt``: demo | bench | serve | status | ls | drop | export | inspect."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import List, Optional

from . import extras


def _demo(argv: List[str]) -> int:
    # Checked before importing the tool: one line at once instead of a traceback later.
    extras.require("demo")
    from ..demo import orchestrator

    return orchestrator.main(argv)


def _bench(argv: List[str]) -> int:
    extras.require("bench")
    if "--control-plane" in argv:  # the control-plane benchmark (docs/control-plane.md)
        from ..bench import control_plane

        return control_plane.main([a for a in argv if a != "--control-plane"])
    from ..bench import main as bench

    return bench.main(argv) or 0


def _serve(argv: List[str]) -> int:
    from ..service import daemon

    return daemon.main(argv)


def _pull(argv: List[str]) -> int:
    from . import service as cli

    return cli.pull_main(argv)


def _status(argv: List[str]) -> int:
    from . import service as cli

    return cli.status_main(argv)


def _ls(argv: List[str]) -> int:
    from . import service as cli

    return cli.ls_main(argv)


def _drop(argv: List[str]) -> int:
    from . import service as cli

    return cli.drop_main(argv)


def _secret(argv: List[str]) -> int:
    from . import service as cli

    return cli.secret_main(argv)


def _export(argv: List[str]) -> int:
    from .inspect import export_main

    return export_main(argv)


def _inspect(argv: List[str]) -> int:
    from .inspect import inspect_main

    return inspect_main(argv)


def _convert(argv: List[str]) -> int:
    from .inspect import convert_main

    return convert_main(argv)


COMMANDS = {
    "demo": (_demo, "run the main job: lose a node mid-training, restore, prove bit-exactness"),
    "bench": (
        _bench,
        "side-by-side benchmark against nvidia-resiliency-ext + Megatron-core "
        "(--control-plane: per-phase metadata costs)",
    ),
    "serve": (_serve, "run this node's checkpoint daemon (store, replication, fetches, metrics)"),
    "status": (_status, "a node daemon's health: store usage, peers, in-flight replications, rejects"),
    "ls": (_ls, "list the checkpoints a node holds (from its daemon or directly from its store)"),
    "drop": (_drop, "retire checkpoints of a session from a node (asks first unless --yes)"),
    "pull": (
        _pull,
        "have a node's daemon pull checkpoints from its peers (a replacement node), with progress",
    ),
    "secret": (_secret, "write a new job secret file (mode 0600) for daemons and trainers"),
    "export": (_export, "write an in-memory iteration to a torch.distributed.checkpoint directory"),
    "inspect": (_inspect, "keys, shapes, dtypes, sizes and iteration of a DCP checkpoint directory"),
    "convert": (_convert, "turn a DCP checkpoint directory into a single torch.save file"),
}


def main(argv: Optional[List[str]] = None) -> int:
    # torch's CUDA module warns about pynvml on import, on every command's stderr (and every
    # liveness probe's); it says nothing about this package.
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        p = argparse.ArgumentParser(
            prog="resilient-ckpt", description="In-memory local checkpoints for PyTorch"
        )
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
