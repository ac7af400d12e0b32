"""Validation of save plans, checkpoint metadata and data files, with errors that name the
key, the chunks or the file.

- :func:`chunk_problems`: what is wrong with a tensor's chunks as a tiling of it (pure);
- :func:`validate_global_plan` / :func:`validate_metadata`: every tensor of a global save plan
  or of loaded metadata tiled exactly once, else :class:`ValidationError` listing each key;
- :func:`check_data_files`: every data file the metadata names exists and is long enough,
  else :class:`CorruptCheckpointError` naming the file.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan

from ..errors import CorruptCheckpointError, ValidationError

# The in-memory tier's own chunk geometry (same boxes, same messages); private there until
# model/ exports them.
from ..model.validation import find_overlap, fmt_box
from .layout import MAX_REPORTED


def _chunk_str(offsets: Sequence[int], sizes: Sequence[int]) -> str:
    return fmt_box((tuple(offsets), tuple(o + s for o, s in zip(offsets, sizes))))


def _chunk_boxes(
    key: str, size: Tuple[int, ...], chunks: Sequence[ChunkStorageMetadata], out: List[str]
) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """The chunks as (start, stop) boxes; a chunk with the wrong rank or outside the tensor
    is reported in ``out`` instead."""
    boxes = []
    for c in chunks:
        off = tuple(int(o) for o in c.offsets)
        ext = tuple(int(s) for s in c.sizes)
        if len(off) != len(size) or len(ext) != len(size):
            out.append(
                f"{key!r}: chunk at offset {off} with sizes {ext} has a different number of axes "
                f"than the tensor size {list(size)}"
            )
            continue
        if any(o < 0 or e < 0 or o + e > s for o, e, s in zip(off, ext, size)):
            out.append(f"{key!r}: chunk {_chunk_str(off, ext)} lies outside the tensor of size {list(size)}")
            continue
        boxes.append((off, tuple(o + e for o, e in zip(off, ext))))
    return boxes


def chunk_problems(key: str, size: Sequence[int], chunks: Sequence[ChunkStorageMetadata]) -> List[str]:
    """What is wrong with ``chunks`` as a tiling of a tensor of ``size`` (empty list: fine).

    Every chunk must lie inside the tensor, no two may overlap, and together they must cover
    it. Pure function (used on save plans and on loaded metadata alike).
    """
    size = tuple(int(s) for s in size)
    out: List[str] = []
    boxes = _chunk_boxes(key, size, chunks, out)
    if out:
        return out
    if not size:
        if len(chunks) != 1:
            out.append(f"{key!r}: a 0-d tensor needs exactly one chunk, got {len(chunks)}")
        return out
    overlap = find_overlap(boxes)
    if overlap is not None:
        a, b = overlap
        out.append(f"{key!r}: chunks {fmt_box(a)} and {fmt_box(b)} overlap")
        return out
    covered = sum(math.prod(e - s for s, e in zip(*box)) for box in boxes)
    total = math.prod(size)
    if covered != total:
        shown = ", ".join(fmt_box(b) for b in sorted(boxes)[:8])
        more = f" (+{len(boxes) - 8} more)" if len(boxes) > 8 else ""
        out.append(
            f"{key!r}: chunks cover {covered} of {total} elements of size {list(size)} (gap); "
            f"chunks: {shown or 'none'}{more}"
        )
    return out


def raise_problems(problems: List[str], what: str, fix: str) -> None:
    """Raise :class:`ValidationError` listing ``problems`` (the first :data:`MAX_REPORTED`)
    under ``what``, with ``fix``; nothing when there are none."""
    if not problems:
        return
    shown = problems[:MAX_REPORTED]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    raise ValidationError(f"{what}:\n  " + "\n  ".join(shown) + more + f"\nfix: {fix}")


def validate_metadata(
    metadata: Metadata, keys: Optional[Iterable[str]] = None, source: str = "checkpoint"
) -> None:
    """Raise :class:`ValidationError` naming every key of ``metadata`` (or of ``keys``) whose
    stored chunks are out of bounds, overlap or leave a gap."""
    problems: List[str] = []
    md = metadata.state_dict_metadata
    for key in sorted(md if keys is None else set(keys) & md.keys()):
        v = md[key]
        if isinstance(v, TensorStorageMetadata):
            problems.extend(chunk_problems(key, v.size, v.chunks))
    raise_problems(
        problems,
        f"{source} metadata describes inconsistent tensor chunks",
        "the checkpoint is damaged or was written by an inconsistent job; restore an older one",
    )


def validate_global_plan(plans: Sequence[SavePlan], metadata: Metadata) -> None:
    """Raise :class:`ValidationError` naming the key and chunks of every inconsistent tensor of
    a global save plan (chunks out of bounds, overlapping, or not covering the tensor)."""
    problems: List[str] = []
    for key, v in sorted(metadata.state_dict_metadata.items()):
        if isinstance(v, TensorStorageMetadata):
            problems.extend(chunk_problems(key, v.size, v.chunks))
    raise_problems(
        problems,
        "the global save plan is inconsistent",
        "every key's saved pieces (ShardedTensor global_offset/local_shape, DTensor placements) "
        "must tile its global shape exactly once across ranks",
    )


def check_data_files(directory: Union[str, os.PathLike], metadata: Metadata) -> None:
    """Every data file the metadata refers to exists and holds the bytes it should."""
    need: Dict[str, Tuple[int, str]] = {}
    for idx, info in (metadata.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        end = int(info.offset) + int(info.length)
        cur = need.get(rel)
        if cur is None or end > cur[0]:
            need[rel] = (end, idx.fqn)
    for rel, (end, fqn) in sorted(need.items()):
        p = Path(directory) / rel
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{p} is missing (it holds {fqn!r} among others): the checkpoint in {directory} is "
                "incomplete; restore an older checkpoint or copy the file back"
            ) from None
        if size < end:
            raise CorruptCheckpointError(
                f"{p} is truncated: {size} bytes, the metadata needs {end} (for {fqn!r}); the "
                f"checkpoint in {directory} is damaged"
            )
