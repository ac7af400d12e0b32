"""The pickle-free codec for the common (non-tensor) part of checkpoints."""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import enum
import functools
import io
import math
import pathlib
import pickle
import random
import struct
import sys
import textwrap

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from hypothesis.vendor import pretty

from resilient_ckpt.errors import CodecError
from resilient_ckpt.model import codec
from resilient_ckpt.model.codec import FORMAT_VERSION, decode, encode, register_type
from resilient_ckpt.model.mapping import ShardedObject, ShardedTensor
from resilient_ckpt.model.nested import HOLE

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*nested tensors is in prototype:UserWarning"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning"),
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning"),
]


def _pretty_tensor(t, p, cycle):
    # Hypothesis prints failing examples; repr() of bits/sub-byte tensors raises, which would
    # hide the real failure.
    p.text(f"<{type(t).__name__} {t.dtype} shape={tuple(t.shape)} stride={t.stride()}>")


pretty.for_type_by_name("torch", "Tensor", _pretty_tensor)
pretty.for_type_by_name("torch.nn.parameter", "Parameter", _pretty_tensor)

TENSOR_DTYPES = sorted(
    {
        d
        for d in vars(torch).values()
        if isinstance(d, torch.dtype) and not str(d).startswith("torch.q")  # quantized
    },
    key=str,
)
NP_CHARS = sorted(c for c in np.typecodes["All"] if np.dtype(c).kind in "biufc")


# --- module-level types the codec can find by name -----------------------------------------


class Color(enum.Enum):
    RED = 1
    GREEN = "green"
    BLUE = (3, "b")


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Perm(enum.Flag):
    R = 4
    W = 2
    X = 1


class Outer:
    class Inner(enum.Enum):
        A = 1.5


@dataclasses.dataclass
class Point:
    x: float
    y: float
    tag: torch.Tensor


register_type(
    Point,
    "tests.codec.Point",
    lambda p: (p.x, p.y, p.tag),
    lambda t: Point(*t),
)


class Opaque:
    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return type(other) is Opaque and other.v == self.v


UNPICKLED = []


def _record_unpickle(v):
    UNPICKLED.append(v)
    return v


class Trap:
    def __reduce__(self):
        return (_record_unpickle, ("trap ran",))


# --- exact comparison ----------------------------------------------------------------------


def _float_bits(f: float) -> bytes:
    return struct.pack("<d", f)


def _raw_tensor_bytes(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    t = t.detach().resolve_conj().resolve_neg()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    t = (t.view(as_int) if as_int is not None else t).contiguous()
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8).numpy().tobytes()


def _assert_same_container(a, b, path):
    if isinstance(a, dict):
        if isinstance(a, collections.defaultdict):
            assert a.default_factory is b.default_factory, path
        assert len(a) == len(b), path
        for (ka, va), (kb, vb) in zip(a.items(), b.items()):
            assert_same(ka, kb, f"{path}/<key>")
            assert_same(va, vb, f"{path}/{ka!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, path
        by_value = {y: y for y in b}
        for x in a:
            assert_same(x, by_value[x], f"{path}/{{{x!r}}}")


def assert_same(a, b, path="root"):
    """Equal values *and* equal types all the way down; floats compared bit for bit."""
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, float):
        assert _float_bits(a) == _float_bits(b), f"{path}: {a!r} vs {b!r}"
    elif isinstance(a, complex):
        assert _float_bits(a.real) + _float_bits(a.imag) == _float_bits(b.real) + _float_bits(b.imag), path
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.requires_grad == b.requires_grad, path
        assert b.device.type == "cpu" and b.is_contiguous(), path
        assert _raw_tensor_bytes(a) == _raw_tensor_bytes(b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.dtype.char == b.dtype.char and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, (dict, list, tuple, set, frozenset)):
        _assert_same_container(a, b, path)
    elif isinstance(a, argparse.Namespace):
        assert_same(vars(a), vars(b), path)
    elif isinstance(a, (ShardedTensor, ShardedObject)):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, slice):
        assert_same((a.start, a.stop, a.step), (b.start, b.stop, b.step), path)
    elif isinstance(a, Point):
        assert_same((a.x, a.y, a.tag), (b.x, b.y, b.tag), path)
    elif isinstance(a, functools.partial):
        assert_same((a.func, a.args, a.keywords, vars(a)), (b.func, b.args, b.keywords, vars(b)), path)
    elif isinstance(a, pathlib.PurePath):
        assert str(a) == str(b), f"{path}: {a!r} vs {b!r}"
    elif a is HOLE or isinstance(a, enum.Enum):
        assert a is b, path
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def roundtrip(x, **kw):
    return decode(encode(x, **kw), **kw)


