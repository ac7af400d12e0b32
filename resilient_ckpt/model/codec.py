"""Pickle-free encoding of the non-tensor ("common") part of a checkpoint.

The common state (iteration, args, RNG states, scheduler state, optimizer param_groups,
ShardedObject payloads, the hollow sharded state dict) is stored in checkpoint headers and
sent to peers, so decoding must be safe on bytes from the store or the network: nothing is
unpickled unless the caller passes ``allow_pickle=True``, no module is imported, and any
malformed input raises :class:`~resilient_ckpt.errors.CodecError` (never another exception;
memory use stays proportional to the input's size).

Layout of an encoding::

    offset  size  field
    0       4     magic b"RCKC"
    4       2     FORMAT_VERSION, big-endian u16 (a newer version is rejected with a clear error)
    6       2     flags, 0 (reserved; non-zero is rejected)
    8       8     body length B, big-endian u64
    16      B     body: one msgpack object (the value tree, see below)
    ...           zero padding to a multiple of 64, then the blob section: the raw bytes of
                  every tensor / ndarray, each at a 64-byte aligned offset

Tensor and array bytes live out of band (not as msgpack ``bin``) so that ``encode`` copies
them exactly once (straight from the tensor's memory into the result) and ``decode`` copies
them exactly once (from the input buffer into a fresh tensor): inline ``bin`` would cost two
copies each way (into msgpack's buffer and out of it; msgpack's ExtType also requires
``bytes``).

Value tree. ``None``, ``bool``, ``int`` in [-2**63, 2**64), ``float`` (all 64 bits kept: NaN
payloads, -0.0), ``str`` and ``bytes`` are msgpack natives, ``list`` is a msgpack array and
``dict`` a msgpack map (any encodable key, insertion order kept). Everything else uses an
ExtType code. Two kinds:

* *scalar* exts carry the whole value in their payload;
* *tags* have an empty payload and only appear as the first element of an array whose other
  elements are the value's fields (encoded recursively, so e.g. a tuple of tuples nests).

====  ==================  ======  ===========================================================
code  kind                form    fields / payload
====  ==================  ======  ===========================================================
1     big int             scalar  two's-complement big-endian bytes (ints outside msgpack's)
2     complex             scalar  16 bytes: real, imag as big-endian float64
3     torch.dtype         scalar  name, e.g. b"bfloat16"
4     torch.device        scalar  str(device), e.g. b"cuda:1"
5     nested.HOLE         scalar  empty; decodes to the singleton
16    tuple               tag     *items
17    set                 tag     *items
18    frozenset           tag     *items
19    bytearray           tag     bin
20    slice               tag     start, stop, step
21    range               tag     start, stop, step (ints)
22    OrderedDict         tag     map
23    defaultdict         tag     factory name ("list", "dict", "int", ... or None), map
24    argparse.Namespace  tag     map attribute -> value (in order)
25    enum member         tag     module, qualname, value
26    numpy.ndarray       tag     dtype ("<f4": byte order + type char), shape, offset, nbytes
27    numpy scalar        tag     dtype, bin (raw bytes of the scalar)
28    torch.Tensor        tag     dtype name, shape, requires_grad, is_parameter, offset, nbytes
29    torch.Size          tag     *dims
30    ShardedTensor       tag     map field name -> value (data is None or a tensor)
31    ShardedObject       tag     map field name -> value (data encoded recursively)
32    register_type       tag     registered name, plain value
33    pickled object      tag     "module.qualname" of its type, bin (only with allow_pickle)
====  ==================  ======  ===========================================================

``offset`` / ``nbytes`` locate a tensor's or array's bytes in the blob section.

Decoded tensors are contiguous CPU tensors (common-state tensors come back on CPU whatever
device they were saved from; ``requires_grad`` and ``nn.Parameter`` are kept). Containers
may nest up to :data:`MAX_DEPTH` msgpack levels (tagged containers such as OrderedDict count
two). Sets are written in iteration order, so encodings of sets of strings differ between
processes (hash randomisation); everything else encodes deterministically.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import math
import pickle
import struct
import sys
import threading
from typing import Any, Callable, Dict, List, Optional

import msgpack
import numpy as np
import torch

from ..errors import CodecError
from .mapping import ShardedObject, ShardedTensor
from .nested import HOLE, format_path

__all__ = ["FORMAT_VERSION", "MAX_DEPTH", "decode", "encode", "register_type"]

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
    """ExtType codes (table in the module docstring)."""

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
# Integer dtypes of each element size: viewing a tensor as one of them keeps its bytes and
# strides, and gives a dtype with a copy kernel (sub-byte and bits dtypes have none).
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_NP_CHARS = frozenset(c for c in np.typecodes["All"] if np.dtype(c).kind in "biufc")
_NATIVE_ORDER = "<" if sys.byteorder == "little" else ">"

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


# --- registry of user types ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _UserType:
    cls: type
    name: str
    to_plain: Callable[[Any], Any]
    from_plain: Callable[[Any], Any]


_USER_BY_TYPE: Dict[type, _UserType] = {}
_USER_BY_NAME: Dict[str, _UserType] = {}
_USER_LOCK = threading.Lock()


def register_type(
    cls: type, name: str, to_plain: Callable[[Any], Any], from_plain: Callable[[Any], Any]
) -> None:
    """Teach the codec a type: ``to_plain(obj)`` returns an encodable value, ``from_plain``
    rebuilds the object from the decoded value. Matching is by exact type (not subclasses);
    the same ``name`` must be registered on the loading side before :func:`decode`.
    Registering the same class and name again replaces the functions (module reloads)."""
    if not isinstance(cls, type):
        raise CodecError(f"register_type needs a class, got {type(cls).__name__}")
    if not isinstance(name, str) or not name:
        raise CodecError(f"register_type({_type_name(cls)}): name must be a non-empty str")
    if not callable(to_plain) or not callable(from_plain):
        raise CodecError(f"register_type({_type_name(cls)}): to_plain/from_plain must be callable")
    if cls in _BUILTIN_TYPES:
        raise CodecError(
            f"{_type_name(cls)} has a built-in encoding and cannot be registered; register a "
            "subclass of it instead"
        )
    entry = _UserType(cls, name, to_plain, from_plain)
    with _USER_LOCK:
        by_name = _USER_BY_NAME.get(name)
        if by_name is not None and _type_name(by_name.cls) != _type_name(cls):
            raise CodecError(
                f"register_type name {name!r} is already used by {_type_name(by_name.cls)}; "
                f"pick another name for {_type_name(cls)}"
            )
        by_type = _USER_BY_TYPE.get(cls)
        if by_type is not None and by_type.name != name:
            raise CodecError(
                f"{_type_name(cls)} is already registered as {by_type.name!r}; a type has one name"
            )
        if by_name is not None:  # same name again: maybe a reloaded module's new class object
            _USER_BY_TYPE.pop(by_name.cls, None)
        _USER_BY_TYPE[cls] = entry
        _USER_BY_NAME[name] = entry


# --- encoding ------------------------------------------------------------------------------

_NATIVE = frozenset((str, bytes, float, bool, type(None)))
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1


def _bigint_bytes(x: int) -> bytes:
    return x.to_bytes((x + (x < 0)).bit_length() // 8 + 1, "big", signed=True)


def _unsupported_tensor(x: torch.Tensor) -> Optional[str]:
    """Why a tensor cannot be stored as raw bytes (None if it can)."""
    if type(x) not in (torch.Tensor, torch.nn.Parameter):
        return f"tensor subclass {_type_name(type(x))} (convert it to a plain tensor first)"
    if x.is_nested:
        return "nested tensor (unbind it into a list of tensors first)"
    if x.is_quantized:
        return "quantized tensor (store .dequantize() or its int_repr() and quantizer params)"
    if x.layout != torch.strided:
        return f"{x.layout} tensor (store .to_dense() or its index/value tensors)"
    if x.device.type == "meta":
        return "meta tensor (it has no data)"
    return None


def _tensor_bytes(x: torch.Tensor) -> memoryview:
    if x.numel() == 0:  # empty views may carry strides that forbid a byte view
        return memoryview(b"")
    t = x.detach().resolve_conj().resolve_neg()
    as_int = _SAME_SIZE_INT.get(t.element_size())
    if as_int is not None:
        t = t.view(as_int)
    if t.device.type != "cpu":
        t = t.cpu()  # common-state tensors are small; a synchronous copy is fine
    if not t.is_contiguous():
        t = t.contiguous()
    # Flat view with stride 1 (reshape keeps odd strides of size-1 dims, which view(uint8)
    # refuses). Its uint8 numpy array shares the tensor's memory: no copy, and numpy never
    # sees the real dtype (it lacks bfloat16, float8, ...).
    flat = t.as_strided((t.numel(),), (1,))
    return memoryview(flat.view(torch.uint8).numpy())


def _np_dtype_str(dt: np.dtype) -> str:
    order = dt.byteorder
    return (_NATIVE_ORDER if order == "=" else order) + dt.char


class _Encoder:
    __slots__ = ("packer", "blobs", "blob_len", "allow_pickle")

    def __init__(self, allow_pickle: bool):
        self.packer = msgpack.Packer(use_bin_type=True, autoreset=False, unicode_errors="surrogatepass")
        self.blobs: List[Any] = []
        self.blob_len = 0
        self.allow_pickle = allow_pickle

    def add_blob(self, mv: memoryview) -> int:
        n = mv.nbytes
        if not n:
            return 0
        pad = -self.blob_len % _ALIGN  # padding before, so a truncated last blob is noticed
        if pad:
            self.blobs.append(_ZEROS[:pad])
        off = self.blob_len + pad
        self.blobs.append(mv)
        self.blob_len = off + n
        return off

    def enc(self, x: Any, depth: int) -> None:
        t = type(x)
        p = self.packer
        if t in _NATIVE:
            p.pack(x)
            return
        if t is int:
            if _INT_MIN <= x <= _INT_MAX:
                p.pack(x)
            else:
                p.pack(_ExtType(_X.BIGINT, _bigint_bytes(x)))
            return
        scalar = _SCALAR_ENCODERS.get(t)
        if scalar is not None:
            p.pack(scalar(x))
            return
        if depth >= MAX_DEPTH:
            raise _Fail(
                f"value at {{path}} is nested more than {MAX_DEPTH} levels deep (a reference "
                "cycle?); flatten it"
            )
        if t is list:
            p.pack_array_header(len(x))
            self.enc_items(x, depth)
            return
        if t is dict:
            self.enc_map(x.items(), len(x), depth)
            return
        if t is tuple:
            p.pack_array_header(len(x) + 1)
            p.pack(_TAG[_X.TUPLE])
            self.enc_items(x, depth)
            return
        handler = _ENCODERS.get(t)
        if handler is not None:
            handler(self, x, depth)
            return
        user = _USER_BY_TYPE.get(t)
        if user is not None:
            self.enc_user(user, x, depth)
            return
        if isinstance(x, enum.Enum):
            self.enc_enum(x, depth)
            return
        if isinstance(x, np.generic) and x.dtype.char in _NP_CHARS:
            p.pack_array_header(3)
            p.pack(_TAG[_X.NPSCALAR])
            p.pack(_np_dtype_str(x.dtype))
            p.pack(x.tobytes())
            return
        why = None
        if isinstance(x, torch.Tensor):
            why = _unsupported_tensor(x)
        self.enc_unknown(x, why)

    def enc_items(self, items: Any, depth: int) -> None:
        """Array elements after a tag (path elements are indexes)."""
        for i, v in enumerate(items):
            try:
                self.enc(v, depth + 1)
            except _Fail as e:
                e.path.append(i)
                raise

    def enc_map(self, items: Any, n: int, depth: int) -> None:
        """A msgpack map at ``depth`` (the caller checked the depth of its own level)."""
        if depth >= MAX_DEPTH:
            raise _Fail(f"value at {{path}} is nested more than {MAX_DEPTH} levels deep")
        self.packer.pack_map_header(n)
        for k, v in items:
            try:
                self.enc(k, depth + 1)
            except _Fail as e:
                e.path.append(f"<key {_path_elem(k)}>")
                raise
            try:
                self.enc(v, depth + 1)
            except _Fail as e:
                e.path.append(_path_elem(k))
                raise

    def tagged(self, code: _X, nfields: int) -> None:
        self.packer.pack_array_header(nfields + 1)
        self.packer.pack(_TAG[code])

    # handlers for non-native types (all of them emit one tagged array at `depth`)

    def enc_set(self, x: Any, depth: int) -> None:
        self.tagged(_X.SET if type(x) is set else _X.FROZENSET, len(x))
        self.enc_items(x, depth)

    def enc_bytearray(self, x: bytearray, depth: int) -> None:
        self.tagged(_X.BYTEARRAY, 1)
        self.packer.pack(memoryview(x))

    def enc_slice(self, x: slice, depth: int) -> None:
        self.tagged(_X.SLICE, 3)
        self.enc_items((x.start, x.stop, x.step), depth)

    def enc_range(self, x: range, depth: int) -> None:
        self.tagged(_X.RANGE, 3)
        self.enc_items((x.start, x.stop, x.step), depth)

    def enc_odict(self, x: collections.OrderedDict, depth: int) -> None:
        self.tagged(_X.ODICT, 1)
        self.enc_map(x.items(), len(x), depth + 1)

    def enc_defaultdict(self, x: collections.defaultdict, depth: int) -> None:
        f = x.default_factory
        name = None if f is None else _DEFAULT_FACTORY_NAMES.get(f)
        if f is not None and name is None:
            raise _Fail(
                f"cannot encode the defaultdict at {{path}}: its default_factory "
                f"{getattr(f, '__qualname__', f)!r} is not a builtin type (allowed: "
                f"{', '.join(sorted(_DEFAULT_FACTORIES))}); convert it to a dict, or "
                "register_type a dict subclass"
            )
        self.tagged(_X.DEFAULTDICT, 2)
        self.packer.pack(name)
        self.enc_map(x.items(), len(x), depth + 1)

    def enc_namespace(self, x: argparse.Namespace, depth: int) -> None:
        attrs = vars(x)
        for k in attrs:
            if type(k) is not str:
                raise _Fail(f"argparse.Namespace at {{path}} has a non-str attribute name {k!r}")
        self.tagged(_X.NAMESPACE, 1)
        self.enc_map(attrs.items(), len(attrs), depth + 1)

    def enc_enum(self, x: enum.Enum, depth: int) -> None:
        cls = type(x)
        module, qualname = cls.__module__, cls.__qualname__
        if _resolve_class(module, qualname) is not cls:
            raise _Fail(
                f"cannot encode enum member {x!r} at {{path}}: its class {qualname} cannot be "
                f"found by name in module {module!r} (defined inside a function?); define it "
                "at module level, or register_type it"
            )
        self.tagged(_X.ENUM, 3)
        self.packer.pack(module)
        self.packer.pack(qualname)
        try:
            self.enc(x.value, depth + 1)
        except _Fail as e:
            e.path.append(f"<{qualname} value>")
            raise

    def enc_ndarray(self, x: np.ndarray, depth: int) -> None:
        if x.dtype.char not in _NP_CHARS:
            raise _Fail(
                f"cannot encode numpy array of dtype {x.dtype} at {{path}}: only bool and "
                "numeric dtypes are stored (object/str/structured arrays may hold code); "
                "convert it, or register_type a wrapper"
            )
        if x.size == 0:
            mv = memoryview(b"")
        else:
            a = x if x.flags.c_contiguous else np.ascontiguousarray(x)
            mv = memoryview(a.reshape(-1).view(np.uint8))
        off = self.add_blob(mv)
        self.tagged(_X.NDARRAY, 4)
        p = self.packer
        p.pack(_np_dtype_str(x.dtype))
        p.pack(list(x.shape))
        p.pack(off)
        p.pack(mv.nbytes)

    def enc_tensor(self, x: torch.Tensor, depth: int) -> None:
        why = _unsupported_tensor(x)
        if why is not None:
            self.enc_unknown(x, why)
            return
        mv = _tensor_bytes(x)
        off = self.add_blob(mv)
        self.tagged(_X.TENSOR, 6)
        p = self.packer
        p.pack(_TORCH_DTYPE_NAMES[x.dtype])
        p.pack(list(x.shape))
        p.pack(bool(x.requires_grad))
        p.pack(type(x) is torch.nn.Parameter)
        p.pack(off)
        p.pack(mv.nbytes)

    def enc_size(self, x: torch.Size, depth: int) -> None:
        self.tagged(_X.SIZE, len(x))
        for d in x:
            self.packer.pack(int(d))

    def enc_sharded_tensor(self, x: ShardedTensor, depth: int) -> None:
        self.tagged(_X.SHARDED_TENSOR, 1)
        self.enc_map(((f, getattr(x, f)) for f in _ST_FIELDS), len(_ST_FIELDS), depth + 1)

    def enc_sharded_object(self, x: ShardedObject, depth: int) -> None:
        self.tagged(_X.SHARDED_OBJECT, 1)
        self.enc_map(((f, getattr(x, f)) for f in _SO_FIELDS), len(_SO_FIELDS), depth + 1)

    def enc_user(self, user: _UserType, x: Any, depth: int) -> None:
        try:
            plain = user.to_plain(x)
        except Exception as e:
            raise _Fail(
                f"register_type({user.name!r}).to_plain failed on the {_type_name(type(x))} at "
                f"{{path}}: {type(e).__name__}: {e}"
            ) from e
        self.tagged(_X.USER, 2)
        self.packer.pack(user.name)
        try:
            self.enc(plain, depth + 1)
        except _Fail as e:
            e.path.append(f"<{user.name}>")
            raise

    def enc_unknown(self, x: Any, why: Optional[str]) -> None:
        tname = _type_name(type(x))
        if not self.allow_pickle:
            what = why or f"object of type {tname}"
            raise _Fail(
                f"cannot encode {what} at {{path}} without pickle. Fix: convert it to plain "
                f"data (containers, numbers, str, bytes, numpy arrays, tensors), or call "
                f"resilient_ckpt.model.codec.register_type({tname}, name, to_plain, from_plain), or "
                "pass allow_pickle=True (local-only use: loading then needs allow_pickle=True, "
                "and pickled data runs code when loaded)"
            )
        try:
            payload = pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise _Fail(
                f"cannot pickle the {tname} at {{path}} (allow_pickle=True): "
                f"{type(e).__name__}: {e}; register_type it instead"
            ) from e
        self.tagged(_X.PICKLE, 2)
        self.packer.pack(tname)
        self.packer.pack(payload)


def _enc_complex(x: complex) -> Any:
    return _ExtType(_X.COMPLEX, _COMPLEX.pack(x.real, x.imag))


def _enc_dtype(x: torch.dtype) -> Any:
    return _ExtType(_X.DTYPE, _TORCH_DTYPE_NAMES[x].encode())


def _enc_device(x: torch.device) -> Any:
    return _ExtType(_X.DEVICE, str(x).encode())


_SCALAR_ENCODERS: Dict[type, Callable[[Any], Any]] = {
    complex: _enc_complex,
    torch.dtype: _enc_dtype,
    torch.device: _enc_device,
    type(HOLE): lambda x: _HOLE_EXT,
}

_ENCODERS: Dict[type, Callable[[_Encoder, Any, int], None]] = {
    set: _Encoder.enc_set,
    frozenset: _Encoder.enc_set,
    bytearray: _Encoder.enc_bytearray,
    slice: _Encoder.enc_slice,
    range: _Encoder.enc_range,
    collections.OrderedDict: _Encoder.enc_odict,
    collections.defaultdict: _Encoder.enc_defaultdict,
    argparse.Namespace: _Encoder.enc_namespace,
    np.ndarray: _Encoder.enc_ndarray,
    torch.Tensor: _Encoder.enc_tensor,
    torch.nn.Parameter: _Encoder.enc_tensor,
    torch.Size: _Encoder.enc_size,
    ShardedTensor: _Encoder.enc_sharded_tensor,
    ShardedObject: _Encoder.enc_sharded_object,
}
# Types with a built-in encoding; register_type refuses them so the format stays fixed.
_BUILTIN_TYPES = frozenset((*_NATIVE, int, list, dict, tuple, *_SCALAR_ENCODERS, *_ENCODERS))


def encode(obj: Any, *, allow_pickle: bool = False) -> bytes:
    """Encode ``obj`` (see the module docstring for the supported types) into bytes.

    Raises :class:`CodecError` naming the type and key path of anything unsupported.
    With ``allow_pickle=True`` unsupported objects are pickled instead (for data that never
    leaves this machine: :func:`decode` refuses them unless it is also given
    ``allow_pickle=True``).
    """
    e = _Encoder(allow_pickle)
    try:
        e.enc(obj, 0)
    except _Fail as f:
        raise f.to_codec_error() from f.__cause__
    except CodecError:
        raise
    except RecursionError as r:
        raise CodecError(
            "cannot encode: the value is nested too deeply for Python's recursion limit; flatten it"
        ) from r
    except (OverflowError, ValueError) as err:  # msgpack limits (e.g. a str over 4 GiB)
        raise CodecError(f"cannot encode: {type(err).__name__}: {err}") from err
    body = e.packer.getbuffer()
    try:
        head = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, body.nbytes)
        if not e.blobs:
            return b"".join((head, body))
        pad = -(_HEADER.size + body.nbytes) % _ALIGN
        return b"".join([head, body, _ZEROS[:pad], *e.blobs])
    finally:
        body.release()


# --- decoding ------------------------------------------------------------------------------


class _Map:
    """A msgpack map as its list of pairs (keys need not be hashable before decoding)."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: list):
        self.pairs = pairs


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


