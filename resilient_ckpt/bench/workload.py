"""A Megatron-like sharded state dict of a chosen size, identical for every system benchmarked.

Layout for ``bytes_per_rank`` = B on ``world_size`` = W ranks (all one data-parallel group
unless ``dp_size`` says otherwise):

* half of B is model parameters (bf16), replicated across data-parallel ranks
  (``replica_id`` = dp rank, so exactly one rank holds the main replica);
* half of B is optimizer state (fp32 ``exp_avg`` / ``exp_avg_sq``), unique per rank and
  sharded along axis 0 like tensor-parallel weights
  (``ShardedTensor.from_rank_offsets(key, t, (0, rank, W))``);
* transformer-shaped tensors: per layer a few large matrices (8-64 MiB from 1 GiB up) and
  many small vectors (several hundred tensors at 1 GiB), an embedding and a pad vector that
  make both halves exactly B/2;
* one ``ShardedObject`` per rank (its RNG states) and a common part (iteration, an
  ``argparse.Namespace``, RNG states, optimizer param groups).

Content is a pure function of ``(seed, key, rank or tp rank, iteration)``: restores are checked
bit-exactly against freshly generated expectations, one tensor at a time (no second copy of the
whole state). After fully parallel dedup a rank saves B/2 + B/(2*dp) bytes (0.75 B at W=2).

``device`` places the live tensors (and a template's zeros): ``"cpu"`` or ``"cuda:<i>"``.
Content is generated on the CPU (a CPU generator: the same bytes on any device) and copied to
the device once; :func:`verify` compares on the CPU and reports tensors restored to another
device than the one asked for.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from ..errors import ValidationError

FLAVOURS = ("ours", "mcore")
_MIN_BYTES = 64 << 10
_MAX_HIDDEN = 1536  # caps matrices at 8*h^2 bytes = 18 MiB (bf16 fc1/fc2), like a ~7B model's
_STATE_KINDS = ("exp_avg", "exp_avg_sq")

Path = Tuple[str, ...]


# --- sizes ---------------------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``"256M"`` / ``"1G"`` / ``"1.5GiB"`` / ``"4096"`` -> bytes (binary units)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValidationError(
            f"cannot parse size {text!r}: use a number with an optional K/M/G/T suffix "
            "(binary units), e.g. 64M, 1G"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(nbytes: float) -> str:
    """Bytes as the shortest exact binary-unit string when possible (``268435456`` -> 256M)."""
    n = float(nbytes)
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{int(n // _UNITS[unit])}{unit}"
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit]:
            return f"{n / _UNITS[unit]:.2f}{unit}"
    return f"{int(n)}"


# --- layout --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One ShardedTensor of the workload: where it sits and how its content is generated."""

    path: Path
    key: str
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    rank_offsets: Tuple[Tuple[int, int, int], ...]
    replica_id: int
    replicated: bool
    content_id: str  # hashed with the seed: same on every rank holding a copy of this shard

    @property
    def nbytes(self) -> int:
        return math.prod(self.local_shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """The shape of one rank's state dict; content comes from :class:`Workload`."""

    bytes_per_rank: int
    world_size: int
    rank: int
    dp_size: int
    seed: int
    hidden: int
    num_layers: int
    vocab: int
    tensors: Tuple[TensorSpec, ...]

    @property
    def tp_size(self) -> int:
        return self.world_size // self.dp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def replicated_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.replicated)

    @property
    def unique_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if not t.replicated)

    @property
    def expected_saved_bytes(self) -> int:
        """Bytes this rank saves after an ideal fully parallel dedup: unique + replicated/dp."""
        return self.unique_bytes + self.replicated_bytes // self.dp_size


def expected_saved_bytes(bytes_per_rank: int, world_size: int, dp_size: Optional[int] = None) -> int:
    """B/2 + B/(2*dp): what one rank stores after fully parallel dedup (ideal balance)."""
    dp = dp_size or world_size
    return bytes_per_rank // 2 + bytes_per_rank // 2 // dp


