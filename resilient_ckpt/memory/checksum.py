"""Checksums of tensor bytes.

xxh3-64 (xxhash): measured on this project's 2-core machine at ~30 GB/s over 512 MiB against
~15 GB/s for crc32c and ~19 GB/s for xxh64, so it is not the bottleneck next to a ~20 GB/s
memcpy. It releases the GIL for large buffers, so checksums run beside the training thread.
"""

from __future__ import annotations

import torch
import xxhash

ALGO = "xxh3_64"


def byte_view(t: torch.Tensor) -> memoryview:
    """A zero-copy memoryview of a contiguous CPU tensor's bytes (any dtype)."""
    if t.device.type != "cpu":
        raise ValueError(f"checksums need CPU bytes, got a tensor on {t.device}")
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1) if t.dim() else t.reshape(1)
    return memoryview(flat.view(torch.uint8).numpy())


def digest(buf) -> int:
    """xxh3-64 of a bytes-like object."""
    return xxhash.xxh3_64_intdigest(buf)


def digest_tensor(t: torch.Tensor) -> int:
    return digest(byte_view(t))
