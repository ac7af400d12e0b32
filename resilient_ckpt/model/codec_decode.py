"""The codec's decoder: validates the header, unpacks msgpack and rebuilds the value tree,
copying tensor and array bytes once out of the input.

Format and supported types: :mod:`resilient_ckpt.model.codec`.
"""

from __future__ import annotations

import argparse
import collections
import enum
import functools
import math
import pickle
import sys
import types
from typing import Any, Callable, Dict, Mapping, Tuple

import msgpack
import numpy as np
import torch

from ..errors import CodecError
from .codec_format import (
    _ALIGN,
    _COMPLEX,
    _DEFAULT_FACTORIES,
    _HEADER,
    _MAX_DIM,
    _MAX_NDIM,
    _NP_CHARS,
    _PARTIAL_LABELS,
    _PATH_CLASSES,
    _REF_FUNCTION_TYPES,
    _SO_FIELDS,
    _ST_FIELDS,
    _TENSOR_DTYPES,
    _TORCH_DTYPES,
    _X,
    FORMAT_VERSION,
    MAGIC,
    MAX_DEPTH,
    _bad_attribute,
    _ExtType,
    _Fail,
    _path_elem,
    _refused_ref,
    _resolve_name,
    _UserType,
)
from .mapping import ShardedObject, ShardedTensor
from .nested import HOLE


