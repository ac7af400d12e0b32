"""The conformance zoo's pieces: models users bring, their data, and a rank's full state.

Every zoo test trains the same models three ways on 2 simulated nodes — uninterrupted without
any checkpointing (the oracle), then with local checkpoints until node 1 is lost (its ranks
SIGKILLed, its store wiped), then restarted from the neighbours' memory — and asserts that
every rank's full state after the run (parameters, buffers, optimizer, scheduler, RNG, the
user's extra values) and every loss after the resume equal the oracle's bit for bit.

The models are small but shaped like what users bring: BatchNorm with and without DDP's buffer
broadcast, tied weights, frozen parameters, parameter groups, amsgrad, integer buffers counted
in forward, non-persistent buffers, ``torch.compile``, AMP with a GradScaler, gradient
accumulation, FSDP2. Data and dropout are functions of (step, rank), so a resumed run repeats
the oracle only if everything came back exactly. (SyncBatchNorm needs CUDA: scripts/gpu_check.)
"""

from __future__ import annotations

import hashlib
import pickle
import random
import shutil
import warnings
from typing import Any, Callable, Dict, List

import numpy as np
import torch

from harness import KILLED, hold_copies_until_fenced, node_store_root


def data(step: int, rank: int, micro: int = 0, shape=(8, 3, 6, 6)) -> torch.Tensor:
    """This rank's batch of ``step`` (micro-batch ``micro``): the same in every run."""
    g = torch.Generator().manual_seed(100_000 * step + 100 * rank + micro)
    return torch.randn(*shape, generator=g)


