"""The codec's encoder: a value tree to msgpack plus the aligned blob section.

Format and supported types: :mod:`resilient_ckpt.model.codec`.
"""

from __future__ import annotations

import argparse
import collections
import enum
import functools
import pickle
import sys
import types
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import msgpack
import numpy as np
import torch

from ..errors import CodecError
from .codec_format import (
    _ALIGN,
    _COMPLEX,
    _DEFAULT_FACTORIES,
    _DEFAULT_FACTORY_NAMES,
    _HEADER,
    _HOLE_EXT,
    _NP_CHARS,
    _PARTIAL_LABELS,
    _PATH_CODES,
    _SO_FIELDS,
    _ST_FIELDS,
    _TAG,
    _TORCH_DTYPE_NAMES,
    _X,
    _ZEROS,
    FORMAT_VERSION,
    MAGIC,
    MAX_DEPTH,
    _bad_attribute,
    _ExtType,
    _Fail,
    _path_elem,
    _refused_ref,
    _resolve_name,
    _type_name,
    _UserType,
)
from .mapping import ShardedObject, ShardedTensor
from .nested import HOLE

# Integer dtypes of each element size: viewing a tensor as one of them keeps its bytes and
# strides, and gives a dtype with a copy kernel (sub-byte and bits dtypes have none).
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NATIVE_ORDER = "<" if sys.byteorder == "little" else ">"

_NATIVE = frozenset((str, bytes, float, bool, type(None)))
#: lists longer than this whose items are all native are packed by msgpack in one call
_BULK = 16
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1


def _packs_in_bulk(x) -> bool:
    """A long sequence that msgpack packs to the same bytes as :meth:`_Encoder.enc` item by
    item: every item native, or an int in msgpack's range (tested at C speed)."""
    if len(x) <= _BULK:
        return False
    types = set(map(type, x))
    if types <= _NATIVE:
        return True
    return types == _INT_TYPE and _INT_MIN <= min(x) and max(x) <= _INT_MAX


_INT_TYPE = {int}


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


# The local-only way out, named by every "cannot encode" error that pickle could resolve.
_PICKLE_OPT_IN = (
    "pass allow_pickle=True to CheckpointManager/LocalCheckpointManager to store it pickled "
    "(local data only: unpickling runs code; codec.encode and codec.decode take "
    "allow_pickle=True too, on both sides)"
)


def _check_attributes(attrs: Dict[Any, Any], what: str) -> None:
    bad = _bad_attribute(attrs)
    if bad is not None:
        raise _Fail(f"cannot encode the {what} at {{path}}: it has {bad}")


def _ref_kind(x: Any) -> str:
    if isinstance(x, type):
        return "class"
    owner = getattr(x, "__self__", None)  # a builtin's module, or a bound method's object
    if type(x) is types.MethodType or not (owner is None or isinstance(owner, types.ModuleType)):
        return "bound method"
    return "function"


def _ref_name(x: Any) -> Tuple[str, str]:
    """The (module, qualified name) under which the decoder's lookup finds ``x`` itself."""
    module = getattr(x, "__module__", None)
    names = (getattr(x, "__qualname__", None), getattr(x, "__name__", None))
    for name in names:  # torch.sigmoid: __qualname__ is _VariableFunctionsClass.sigmoid
        if type(module) is str and type(name) is str and _resolve_name(module, name) is x:
            refused = _refused_ref(module, name)
            if refused is not None:
                raise _Fail(
                    f"refusing to encode the reference at {{path}}: {refused}. Fix: store its "
                    f"name as a str and look it up yourself, or {_PICKLE_OPT_IN}"
                )
            return module, name
    kind = _ref_kind(x)
    name = names[0] or names[1] or repr(x)[:60]
    if type(module) is str:
        name = f"{module}.{name}"
    if kind == "bound method":
        raise _Fail(
            f"cannot encode the bound method {name} at {{path}}: it carries its object (self), "
            "and functions are stored by name only. Fix: store the plain function or a "
            f"functools.partial of a module-level function, or {_PICKLE_OPT_IN}"
        )
    raise _Fail(
        f"cannot encode the {kind} {name} at {{path}}: it cannot be found by that name (a "
        f"lambda, or defined inside a function?), and functions and classes are stored by name "
        "only. Fix: define it at module level, or store functools.partial(<module-level "
        "function>, ...). allow_pickle=True does not help here: pickle stores functions and "
        "classes by name too"
    )


def _unencodable_message(what: str, tname: str) -> str:
    msg = (
        f"cannot encode {what} at {{path}} without pickle. Fix: convert it to plain data "
        "(containers, numbers, str, bytes, paths, numpy arrays, tensors, module-level functions), "
        f"or call resilient_ckpt.model.codec.register_type({tname}, name, to_plain, from_plain), "
        f"or {_PICKLE_OPT_IN}"
    )
    if "<locals>" in tname:
        msg += (
            ". Pickle cannot store it either while its class is defined inside a function: "
            "define the class at module level first"
        )
    return msg