def _str(x: Any, what: str) -> str:
    if type(x) is not str:
        raise _Fail(f"{what} at {{path}} must be a str, found {type(x).__name__}")
    return x


def _int(x: Any, what: str) -> int:
    if type(x) is not int:
        raise _Fail(f"{what} at {{path}} must be an int, found {type(x).__name__}")
    return x


def _shape(x: Any) -> tuple:
    if type(x) is not list or len(x) > _MAX_NDIM:
        raise _Fail(f"malformed shape at {{path}} (a list of at most {_MAX_NDIM} ints expected)")
    for d in x:
        if type(d) is not int or not 0 <= d <= _MAX_DIM:
            raise _Fail("malformed shape at {path} (dimensions must be ints >= 0)")
    return tuple(x)


class _Decoder:
    __slots__ = ("blobs", "budget", "allow_pickle")

    def __init__(self, blobs: memoryview, allow_pickle: bool):
        self.blobs = blobs
        # Blobs may be referenced more than once by crafted input; never materialise more
        # bytes than the input holds.
        self.budget = len(blobs)
        self.allow_pickle = allow_pickle

    def dec(self, x: Any, depth: int) -> Any:
        t = type(x)
        if t in _PLAIN:
            return x
        if t is list or t is _Map:
            if depth >= MAX_DEPTH:
                raise _Fail(f"data nested more than {MAX_DEPTH} levels deep at {{path}}")
            if t is _Map:
                return self.dec_map(x, depth, dict())
            if x and type(x[0]) is _ExtType and x[0].code in _TAG_DECODERS:
                if x[0].data:
                    raise _Fail(f"malformed tag {x[0].code} at {{path}} (it has a payload)")
                return _TAG_DECODERS[x[0].code](self, x, depth)
            return self.dec_items(x, 0, depth)
        if t is _ExtType:
            f = _SCALAR_DECODERS.get(x.code)
            if f is None:
                where = "outside a tagged array" if x.code in _TAG_DECODERS else "(unknown code)"
                raise _Fail(f"unexpected ExtType code {x.code} at {{path}} {where}")
            return f(x.data)
        raise _Fail(f"unexpected msgpack value of type {t.__name__} at {{path}}")

    def dec_items(self, arr: list, start: int, depth: int) -> list:
        out = []
        for i in range(start, len(arr)):
            try:
                out.append(self.dec(arr[i], depth + 1))
            except _Fail as e:
                e.path.append(i - start)
                raise
        return out

    def dec_map(self, m: Any, depth: int, out: dict) -> dict:
        if type(m) is not _Map:
            raise _Fail(f"malformed data at {{path}}: a map expected, found {type(m).__name__}")
        if depth >= MAX_DEPTH:
            raise _Fail(f"data nested more than {MAX_DEPTH} levels deep at {{path}}")
        for k, v in m.pairs:
            try:
                dk = self.dec(k, depth + 1)
            except _Fail as e:
                e.path.append("<key>")
                raise
            try:
                dv = self.dec(v, depth + 1)
            except _Fail as e:
                e.path.append(_path_elem(dk))
                raise
            try:
                if dk in out:
                    raise _Fail(f"duplicate key {_path_elem(dk)} in the map at {{path}}")
                out[dk] = dv
            except TypeError:
                raise _Fail(f"unhashable dict key of type {type(dk).__name__} at {{path}}") from None
        return out

    def fields(self, arr: list, n: int, what: str) -> list:
        if len(arr) != n + 1:
            raise _Fail(f"malformed {what} at {{path}}: {len(arr) - 1} fields, expected {n}")
        return arr

    def blob(self, off: Any, n: Any) -> memoryview:
        if type(off) is not int or type(n) is not int or off < 0 or n < 0:
            raise _Fail("malformed data reference at {path}")
        if off + n > len(self.blobs):
            raise _Fail(
                f"tensor/array data at {{path}} lies outside the encoded bytes "
                f"(needs {off + n} bytes of data, {len(self.blobs)} present): truncated input?"
            )
        if n > self.budget:
            raise _Fail("malformed data at {path}: data regions are referenced more than once")
        self.budget -= n
        return self.blobs[off : off + n]

    # tagged values

    def dec_tuple(self, arr: list, depth: int) -> tuple:
        return tuple(self.dec_items(arr, 1, depth))

    def dec_set(self, arr: list, depth: int) -> Any:
        items = self.dec_items(arr, 1, depth)
        try:
            return (set if arr[0].code == _X.SET else frozenset)(items)
        except TypeError:
            raise _Fail("unhashable set element at {path}") from None

    def dec_bytearray(self, arr: list, depth: int) -> bytearray:
        _, b = self.fields(arr, 1, "bytearray")
        if type(b) is not bytes:
            raise _Fail("malformed bytearray at {path}")
        return bytearray(b)

    def dec_slice(self, arr: list, depth: int) -> slice:
        self.fields(arr, 3, "slice")
        return slice(*self.dec_items(arr, 1, depth))

    def dec_range(self, arr: list, depth: int) -> range:
        self.fields(arr, 3, "range")
        vals = self.dec_items(arr, 1, depth)
        if any(type(v) is not int for v in vals) or vals[2] == 0:
            raise _Fail("malformed range at {path}")
        return range(*vals)

    def dec_odict(self, arr: list, depth: int) -> collections.OrderedDict:
        self.fields(arr, 1, "OrderedDict")
        return self.dec_map(arr[1], depth + 1, collections.OrderedDict())

    def dec_defaultdict(self, arr: list, depth: int) -> collections.defaultdict:
        _, name, m = self.fields(arr, 2, "defaultdict")
        if name is None:
            factory = None
        elif type(name) is str and name in _DEFAULT_FACTORIES:
            factory = _DEFAULT_FACTORIES[name]
        else:
            raise _Fail("malformed defaultdict at {path}: unknown default_factory")
        return self.dec_map(m, depth + 1, collections.defaultdict(factory))

    def dec_namespace(self, arr: list, depth: int) -> argparse.Namespace:
        self.fields(arr, 1, "argparse.Namespace")
        attrs = self.dec_map(arr[1], depth + 1, {})
        if any(type(k) is not str for k in attrs):
            raise _Fail("malformed argparse.Namespace at {path}: non-str attribute name")
        ns = argparse.Namespace()
        # Through __dict__, not setattr: a crafted name like "__class__" stays a plain entry.
        vars(ns).update(attrs)
        return ns

    def dec_enum(self, arr: list, depth: int) -> enum.Enum:
        _, module, qualname, value = self.fields(arr, 3, "enum member")
        module = _str(module, "enum module")
        qualname = _str(qualname, "enum class name")
        if module not in sys.modules:
            raise _Fail(
                f"cannot decode the enum member of {module}.{qualname} at {{path}}: module "
                f"{module!r} is not imported, and decoding never imports (importing runs "
                f"code). Fix: import {module} before loading, or register_type the enum"
            )
        cls = _resolve_class(module, qualname)
        if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
            raise _Fail(
                f"cannot decode the enum member at {{path}}: {module}.{qualname} is not an Enum "
                f"class in the imported module. Fix: import the module that defines it before "
                "loading, or register_type it"
            )
        try:
            v = self.dec(value, depth + 1)
        except _Fail as e:
            e.path.append(f"<{qualname} value>")
            raise
        try:
            return cls(v)
        except Exception:
            raise _Fail(f"stored value at {{path}} is not a member of {module}.{qualname}") from None

    def dec_ndarray(self, arr: list, depth: int) -> np.ndarray:
        _, dt, shape, off, n = self.fields(arr, 4, "numpy array")
        dtype = _np_dtype(dt)
        shape = _shape(shape)
        if math.prod(shape) * dtype.itemsize != n:
            raise _Fail("malformed numpy array at {path}: byte count does not match shape")
        src = self.blob(off, n)
        out = np.empty(shape, dtype=dtype)
        if n:
            np.copyto(out.reshape(-1).view(np.uint8), np.frombuffer(src, np.uint8))
        return out

    def dec_npscalar(self, arr: list, depth: int) -> np.generic:
        _, dt, raw = self.fields(arr, 2, "numpy scalar")
        dtype = _np_dtype(dt)
        if type(raw) is not bytes or len(raw) != dtype.itemsize:
            raise _Fail("malformed numpy scalar at {path}")
        return np.frombuffer(raw, dtype)[0]

    def dec_tensor(self, arr: list, depth: int) -> torch.Tensor:
        _, dname, shape, rg, is_param, off, n = self.fields(arr, 6, "tensor")
        dtype = _TENSOR_DTYPES.get(dname) if type(dname) is str else None
        if dtype is None:
            raise _Fail("malformed tensor at {path}: unknown dtype")
        shape = _shape(shape)
        if type(rg) is not bool or type(is_param) is not bool:
            raise _Fail("malformed tensor at {path}")
        if math.prod(shape) * dtype.itemsize != n:
            raise _Fail("malformed tensor at {path}: byte count does not match shape and dtype")
        src = self.blob(off, n)
        out = torch.empty(shape, dtype=dtype, device="cpu")  # whatever the default device
        if n:
            np.copyto(out.reshape(-1).view(torch.uint8).numpy(), np.frombuffer(src, np.uint8))
        if is_param:
            return torch.nn.Parameter(out, requires_grad=rg)
        if rg:
            out.requires_grad_(True)
        return out

    def dec_size(self, arr: list, depth: int) -> torch.Size:
        dims = arr[1:]
        if len(dims) > _MAX_NDIM or any(type(d) is not int for d in dims):
            raise _Fail("malformed torch.Size at {path}")
        return torch.Size(dims)

    def dec_dataclass(self, arr: list, depth: int, cls: type, names: tuple) -> Any:
        what = cls.__name__
        self.fields(arr, 1, what)
        kw = self.dec_map(arr[1], depth + 1, {})
        unknown = [k for k in kw if k not in names]
        if unknown:
            raise _Fail(f"malformed {what} at {{path}}: unknown field(s) {unknown[:5]!r}")
        data = kw.get("data")
        if cls is ShardedTensor:
            if data is not None and not isinstance(data, torch.Tensor):
                raise _Fail(f"malformed {what} at {{path}}: data is not a tensor")
            if not isinstance(kw.get("dtype"), torch.dtype):
                raise _Fail(f"malformed {what} at {{path}}: dtype is not a torch.dtype")
        try:
            return cls(**kw)
        except Exception as e:
            raise _Fail(f"stored {what} at {{path}} is invalid: {type(e).__name__}: {e}") from e

    def dec_sharded_tensor(self, arr: list, depth: int) -> ShardedTensor:
        return self.dec_dataclass(arr, depth, ShardedTensor, _ST_FIELDS)

    def dec_sharded_object(self, arr: list, depth: int) -> ShardedObject:
        return self.dec_dataclass(arr, depth, ShardedObject, _SO_FIELDS)

    def dec_user(self, arr: list, depth: int) -> Any:
        _, name, plain = self.fields(arr, 2, "registered type")
        name = _str(name, "registered type name")
        user = _USER_BY_NAME.get(name)
        if user is None:
            raise _Fail(
                f"cannot decode the value at {{path}}: it was saved as registered type {name!r}, "
                "which is not registered here. Fix: call resilient_ckpt.model.codec.register_type"
                f"(<class>, {name!r}, to_plain, from_plain) before loading"
            )
        try:
            v = self.dec(plain, depth + 1)
        except _Fail as e:
            e.path.append(f"<{name}>")
            raise
        try:
            return user.from_plain(v)
        except Exception as e:
            raise _Fail(
                f"register_type({name!r}).from_plain failed at {{path}}: {type(e).__name__}: {e}"
            ) from e

    def dec_pickle(self, arr: list, depth: int) -> Any:
        _, tname, payload = self.fields(arr, 2, "pickled value")
        tname = _str(tname, "pickled type name")
        if type(payload) is not bytes:
            raise _Fail("malformed pickled value at {path}")
        if not self.allow_pickle:
            raise _Fail(
                f"refusing to unpickle the {tname[:200]} at {{path}}: unpickling runs arbitrary "
                "code. If you wrote this data yourself (local-only use), decode with "
                "allow_pickle=True; otherwise save it as plain data or with register_type"
            )
        try:
            return pickle.loads(payload)
        except Exception as e:
            raise _Fail(f"cannot unpickle the {tname[:200]} at {{path}}: {type(e).__name__}: {e}") from e


