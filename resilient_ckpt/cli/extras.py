"""The ``tools`` extra: what ``resilient-ckpt demo`` and ``bench`` need beyond a plain install.

A trainer or a node daemon installs ``resilient-ckpt``; the demo, the benchmark and their plots
come with ``resilient-ckpt[tools]`` (pyproject.toml). Their imports stay inside the functions
that use them, and each tool command checks for them before it starts anything, so a missing
extra is one line at once, not a traceback after a minute of training.
"""

from __future__ import annotations

import importlib.util
from typing import Dict, List, Sequence, Tuple

EXTRA = "tools"

#: command -> the modules of the tools extra it imports (module names = distribution names)
TOOL_MODULES: Dict[str, Tuple[str, ...]] = {
    "demo": ("matplotlib",),
    "bench": ("matplotlib", "psutil", "rich"),
}


def missing(modules: Sequence[str]) -> List[str]:
    """The modules of ``modules`` that cannot be imported (checked without importing them)."""
    out = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken package, or one blocked via sys.modules
            found = False
        if not found:
            out.append(name)
    return out


def message(command: str, missing_modules: Sequence[str]) -> str:
    return (
        f"resilient-ckpt {command} needs the {EXTRA} extra (missing: {', '.join(missing_modules)}): "
        f"pip install 'resilient-ckpt[{EXTRA}]'"
    )


def require(command: str) -> None:
    """Raise SystemExit (one line on stderr, exit status 1) when ``command`` lacks a module."""
    gone = missing(TOOL_MODULES[command])
    if gone:
        raise SystemExit(message(command, gone))
