"""Checkpoint bytes are copied as bytes (layer 0).

A copy between two tensors of a floating-point dtype is a copy of *values*, and some kernels
compute it through another type: CUDA's fused ``_foreach_copy_`` takes bf16 and fp16 through
float, which turns every NaN into the canonical one (0x7FFF) — a NaN payload, a signalling
NaN, or integer data kept in a 16-bit float tensor (packed quantized weights) is rewritten, and
a checksum computed afterwards cannot notice. Every copy of saved bytes goes through these
helpers instead: both sides viewed as integers of the element's size (same shape, same
strides: ``Tensor.view(dtype)`` of an equal-size dtype works for any layout), so the kernel
moves bits. ``tests/test_bit_copies.py`` records the dtype of every copy torch is asked to make
during saves and restores and fails on a floating-point one.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

__all__ = [
    "bits",
    "copy_bits",
    "foreach_copy_bits",
    "foreach_copy_run_bits",
    "foreach_copy_views",
    "run_bits",
]

#: element size -> the integer dtype of that size
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element's size (the same memory, shape and strides).
    Integer tensors come back as they are; a 16-byte element (complex128) as a pair of int64
    in a new last dimension (``view_as_real``: any layout, 0-dim too)."""
    if not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        return t
    if t.is_conj() or t.is_neg():  # a lazy conjugate/negative view: its bytes are not its values
        t = t.resolve_conj().resolve_neg()  # (a new tensor: for reading only, see copy_bits)
    size = t.element_size()
    target = _INT_OF_SIZE.get(size)
    if target is not None:
        return t.view(target)
    return torch.view_as_real(t).view(torch.int64)  # complex128


def copy_bits(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``dst.copy_(src)`` of the same dtype, moving bits; returns ``dst``."""
    if dst.dtype != src.dtype:
        raise TypeError(
            f"copy_bits: {src.dtype} into {dst.dtype} would convert values; the dtypes must match"
        )
    bits(dst).copy_(bits(src), non_blocking=non_blocking)
    return dst


def foreach_copy_bits(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], non_blocking: bool = False
) -> None:
    """``torch._foreach_copy_(dsts, srcs)`` (one fused launch per device) moving bits."""
    if not dsts:
        return
    if any(d.is_conj() or d.is_neg() for d in dsts):
        for d, s in zip(dsts, srcs):
            copy_bits(d, s, non_blocking)
        return
    torch._foreach_copy_([bits(d) for d in dsts], [bits(s) for s in srcs], non_blocking=non_blocking)


def run_bits(srcs: Sequence[torch.Tensor], dtype: torch.dtype) -> Optional[List[torch.Tensor]]:
    """Each of ``srcs`` (one ``dtype``) viewed as integers of its element's size, one call
    each (integer sources as they are); None where a view cannot be had: complex128 (16-byte
    elements) or a source whose bytes are not its values (a lazy negative or conjugate view:
    ``view`` refuses it). Staging keeps these across saves of the same tensors."""
    if not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
        return list(srcs)
    target = _INT_OF_SIZE.get(dtype.itemsize)
    if target is None:
        return None
    try:
        return [s.view(target) for s in srcs]
    except RuntimeError:  # a negative / conjugate view among them
        return None


def foreach_copy_run_bits(
    int_dsts: Sequence[torch.Tensor],
    srcs: Sequence[torch.Tensor],
    dtype: torch.dtype,
    non_blocking: bool = False,
    src_bits: Optional[Sequence[torch.Tensor]] = None,
) -> None:
    """:func:`foreach_copy_bits` for a run of one ``dtype`` whose destinations are already
    integer views of its element's size (staging's views of a segment): the integer dtype is
    found once and each source viewed with one call (:func:`run_bits`), or not at all where
    the caller kept them (``src_bits``). At 50,000 small tensors the per-tensor checks of
    :func:`bits` cost twice the copy itself. Sources without such views take the general path."""
    if not int_dsts:
        return
    if src_bits is None:
        src_bits = run_bits(srcs, dtype)
    if src_bits is None:
        foreach_copy_bits(int_dsts, srcs, non_blocking)
        return
    foreach_copy_views(int_dsts, src_bits, non_blocking)


def foreach_copy_views(
    int_dsts: Sequence[torch.Tensor], int_srcs: Sequence[torch.Tensor], non_blocking: bool = False
) -> None:
    """One ``_foreach_copy_`` between integer views made by :func:`bits` (or
    :func:`run_bits`) and kept by the caller: nothing is checked or viewed per tensor."""
    if int_dsts:
        torch._foreach_copy_(list(int_dsts), list(int_srcs), non_blocking=non_blocking)