_PLAIN = frozenset((str, int, float, bool, bytes, type(None)))


def _np_dtype(desc: Any) -> np.dtype:
    if type(desc) is not str or len(desc) != 2 or desc[0] not in "<>|" or desc[1] not in _NP_CHARS:
        raise _Fail("malformed numpy dtype at {path}")
    return np.dtype(desc)


def _dec_bigint(b: bytes) -> int:
    if not b:
        raise _Fail("malformed big int at {path}")
    return int.from_bytes(b, "big", signed=True)


def _dec_complex(b: bytes) -> complex:
    if len(b) != _COMPLEX.size:
        raise _Fail("malformed complex at {path}")
    return complex(*_COMPLEX.unpack(b))


def _dec_dtype(b: bytes) -> torch.dtype:
    d = _TORCH_DTYPES.get(b.decode("ascii", "replace"))
    if d is None:
        raise _Fail("unknown torch dtype at {path} (saved by a newer torch?)")
    return d


def _dec_device(b: bytes) -> torch.device:
    if len(b) > 64:
        raise _Fail("malformed torch.device at {path}")
    try:
        return torch.device(b.decode("ascii"))
    except Exception:
        raise _Fail("malformed torch.device at {path}") from None


def _dec_hole(b: bytes) -> Any:
    if b:
        raise _Fail("malformed HOLE at {path}")
    return HOLE