class ConvBN(torch.nn.Module):
    """Conv + BatchNorm2d (running statistics, an int64 counter) + dropout + linear head."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3)
        self.bn = torch.nn.BatchNorm2d(6)
        self.drop = torch.nn.Dropout(0.2)
        self.head = torch.nn.Linear(6 * 4 * 4, 5)

    def forward(self, x):
        return self.head(self.drop(torch.relu(self.bn(self.conv(x)))).flatten(1))


class TiedLM(torch.nn.Module):
    """Tied embedding/head, a frozen parameter, an int64 buffer counted in forward, a
    non-persistent buffer (kept out of the state dict), dropout, LayerNorm."""

    def __init__(self, vocab=11, dim=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.frozen = torch.nn.Parameter(torch.linspace(-1, 1, dim), requires_grad=False)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.drop = torch.nn.Dropout(0.1)
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scale", torch.full((dim,), 0.5), persistent=False)

    def forward(self, x):
        tokens = (x.abs() * 3).long().clamp(max=10).flatten(1)[:, :6]
        self.tokens_seen += tokens.numel()
        h = self.drop(self.mix(self.norm(self.emb(tokens)) * self.scale + self.frozen))
        return self.head(torch.tanh(h)).mean(1)


class Plain(torch.nn.Module):
    """A LayerNorm MLP (FSDP2 shards it; AMP runs it)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(108, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.b = torch.nn.Linear(16, 5)

    def forward(self, x):
        return self.b(torch.relu(self.norm(self.a(x.flatten(1)))))


def seed_everything(seed: int) -> None:
    """torch, numpy and Python's RNGs (a forked process's Python RNG is reseeded at random)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


class Tokens(torch.utils.data.Dataset):
    """Token ids and labels, item i a function of i (a language model's data set)."""

    def __len__(self):
        return 256

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return (out.float() - 0.3).pow(2).mean()


# ---- full state of a rank ---------------------------------------------------------------------


def _bytes(v: Any) -> bytes:
    if isinstance(v, torch.Tensor):
        t = v.detach()
        if hasattr(t, "full_tensor") and type(t).__name__ == "DTensor":
            t = t.to_local()
        t = t.cpu().contiguous()
        return f"{t.dtype}{tuple(t.shape)}".encode() + t.view(-1).view(torch.uint8).numpy().tobytes()
    if isinstance(v, dict):
        return (
            b"{"
            + b",".join(repr(k).encode() + b":" + _bytes(x) for k, x in sorted(v.items(), key=repr))
            + b"}"
        )
    if isinstance(v, (list, tuple)):
        return b"[" + b",".join(_bytes(x) for x in v) + b"]"
    if isinstance(v, np.ndarray):
        return v.tobytes()
    if isinstance(v, float):
        return np.float64(v).tobytes()
    return repr(v).encode()


def digests(**parts: Any) -> Dict[str, str]:
    """Per entry (``model.<name>``, ``optimizer.state.<i>.<k>``, ...), a digest of its exact bytes."""
    out: Dict[str, str] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict) and v:
            for k, x in v.items():
                walk(f"{prefix}.{k}", x)
        else:
            out[prefix] = hashlib.sha256(_bytes(v)).hexdigest()[:16]

    for name, v in parts.items():
        walk(name, v)
    return out


def rng_state() -> Dict[str, Any]:
    np_state = np.random.get_state()
    out = {
        "torch": torch.get_rng_state(),
        "numpy": (np_state[0], np_state[1], *np_state[2:]),
        "python": pickle.dumps(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def full_state(model, optimizer=None, scheduler=None, extra=None, **more) -> Dict[str, str]:
    """Every piece of a rank's state, digested entry by entry: parameters and buffers (every
    buffer, the non-persistent ones too), optimizer state and hyper-parameters, scheduler, RNG,
    the caller's extra values and anything else passed (a GradScaler's state, ...)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    parts: Dict[str, Any] = {"model": named, "rng": rng_state()}
    if optimizer is not None:
        osd = optimizer.state_dict()
        parts["optimizer.state"] = osd["state"]
        parts["optimizer.param_groups"] = [{k: v for k, v in g.items()} for g in osd["param_groups"]]
    if scheduler is not None:
        parts["scheduler"] = scheduler.state_dict()
    if extra is not None:
        parts["extra"] = dict(extra)
    parts.update(more)
    return digests(**parts)


def first_difference(got: Dict[str, str], want: Dict[str, str]) -> str:
    """The entries that differ (for the assertion message), or ''."""
    keys = sorted(set(got) | set(want))
    bad = [k for k in keys if got.get(k) != want.get(k)]
    return ", ".join(bad[:8]) + (f" (+{len(bad) - 8} more)" if len(bad) > 8 else "")


def compile_eager(model: torch.nn.Module) -> Callable:
    """``torch.compile`` through TorchDynamo and AOTAutograd without code generation (seconds,
    not tens of seconds, on a CPU; the state dict, hooks and DDP see what inductor gives them)."""
    return torch.compile(model, backend="aot_eager")


# ---- the three runs and the verdict -------------------------------------------------------------


def rank_job(ctx, phase: str, names: List[str], train: Callable[..., Dict[str, Any]]) -> Dict[str, Any]:
    """One rank's part of a run: ``train(ctx, name, phase)`` for every model; in the run that
    loses node 1, the saves' copies are held until the training thread fences them (the next
    forward always runs while they are pending, as it may in any real run) and node 1's ranks
    SIGKILL themselves after the last model."""
    warnings.filterwarnings("ignore")
    if phase == "faulty":
        hold_copies_until_fenced()
    results = {name: train(ctx, name, phase) for name in names}
    if phase == "faulty" and ctx.node == 1:
        ctx.kill_self()  # node 1 is lost: its trainers die, its memory below
    return results


def run_zoo(
    run_ranks: Callable,
    tmp_path,
    rpn: int,
    job: Callable,
    names: List[str],
    timeout: float = 240,
    more_args: tuple = (),
) -> Dict[str, List[Any]]:
    """The zoo's three runs of ``job(ctx, phase, names)`` on 2 nodes x ``rpn`` ranks (through
    ``run_ranks``: the harness's, or a zygote's; ``more_args`` follow ``names``): the oracle, the
    run that loses node 1 (its ranks SIGKILL themselves, its store is wiped), the resumed run.
    Per model, per rank: (oracle, resumed)."""
    world = 2 * rpn
    kw = dict(ranks_per_node=rpn, timeout=timeout, collective_timeout=60)
    reference = run_ranks(job, world, tmp_path / "reference", args=("reference", names, *more_args), **kw)
    run = tmp_path / "run"
    faulty = run_ranks(
        job, world, run, args=("faulty", names, *more_args), expect_killed=list(range(rpn, world)), **kw
    )
    assert [repr(r) for r in faulty[rpn:]] == [repr(KILLED)] * rpn
    shutil.rmtree(node_store_root(str(run), 1))  # node 1's memory is gone with it
    resumed = run_ranks(job, world, run, args=("resumed", names, *more_args), **kw)
    return {name: [(reference[r][name], resumed[r][name]) for r in range(world)] for name in names}


def check_bit_exact(results: Dict[str, List[Any]], rpn: int, restored: int) -> None:
    """Every model, every rank: resumed from the checkpoint of iteration ``restored`` (node 1's
    ranks from the replicas on node 0), the same losses after it, the same full state."""
    problems = []
    for name, per_rank in results.items():
        for rank, (ref, run) in enumerate(per_rank):
            where = f"{name}, rank {rank}"
            source = "local" if rank < rpn else "peer"
            if run["restored_from"] != {"iteration": restored, "source": source}:
                problems.append(f"{where}: restored from {run['restored_from']}")
            if run["failed"]:
                problems.append(f"{where}: {run['failed']} failed saves")
            want = {s: v for s, v in ref["losses"].items() if s >= min(run["losses"], default=0)}
            if run["losses"] != want:
                problems.append(f"{where}: losses after the resume differ")
            diff = first_difference(run["state"], ref["state"])
            if diff:
                problems.append(f"{where}: final state differs in {diff} ({run['buckets']})")
    assert not problems, "not bit-exact:\n" + "\n".join(problems)
