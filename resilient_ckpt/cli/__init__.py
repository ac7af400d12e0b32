"""Layer 8 — ``resilient-ckpt`` commands: demo, bench, serve and the operator commands,
export/inspect/convert. May import every layer below.

The entry point is ``resilient_ckpt.cli.main:main`` (the ``resilient-ckpt`` script, or
``python -m resilient_ckpt.cli.main``); the package does not import it, so running the module
with ``-m`` does not find it imported already (runpy's RuntimeWarning)."""
