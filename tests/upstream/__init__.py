"""Upstream unit tests of local checkpointing, ported to CPU/gloo and run against both the
reference (nvidia-resiliency-ext / Megatron-core) and ours. See docs/upstream-tests.md."""
