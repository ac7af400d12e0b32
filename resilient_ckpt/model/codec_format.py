"""The codec's wire format, shared by its encoder and decoder: header constants, ExtType
codes, the type tables both sides agree on, key-path errors and the entry of a user type.

The format itself is described in :mod:`resilient_ckpt.model.codec`, the public module.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pathlib
import struct
import sys
import types
from typing import Any, Callable, Dict, List, Optional

import msgpack
import numpy as np
import torch

from ..errors import CodecError
from .mapping import DTYPE_NAMES, TORCH_DTYPES, ShardedObject, ShardedTensor
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
    PURE_POSIX_PATH = 6
    PURE_WINDOWS_PATH = 7
    POSIX_PATH = 8
    WINDOWS_PATH = 9
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
    REF = 34
    PARTIAL = 35
    SIMPLE_NAMESPACE = 36


_ExtType = msgpack.ExtType
_TAG = {code: _ExtType(int(code), b"") for code in _X}
_HOLE_EXT = _ExtType(_X.HOLE, b"")
_COMPLEX = struct.Struct(">dd")

_TORCH_DTYPES: Dict[str, torch.dtype] = TORCH_DTYPES
_TORCH_DTYPE_NAMES: Dict[torch.dtype, str] = DTYPE_NAMES
# Quantized dtypes need a quantizer (scale, zero point) that raw bytes do not carry.
_TENSOR_DTYPES = {n: d for n, d in _TORCH_DTYPES.items() if not n.startswith("q")}

_NP_CHARS = frozenset(c for c in np.typecodes["All"] if np.dtype(c).kind in "biufc")

_DEFAULT_FACTORIES: Dict[str, Callable] = {
    f.__name__: f
    for f in (list, dict, set, frozenset, tuple, int, float, complex, str, bytes, bytearray, bool)
}
_DEFAULT_FACTORY_NAMES = {f: n for n, f in _DEFAULT_FACTORIES.items()}

_PATH_CODES: Dict[type, _X] = {
    pathlib.PurePosixPath: _X.PURE_POSIX_PATH,
    pathlib.PureWindowsPath: _X.PURE_WINDOWS_PATH,
    pathlib.PosixPath: _X.POSIX_PATH,
    pathlib.WindowsPath: _X.WINDOWS_PATH,
}
# The concrete class of the other operating system cannot be instantiated: its pure class.
_PATH_CLASSES: Dict[int, type] = {
    _X.PURE_POSIX_PATH: pathlib.PurePosixPath,
    _X.PURE_WINDOWS_PATH: pathlib.PureWindowsPath,
    _X.POSIX_PATH: pathlib.PurePosixPath if os.name == "nt" else pathlib.PosixPath,
    _X.WINDOWS_PATH: pathlib.WindowsPath if os.name == "nt" else pathlib.PureWindowsPath,
}
# The fields of a stored functools.partial, as error paths name them.
_PARTIAL_LABELS = ("<partial func>", "<partial args>", "<partial keywords>", "<partial attributes>")

# What a reference (ExtType REF) may name: functions, builtins and classes.
_REF_FUNCTION_TYPES = (types.FunctionType, types.BuiltinFunctionType)
# Never stored or loaded by name: called with stored arguments (a functools.partial) they
# would run commands or code. A guard against the obvious, not a sandbox.
_REFUSED_REF_MODULES = frozenset(
    "os posix nt sys subprocess _posixsubprocess shutil importlib pickle _pickle marshal ctypes "
    "_ctypes runpy code codeop pty socket _socket multiprocessing pdb bdb io _io webbrowser".split()
)
_REFUSED_BUILTINS = frozenset(
    "eval exec compile __import__ breakpoint open input getattr setattr delattr globals locals "
    "vars exit quit help".split()
)

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


_DESCRIPTIVE_DUNDERS = frozenset(("__name__", "__qualname__", "__module__", "__doc__"))
_MODULE_NAMESPACE = types.ModuleType.__dict__["__dict__"].__get__
_CLASS_NAMESPACE = type.__dict__["__dict__"].__get__


def _resolve_name(module: str, qualname: str) -> Any:
    """The object ``qualname`` names in the already-imported ``module``, or None.

    Runs no code: no import, no module ``__getattr__`` (lazy modules stay unloaded), no
    descriptor, property or ``isinstance`` hook; module and class namespaces are read through
    the C-level ``__dict__`` slots. Every dotted part before the last must be a class."""
    mod = sys.modules.get(module)
    if not issubclass(type(mod), types.ModuleType):
        return None
    ns: Any = _MODULE_NAMESPACE(mod)
    *outer, last = qualname.split(".")
    for part in outer:
        cls = ns.get(part)
        if not issubclass(type(cls), type):  # only classes nest functions and classes
            return None
        ns = _CLASS_NAMESPACE(cls)
    return ns.get(last)


def _bad_attribute(attrs: Dict[Any, Any]) -> Optional[str]:
    """Why the attributes of a stored Namespace or partial cannot be stored (None if they can).

    Dunder names other than the descriptive ones (``__name__``, ``__doc__``, ...) are refused:
    Python looks some up on the instance (``copy.deepcopy`` calls an instance's
    ``__deepcopy__``), so a stored one could make copying the state call a stored function."""
    for k in attrs:
        if type(k) is not str:
            return f"a non-str attribute name of type {type(k).__name__}"
        if len(k) > 4 and k[:2] == "__" and k[-2:] == "__" and k not in _DESCRIPTIVE_DUNDERS:
            return f"the attribute {k[:60]!r} (dunder names are refused: Python calls some of them)"
    return None


def _refused_ref(module: str, qualname: str) -> Optional[str]:
    """Why a reference to ``module.qualname`` is never stored or loaded (None if it may be)."""
    if module.split(".", 1)[0] in _REFUSED_REF_MODULES or (
        module == "builtins" and qualname in _REFUSED_BUILTINS
    ):
        return (
            f"{module}.{qualname} is never stored or loaded by name: called with stored "
            "arguments it could run commands or code"
        )
    return None


@dataclasses.dataclass(frozen=True)
class _UserType:
    """One ``codec.register_type`` registration."""

    cls: type
    name: str
    to_plain: Callable[[Any], Any]
    from_plain: Callable[[Any], Any]