# --- strategies ----------------------------------------------------------------------------

float_bits = st.integers(0, 2**64 - 1).map(lambda i: struct.unpack("<d", struct.pack("<Q", i))[0])
floats_any = st.one_of(st.floats(), float_bits, st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan]))
ints = st.one_of(
    st.integers(-(2**64), 2**65),
    st.integers(-(2**300), 2**300),
    st.sampled_from([2**63 - 1, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, -1, 0]),
)
texts = st.one_of(st.text(max_size=10), st.sampled_from(["\ud800", "a\udfffb", ""]))
# Functions and classes stored by name (module-level, found without importing anything).
REFERENCES = [
    len,
    int,
    math.sqrt,
    torch.sigmoid,  # its __qualname__ is _VariableFunctionsClass.sigmoid; stored as torch.sigmoid
    torch.nn.functional.gelu,  # a builtin of torch._C._nn
    torch.nn.functional.silu,
    torch.nn.init.normal_,
    torch.nn.Linear,
    collections.OrderedDict,
    Color,
    Outer.Inner,
    _record_unpickle,
]
paths = st.builds(
    lambda cls, t: cls(t),
    st.sampled_from([pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.Path]),
    texts,
)
hashable_leaves = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    st.floats(allow_nan=False),
    texts,
    st.binary(max_size=8),
    st.complex_numbers(allow_nan=False),
    st.sampled_from([Color.RED, Level.HIGH, Perm.R | Perm.X, Outer.Inner.A, HOLE]),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e4m3fn]),
    st.sampled_from(REFERENCES),
    paths,
)
hashables = st.recursive(
    hashable_leaves,
    lambda c: st.one_of(st.lists(c, max_size=3).map(tuple), st.frozensets(c, max_size=3)),
    max_leaves=6,
)


@st.composite
def tensors(draw, max_dims=3):
    dtype = draw(st.sampled_from(TENSOR_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=max_dims))
    n = math.prod(shape) * dtype.itemsize
    raw = draw(st.binary(min_size=n, max_size=n))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if n else torch.empty(0).byte()
    t = t.view(dtype).reshape(shape)
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if layout == "transposed" and t.ndim >= 2:
        t = t.transpose(0, t.ndim - 1)
    elif layout == "strided" and t.ndim >= 1:
        t = t[::2]
    if dtype in (torch.float32, torch.float64, torch.bfloat16) and draw(st.booleans()):
        t = t.detach().requires_grad_(True)
        if draw(st.booleans()):
            t = torch.nn.Parameter(t.detach(), requires_grad=draw(st.booleans()))
    return t


@st.composite
def ndarrays(draw):
    char = draw(st.sampled_from(NP_CHARS))
    order = draw(st.sampled_from("<>")) if np.dtype(char).itemsize > 1 else "|"
    dt = np.dtype(order + char)
    a = draw(hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)))
    if a.ndim >= 2 and draw(st.booleans()):
        a = a.T
    return a


@st.composite
def np_scalars(draw):
    dt = np.dtype(draw(st.sampled_from(NP_CHARS)))
    return draw(hnp.arrays(dt, ()))[()]


@st.composite
def sharded_tensors(draw):
    rows = draw(st.integers(1, 3))
    frag = draw(st.integers(1, 3))
    data = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2)
    st_ = ShardedTensor.from_rank_offsets(
        draw(st.text(min_size=1, max_size=6)),
        data,
        (0, draw(st.integers(0, frag - 1)), frag),
        replica_id=draw(st.sampled_from([0, 1, (0, 1, 0)])),
        allow_shape_mismatch=draw(st.booleans()),
    )
    return st_.without_data() if draw(st.booleans()) else st_


leaves = st.one_of(
    hashable_leaves,
    floats_any,
    st.binary(max_size=20).map(bytearray),
    st.builds(range, ints, ints, ints.filter(bool)),
    st.sampled_from([torch.device("cpu"), torch.device("cuda", 3), torch.device("meta")]),
    st.lists(st.integers(0, 2**40), max_size=4).map(torch.Size),
    tensors(),
    ndarrays(),
    np_scalars(),
    sharded_tensors(),
)