_SCALAR_DECODERS: Dict[int, Callable[[bytes], Any]] = {
    _X.BIGINT: _dec_bigint,
    _X.COMPLEX: _dec_complex,
    _X.DTYPE: _dec_dtype,
    _X.DEVICE: _dec_device,
    _X.HOLE: _dec_hole,
}

_TAG_DECODERS: Dict[int, Callable[[_Decoder, list, int], Any]] = {
    _X.TUPLE: _Decoder.dec_tuple,
    _X.SET: _Decoder.dec_set,
    _X.FROZENSET: _Decoder.dec_set,
    _X.BYTEARRAY: _Decoder.dec_bytearray,
    _X.SLICE: _Decoder.dec_slice,
    _X.RANGE: _Decoder.dec_range,
    _X.ODICT: _Decoder.dec_odict,
    _X.DEFAULTDICT: _Decoder.dec_defaultdict,
    _X.NAMESPACE: _Decoder.dec_namespace,
    _X.ENUM: _Decoder.dec_enum,
    _X.NDARRAY: _Decoder.dec_ndarray,
    _X.NPSCALAR: _Decoder.dec_npscalar,
    _X.TENSOR: _Decoder.dec_tensor,
    _X.SIZE: _Decoder.dec_size,
    _X.SHARDED_TENSOR: _Decoder.dec_sharded_tensor,
    _X.SHARDED_OBJECT: _Decoder.dec_sharded_object,
    _X.USER: _Decoder.dec_user,
    _X.PICKLE: _Decoder.dec_pickle,
}


