"""Layer 1 — the model's state: nested-dict walking, ShardedTensor/ShardedObject (and the
Megatron-core adapter), plain/DDP/FSDP2 state <-> sharded state dict, the pickle-free codec,
sharding validation. Imports only ``resilient_ckpt.errors``."""