class _Encoder:
    __slots__ = ("packer", "blobs", "blob_len", "allow_pickle", "user_types")

    def __init__(self, allow_pickle: bool, user_types: Mapping[type, _UserType]):
        self.packer = msgpack.Packer(use_bin_type=True, autoreset=False, unicode_errors="surrogatepass")
        self.blobs: List[Any] = []
        self.blob_len = 0
        self.allow_pickle = allow_pickle
        self.user_types = user_types

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
            if _packs_in_bulk(x):
                p.pack(x)  # the same bytes, packed in C (a saved tensor's device type each)
                return
            p.pack_array_header(len(x))
            self.enc_items(x, depth)
            return
        if t is dict:
            self.enc_map(x.items(), len(x), depth)
            return
        if t is tuple:
            if _packs_in_bulk(x):
                # The same bytes in one C call: Python's RNG state is a tuple of 625 ints, in
                # every TrainState save (one Python call per int was a fifth of a cached save)
                p.pack([_TAG[_X.TUPLE], *x])
                return
            p.pack_array_header(len(x) + 1)
            p.pack(_TAG[_X.TUPLE])
            self.enc_items(x, depth)
            return
        handler = _ENCODERS.get(t)
        if handler is not None:
            handler(self, x, depth)
            return
        user = self.user_types.get(t)
        if user is not None:
            self.enc_user(user, x, depth)
            return
        self.enc_subclassed(x, depth)

    def enc_subclassed(self, x: Any, depth: int) -> None:
        """Values matched by ``isinstance`` rather than by exact type, and the rest."""
        if isinstance(x, enum.Enum):
            self.enc_enum(x, depth)
            return
        if isinstance(x, type):
            self.enc_ref(x, depth)
            return
        if isinstance(x, np.generic) and x.dtype.char in _NP_CHARS:
            self.tagged(_X.NPSCALAR, 2)
            self.packer.pack(_np_dtype_str(x.dtype))
            self.packer.pack(x.tobytes())
            return
        why = None
        if isinstance(x, torch.Tensor):
            why = _unsupported_tensor(x)
        self.enc_unknown(x, why)

    def enc_field(self, x: Any, label: str, depth: int) -> None:
        """One field of the tagged value at ``depth``, called ``label`` in error paths."""
        try:
            self.enc(x, depth + 1)
        except _Fail as e:
            e.path.append(label)
            raise

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

    def enc_namespace(self, x: Any, depth: int) -> None:
        """argparse.Namespace or types.SimpleNamespace (Megatron's args are either)."""
        simple = type(x) is types.SimpleNamespace
        attrs = vars(x)
        _check_attributes(attrs, f"{type(x).__module__}.{type(x).__qualname__}")
        self.tagged(_X.SIMPLE_NAMESPACE if simple else _X.NAMESPACE, 1)
        self.enc_map(attrs.items(), len(attrs), depth + 1)

    def enc_enum(self, x: enum.Enum, depth: int) -> None:
        cls = type(x)
        module, qualname = cls.__module__, cls.__qualname__
        if _resolve_name(module, qualname) is not cls:
            raise _Fail(
                f"cannot encode enum member {x!r} at {{path}}: its class {qualname} cannot be "
                f"found by name in module {module!r} (defined inside a function?); define it "
                "at module level, or register_type it"
            )
        self.tagged(_X.ENUM, 3)
        self.packer.pack(module)
        self.packer.pack(qualname)
        self.enc_field(x.value, f"<{qualname} value>", depth)

    def enc_ref(self, x: Any, depth: int) -> None:
        try:
            module, name = _ref_name(x)
        except _Fail:
            if not self.allow_pickle:
                raise
            self.enc_unknown(x, None)  # pickle may find what the codec's lookup cannot
            return
        self.tagged(_X.REF, 2)
        self.packer.pack(module)
        self.packer.pack(name)

    def enc_partial(self, x: functools.partial, depth: int) -> None:
        attrs = vars(x)
        _check_attributes(attrs, "functools.partial")
        self.tagged(_X.PARTIAL, 4)
        for label, v in zip(_PARTIAL_LABELS, (x.func, x.args, x.keywords, attrs)):
            self.enc_field(v, label, depth)

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
        self.enc_field(plain, f"<{user.name}>", depth)

    def enc_unknown(self, x: Any, why: Optional[str]) -> None:
        tname = _type_name(type(x))
        if not self.allow_pickle:
            raise _Fail(_unencodable_message(why or f"object of type {tname}", tname))
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


def _enc_path(x: Any) -> Any:
    return _ExtType(_PATH_CODES[type(x)], str(x).encode("utf-8", "surrogatepass"))


_SCALAR_ENCODERS: Dict[type, Callable[[Any], Any]] = {
    complex: _enc_complex,
    torch.dtype: _enc_dtype,
    torch.device: _enc_device,
    type(HOLE): lambda x: _HOLE_EXT,
    **{cls: _enc_path for cls in _PATH_CODES},
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
    types.SimpleNamespace: _Encoder.enc_namespace,
    np.ndarray: _Encoder.enc_ndarray,
    torch.Tensor: _Encoder.enc_tensor,
    torch.nn.Parameter: _Encoder.enc_tensor,
    torch.Size: _Encoder.enc_size,
    ShardedTensor: _Encoder.enc_sharded_tensor,
    ShardedObject: _Encoder.enc_sharded_object,
    types.FunctionType: _Encoder.enc_ref,
    types.BuiltinFunctionType: _Encoder.enc_ref,
    types.MethodType: _Encoder.enc_ref,
    functools.partial: _Encoder.enc_partial,
}
# Types with a built-in encoding; register_type refuses them so the format stays fixed.
_BUILTIN_TYPES = frozenset((*_NATIVE, int, list, dict, tuple, *_SCALAR_ENCODERS, *_ENCODERS))


def encode_with(obj: Any, allow_pickle: bool, user_types: Mapping[type, _UserType]) -> bytes:
    """:func:`resilient_ckpt.model.codec.encode` with the registered types passed in
    (``user_types``: class -> registration)."""
    e = _Encoder(allow_pickle, user_types)
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