def _check_header(mv: memoryview) -> int:
    """Validate the header; return the body length."""
    n = len(mv)
    if n < _HEADER.size:
        raise CodecError(
            f"encoded common state is {n} bytes, shorter than its {_HEADER.size}-byte header: "
            "truncated, or not written by resilient_ckpt.model.codec"
        )
    magic, version, flags, body_len = _HEADER.unpack_from(mv)
    if magic != MAGIC:
        hint = ""
        if magic[:1] == b"\x80":
            hint = " (it looks like a pickle, which is never loaded here)"
        elif magic == b"PK\x03\x04":
            hint = " (it looks like a torch.save zip archive, which is never loaded here)"
        raise CodecError(
            f"not a resilient_ckpt codec encoding: starts with {bytes(magic)!r}, expected {MAGIC!r}{hint}"
        )
    if version != FORMAT_VERSION:
        if version > FORMAT_VERSION:
            raise CodecError(
                f"common state was encoded with codec format version {version}, newer than "
                f"this resilient_ckpt reads (version {FORMAT_VERSION}); upgrade resilient_ckpt "
                "on this node to load it"
            )
        raise CodecError(
            f"common state has codec format version {version}, which this resilient_ckpt "
            f"(version {FORMAT_VERSION}) does not read"
        )
    if flags:
        raise CodecError(
            f"common state header has flags {flags:#06x} that format version "
            f"{FORMAT_VERSION} does not define: corrupt, or written by a newer resilient_ckpt"
        )
    if body_len > n - _HEADER.size:
        raise CodecError(
            f"truncated common state: the header announces a {body_len}-byte body but only "
            f"{n - _HEADER.size} bytes follow"
        )
    return body_len