ident = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True).filter(
    lambda k: not (len(k) > 4 and k[:2] == k[-2:] == "__")  # dunders are refused
)


def _partials(c):
    return st.builds(
        lambda f, a, kw: functools.partial(f, *a, **kw),
        st.sampled_from(REFERENCES),
        st.lists(c, max_size=2),
        st.dictionaries(ident, c, max_size=2),
    )


def _containers(c):
    return st.one_of(
        st.lists(c, max_size=4),
        st.lists(c, max_size=4).map(tuple),
        st.dictionaries(hashables, c, max_size=4),
        st.dictionaries(texts, c, max_size=4).map(collections.OrderedDict),
        st.tuples(st.sampled_from([list, int, dict, None]), st.dictionaries(hashables, c, max_size=3)).map(
            lambda fd: collections.defaultdict(fd[0], fd[1])
        ),
        st.sets(hashables, max_size=4),
        st.frozensets(hashables, max_size=4),
        st.builds(slice, c, c, c),
        st.dictionaries(ident, c, max_size=4).map(lambda d: argparse.Namespace(**d)),
        st.builds(
            lambda k, d, n: ShardedObject(k, d, (n + 1,), (n,), replica_id=0),
            st.text(min_size=1, max_size=5),
            c,
            st.integers(0, 5),
        ),
        st.builds(Point, floats_any, floats_any, tensors(max_dims=1)),
        _partials(c),
    )


values = st.recursive(leaves, _containers, max_leaves=12)
# What a trainer's args hold (no sets: their decoded iteration order may differ).
trainer_values = st.recursive(
    hashable_leaves,
    lambda c: st.one_of(
        st.lists(c, max_size=3).map(tuple),
        st.dictionaries(ident, c, max_size=3).map(lambda d: argparse.Namespace(**d)),
        _partials(c),
    ),
    max_leaves=10,
)

ROUNDTRIP = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --- round trips ---------------------------------------------------------------------------


@ROUNDTRIP
@given(values)
def test_every_supported_value_round_trips_exactly_types_included(x):
    assert_same(x, roundtrip(x))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trainer_values)
def test_encoding_is_deterministic_and_a_fixed_point_of_decoding(x):
    data = encode(x)
    assert encode(x) == data
    assert encode(decode(data)) == data


@settings(max_examples=200, deadline=None)
@given(floats_any)
def test_floats_round_trip_bit_exactly_including_nan_payloads(f):
    assert _float_bits(roundtrip(f)) == _float_bits(f)
    assert _float_bits(roundtrip([f])[0]) == _float_bits(f)


_long_items = st.one_of(
    st.integers(-(2**65), 2**65),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.none(),
    st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.lists(_long_items, min_size=17, max_size=40),
            st.lists(st.integers(-(2**63), 2**64 - 1), min_size=17, max_size=40),
        ),
        min_size=1,
        max_size=3,
    ),
    st.booleans(),
)
def test_long_sequences_packed_in_bulk_are_the_bytes_of_item_by_item(sequences, as_tuples):
    """A long list or tuple of plain items (Python's RNG state: 625 ints) is packed by msgpack in
    one call; its bytes are those of the item-by-item encoding, and it decodes to itself."""
    from resilient_ckpt.model import codec_encode

    x = [tuple(v) if as_tuples else v for v in sequences]
    bulk = encode(x)
    real = codec_encode._packs_in_bulk
    codec_encode._packs_in_bulk = lambda _seq: False
    try:
        one_by_one = encode(x)
    finally:
        codec_encode._packs_in_bulk = real
    assert bulk == one_by_one
    assert_same(x, decode(bulk))


def test_integers_beyond_msgpack_range_round_trip():
    for v in [2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**400, -(10**400)]:
        assert roundtrip(v) == v and type(roundtrip(v)) is int


def test_dict_keys_of_every_hashable_kind_keep_type_and_order():
    d = {
        "s": 1,
        3: 2,
        2.5: 3,
        True: 4,
        None: 5,
        b"raw": 6,
        (1, ("a", b"b")): 7,
        frozenset({1, 2}): 8,
        2**100: 9,
        Color.RED: 10,
        -0.0: 11,
    }
    out = roundtrip(d)
    assert_same(d, out)
    assert list(out) == list(d)


