"""Pickle-free encoding of the non-tensor ("common") part of a checkpoint.

The common state (iteration, args, RNG states, scheduler state, optimizer param_groups,
ShardedObject payloads, the hollow sharded state dict) is stored in checkpoint headers and
sent to peers, so decoding must be safe on bytes from the store or the network: nothing is
unpickled unless the caller passes ``allow_pickle=True``, no module is imported, stored
functions and classes are looked up by name and never called, and any malformed input raises
:class:`~resilient_ckpt.errors.CodecError` (never another exception; memory use stays
proportional to the input's size).

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
6     PurePosixPath       scalar  str(path) as UTF-8 (lone surrogates kept, as "surrogatepass")
7     PureWindowsPath     scalar  same
8     PosixPath           scalar  same; on Windows it decodes as a PurePosixPath
9     WindowsPath         scalar  same; on POSIX it decodes as a PureWindowsPath
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
34    function or class   tag     module, qualified name (see "Functions and classes")
35    functools.partial   tag     func, args (a tuple), keywords (a dict), attributes (a dict)
36    SimpleNamespace     tag     map attribute -> value (in order), as argparse.Namespace
====  ==================  ======  ===========================================================

``offset`` / ``nbytes`` locate a tensor's or array's bytes in the blob section.

Functions and classes (a trainer's ``args.init_method``, ``activation_func``, a class) are
stored by name: the module and qualified name under which the decoder's lookup finds that very
object, checked when encoding (``torch.sigmoid``, whose ``__qualname__`` says
``_VariableFunctionsClass.sigmoid``, is stored under its ``__name__``). Lambdas, functions and
classes defined inside a function, and bound methods are refused with the key path; so are a
few names that would turn stored arguments into commands or code (``eval``, ``exec``,
``open``, ``getattr``, ..., and everything in ``os``, ``sys``, ``subprocess``, ``shutil``,
``pickle``, ``importlib``, ``ctypes``, ...: a guard against the obvious, not a sandbox).
Decoding looks the name up only in modules already imported (``sys.modules``), through the
module's and classes' ``__dict__``: it never imports, and runs no module ``__getattr__``,
descriptor or lazy-module loader. A module that is not imported is an error naming the key
path and the fix, ``import <module> before loading``; the decoder does not return a placeholder
to resolve later, which would fail far from its cause, the first time the trainer calls it.
A ``functools.partial`` of such functions keeps its arguments, keywords and attributes
(encoded like any value). Attributes of a stored Namespace or partial may not be dunder names
other than ``__name__``, ``__qualname__``, ``__module__``, ``__doc__``: Python looks some up on
the instance (``copy.deepcopy`` calls ``__deepcopy__``). Enum members are resolved by the same
lookup. A decoded function runs only when the program calls it: load functions only from
checkpoints of your own job, as with any stored configuration.

Local-only opt-in: values the codec cannot store (objects of unregistered classes, bound
methods, ...) raise :class:`CodecError` naming the key path, the type and the fixes. For data
that never leaves the job, ``encode(obj, allow_pickle=True)`` pickles them and
``decode(data, allow_pickle=True)`` loads them (unpickling runs code: only for bytes you wrote);
managers take ``allow_pickle=True`` for the same (``CheckpointManager``,
``LocalCheckpointManager``). Pickle stores functions and classes by name too, so it does not
help with lambdas and local definitions.

Adding ExtType codes keeps :data:`FORMAT_VERSION`: a reader that predates a code rejects it
with ``CodecError`` ("unexpected ExtType code ... (unknown code)"), it never mis-decodes it.

Decoded tensors are contiguous CPU tensors (common-state tensors come back on CPU whatever
device they were saved from; ``requires_grad`` and ``nn.Parameter`` are kept). Containers
may nest up to :data:`MAX_DEPTH` msgpack levels (tagged containers such as OrderedDict count
two). Sets are written in iteration order, so encodings of sets of strings differ between
processes (hash randomisation); everything else encodes deterministically.

This module is the public API and holds the registry of user types; the work is done by
:mod:`.codec_encode` and :mod:`.codec_decode`, which share :mod:`.codec_format` (constants,
ExtType codes, type tables).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict

from ..errors import CodecError
from ..gc_pause import paused_gc
from .codec_decode import decode_with
from .codec_encode import _BUILTIN_TYPES, encode_with
from .codec_format import FORMAT_VERSION, MAX_DEPTH, _type_name, _UserType
from .codec_format import MAGIC as MAGIC  # read by the persistent layer to recognise encodings

__all__ = ["FORMAT_VERSION", "MAX_DEPTH", "decode", "encode", "register_type"]


def encode(obj: Any, *, allow_pickle: bool = False) -> bytes:
    """Encode ``obj`` (see the module docstring for the supported types) into bytes.

    Raises :class:`CodecError` naming the type and key path of anything unsupported.
    With ``allow_pickle=True`` unsupported objects are pickled instead (for data that never
    leaves this job: :func:`decode` refuses them unless it is also given
    ``allow_pickle=True``).
    """
    with paused_gc():
        return encode_with(obj, allow_pickle, _USER_BY_TYPE)


def decode(data: Any, *, allow_pickle: bool = False) -> Any:
    """Decode bytes made by :func:`encode` (``bytes``, ``bytearray`` or ``memoryview``,
    e.g. of shared memory; nothing in the result aliases it).

    Any malformed input raises :class:`CodecError`. Pickled values are refused unless
    ``allow_pickle=True`` (only for data you wrote yourself: unpickling runs code).
    """
    with paused_gc():
        return decode_with(data, allow_pickle, _USER_BY_NAME)


# --- registry of user types ----------------------------------------------------------------

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