def decode(data: Any, *, allow_pickle: bool = False) -> Any:
    """Decode bytes made by :func:`encode` (``bytes``, ``bytearray`` or ``memoryview``,
    e.g. of shared memory; nothing in the result aliases it).

    Any malformed input raises :class:`CodecError`. Pickled values are refused unless
    ``allow_pickle=True`` (only for data you wrote yourself: unpickling runs code).
    """
    try:
        mv = memoryview(data)
        if not mv.c_contiguous:
            raise TypeError("the buffer is not contiguous")
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
    except TypeError as e:
        raise CodecError(
            f"decode() needs bytes, bytearray or a contiguous memoryview, got {type(data).__name__}: {e}"
        ) from None
    body_len = _check_header(mv)
    body_end = _HEADER.size + body_len
    blob_start = min(len(mv), body_end + (-body_end % _ALIGN))
    try:
        native = msgpack.unpackb(
            mv[_HEADER.size : body_end],
            raw=False,
            use_list=True,
            strict_map_key=False,
            object_pairs_hook=_Map,
            unicode_errors="surrogatepass",
        )
        return _Decoder(mv[blob_start:], allow_pickle).dec(native, 0)
    except _Fail as f:
        raise f.to_codec_error() from None
    except CodecError:
        raise
    except RecursionError:
        raise CodecError("malformed common state: nested too deeply to decode") from None
    except Exception as e:
        # Anything else that bad bytes can provoke (msgpack's own errors, unhashable keys,
        # constructor checks) is reported the same way: the input is unusable.
        raise CodecError(f"malformed common state: {type(e).__name__}: {e}") from e
