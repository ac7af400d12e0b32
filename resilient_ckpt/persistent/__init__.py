"""Layer 6 — the persistent tier over torch.distributed.checkpoint: planners and storage
(``dcp``), the tier (flush, fallback load, two-stage load, export) and the strategies
registry. Imports model, parallel, memory, replication."""
