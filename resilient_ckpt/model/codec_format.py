"""The codec's wire format, shared by its encoder and decoder: header constants, ExtType
codes, the type tables both sides agree on, key-path errors and the entry of a user type.

The format itself is described in :mod:`resilient_ckpt.model.codec`, the public module.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import sys
from typing import Any, Callable, Dict, List

import msgpack
import numpy as np
import torch

from ..errors import CodecError
from .mapping import ShardedObject, ShardedTensor
from .nested import format_path

#: Version of the encoding; bumped on any incompatible change.
FORMAT_VERSION = 1
#: Deepest container nesting accepted (msgpack levels), on encode and decode alike.
MAX_DEPTH = 256

MAGIC = b"RCKC"
_HEADER = struct.Struct(">4sHHQ")
_ALIGN = 64
_ZEROS = bytes(_ALIGN)
_MAX_NDIM = 64
_MAX_DIM = 1 << 62


class _X(enum.IntEnum):
    """ExtType codes (table in the docstring of :mod:`resilient_ckpt.model.codec`)."""

    BIGINT = 1
    COMPLEX = 2
    DTYPE = 3
    DEVICE = 4
    HOLE = 5
    TUPLE = 16
    SET = 17
    FROZENSET = 18
    BYTEARRAY = 19
    SLICE = 20
    RANGE = 21
    ODICT = 22
    DEFAULTDICT = 23
    NAMESPACE = 24
    ENUM = 25
    NDARRAY = 26
    NPSCALAR = 27
    TENSOR = 28
    SIZE = 29
    SHARDED_TENSOR = 30
    SHARDED_OBJECT = 31
    USER = 32
    PICKLE = 33


_ExtType = msgpack.ExtType
_TAG = {code: _ExtType(int(code), b"") for code in _X}
_HOLE_EXT = _ExtType(_X.HOLE, b"")
_COMPLEX = struct.Struct(">dd")

_TORCH_DTYPES: Dict[str, torch.dtype] = {
    str(d).split(".", 1)[1]: d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
_TORCH_DTYPE_NAMES: Dict[torch.dtype, str] = {d: n for n, d in _TORCH_DTYPES.items()}
# Quantized dtypes need a quantizer (scale, zero point) that raw bytes do not carry.
_TENSOR_DTYPES = {n: d for n, d in _TORCH_DTYPES.items() if not n.startswith("q")}

_NP_CHARS = frozenset(c for c in np.typecodes["All"] if np.dtype(c).kind in "biufc")

_DEFAULT_FACTORIES: Dict[str, Callable] = {
    f.__name__: f
    for f in (list, dict, set, frozenset, tuple, int, float, complex, str, bytes, bytearray, bool)
}
_DEFAULT_FACTORY_NAMES = {f: n for n, f in _DEFAULT_FACTORIES.items()}

_ST_FIELDS = tuple(f.name for f in dataclasses.fields(ShardedTensor))
_SO_FIELDS = tuple(f.name for f in dataclasses.fields(ShardedObject))


def _type_name(t: type) -> str:
    mod = getattr(t, "__module__", None)
    qn = getattr(t, "__qualname__", getattr(t, "__name__", repr(t)))
    return qn if mod in (None, "builtins") else f"{mod}.{qn}"


def _path_elem(k: Any) -> Any:
    if type(k) in (str, int):
        return k
    r = repr(k) if type(k) in (float, bool, bytes, tuple, type(None)) else f"<{type(k).__name__}>"
    return r if len(r) <= 60 else r[:57] + "..."


class _Fail(Exception):
    """Internal: an error whose key path is filled in while the stack unwinds."""

    def __init__(self, msg: str):
        super().__init__(msg)
        self.msg = msg
        self.path: List[Any] = []  # innermost first

    def to_codec_error(self) -> CodecError:
        return CodecError(self.msg.replace("{path}", format_path(tuple(reversed(self.path)))))


def _resolve_class(module: str, qualname: str) -> Any:
    """Look a class up by name among already-imported modules, without running any code
    (no import, no module ``__getattr__``, no descriptors)."""
    obj = sys.modules.get(module)
    if obj is None:
        return None
    d = getattr(obj, "__dict__", None)
    for part in qualname.split("."):
        if not isinstance(d, (dict, type(type.__dict__))):
            return None
        obj = d.get(part)
        if not isinstance(obj, type):  # only classes nest classes
            return None
        d = obj.__dict__
    return obj


@dataclasses.dataclass(frozen=True)
class _UserType:
    """One ``codec.register_type`` registration."""

    cls: type
    name: str
    to_plain: Callable[[Any], Any]
    from_plain: Callable[[Any], Any]