def test_dict_subclasses_keep_their_type_and_default_factory():
    od = collections.OrderedDict([("b", 1), ("a", 2)])
    dd = collections.defaultdict(list, {"x": [1]})
    out = roundtrip({"od": od, "dd": dd, "ddi": collections.defaultdict(int)})
    assert type(out["od"]) is collections.OrderedDict and list(out["od"]) == ["b", "a"]
    assert out["dd"].default_factory is list
    out["dd"]["new"].append(3)  # still behaves as a defaultdict
    assert out["ddi"]["missing"] == 0


def test_defaultdict_with_a_non_builtin_factory_is_rejected_with_path():
    with pytest.raises(CodecError, match=r"sched/counts.*default_factory.*builtin"):
        encode({"sched": {"counts": collections.defaultdict(lambda: 7)}})


def test_hole_decodes_to_the_same_singleton():
    out = roundtrip([1, HOLE, {"a": HOLE}])
    assert out[1] is HOLE and out[2]["a"] is HOLE


def test_sharded_tensor_and_object_keep_every_field():
    data = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    sh = ShardedTensor.from_rank_offsets(
        "decoder.w", data, (0, 1, 2), (1, 0, 4), replica_id=(0, 2), prepend_axis_num=1
    )
    hollow = sh.without_data()
    obj = ShardedObject("opt/extra", {"step": 3, "t": torch.ones(2)}, (4,), (1,), replica_id=1)
    out = roundtrip({"sh": sh, "hollow": hollow, "obj": obj})
    assert_same(sh, out["sh"])
    assert_same(hollow, out["hollow"])
    assert out["hollow"].data is None
    assert_same(obj, out["obj"])


def test_numpy_scalars_keep_their_exact_type():
    for v in [
        np.float32(1.5),
        np.float16(-0.0),
        np.int8(-3),
        np.uint64(2**64 - 1),
        np.bool_(True),
        np.complex64(1 - 2j),
        np.longlong(5),
        np.intc(7),
        np.longdouble(1) / 3,
    ]:
        out = roundtrip(v)
        assert type(out) is type(v) and out.tobytes() == v.tobytes()


def test_numpy_arrays_of_non_numeric_dtypes_are_rejected():
    for bad in [np.array([object()]), np.array(["a"]), np.zeros(2, dtype=[("a", "i4")])]:
        with pytest.raises(CodecError, match=r"args/arr.*dtype"):
            encode({"args": {"arr": bad}})
    with pytest.raises(CodecError, match="numpy.str_"):
        encode(np.str_("x"))


# --- tensors -------------------------------------------------------------------------------


def _reference_bytes(base_raw: bytes, shape, itemsize, perm=None, index=None) -> bytes:
    """Bytes of a view computed with numpy on raw bytes only (independent of the codec)."""
    a = np.frombuffer(base_raw, np.uint8).reshape(*shape, itemsize)
    if perm is not None:
        a = a.transpose(*perm, len(shape))
    if index is not None:
        a = a[index]
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("dtype", TENSOR_DTYPES, ids=str)
def test_every_torch_dtype_round_trips_bit_exactly(dtype):
    isz = dtype.itemsize
    raw = random.Random(str(dtype)).randbytes(4 * 6 * isz)
    base = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(4, 6)
    cases = {
        "contiguous": (base, _reference_bytes(raw, (4, 6), isz)),
        "transposed": (base.t(), _reference_bytes(raw, (4, 6), isz, perm=(1, 0))),
        "strided": (base[::2, 1::2], _reference_bytes(raw, (4, 6), isz, index=np.s_[::2, 1::2])),
        "0-dim": (base[2, 3], _reference_bytes(raw, (4, 6), isz, index=np.s_[2, 3])),
        "empty": (base[:0], b""),
    }
    out = roundtrip(cases)
    for name, (src, expected) in cases.items():
        got = out[name][0]
        assert type(got) is torch.Tensor and got.dtype == dtype, name
        assert got.shape == src.shape and got.is_contiguous() and got.device.type == "cpu", name
        assert got.reshape(-1).view(torch.uint8).numpy().tobytes() == expected, name


def test_conjugated_and_negated_views_are_stored_resolved():
    z = torch.tensor([1 + 2j, -3j], dtype=torch.complex64)
    out = roundtrip(z.conj())
    assert not out.is_conj()
    assert torch.equal(out, z.conj().resolve_conj())


