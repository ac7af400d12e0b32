"""ShardedTensor metadata as one compact table: the hollow state dict's bulk, at C speed.

A checkpoint of a mixture-of-experts model with its optimizer state holds 50,000+ shards per
rank. Encoding each ShardedTensor through the general codec (a tagged map of ten fields, each
field dispatched in Python) cost ~30 us per shard each way, and decoding re-ran
``__post_init__`` validation on metadata this package wrote itself. Here every shard is one
plain row, packed and unpacked by msgpack's C extension in one call:

    [TABLE_VERSION, [(key, dtype name, local_shape, global_shape, global_offset,
                      axis_fragmentations, replica_id, prepend_axis_num,
                      allow_shape_mismatch), ...]]

Shapes and offsets are msgpack arrays (tuples on decode), ``axis_fragmentations`` may be nil,
``replica_id`` an int or an array. Rows describe metadata only: tensor bytes live in the
store segment, so ``data`` decodes as None.

Decoding trusts the field *values* (they come from ShardedTensors validated when they were
built, and the header that carries them is written by this package) but checks the shape of
the table, so a damaged or foreign table raises :class:`CodecError` naming what is wrong
instead of producing wrong shards.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import msgpack

from ..errors import CodecError
from ..gc_pause import paused_gc
from .codec_format import _TORCH_DTYPE_NAMES, _TORCH_DTYPES
from .mapping import ShardedTensor

TABLE_VERSION = 1
_ROW_FIELDS = 9


def shard_row(st: ShardedTensor) -> tuple:
    """The table row of one shard (also what a cached save compares to detect a change)."""
    return (
        st.key,
        _TORCH_DTYPE_NAMES[st.dtype],
        st.local_shape,
        st.global_shape,
        st.global_offset,
        st.axis_fragmentations,
        st.replica_id,
        st.prepend_axis_num,
        st.allow_shape_mismatch,
    )


def encode_rows(rows: Sequence[tuple]) -> bytes:
    """Pack rows made by :func:`shard_row`."""
    with paused_gc():
        return msgpack.packb([TABLE_VERSION, rows], use_bin_type=True)


def decode_shards(data: Any) -> List[ShardedTensor]:
    """ShardedTensors (``data`` None) from :func:`encode_rows`' bytes."""
    return decode_table(data)[1]


def decode_rows(data: Any) -> Tuple[tuple, ...]:
    """The rows of :func:`encode_rows`' bytes, as :func:`shard_row` makes them (the table's
    version checked, the rows not yet)."""
    try:
        with paused_gc():
            version, rows = msgpack.unpackb(data, use_list=False, raw=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise CodecError(f"shard table: not a msgpack table ({type(e).__name__}: {e})") from e
    if version != TABLE_VERSION:
        raise CodecError(
            f"shard table version {version!r}, this reader knows {TABLE_VERSION}; restore with the "
            "resilient_ckpt version that saved the checkpoint"
        )
    return rows


def shard_ids(rows: Sequence[tuple]) -> List[Tuple[str, tuple]]:
    """Each row's shard id, ``(key, global_offset)`` as ``ShardedTensor.shard_id`` gives it,
    without making the ShardedTensors (a holder looking up which shards a copy has)."""
    ids: List[Tuple[str, tuple]] = []
    for row in rows:
        if not isinstance(row, tuple) or len(row) != _ROW_FIELDS:
            raise CodecError(f"shard table row {len(ids)} is malformed; each row has {_ROW_FIELDS} fields")
        ids.append((row[0], row[4]))
    return ids


def decode_table(data: Any) -> Tuple[Tuple[tuple, ...], List[ShardedTensor]]:
    """The rows (as :func:`shard_row` makes them) and their ShardedTensors (``data`` None)."""
    rows = decode_rows(data)
    new = object.__new__
    dtypes = _TORCH_DTYPES
    out = []
    with paused_gc():
        try:
            for key, dt, local, glob, off, frag, replica, prepend, mismatch in rows:
                st = new(ShardedTensor)
                st.__dict__ = {
                    "key": key,
                    "data": None,
                    "dtype": dtypes[dt],
                    "local_shape": local,
                    "global_shape": glob,
                    "global_offset": off,
                    "axis_fragmentations": frag,
                    "replica_id": replica,
                    "prepend_axis_num": prepend,
                    "allow_shape_mismatch": mismatch,
                }
                out.append(st)
        except (ValueError, TypeError) as e:
            raise CodecError(
                f"shard table row {len(out)} is malformed ({e}); each row has {_ROW_FIELDS} fields"
            ) from e
        except KeyError as e:
            raise CodecError(f"shard table row {len(out)}: unknown dtype {e}") from e
    return rows, out