def _check_args(bytes_per_rank: int, world_size: int, rank: int, dp_size: int) -> None:
    if not isinstance(bytes_per_rank, int) or bytes_per_rank < _MIN_BYTES or bytes_per_rank % 16:
        raise ValidationError(
            f"bytes_per_rank={bytes_per_rank!r}: use an integer multiple of 16 bytes, at least "
            f"{_MIN_BYTES} (e.g. 64M)"
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValidationError(f"rank {rank} is outside world size {world_size}: pass 0 <= rank < world_size")
    if dp_size < 1 or world_size % dp_size:
        raise ValidationError(
            f"dp_size={dp_size} does not divide world_size={world_size}: the remaining factor "
            "is the tensor-parallel size, so pick a divisor"
        )


def _layer_params(h: int) -> List[Tuple[str, Tuple[int, ...]]]:
    return [
        ("input_layernorm.weight", (h,)),
        ("input_layernorm.bias", (h,)),
        ("self_attention.linear_qkv.weight", (3 * h, h)),
        ("self_attention.linear_qkv.bias", (3 * h,)),
        ("self_attention.linear_proj.weight", (h, h)),
        ("self_attention.linear_proj.bias", (h,)),
        ("pre_mlp_layernorm.weight", (h,)),
        ("pre_mlp_layernorm.bias", (h,)),
        ("mlp.linear_fc1.weight", (4 * h, h)),
        ("mlp.linear_fc1.bias", (4 * h,)),
        ("mlp.linear_fc2.weight", (h, 4 * h)),
        ("mlp.linear_fc2.bias", (h,)),
    ]


@dataclass(frozen=True)
class _Dims:
    """Model dimensions that make the replicated half exactly ``half`` bytes of bf16."""

    hidden: int
    num_layers: int
    vocab: int
    pad: int  # elements of the pad vector

    @classmethod
    def for_half(cls, half: int) -> "_Dims":
        # hidden size: ~4 layers at small sizes, capped so big checkpoints get more layers (and
        # more tensors) rather than ever larger matrices; a multiple of 64 keeps every byte count
        # below divisible by 8.
        h = int(math.sqrt(half / 96) // 64) * 64
        h = max(64, min(_MAX_HIDDEN, h))
        per_layer = 2 * sum(math.prod(s) for _, s in _layer_params(h))  # bf16 bytes
        num_layers = half // per_layer
        rest = half - num_layers * per_layer
        vocab = 4 * (rest // (8 * h))  # multiple of 4: optimizer states split axis 0 in 4
        pad = (rest - 2 * vocab * h) // 2  # bf16 elements, a multiple of 4
        return cls(h, num_layers, vocab, pad)

    def params(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """(name, shape) of every model parameter, in state dict order."""
        h = self.hidden
        params: List[Tuple[str, Tuple[int, ...]]] = []
        if self.vocab:
            params.append(("embedding.word_embeddings.weight", (self.vocab, h)))
        for i in range(self.num_layers):
            params += [(f"decoder.layers.{i}.{n}", s) for n, s in _layer_params(h)]
        if self.pad:
            params.append(("decoder.final_layernorm.weight", (self.pad,)))
        return params


def _param_specs(
    params: List[Tuple[str, Tuple[int, ...]]], tp: int, tp_rank: int, dp_rank: int
) -> List[TensorSpec]:
    # bf16 parameter: replicated over dp, split over tp (when tp > 1)
    offsets = ((0, tp_rank, tp),) if tp > 1 else ()
    return [
        TensorSpec(
            ("model", name), name, torch.bfloat16, shape, offsets, dp_rank, True, f"param/{name}/tp{tp_rank}"
        )
        for name, shape in params
    ]


def _state_specs(params: List[Tuple[str, Tuple[int, ...]]], rank: int, world_size: int) -> List[TensorSpec]:
    specs: List[TensorSpec] = []
    for kind in _STATE_KINDS:
        for name, shape in params:
            # fp32 state of a quarter of the parameter's rows: 2 states x 4 B x n/4 = 2n B,
            # the parameter's own bf16 size, so the unique half equals the replicated half.
            local = (shape[0] // 4,) + shape[1:]
            key = f"optimizer.state.{kind}.{name}"
            specs.append(
                TensorSpec(
                    ("optimizer", "state", kind, name),
                    key,
                    torch.float32,
                    local,
                    ((0, rank, world_size),),
                    0,
                    False,
                    f"state/{key}/r{rank}",
                )
            )
    return specs


def layout(
    bytes_per_rank: int,
    world_size: int,
    rank: int,
    *,
    dp_size: Optional[int] = None,
    seed: int = 0,
) -> Layout:
    """The tensors of rank ``rank``; replicated and unique halves are exactly B/2 each."""
    dp = world_size if dp_size is None else dp_size
    _check_args(bytes_per_rank, world_size, rank, dp)
    tp = world_size // dp
    tp_rank, dp_rank = rank % tp, rank // tp
    half = bytes_per_rank // 2
    dims = _Dims.for_half(half)
    params = dims.params()
    specs = _param_specs(params, tp, tp_rank, dp_rank) + _state_specs(params, rank, world_size)
    lay = Layout(
        bytes_per_rank, world_size, rank, dp, seed, dims.hidden, dims.num_layers, dims.vocab, tuple(specs)
    )
    assert lay.replicated_bytes == lay.unique_bytes == half, (lay.replicated_bytes, half)
    return lay


# --- content -------------------------------------------------------------------------------


def _seed64(*parts: Any) -> int:
    # hashlib, not hash(): str hashes are salted per process and every rank must agree.
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _fill_random(t: torch.Tensor, seed: int) -> None:
    """Random bit patterns at ~1 GB/s (int64 ``random_``; randn is 6x slower)."""
    flat = t.view(-1).view(torch.uint8)
    g = torch.Generator().manual_seed(seed)
    n8 = flat.numel() // 8
    if n8:
        flat[: n8 * 8].view(torch.int64).random_(generator=g)
    if flat.numel() % 8:
        flat[n8 * 8 :].random_(0, 256, generator=g)


def _stamp(t: torch.Tensor, seed: int, iteration: int) -> None:
    """Make the first 8 bytes depend on the iteration: a cheap stand-in for a training step
    that still lets a restore of the wrong iteration (or of torn data) fail the check."""
    flat = t.view(-1).view(torch.uint8)
    word = _seed64(seed, "iteration", iteration).to_bytes(8, "little")
    n = min(8, flat.numel())
    flat[:n] = torch.frombuffer(bytearray(word[:n]), dtype=torch.uint8)


def _tensor_seed(lay: Layout, spec: TensorSpec) -> int:
    return _seed64(lay.seed, spec.content_id)


def expected_tensor(lay: Layout, spec: TensorSpec, iteration: int) -> torch.Tensor:
    """The content ``spec`` has at ``iteration`` on this rank."""
    t = torch.empty(spec.local_shape, dtype=spec.dtype)
    s = _tensor_seed(lay, spec)
    _fill_random(t, s)
    _stamp(t, s, iteration)
    return t


def _rank_object(lay: Layout) -> Dict[str, Any]:
    s = _seed64(lay.seed, "rng", lay.rank)
    return {
        "random_rng_state": random.Random(s).getstate(),
        "np_rng_state": np.random.RandomState(s % (1 << 32)).get_state(),
        "torch_rng_state": torch.Generator().manual_seed(s).get_state(),
        "rank": lay.rank,
    }


def _common(lay: Layout, iteration: int) -> Dict[str, Any]:
    s = _seed64(lay.seed, "common")
    args = argparse.Namespace(
        hidden_size=lay.hidden,
        num_layers=lay.num_layers,
        padded_vocab_size=lay.vocab,
        world_size=lay.world_size,
        data_parallel_size=lay.dp_size,
        tensor_model_parallel_size=lay.tp_size,
        bytes_per_rank=lay.bytes_per_rank,
        seed=lay.seed,
        lr=3e-4,
        bf16=True,
        optimizer="adam",
        save_interval=100,
    )
    return {
        "iteration": iteration,
        "checkpoint_version": 3.0,
        "args": args,
        "rng_state_common": {
            "random": random.Random(s).getstate(),
            "np": np.random.RandomState(s % (1 << 32)).get_state(),
            "torch": torch.Generator().manual_seed(s).get_state(),
        },
        "optimizer_param_groups": [
            {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "step": iteration}
        ],
    }


def _mapping_module(flavour: str):
    if flavour == "ours":
        from ..model import mapping

        return mapping
    if flavour == "mcore":
        try:
            from megatron.core.dist_checkpointing import mapping
        except ImportError as e:  # pragma: no cover - megatron-core is installed in dev
            raise ValidationError(
                "flavour 'mcore' needs megatron-core (pip install --no-deps megatron-core)"
            ) from e
        return mapping
    raise ValidationError(f"unknown workload flavour {flavour!r}: use one of {FLAVOURS}")


def _set(d: Dict[str, Any], path: Path, value: Any) -> None:
    for p in path[:-1]:
        d = d.setdefault(p, {})
    d[path[-1]] = value


def _get(d: Any, path: Path) -> Any:
    for p in path:
        d = d[p]
    return d


class Workload:
    """One rank's live training state: tensors allocated once, mutated in place.

    :meth:`sharded_state_dict` wraps the live tensors in fresh mapping objects on every call,
    as a Megatron model's ``sharded_state_dict()`` does (checkpoint libraries may consume the
    wrappers, e.g. Megatron drops the data of shards another rank saves).
    """

    def __init__(
        self,
        bytes_per_rank: int,
        world_size: int,
        rank: int,
        *,
        flavour: str = "ours",
        dp_size: Optional[int] = None,
        seed: int = 0,
        iteration: int = 0,
        fill: str = "random",
        device: Any = "cpu",
    ):
        if fill not in ("random", "zeros"):
            raise ValidationError(f"fill={fill!r}: use 'random' (a state) or 'zeros' (a template)")
        self.flavour = flavour
        self._mapping = _mapping_module(flavour)
        self.layout = layout(bytes_per_rank, world_size, rank, dp_size=dp_size, seed=seed)
        self.iteration = iteration
        self.device = torch.device(device)
        self.tensors: Dict[Path, torch.Tensor] = {}
        for spec in self.layout.tensors:
            if fill == "zeros":
                self.tensors[spec.path] = torch.zeros(spec.local_shape, dtype=spec.dtype, device=self.device)
            else:
                self.tensors[spec.path] = expected_tensor(self.layout, spec, iteration).to(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a state is complete before anyone saves it

    def advance(self, iteration: int) -> None:
        """Training went on to ``iteration``: mutate every tensor in place (cheaply)."""
        for spec in self.layout.tensors:
            _stamp(self.tensors[spec.path], _tensor_seed(self.layout, spec), iteration)
        self.iteration = iteration

    def sharded_state_dict(self) -> Dict[str, Any]:
        lay, m = self.layout, self._mapping
        sd: Dict[str, Any] = {}
        for spec in lay.tensors:
            st = m.ShardedTensor.from_rank_offsets(
                spec.key, self.tensors[spec.path], *spec.rank_offsets, replica_id=spec.replica_id
            )
            _set(sd, spec.path, st)
        sd["rng_state"] = m.ShardedObject(
            "rng_state", _rank_object(lay), (lay.world_size,), (lay.rank,), replica_id=0
        )
        sd.update(_common(lay, self.iteration))
        return sd


def build(
    bytes_per_rank: int,
    world_size: int,
    rank: int,
    flavour: str = "ours",
    *,
    dp_size: Optional[int] = None,
    seed: int = 0,
    iteration: int = 0,
) -> Dict[str, Any]:
    """The sharded state dict of ``rank``: resilient_ckpt.model.mapping objects (``flavour="ours"``)
    or megatron-core's (``"mcore"``), same layout and content either way."""
    return Workload(
        bytes_per_rank,
        world_size,
        rank,
        flavour=flavour,
        dp_size=dp_size,
        seed=seed,
        iteration=iteration,
    ).sharded_state_dict()


# --- verification --------------------------------------------------------------------------


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat CPU uint8 tensor (copied from a device if need be)."""
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        # bytes, not values (NaN payloads count), compared on the CPU whatever the devices
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_host_bytes(a), _host_bytes(b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and np.array_equal(a, b)
        )
    if isinstance(a, argparse.Namespace) or isinstance(b, argparse.Namespace):
        return type(a) is type(b) and _same(vars(a), vars(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _leaf_paths(d: Any, prefix: Path = ()) -> Iterator[Path]:
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _leaf_paths(v, prefix + (k,))
    else:
        yield prefix


def verify(
    restored: Any, lay: Layout, iteration: int, *, limit: int = 5, device: Optional[Any] = None
) -> List[str]:
    """Compare a restored (plain) state dict with the state saved at ``iteration``.

    Returns up to ``limit`` descriptions of mismatches; empty means bit-exact. Expectations
    are generated one tensor at a time so the check needs no second copy of the state.
    ``device`` (e.g. ``"cuda"`` or ``"cuda:0"``): every restored tensor must live there (a type
    alone matches any index); None accepts any device.
    """
    want_dev = None if device is None else torch.device(device)
    problems: List[str] = []

    def bad(msg: str) -> bool:
        problems.append(msg)
        return len(problems) >= limit

    if not isinstance(restored, dict):
        return [f"restored state is a {type(restored).__name__}, expected a dict"]
    for spec in lay.tensors:
        try:
            got = _get(restored, spec.path)
        except (KeyError, TypeError):
            if bad(f"missing tensor {'/'.join(spec.path)}"):
                return problems
            continue
        if want_dev is not None and isinstance(got, torch.Tensor) and not _on(got, want_dev):
            if bad(f"tensor {'/'.join(spec.path)} was restored to {got.device}, expected {want_dev}"):
                return problems
            continue
        want = expected_tensor(lay, spec, iteration)
        if not _same(got, want):
            desc = f"{type(got).__name__} {getattr(got, 'dtype', '')} {tuple(getattr(got, 'shape', ()))}"
            if bad(f"tensor {'/'.join(spec.path)} differs (got {desc})"):
                return problems
    expected_rest = {"rng_state": _rank_object(lay), **_common(lay, iteration)}
    for path in _leaf_paths(expected_rest):
        try:
            got = _get(restored, path)
        except (KeyError, TypeError):
            if bad(f"missing value {'/'.join(path)}"):
                return problems
            continue
        if not _same(got, _get(expected_rest, path)):
            if bad(f"value {'/'.join(path)} differs: {got!r:.200}"):
                return problems
    return problems
