"""The arithmetic of parity shares: XOR (one share) and Reed–Solomon over GF(2^8) (two).

XOR runs on 64-bit words with torch (vectorised, multi-threaded, ~memory bandwidth).
Reed–Solomon comes from zfec (Tahoe-LAFS's maintained, systematic Vandermonde code in C):
measured on this project's 2-core machine at 64 MiB blocks, zfec encodes 0.70 GB/s of data
and decodes 0.71 GB/s, where pyeclib's ISA-L backend reached 0.41 / 0.57 GB/s (it wants one
concatenated buffer and returns fragments with headers: extra copies) and galois is numpy
table arithmetic. zfec takes the blocks as buffers (no concatenation) and releases the GIL,
so blocks are coded in chunks on a small thread pool.

Share numbers follow zfec: ``0..k-1`` data blocks, ``k..k+m-1`` parity blocks.
"""

from __future__ import annotations

from typing import List, Mapping, Sequence

import torch

from ..errors import ReplicationError
from ..thread_pools import LazyThreadPool

#: bytes coded per task (zfec): small enough to spread over the pool, large enough to stream
_CHUNK = 4 << 20
#: the coding threads (remade in a forked child: see thread_pools)
_CODERS = LazyThreadPool("rc-erasure")


def _pool():
    return _CODERS.get(max(1, min(4, torch.get_num_threads())))


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64) if t.numel() % 8 == 0 else t


def xor_into(out: torch.Tensor, blocks: Sequence[torch.Tensor]) -> None:
    """``out = blocks[0] ^ blocks[1] ^ …`` (1-D uint8, equal lengths; ``out`` may alias none)."""
    if not blocks:
        out.zero_()
        return
    o = _words(out)
    if len(blocks) == 1:
        out.copy_(blocks[0])
        return
    torch.bitwise_xor(_words(blocks[0]), _words(blocks[1]), out=o)
    for b in blocks[2:]:
        o.bitwise_xor_(_words(b))


def _zfec():
    try:
        import zfec
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ReplicationError(
            "parity_shares=2 needs zfec (Reed-Solomon): pip install zfec, or use parity_shares=1"
        ) from e
    return zfec


def _chunks(n: int) -> List[slice]:
    return [slice(lo, min(lo + _CHUNK, n)) for lo in range(0, n, _CHUNK)]


def encode(k: int, m: int, data: Sequence[torch.Tensor], index: int, out: torch.Tensor) -> None:
    """Parity share ``k + index`` of one stripe into ``out``, from its ``k`` data blocks."""
    if len(data) != k or any(d.numel() != out.numel() for d in data):
        raise ReplicationError(f"a stripe needs {k} data blocks of {out.numel()} bytes")
    if m == 1:
        xor_into(out, data)
        return
    enc = _zfec().Encoder(k, k + m)
    arrays = [d.numpy() for d in data]
    dest = out.numpy()

    def one(sl: slice) -> None:
        (block,) = enc.encode(tuple(memoryview(a[sl]) for a in arrays), (k + index,))
        dest[sl] = memoryview(block)

    list(_pool().map(one, _chunks(out.numel())))


def decode(k: int, m: int, shares: Mapping[int, torch.Tensor], want: int, out: torch.Tensor) -> None:
    """Data share ``want`` of one stripe into ``out``, from any ``k`` of its shares (share
    number -> block)."""
    if len(shares) != k or want >= k:
        raise ReplicationError(f"decoding needs exactly {k} shares and a data share, got {sorted(shares)}")
    if want in shares:
        out.copy_(shares[want])
        return
    if m == 1:
        if k not in shares:
            raise ReplicationError("XOR decoding needs the parity share")
        xor_into(out, list(shares.values()))
        return
    dec = _zfec().Decoder(k, k + m)
    nums = tuple(sorted(shares))
    arrays = [shares[n].numpy() for n in nums]
    dest = out.numpy()

    def one(sl: slice) -> None:
        blocks = dec.decode(tuple(memoryview(a[sl]) for a in arrays), nums)
        dest[sl] = memoryview(blocks[want])

    list(_pool().map(one, _chunks(out.numel())))