def test_requires_grad_and_parameters_survive():
    p = torch.nn.Parameter(torch.randn(3))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    leaf = torch.randn(2, requires_grad=True)
    out = roundtrip([p, frozen, leaf, torch.ones(1)])
    assert type(out[0]) is torch.nn.Parameter and out[0].requires_grad
    assert type(out[1]) is torch.nn.Parameter and not out[1].requires_grad
    assert type(out[2]) is torch.Tensor and out[2].requires_grad
    assert not out[3].requires_grad


def test_decoded_tensors_own_their_memory():
    t = torch.arange(1000, dtype=torch.int32)
    buf = bytearray(encode({"t": t}))
    out = decode(buf)
    buf[:] = bytes(len(buf))
    assert torch.equal(out["t"], torch.arange(1000, dtype=torch.int32))
    out["t"][0] = 5  # writable


def test_large_tensor_costs_no_more_than_its_bytes_plus_a_small_header():
    t = torch.randn(4 * 1024 * 1024)  # 16 MiB
    b = encode({"big": t, "meta": {"step": 3}})
    assert t.nbytes <= len(b) <= t.nbytes + 4096
    view = memoryview(bytearray(b"\0" * 64 + b))[64:]  # e.g. a slice of a shared segment
    assert torch.equal(decode(view)["big"], t)


@pytest.mark.parametrize(
    "bad, what",
    [
        (lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), "quantized"),
        (lambda: torch.eye(3).to_sparse(), "sparse_coo"),
        (lambda: torch.eye(3).to_sparse_csr(), "sparse_csr"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
        (lambda: torch.empty(2, device="meta"), "meta"),
    ],
)
def test_tensors_without_plain_bytes_are_rejected_with_path(bad, what):
    with pytest.raises(CodecError, match=rf"{what} tensor.*at opt/state/0"):
        encode({"opt": {"state": [bad()]}})


def test_torch_dtype_size_and_device_round_trip():
    x = [torch.float8_e5m2, torch.Size([2, 0, 3]), torch.device("cuda:1"), torch.device("cpu")]
    assert_same(x, roundtrip(x))


# --- RNG states ----------------------------------------------------------------------------


def test_restored_torch_rng_state_reproduces_the_stream():
    state = torch.get_rng_state()
    expected = torch.randn(5)
    torch.set_rng_state(roundtrip({"rng": state})["rng"])
    assert torch.equal(torch.randn(5), expected)


def test_restored_torch_generator_state_reproduces_the_stream():
    g = torch.Generator().manual_seed(1234)
    torch.rand(3, generator=g)
    state = g.get_state()
    expected = torch.rand(4, generator=g)
    g2 = torch.Generator()
    g2.set_state(roundtrip(state))
    assert torch.equal(torch.rand(4, generator=g2), expected)


def test_restored_numpy_global_state_reproduces_the_stream():
    np.random.seed(7)
    np.random.normal()  # leaves a cached gaussian in the state
    state = np.random.get_state()
    expected = np.random.normal(size=4)
    np.random.set_state(roundtrip(state))
    assert np.array_equal(np.random.normal(size=4), expected)


def test_restored_numpy_generator_state_reproduces_the_stream():
    rng = np.random.default_rng(99)
    rng.integers(0, 10, 3)
    state = rng.bit_generator.state
    expected = rng.random(4)
    rng2 = np.random.default_rng()
    rng2.bit_generator.state = roundtrip(state)
    assert np.array_equal(rng2.random(4), expected)


def test_restored_python_random_state_reproduces_the_stream():
    r = random.Random(5)
    r.gauss(0, 1)
    state = r.getstate()
    expected = [r.random() for _ in range(4)]
    r2 = random.Random()
    r2.setstate(roundtrip(state))
    assert [r2.random() for _ in range(4)] == expected


# --- Namespace and enums -------------------------------------------------------------------


def test_namespace_keeps_attributes_in_order():
    ns = argparse.Namespace(zeta=1, alpha=[1, 2], mid=argparse.Namespace(x=torch.int8))
    out = roundtrip(ns)
    assert list(vars(out)) == ["zeta", "alpha", "mid"]
    assert_same(ns, out)


def test_enum_members_decode_to_the_identical_member():
    members = [Color.RED, Color.BLUE, Level.HIGH, Perm.R | Perm.W, Outer.Inner.A]
    out = roundtrip(members)
    assert all(a is b for a, b in zip(members, out))


def test_enum_defined_in_a_function_is_rejected_at_encode():
    class Local(enum.Enum):
        A = 1

    with pytest.raises(CodecError, match=r"args/mode.*module level"):
        encode({"args": {"mode": Local.A}})


