"""Layer 7 — the trainer's entry points: ``CheckpointManager`` (save pipeline, restore,
healing), the load path (``restore``) and ``CheckpointHook``. Imports every layer below
(model, parallel, memory, replication, service, persistent)."""