class _Map:
    """A msgpack map as its list of pairs (keys need not be hashable before decoding)."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: list):
        self.pairs = pairs


def _str(x: Any, what: str) -> str:
    if type(x) is not str:
        raise _Fail(f"{what} at {{path}} must be a str, found {type(x).__name__}")
    return x


def _named(module: Any, qualname: Any, what: str) -> Tuple[str, str]:
    """The module and qualified name fields of a stored enum member or reference."""
    return _str(module, f"{what} module"), _str(qualname, f"{what} name")


def _lookup(module: str, qualname: str, what: str, or_else: str = "") -> Any:
    """The object ``module.qualname`` names (None if none), from imported modules only."""
    if module not in sys.modules:
        module = module[:200]
        raise _Fail(
            f"cannot decode the {what} {module}.{qualname[:200]} at {{path}}: module {module!r} "
            f"is not imported, and decoding never imports (importing runs code). Fix: import "
            f"{module} before loading{or_else}"
        )
    return _resolve_name(module, qualname)


def _attributes(attrs: dict, what: str) -> dict:
    bad = _bad_attribute(attrs)
    if bad is not None:
        raise _Fail(f"malformed {what} at {{path}}: {bad}")
    return attrs


def _shape(x: Any) -> tuple:
    if type(x) is not list or len(x) > _MAX_NDIM:
        raise _Fail(f"malformed shape at {{path}} (a list of at most {_MAX_NDIM} ints expected)")
    for d in x:
        if type(d) is not int or not 0 <= d <= _MAX_DIM:
            raise _Fail("malformed shape at {path} (dimensions must be ints >= 0)")
    return tuple(x)


class _Decoder:
    __slots__ = ("blobs", "budget", "allow_pickle", "user_types")

    def __init__(self, blobs: memoryview, allow_pickle: bool, user_types: Mapping[str, _UserType]):
        self.blobs = blobs
        # Blobs may be referenced more than once by crafted input; never materialise more
        # bytes than the input holds.
        self.budget = len(blobs)
        self.allow_pickle = allow_pickle
        self.user_types = user_types

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

    def dec_field(self, x: Any, label: str, depth: int) -> Any:
        """One field of the tagged value at ``depth``, called ``label`` in error paths."""
        try:
            return self.dec(x, depth + 1)
        except _Fail as e:
            e.path.append(label)
            raise

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

    def dec_namespace(self, arr: list, depth: int) -> Any:
        cls = types.SimpleNamespace if arr[0].code == _X.SIMPLE_NAMESPACE else argparse.Namespace
        what = f"{cls.__module__}.{cls.__qualname__}"
        self.fields(arr, 1, what)
        attrs = _attributes(self.dec_map(arr[1], depth + 1, {}), what)
        ns = cls()
        # Through __dict__, not setattr: no descriptor or __setattr__ runs.
        vars(ns).update(attrs)
        return ns

    def dec_enum(self, arr: list, depth: int) -> enum.Enum:
        _, module, qualname, value = self.fields(arr, 3, "enum member")
        module, qualname = _named(module, qualname, "enum class")
        cls = _lookup(module, qualname, "enum member of", ", or register_type the enum")
        if not (issubclass(type(cls), type) and issubclass(cls, enum.Enum)):
            raise _Fail(
                f"cannot decode the enum member at {{path}}: {module}.{qualname} is not an Enum "
                f"class in the imported module. Fix: import the module that defines it before "
                "loading, or register_type it"
            )
        v = self.dec_field(value, f"<{qualname} value>", depth)
        try:
            return cls(v)
        except Exception:
            raise _Fail(f"stored value at {{path}} is not a member of {module}.{qualname}") from None

    def dec_ref(self, arr: list, depth: int) -> Any:
        _, module, qualname = self.fields(arr, 2, "reference")
        module, qualname = _named(module, qualname, "reference")
        refused = _refused_ref(module, qualname)
        if refused is not None:
            raise _Fail(f"refusing to decode the reference at {{path}}: {refused}")
        obj = _lookup(module, qualname, "reference to")
        if not (type(obj) in _REF_FUNCTION_TYPES or issubclass(type(obj), type)):
            found = "nothing" if obj is None else f"a {type(obj).__name__}"
            raise _Fail(
                f"cannot decode the reference at {{path}}: {module}.{qualname} names {found} in "
                "the imported module, not a function or class. Fix: import the module (and "
                "version) that defines it before loading"
            )
        return obj

    def dec_partial(self, arr: list, depth: int) -> functools.partial:
        self.fields(arr, 4, "functools.partial")
        func, args, kw, attrs = (
            self.dec_field(v, label, depth) for v, label in zip(arr[1:], _PARTIAL_LABELS)
        )
        if not callable(func) or type(args) is not tuple or type(kw) is not dict or type(attrs) is not dict:
            raise _Fail("malformed functools.partial at {path}")
        if any(type(k) is not str for k in kw):
            raise _Fail("malformed functools.partial at {path}: a non-str keyword")
        p = functools.partial(func, *args, **kw)
        vars(p).update(_attributes(attrs, "functools.partial"))
        return p

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
        user = self.user_types.get(name)
        if user is None:
            raise _Fail(
                f"cannot decode the value at {{path}}: it was saved as registered type {name!r}, "
                "which is not registered here. Fix: call resilient_ckpt.model.codec.register_type"
                f"(<class>, {name!r}, to_plain, from_plain) before loading"
            )
        v = self.dec_field(plain, f"<{name}>", depth)
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


def _path_decoder(cls: type) -> Callable[[bytes], Any]:
    def dec(b: bytes) -> Any:
        try:
            return cls(b.decode("utf-8", "surrogatepass"))
        except Exception:
            raise _Fail(f"malformed {cls.__name__} at {{path}}") from None

    return dec


_SCALAR_DECODERS: Dict[int, Callable[[bytes], Any]] = {
    _X.BIGINT: _dec_bigint,
    _X.COMPLEX: _dec_complex,
    _X.DTYPE: _dec_dtype,
    _X.DEVICE: _dec_device,
    _X.HOLE: _dec_hole,
    **{code: _path_decoder(cls) for code, cls in _PATH_CLASSES.items()},
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
    _X.SIMPLE_NAMESPACE: _Decoder.dec_namespace,
    _X.ENUM: _Decoder.dec_enum,
    _X.NDARRAY: _Decoder.dec_ndarray,
    _X.NPSCALAR: _Decoder.dec_npscalar,
    _X.TENSOR: _Decoder.dec_tensor,
    _X.SIZE: _Decoder.dec_size,
    _X.SHARDED_TENSOR: _Decoder.dec_sharded_tensor,
    _X.SHARDED_OBJECT: _Decoder.dec_sharded_object,
    _X.USER: _Decoder.dec_user,
    _X.PICKLE: _Decoder.dec_pickle,
    _X.REF: _Decoder.dec_ref,
    _X.PARTIAL: _Decoder.dec_partial,
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


def decode_with(data: Any, allow_pickle: bool, user_types: Mapping[str, _UserType]) -> Any:
    """:func:`resilient_ckpt.model.codec.decode` with the registered types passed in
    (``user_types``: registered name -> registration)."""
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
        return _Decoder(mv[blob_start:], allow_pickle, user_types).dec(native, 0)
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