def test_enum_of_a_module_not_imported_is_refused_without_importing_it(tmp_path, monkeypatch):
    (tmp_path / "codec_enum_mod.py").write_text(
        textwrap.dedent(
            """
            import enum
            class Mode(enum.Enum):
                FAST = "fast"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import codec_enum_mod

    data = encode({"mode": codec_enum_mod.Mode.FAST})
    monkeypatch.delitem(sys.modules, "codec_enum_mod")
    with pytest.raises(CodecError, match=r"mode.*import codec_enum_mod before loading.*register"):
        decode(data)
    assert "codec_enum_mod" not in sys.modules  # decoding did not import it
    monkeypatch.setitem(sys.modules, "codec_enum_mod", codec_enum_mod)
    assert decode(data)["mode"] is codec_enum_mod.Mode.FAST


def test_enum_name_resolving_to_a_non_enum_is_refused(monkeypatch):
    data = encode([Color.RED])
    monkeypatch.setattr(sys.modules[__name__], "Color", Opaque)
    with pytest.raises(CodecError, match=r"test_codec.Color is not an Enum"):
        decode(data)


# --- unsupported values, register_type, pickle ---------------------------------------------


def test_unknown_object_is_rejected_naming_type_path_and_fix():
    state = {"optimizer": {"param_groups": [{"lr": 0.1, "sched": Opaque(1)}]}}
    with pytest.raises(CodecError) as ei:
        encode(state)
    msg = str(ei.value)
    assert "object of type test_codec.Opaque at optimizer/param_groups/0/sched" in msg
    assert "register_type(test_codec.Opaque, name, to_plain, from_plain)" in msg
    assert "pass allow_pickle=True to CheckpointManager/LocalCheckpointManager" in msg
    assert "local data only: unpickling runs code" in msg


def test_unencodable_dict_key_is_reported():
    with pytest.raises(CodecError, match=r"type object at cfg/<key <object>>"):
        encode({"cfg": {object(): 1}})


def test_cycles_and_excessive_nesting_are_rejected_at_encode():
    cyc: list = []
    cyc.append(cyc)
    with pytest.raises(CodecError, match="nested more than 256"):
        encode({"a": cyc})
    deep: list = []
    cur = deep
    for _ in range(300):
        cur.append([])
        cur = cur[0]
    with pytest.raises(CodecError, match="nested more than 256"):
        encode(deep)


def test_registered_type_round_trips_and_subclasses_are_not_matched():
    p = Point(1.0, -0.0, torch.arange(3))
    out = roundtrip({"pts": [p]})
    assert_same(p, out["pts"][0])

    class SubPoint(Point):
        pass

    with pytest.raises(CodecError, match="SubPoint"):
        encode(SubPoint(1.0, 2.0, torch.ones(1)))


def test_registered_name_unknown_at_load_is_reported(monkeypatch):
    data = encode({"p": Point(1.0, 2.0, torch.ones(1))})
    monkeypatch.setattr(codec, "_USER_BY_NAME", {})
    with pytest.raises(CodecError, match=r"'tests.codec.Point'.*register_type.*before loading"):
        decode(data)


def test_register_type_refuses_conflicts_and_builtin_types():
    class Other:
        pass

    with pytest.raises(CodecError, match="already used by"):
        register_type(Other, "tests.codec.Point", lambda o: 0, lambda v: Other())
    with pytest.raises(CodecError, match="built-in encoding"):
        register_type(dict, "tests.codec.dict", dict, dict)
    with pytest.raises(CodecError, match="already registered"):
        register_type(Point, "tests.codec.Point2", lambda p: 0, lambda v: v)


def test_pickle_is_opt_in_on_both_sides():
    state = {"extra": {"obj": Opaque([1, 2])}, "step": 3}
    with pytest.raises(CodecError, match=r"extra/obj.*test_codec.Opaque"):
        encode(state)
    data = encode(state, allow_pickle=True)
    with pytest.raises(CodecError, match=r"refusing to unpickle the test_codec.Opaque at extra/"):
        decode(data)
    with pytest.raises(CodecError, match="allow_pickle=True"):
        decode(data)
    assert decode(data, allow_pickle=True) == state


def test_decoding_never_unpickles_without_opt_in():
    UNPICKLED.clear()
    data = encode([Trap()], allow_pickle=True)
    with pytest.raises(CodecError):
        decode(data)
    assert UNPICKLED == []
    assert decode(data, allow_pickle=True) == ["trap ran"]


# --- untrusted input -----------------------------------------------------------------------


def _frame(body: bytes, blobs: bytes = b"", version: int = FORMAT_VERSION) -> bytes:
    head = struct.pack(">4sHHQ", b"RCKC", version, 0, len(body))
    pad = b"\0" * (-(len(head) + len(body)) % 64) if blobs else b""
    return head + body + pad + blobs


def test_newer_format_version_is_rejected_with_upgrade_hint():
    data = bytearray(encode({"a": 1}))
    data[4:6] = struct.pack(">H", FORMAT_VERSION + 1)
    with pytest.raises(CodecError, match=rf"version {FORMAT_VERSION + 1}.*newer.*upgrade"):
        decode(bytes(data))


def test_pickle_and_torch_save_files_are_recognised_and_refused():
    buf = io.BytesIO()
    torch.save({"a": 1}, buf)
    with pytest.raises(CodecError, match="torch.save"):
        decode(buf.getvalue())
    with pytest.raises(CodecError, match="pickle"):
        decode(pickle.dumps({"a": 1}))


def test_truncated_encodings_are_rejected():
    data = encode({"t": torch.arange(100), "x": list(range(50))})
    for cut in [0, 5, 15, 16, 40, len(data) - 1]:
        with pytest.raises(CodecError):
            decode(data[:cut])


def test_huge_declared_lengths_do_not_allocate():
    with pytest.raises(CodecError):
        decode(_frame(b"\xdd\xff\xff\xff\xff"))  # array of 2**32-1 items, no items
    tag = msgpack.ExtType(28, b"")
    huge = msgpack.packb([tag, "float32", [1 << 40], False, False, 0, 4 << 40])
    with pytest.raises(CodecError, match="outside the encoded bytes"):
        decode(_frame(huge, b"\0" * 64))
    shape_lie = msgpack.packb([tag, "float32", [1 << 40, 0], False, False, 0, 0])
    assert decode(_frame(shape_lie)).shape == (1 << 40, 0)  # zero elements: nothing allocated


def test_one_data_region_referenced_many_times_is_refused():
    ref = [msgpack.ExtType(28, b""), "uint8", [1 << 20], False, False, 0, 1 << 20]
    with pytest.raises(CodecError, match="more than once"):
        decode(_frame(msgpack.packb([ref] * 50), bytes(1 << 20)))


def test_deep_nesting_is_refused():
    with pytest.raises(CodecError):
        decode(_frame(b"\x91" * 100_000 + b"\xc0"))
    nested = None
    for _ in range(300):
        nested = [msgpack.ExtType(16, b""), nested]
    with pytest.raises(CodecError, match="nested more than 256"):
        decode(_frame(msgpack.packb(nested)))


def test_decode_rejects_non_buffers_with_codec_error():
    with pytest.raises(CodecError, match="needs bytes"):
        decode("not bytes")  # type: ignore[arg-type]


def _decode_or_codec_error(data, allow_pickle=False):
    try:
        decode(data, allow_pickle=allow_pickle)
    except CodecError:
        pass


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_codec_error(data):
    _decode_or_codec_error(data)
    _decode_or_codec_error(_frame(data))


SAMPLE = {
    "iteration": 1200,
    "args": argparse.Namespace(
        lr=3e-4,
        seq=(1, 2),
        mode=Color.GREEN,
        save=pathlib.PurePosixPath("/ckpt/run"),
        act=torch.nn.functional.gelu,
        init=functools.partial(torch.nn.init.normal_, mean=0.0, std=0.02),
        cls=torch.nn.Linear,
    ),
    "rng": [torch.get_rng_state()[:64], np.random.default_rng(1).bit_generator.state],
    "sched": collections.OrderedDict(last=-(2**70), warm={1.5, "a"}),
    "opt": {"param_groups": [{"lr": 0.1, "params": list(range(5)), "betas": (0.9, 0.95)}]},
    "sh": ShardedTensor.from_rank_offsets("w", torch.ones(2, 2, dtype=torch.bfloat16), (0, 1, 2)),
    "obj": ShardedObject("o", {"x": np.arange(6, dtype=np.int16)}, (2,), (1,)),
    "misc": [
        HOLE,
        slice(1, 5),
        range(3),
        bytearray(b"ab"),
        1 + 2j,
        torch.float16,
        torch.Size([3]),
        torch.device("cpu"),
        np.float32(2.5),
        Point(1.0, 2.0, torch.ones(2)),
        collections.defaultdict(list, {"k": [1]}),
        pathlib.PureWindowsPath("C:/data"),
        pathlib.Path("rel/p"),
    ],
}
SAMPLE_BYTES = encode(SAMPLE)


@settings(max_examples=1000, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["flip", "set", "truncate", "insert", "delete"]),
            st.integers(0, len(SAMPLE_BYTES)),
            st.integers(0, 255),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_mutated_valid_encodings_raise_only_codec_error(mutations):
    data = bytearray(SAMPLE_BYTES)
    for op, pos, val in mutations:
        pos = min(pos, max(len(data) - 1, 0))
        if op == "flip" and data:
            data[pos] ^= 1 << (val % 8)
        elif op == "set" and data:
            data[pos] = val
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = bytes([val])
        elif op == "delete":
            del data[pos : pos + 1 + val % 8]
    assume(bytes(data) != SAMPLE_BYTES)
    _decode_or_codec_error(bytes(data))


def test_sample_state_round_trips():
    assert_same(SAMPLE, decode(SAMPLE_BYTES))


_ext = st.builds(msgpack.ExtType, st.integers(0, 40), st.binary(max_size=20))
_native_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=5),
    st.binary(max_size=10),
    _ext,
    st.sampled_from(
        ["float32", "uint8", "<f4", "list", "test_codec", "Color", "tests.codec.Point", "", "cpu"]
        + ["torch.nn.init", "normal_", "builtins", "eval", "len", "os", "system", "math", "pi"]
        + ["__deepcopy__", "Outer.Inner", "Outer.Inner.A", "torch", "nn", "sigmoid"]
    ),
    st.integers(-2, 200),
)


def _native_containers(c):
    tagged = st.builds(
        lambda code, rest: [msgpack.ExtType(code, b"")] + rest,
        st.integers(16, 36),
        st.lists(c, max_size=7),
    )
    keys = st.text(max_size=3) | st.integers(-9, 2**64 - 1)
    return st.one_of(st.lists(c, max_size=4), tagged, st.dictionaries(keys, c, max_size=3))


_native_values = st.recursive(_native_leaves, _native_containers, max_leaves=15)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_native_values, st.binary(max_size=256))
def test_well_framed_but_meaningless_structures_raise_only_codec_error(tree, blobs):
    data = _frame(msgpack.packb(tree, use_bin_type=True), blobs)
    _decode_or_codec_error(data)


def _split_sample():
    body_len = struct.unpack_from(">Q", SAMPLE_BYTES, 8)[0]
    body_end = 16 + body_len
    tree = msgpack.unpackb(SAMPLE_BYTES[16:body_end], strict_map_key=False)
    return tree, SAMPLE_BYTES[body_end + (-body_end % 64) :]


SAMPLE_TREE, SAMPLE_BLOBS = _split_sample()


def _slots(x, out):
    """Every (container, index-or-key) position of a native msgpack tree."""
    items = enumerate(x) if isinstance(x, list) else x.items() if isinstance(x, dict) else ()
    for k, v in items:
        out.append((x, k))
        _slots(v, out)
    return out


N_SLOTS = len(_slots(SAMPLE_TREE, []))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, N_SLOTS - 1), _native_values), min_size=1, max_size=3))
def test_valid_encodings_with_replaced_fields_raise_only_codec_error(replacements):
    tree = copy.deepcopy(SAMPLE_TREE)
    for i, new in replacements:
        slots = _slots(tree, [])
        container, k = slots[i % len(slots)]
        container[k] = new
    _decode_or_codec_error(_frame(msgpack.packb(tree, use_bin_type=True), SAMPLE_BLOBS))


def test_the_replaced_field_fuzz_starts_from_a_valid_encoding():
    data = _frame(msgpack.packb(SAMPLE_TREE, use_bin_type=True), SAMPLE_BLOBS)
    assert_same(SAMPLE, decode(data))


def test_decode_rejects_non_contiguous_buffers():
    data = encode([1, 2])
    with pytest.raises(CodecError, match="contiguous"):
        decode(memoryview(data + data)[::2])


def test_decoded_tensors_are_on_cpu_whatever_the_default_device():
    data = encode({"t": torch.arange(4.0)})
    with torch.device("meta"):
        out = decode(data)
    assert out["t"].device.type == "cpu"
    assert torch.equal(out["t"], torch.arange(4.0))
