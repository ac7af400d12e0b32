"""Layer 8 — ``resilient-ckpt`` commands: demo, bench, serve and the operator commands,
export/inspect/convert. May import every layer below."""

from .main import main

__all__ = ["main"]
