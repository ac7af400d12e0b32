"""What a checkpoint after *every* training step costs the training loop, three systems side by side.

    PYTHONPATH=. .venv/bin/python benchmarks/per_step_loop.py                  # both workloads, ~4 min
    PYTHONPATH=. .venv/bin/python benchmarks/per_step_loop.py --workload a --steps 60 --json out.json
    PYTHONPATH=. .venv/bin/python benchmarks/per_step_loop.py --quick          # small and short (the test)
    PYTHONPATH=. .venv/bin/python benchmarks/per_step_loop.py --device cuda    # model and data on the GPU

Setup: 2 simulated nodes = 2 rank processes (spawned; gloo on 127.0.0.1; one intra-op thread
each), each node with its own store root under a temporary directory on /dev/shm, every rank's
checkpoint replicated to the other node. Each (workload, system) runs in fresh processes, so
memory figures are the system's own: ``--warmup`` steps (saving as the system does), then the
measured ``--steps``, then the outstanding saves are drained (timed apart). Defaults: a 5 + 30
steps, b 4 + 20, except nvrx on b: 2 + 2 (``--nvrx-warmup``, ``--nvrx-steps``), whose every save
takes ~20-30 s on 2 cores (its replication broadcasts each of the 25k tensors a rank saves on its
own); the whole default run takes ~4 minutes there.

Systems:

* ``none``: the same loop without checkpoints (the reference for every difference below);
* ``ours``: the README's plain-PyTorch loop, ``TrainState(model, optimizer)`` and
  ``CheckpointHook(CheckpointManager(store_root=<node>, replication_factor=2, keep_last=1,
  background_nice=19), every_n_steps=1, when_busy="skip_in_background")``: a due save while the
  previous one is still in flight on any rank is skipped on every rank and the next step saves
  instead, the ranks voting off the training thread (``--when-busy skip``: in one all-reduce on
  it), the save's background threads below the training thread (``--background-nice``);
* ``nvrx``: Megatron-LM's local checkpoint at every step: Megatron-core
  ``MCoreTensorAwareStateDict.from_state_dict`` (cached distribution) of the model's and the
  optimizer's sharded state dict (built each step as Megatron builds it: ShardedTensors of the
  parameters, ``optim_state_to_sharding_state`` for the optimizer), nvidia-resiliency-ext
  ``LocalCheckpointManager.save(is_async=True)`` (clique replication, factor 2) on nvrx's
  ``AsyncCallsQueue`` (a forked writer per save) — ``resilient_ckpt.bench.baseline``. The queue
  cannot skip a save, so each step first finalizes the previous save (blocking: whatever blocks,
  blocks), then starts its own; the achieved interval is 1 by construction.

Workloads:

* ``a``: a GPT-2-small-shaped transformer scaled to this machine (token + position embeddings,
  ``--layers`` blocks of LayerNorm, causal self-attention with a qkv and an output Linear,
  LayerNorm, 4x MLP; a final LayerNorm and an LM head tied to the token embedding), AdamW,
  DDP-wrapped (gloo); each step a deterministic random batch of tokens per rank;
* ``b``: ``--tensors`` small float32 parameters (``--numel`` elements each) in a ParameterList,
  SGD without momentum (foreach); a step's "forward/backward" is one foreach op that reads every
  parameter and writes every gradient, the same on every rank (the replicas stay equal without
  DDP): what a save costs per tensor.

Measured per rank, reported for the slowest rank (medians over the measured steps):

* step time; the training thread's time **blocked** by checkpointing, two ways: the difference of
  the median step to ``none``'s, and directly — ours: ``hook.step()`` plus the time
  ``optimizer.step()`` waited in the hook's fence (timed by step pre-hooks registered just before
  and just after the hook's); nvrx: finalize of the previous save plus the new save's call — both
  as % of ``none``'s median step;
* **extra CPU seconds per step**: the process's CPU time (every thread; for nvrx also its joined
  writer processes) over the measured steps, per step, minus ``none``'s; and, in the same
  process, the time of a plain single-thread memcpy of the rank's checkpoint bytes (into a
  populated buffer; into fresh pages too) so the extra reads as memcpys of the state;
* the achieved checkpoint **interval** in steps (ours: ``hook.metrics.interval_steps`` and the
  measured steps over the saves started in them; skipped and failed saves), steps at risk;
* **host memory**: private RSS (``RssAnon``, after every step; start and end: the median of the
  first and of the last 5 measured steps; the peak sampled every 10 ms, nvrx's forked writers'
  ``Pss_Anon`` counted in it) and the store's bytes on /dev/shm for the rank's node (allocated
  blocks of every file under its store root) at the start and the end of the measured steps,
  the peak in between (sampled every 50 ms) and after the drain — ours with ``keep_last=1``
  must not grow;
* the checkpoint's bytes per rank (what the rank stores as its own after the data-parallel
  dedup) and the state's tensor count; ours' state restores bit-exactly (checked after the run
  unless ``--no-verify``).

Output: a table (one row per workload x system) and, with ``--json PATH``, every figure per
rank. A system that cannot run here is reported as ``unavailable: <why>`` instead of aborting.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional

SYSTEMS = ("none", "ours", "nvrx")
WORKLOADS = ("a", "b")
WORLD = 2
MIB = 1 << 20

#: per workload: default and --quick settings
DEFAULTS = {
    "a": dict(layers=12, d_model=256, heads=4, vocab=8192, seq=128, batch=1, warmup=5, steps=30),
    "b": dict(tensors=50_000, numel=384, warmup=4, steps=20),
}
#: nvrx's per-step save of workload b takes ~30 s here (its replication broadcasts every tensor
#: on its own: 50k gloo broadcasts per save): fewer steps, so the default run stays ~4 minutes
NVRX_DEFAULTS = {"b": dict(warmup=2, steps=2)}
QUICK = {
    "a": dict(layers=2, d_model=64, heads=2, vocab=512, seq=32, batch=2, warmup=2, steps=4),
    "b": dict(tensors=600, numel=64, warmup=2, steps=4),
}


# --- the rank process ---------------------------------------------------------------------------


def _gpt(cfg: Dict[str, Any]):
    """Workload a's model (plain torch.nn), built after torch is imported."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self, d: int, heads: int):
            super().__init__()
            self.heads = heads
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self, layers: int, d: int, heads: int, vocab: int, seq: int):
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)

        def forward(self, idx):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.tok(idx) + self.pos(pos)
            for block in self.blocks:
                x = block(x)
            return self.ln_f(x) @ self.tok.weight.t()  # the LM head, tied to the token embedding

    return GPT(cfg["layers"], cfg["d_model"], cfg["heads"], cfg["vocab"], cfg["seq"])


class _Workload:
    """The model, its optimizer and one training step (forward, backward, ``optimizer.step()``)."""

    def __init__(self, cfg: Dict[str, Any], rank: int, device, seed: int = 0):
        import torch

        self.cfg, self.rank, self.device = cfg, rank, device
        torch.manual_seed(seed)
        if cfg["workload"] == "a":
            from torch.nn.parallel import DistributedDataParallel as DDP

            module = _gpt(cfg).to(device)
            self.model = DDP(module, device_ids=[device.index] if device.type == "cuda" else None)
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
            self._step = self._step_a
        else:
            g = torch.Generator().manual_seed(seed)
            n, numel = cfg["tensors"], cfg["numel"]
            self.model = torch.nn.Module()
            self.model.params = torch.nn.ParameterList(
                torch.nn.Parameter(torch.randn(numel, generator=g).to(device)) for _ in range(n)
            )
            self.params = list(self.model.parameters())
            self.grads = [torch.zeros_like(p) for p in self.params]
            for p, gr in zip(self.params, self.grads):
                p.grad = gr
            self.optimizer = torch.optim.SGD(self.params, lr=1e-3, momentum=0.0, foreach=True)
            self._step = self._step_b

    def step(self, step: int) -> None:
        self._step(step)

    def _step_a(self, step: int) -> None:
        import torch
        from torch.nn import functional as F

        cfg = self.cfg
        g = torch.Generator().manual_seed(1_000_003 * step + self.rank)  # this rank's batch
        idx = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g).to(self.device)
        logits = self.model(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg["vocab"]), idx[:, 1:].reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def _step_b(self, step: int) -> None:
        import torch

        # grad <- grad + w * (param - grad): reads every parameter, writes every gradient; the
        # same on every rank, so the data-parallel replicas stay bit-identical without DDP. No
        # graph: gradients come out of a backward pass as plain tensors.
        with torch.no_grad():
            torch._foreach_lerp_(self.grads, self.params, 0.25 + 0.05 * (step % 5))
        self.optimizer.step()

    def tensors(self) -> List[Any]:
        """Every tensor of the state: model (parameters and buffers) and optimizer state."""
        import torch

        out = [t for t in self.model.state_dict().values() if isinstance(t, torch.Tensor)]
        for values in self.optimizer.state.values():
            out += [v for v in values.values() if isinstance(v, torch.Tensor)]
        return out


class _None:
    """The loop without checkpoints."""

    name = "none"

    def warm(self) -> bool:
        return True

    def after_step(self, step: int) -> Dict[str, Any]:
        return {}

    def finish(self) -> None:
        pass

    def summary(self, first: int) -> Dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class _Ours:
    """The README loop's ``CheckpointHook(every_n_steps=1, when_busy="skip_in_background")``."""

    name = "ours"

    def __init__(self, wl: _Workload, store_root: str, session: str, when_busy: str, nice: int):
        from resilient_ckpt import CheckpointHook, CheckpointManager, TrainState

        self.wl, self.store_root, self.session = wl, store_root, session
        self.manager = CheckpointManager(
            session_id=session,
            store_root=store_root,
            replication_factor=2,
            keep_last=1,
            background_nice=nice,
        )
        self.state = TrainState(wl.model, wl.optimizer)
        self.state_dict_s: List[float] = []
        real = self.state.sharded_state_dict

        def timed():  # the hook builds the state here (not when this rank is itself busy)
            t0 = time.perf_counter()
            try:
                return real()
            finally:
                self.state_dict_s.append(time.perf_counter() - t0)

        self.state.sharded_state_dict = timed
        self.hook = CheckpointHook(self.manager, every_n_steps=1, state=self.state, when_busy=when_busy)
        self.saves: List[Any] = []  # (step, SaveMetrics): the fence adds to stall_s later
        self.at_risk: List[int] = []
        self.at_risk_steps: List[int] = []  # the steps hook.step saw

    def after_step(self, step: int) -> Dict[str, Any]:
        n = len(self.state_dict_s)
        handle = self.hook.step(step)
        if handle is not None:
            self.saves.append((step, handle.metrics))
        self.at_risk.append(self.hook.metrics.steps_at_risk)
        self.at_risk_steps.append(step)
        return {
            "saved": handle is not None,
            "state_dict_s": sum(self.state_dict_s[n:]),
        }

    def warm(self) -> bool:
        """In its steady state: three saves started and the third complete (the store holds
        its own and its peer's newest plus the spares)."""
        started = self.hook.saved_steps
        return len(started) >= 3 and self.hook.metrics.last_complete_step >= started[2]

    def finish(self) -> None:
        self.hook.finish()

    def summary(self, first: int) -> Dict[str, Any]:
        m = self.hook.metrics
        measured = [s for s in self.hook.saved_steps if s >= first]
        window = [mt for s, mt in self.saves if s >= first]
        last = self.manager.last_save_metrics
        return {
            **{f"hook_{k}": v for k, v in m.as_dict().items()},
            "saves_started": len(measured),
            "saves_skipped": sum(1 for s in self.at_risk_steps if s >= first) - len(measured),
            "saves_failed": m.saves_failed,
            "saved_steps": measured,
            "steps_at_risk_max": max(self.at_risk[first:], default=0),
            "steps_at_risk_median": _median(self.at_risk[first:]),
            "ckpt_bytes": last.bytes_staged if last is not None else 0,
            "save_stall_s_median": _median([mt.stall_s for mt in window]),
            "save_durable_s_median": _median([mt.durable_s for mt in window]),
            "save_staging_s_median": _median([mt.staging_s for mt in window]),
            "save_replication_s_median": _median([mt.replication_s for mt in window]),
            "structure_cached": sum(1 for mt in window if mt.structure_cached),
            "store_bytes_reported": last.store_bytes if last is not None else 0,
        }

    def verify(self, last_step: int, rebuild: Callable[[], _Workload]) -> Dict[str, Any]:
        """Save the last step if it was skipped, restore into a freshly built model and
        optimizer through a new manager (as after a restart), compare bit for bit."""
        import logging

        import torch

        from resilient_ckpt import CheckpointHook, CheckpointManager, TrainState

        if self.hook.saved_steps[-1] != last_step:  # the same on every rank
            self.manager.save_local(self.state.sharded_state_dict, iteration=last_step, is_async=False)
        self.close()
        fresh = rebuild()
        logging.getLogger("resilient_ckpt").setLevel(logging.ERROR)  # its "Resumed session" line
        with CheckpointManager(
            session_id=self.session, store_root=self.store_root, replication_factor=2, keep_last=1
        ) as again:
            t0 = time.perf_counter()
            hook = CheckpointHook(again, every_n_steps=1, state=TrainState(fresh.model, fresh.optimizer))
            next_step = hook.restore()
            restore_s = time.perf_counter() - t0
            hook.close()
        live, back = self.wl.tensors(), fresh.tensors()
        exact = len(live) == len(back) and all(torch.equal(a, b) for a, b in zip(live, back))
        return {"restored_step": next_step - 1, "bit_exact": exact, "restore_s": restore_s}

    def close(self) -> None:
        if self.hook is not None:
            self.hook.close()
            self.manager.close()
            self.hook = None


def _mcore_state_fn(wl: _Workload, rank: int, world: int) -> Callable[[], Dict[str, Any]]:
    """Megatron's sharded state dict of the model and its optimizer, built anew per save:
    every parameter a ShardedTensor replicated over data parallel (``replica_id`` = dp rank),
    the optimizer's state through ``optim_state_to_sharding_state`` (its per-parameter ``step``
    kept as a common value), this rank's RNG state a ShardedObject."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    params = [p for group in wl.optimizer.param_groups for p in group["params"]]

    def build() -> Dict[str, Any]:
        model = {
            k: ShardedTensor.from_rank_offsets(f"model.{k}", v, replica_id=rank)
            for k, v in wl.model.state_dict(keep_vars=True).items()
        }
        optim = wl.optimizer.state_dict()
        steps = {
            i: float(s["step"]) for i, s in optim["state"].items() if isinstance(s.get("step"), torch.Tensor)
        }
        optim_state_to_sharding_state(optim, get_param_id_to_sharded_param_map(model, params), ("step",))
        for st in model.values():  # matched to the optimizer's parameters by identity; saved as data
            st.data = st.data.detach()
        rng = ShardedObject("rng_state", torch.get_rng_state(), (world,), (rank,), replica_id=0)
        return {"model": model, "optimizer": optim, "optimizer_steps": steps, "rng_state": rng}

    return build


class _Nvrx:
    """Megatron-LM + nvidia-resiliency-ext, saving every step; each save first finalizes the
    previous one (nvrx's queue cannot skip)."""

    name = "nvrx"

    def __init__(self, wl: _Workload, rank: int, world: int, tmp_root: str, session: str):
        from resilient_ckpt.bench.baseline import BaselineSystem
        from resilient_ckpt.bench.launcher import RankContext

        ctx = RankContext(rank, world, 1, tmp_root, session=session, replication_factor=2)
        self.system = BaselineSystem()
        self.system.setup(ctx)  # apply_cpu_patches() without CUDA, the gloo adaptation with it
        self.state_fn = _mcore_state_fn(wl, rank, world)
        self.pending = None
        self.handles: List[Any] = []  # (step, SaveHandle)
        self.last_complete = -1
        self.at_risk: List[int] = []

    def warm(self) -> bool:
        return True  # a save every step from the first: steady after the warm-up steps

    def after_step(self, step: int) -> Dict[str, Any]:
        t0 = time.perf_counter()
        if self.pending is not None:
            self.pending.wait()  # maybe_finalize_async_calls(blocking=True): writer joined, find_latest
            self.last_complete = step - 1
        t1 = time.perf_counter()
        self.pending = self.system.save(self.state_fn(), step)
        self.handles.append((step, self.pending))
        self.at_risk.append(step - self.last_complete)
        return {"saved": True, "finalize_s": t1 - t0, "save_call_s": time.perf_counter() - t1}

    def finish(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def summary(self, first: int) -> Dict[str, Any]:
        window = [h for s, h in self.handles if s >= first]
        out = {
            "saves_started": len(window),
            "saves_skipped": 0,  # the queue cannot skip: each save waits for the previous one
            "saves_failed": 0,  # a failed save raises (the run is then reported unavailable)
            "hook_interval_steps": 1.0 if len(window) > 1 else 0.0,
            "steps_at_risk_max": max(self.at_risk[first:], default=0),
            "steps_at_risk_median": _median(self.at_risk[first:]),
            "ckpt_bytes": window[-1].saved_bytes if window else 0,
            "saved_tensors": self.system.saved_tensors,
        }
        for key in ("from_state_dict_s", "replicate_and_clone_s", "fork_writer_s", "writer_s"):
            out[f"save_{key}_median"] = _median([h.details.get(key, 0.0) for h in window])
        try:
            out["find_latest"] = self.system.manager.find_latest()
        except Exception as e:  # reported, not fatal: the figures above stand
            out["find_latest"] = f"{type(e).__name__}: {e}"
        return out

    def close(self) -> None:
        self.system.teardown()


#: warm-up steps at most, however long a system takes to reach its steady state
MAX_WARMUP = 40


def _all_warm(warm: bool) -> bool:
    """Whether every rank's system is warm (a MIN all-reduce: the ranks' loops stay in step)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(warm)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _private_rss() -> int:
    """This process's private resident memory (``RssAnon``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _tree_bytes(root: str) -> int:
    """Allocated bytes of every file under ``root`` (tmpfs: the host memory they hold), each
    file once (by inode: one renamed while the walk runs is not counted twice)."""
    seen: Dict[tuple, int] = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:  # retired meanwhile
                continue
            seen[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return sum(seen.values())


class _StorePeak:
    """Samples the store's bytes every ``interval_s`` in a thread; ``peak``."""

    def __init__(self, root: str, interval_s: float = 0.05):
        self.root, self.interval_s, self.peak = root, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, _tree_bytes(self.root))

    def __enter__(self) -> "_StorePeak":
        self.peak = _tree_bytes(self.root)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _tree_bytes(self.root))


def _memcpy(nbytes: int, reps: int = 5) -> Dict[str, float]:
    """Best single-thread copy of ``nbytes``: into a populated buffer, and into fresh pages."""
    import torch

    src = torch.ones(max(nbytes, 1), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    warm = fresh = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        warm = min(warm, time.perf_counter() - t0)
    del dst
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.empty(src.numel(), dtype=torch.uint8).copy_(src)
        fresh = min(fresh, time.perf_counter() - t0)
    return {"memcpy_s": warm, "memcpy_fresh_s": fresh}


def _cpu_s() -> float:
    """CPU seconds of this process (every thread) and of its children that were joined."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _median(values: List[float]) -> float:
    return statistics.median(values) if values else 0.0


def _run_rank(ctx, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """One rank (``resilient_ckpt.bench.launcher.launch``: one per simulated node, its process
    group up, the known import warnings silenced; it and the writers it forks end together)."""
    import torch

    from resilient_ckpt.bench.loop import PrivateMemory

    rank, tmp_root = ctx.rank, ctx.tmp_root
    device = torch.device("cpu")
    if cfg["device"] == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    store_root = os.path.join(tmp_root, f"node{rank}")  # one rank per node
    os.makedirs(store_root, exist_ok=True)
    session = f"per-step-{cfg['workload']}"
    wl = _Workload(cfg, rank, device)
    marks: Dict[str, float] = {}
    # bracket the hook's optimizer pre-step fence (registered by CheckpointHook) with two of ours
    wl.optimizer.register_step_pre_hook(lambda *_a, **_k: marks.__setitem__("pre", time.perf_counter()))
    system: Any
    if cfg["system"] == "ours":
        system = _Ours(wl, store_root, session, cfg["when_busy"], cfg["background_nice"])
    elif cfg["system"] == "nvrx":
        system = _Nvrx(wl, rank, WORLD, tmp_root, session)
    else:
        system = _None()
    wl.optimizer.register_step_pre_hook(
        lambda *_a, **_k: marks.__setitem__("fence_s", time.perf_counter() - marks["pre"])
    )

    first, total = cfg["warmup"], cfg["warmup"] + cfg["steps"]
    steps: List[Dict[str, Any]] = []
    mem = PrivateMemory()
    store = _StorePeak(store_root)
    start: Dict[str, float] = {}
    try:
        step = -1
        while step + 1 < total:
            step += 1
            if step == first and step < MAX_WARMUP and not _all_warm(system.warm()):
                first, total = first + 1, total + 1  # every rank alike: the vote above
            if step == first:
                sync()
                start = {"cpu": _cpu_s(), "rss": _private_rss(), "store": _tree_bytes(store_root)}
                mem.__enter__()
                store.__enter__()
            sync()
            t0 = time.perf_counter()
            wl.step(step)
            t1 = time.perf_counter()
            rec = system.after_step(step)
            t2 = time.perf_counter()
            sync()
            t3 = time.perf_counter()
            if step >= first:
                steps.append(
                    {
                        "step_s": t3 - t0,
                        "train_s": t1 - t0,
                        "system_s": t2 - t1,
                        "fence_s": marks["fence_s"],
                        "rss": _private_rss(),
                        **rec,
                    }
                )
        end = {"cpu": _cpu_s(), "rss": _private_rss(), "store": _tree_bytes(store_root)}
    finally:
        if store._thread.is_alive():
            store.__exit__()
        if mem._thread is not None:
            mem.__exit__()
    t0 = time.perf_counter()
    system.finish()
    drain_s = time.perf_counter() - t0
    drained = {"rss": _private_rss(), "store": _tree_bytes(store_root)}
    summary = system.summary(first)

    n = len(steps)
    step_s = [s["step_s"] for s in steps]
    blocked = [s["system_s"] + s["fence_s"] for s in steps]
    rss = [s["rss"] for s in steps]
    ckpt_bytes = summary.get("ckpt_bytes", 0)
    state = wl.tensors()
    state_bytes = sum(t.numel() * t.element_size() for t in state)
    out: Dict[str, Any] = {
        "rank": rank,
        "warmup": first,
        "steps": n,
        "step_s_median": _median(step_s),
        "step_s_mean": sum(step_s) / n,
        "train_s_median": _median([s["train_s"] for s in steps]),
        "blocked_s_median": _median(blocked),
        "blocked_s_mean": sum(blocked) / n,
        "system_s_median": _median([s["system_s"] for s in steps]),
        "system_s_mean": sum(s["system_s"] for s in steps) / n,
        "fence_s_median": _median([s["fence_s"] for s in steps]),
        "fence_s_mean": sum(s["fence_s"] for s in steps) / n,
        "cpu_s_per_step": (end["cpu"] - start["cpu"]) / n,
        "state_bytes": state_bytes,
        "state_tensors": len(state),
        "ckpt_bytes": ckpt_bytes,
        **_memcpy(ckpt_bytes or state_bytes // WORLD),
        # RSS wanders by +-15 MiB from step to step (the allocator): growth is read between the
        # medians of the first and of the last 5 measured steps; the instants are kept too
        "rss_start": _median(rss[:5]),
        "rss_end": _median(rss[-5:]),
        "rss_at_start": start["rss"],
        "rss_at_end": end["rss"],
        "rss_peak": max([mem.peak, *rss]),
        "rss_drained": drained["rss"],
        "store_start": start["store"],
        "store_end": end["store"],
        "store_peak": store.peak,
        "store_drained": drained["store"],
        "drain_s": drain_s,
        **summary,
        "per_step": {k: [s.get(k) for s in steps] for k in steps[0]} if steps else {},
    }
    if cfg["system"] == "nvrx":
        out["save_call_s_median"] = _median([s["save_call_s"] for s in steps])
        out["finalize_s_median"] = _median([s["finalize_s"] for s in steps])
    if cfg["system"] == "ours":
        out["state_dict_s_median"] = _median([s["state_dict_s"] for s in steps if s["state_dict_s"] > 0])
        out["system_s_saved_median"] = _median([s["system_s"] for s in steps if s["saved"]])
        out["system_s_skipped_median"] = _median([s["system_s"] for s in steps if not s["saved"]])
        if cfg["verify"]:
            out["restore"] = system.verify(total - 1, lambda: _Workload(cfg, rank, device, seed=1))
    system.close()
    return out


# --- the parent ----------------------------------------------------------------------------------


def _launch(cfg: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Run one (workload, system) in WORLD fresh rank processes; their results in rank order."""
    from resilient_ckpt.bench.launcher import launch, mp_context

    mp_context(cuda=cfg["device"] == "cuda")  # GPU ranks: only CUDA-safe preloads in the fork server
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="per-step-", dir=shm) as tmp_root:
        return launch(_run_rank, WORLD, tmp_root, ranks_per_node=1, args=(cfg,), timeout=cfg["timeout_s"])


def _slowest(ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Every numeric figure's maximum over ranks (the slowest / largest rank)."""
    keys = [k for k, v in ranks[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {k: max(r[k] for r in ranks) for k in keys if k != "rank"}


def _derive(row: Dict[str, Any], ref: Optional[Dict[str, Any]]) -> None:
    """The figures against ``none`` (same workload)."""
    if ref is None or "unavailable" in row or "unavailable" in ref:
        return
    base = ref["step_s_median"]
    row["blocked_delta_s"] = row["step_s_median"] - base
    row["blocked_delta_pct"] = 100.0 * row["blocked_delta_s"] / base
    row["blocked_direct_pct"] = 100.0 * row["blocked_s_mean"] / base
    row["blocked_direct_median_pct"] = 100.0 * row["blocked_s_median"] / base
    row["extra_cpu_s_per_step"] = row["cpu_s_per_step"] - ref["cpu_s_per_step"]
    row["extra_cpu_memcpys"] = row["extra_cpu_s_per_step"] / row["memcpy_s"] if row["memcpy_s"] else 0.0
    row["rss_growth"] = row["rss_end"] - row["rss_start"]
    row["store_growth"] = row["store_end"] - row["store_start"]


def _interval(row: Dict[str, Any]) -> float:
    started = row.get("saves_started", 0)
    return row["steps"] / started if started else math.inf


def _mib_span(r: Dict[str, Any], what: str) -> str:
    return f"{r[what + '_start'] / MIB:.0f}>{r[what + '_end'] / MIB:.0f} ({r[what + '_peak'] / MIB:.0f})"


def _table(results: Dict[str, Dict[str, Dict[str, Any]]]) -> str:
    def fig(key: str, scale: float = 1e3, fmt: str = "{:.1f}") -> Callable[[str, Dict[str, Any]], str]:
        return lambda _name, r: fmt.format(r[key] * scale) if key in r else "-"

    def saving(fn: Callable[[str, Dict[str, Any]], str]) -> Callable[[str, Dict[str, Any]], str]:
        return lambda name, r: "-" if name == "none" else fn(name, r)

    columns = [
        ("step ms", 9, fig("step_s_median")),
        ("Δ ms", 8, fig("blocked_delta_s")),
        ("Δ %", 7, fig("blocked_delta_pct", 1)),
        ("direct ms", 10, fig("blocked_s_mean")),
        ("direct %", 9, fig("blocked_direct_pct", 1)),
        ("+CPU ms", 9, fig("extra_cpu_s_per_step")),
        ("memcpys", 9, fig("extra_cpu_memcpys", 1)),
        ("interval", 9, saving(lambda _n, r: f"{_interval(r):.2f}")),
        ("skip", 5, saving(lambda _n, r: str(r.get("saves_skipped", 0)))),
        ("fail", 5, saving(lambda _n, r: str(r.get("saves_failed", 0)))),
        ("ckpt MiB", 9, saving(fig("ckpt_bytes", 1 / MIB))),
        ("tensors", 8, lambda _n, r: str(r["state_tensors"])),
        ("RSS MiB start>end (peak)", 26, lambda _n, r: _mib_span(r, "rss")),
        ("store MiB start>end (peak)", 28, lambda _n, r: _mib_span(r, "store")),
    ]
    head = f"{'wl':<3}{'system':<7}" + "".join(f"{h:>{w}}" for h, w, _ in columns)
    lines = [head, "-" * len(head)]
    for wl, systems in results.items():
        for name, r in systems.items():
            if "unavailable" in r:
                lines.append(f"{wl:<3}{name:<7}unavailable: {r['unavailable'].splitlines()[0][:160]}")
                continue
            lines.append(f"{wl:<3}{name:<7}" + "".join(f"{fn(name, r):>{w}}" for _h, w, fn in columns))
    return "\n".join(lines)


def _notes(wl: str, rows: Dict[str, Dict[str, Any]]) -> List[str]:
    """A line per system on where its time goes."""
    out = []
    ours, nvrx = rows.get("ours", {}), rows.get("nvrx", {})
    if "step_s_median" in ours:
        line = (
            f"{wl} ours: hook.step {ours['system_s_saved_median'] * 1e3:.1f} ms when it saved "
            f"(save_local {ours['save_stall_s_median'] * 1e3:.1f}, state dict "
            f"{ours['state_dict_s_median'] * 1e3:.1f}), {ours['system_s_skipped_median'] * 1e3:.1f} ms "
            f"when skipped; fence {ours['fence_s_mean'] * 1e3:.2f} ms/step; training compute "
            f"{ours['train_s_median'] * 1e3:.0f} ms (none: {rows['none']['train_s_median'] * 1e3:.0f}); "
            f"save durable in {ours['save_durable_s_median'] * 1e3:.0f} ms; hook.metrics interval "
            f"{ours['hook_interval_steps']:.2f}, steps at risk <= {ours['steps_at_risk_max']}"
        )
        if "restore_bit_exact" in ours:
            line += f"; restored step {ours['restored_step']} bit-exact: {ours['restore_bit_exact']}"
        out.append(line)
    if "step_s_median" in nvrx:
        out.append(
            f"{wl} nvrx: save call {nvrx['save_call_s_median'] * 1e3:.0f} ms (from_state_dict "
            f"{nvrx['save_from_state_dict_s_median'] * 1e3:.0f}, replicate+clone "
            f"{nvrx['save_replicate_and_clone_s_median'] * 1e3:.0f}, fork "
            f"{nvrx['save_fork_writer_s_median'] * 1e3:.0f}), finalize of the previous save "
            f"{nvrx['finalize_s_median'] * 1e3:.0f} ms; training compute {nvrx['train_s_median'] * 1e3:.0f} "
            f"ms (none: {rows['none']['train_s_median'] * 1e3:.0f}); find_latest after the drain: "
            f"{nvrx.get('find_latest')}"
        )
    return out


def _config(args, wl: str) -> Dict[str, Any]:
    cfg = dict((QUICK if args.quick else DEFAULTS)[wl])
    for key in ("layers", "d_model", "vocab", "seq", "batch", "tensors", "numel", "warmup"):
        value = getattr(args, key)
        if value is not None and key in cfg:
            cfg[key] = value
    if args.steps is not None:
        cfg["steps"] = args.steps
    if not args.quick and args.steps is None and args.warmup is None:
        cfg["nvrx"] = dict(NVRX_DEFAULTS.get(wl, {}))
    else:
        cfg["nvrx"] = {}
    for key in ("warmup", "steps"):
        value = getattr(args, f"nvrx_{key}")
        if value is not None:
            cfg["nvrx"][key] = value
    cfg.update(
        workload=wl,
        device=args.device,
        verify=not args.no_verify,
        timeout_s=args.timeout,
        when_busy=args.when_busy,
        background_nice=_background_nice(args),
    )
    return cfg


def _background_nice(args) -> int:
    """19 as the README's per-step loop, unless given; ``--quick`` (the suite's smoke test) 0:
    lowered threads wait for whatever else the machine runs (another test worker), and the
    smoke test's verdict must not depend on that."""
    if args.background_nice is not None:
        return args.background_nice
    return 0 if args.quick else 19


def _describe(cfg: Dict[str, Any]) -> str:
    if cfg["workload"] == "a":
        return (
            f"a: GPT {cfg['layers']} layers, d_model {cfg['d_model']}, {cfg['heads']} heads, vocab "
            f"{cfg['vocab']}, seq {cfg['seq']}, batch {cfg['batch']}/rank, AdamW, DDP (gloo)"
        )
    return f"b: {cfg['tensors']} float32 tensors x {cfg['numel']} elements, SGD (no momentum)"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=("a", "b", "both"), default="both")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of none,ours,nvrx")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--quick", action="store_true", help="small models, a few steps (the test's run)")
    p.add_argument("--steps", type=int, help="measured steps (default: a 30, b 20; nvrx on b 2)")
    p.add_argument("--warmup", type=int, help="steps before the measured ones (default: a 5, b 4)")
    p.add_argument("--layers", type=int)
    p.add_argument("--d-model", dest="d_model", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--tensors", type=int, help="workload b: how many tensors")
    p.add_argument("--numel", type=int, help="workload b: elements per tensor")
    p.add_argument("--nvrx-steps", type=int, help="measured steps of nvrx (default: as --steps; b: 2)")
    p.add_argument("--nvrx-warmup", type=int, help="warm-up steps of nvrx (default: as --warmup; b: 2)")
    p.add_argument("--no-verify", action="store_true", help="skip the restore check of ours")
    p.add_argument(
        "--when-busy",
        choices=("skip", "skip_in_background"),
        default="skip_in_background",
        help="ours: the hook's when_busy (skip: the ranks vote on the training thread)",
    )
    p.add_argument(
        "--background-nice",
        type=int,
        help="ours: CheckpointManager(background_nice=...) (default 19, as the README's per-step "
        "loop; --quick: 0, the background threads at the training thread's priority)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per (workload, system) run")
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
    if "none" not in systems:
        systems.insert(0, "none")  # every difference is against it
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA device")
    # every rank (spawned: it inherits this environment) runs one intra-op thread, as one rank
    # per GPU would; two ranks share this machine's cores
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"

    workloads = WORKLOADS if args.workload == "both" else (args.workload,)
    report: Dict[str, Any] = {"world_size": WORLD, "device": args.device, "workloads": {}, "results": {}}
    t_all = time.perf_counter()
    failed = False
    for wl in workloads:
        cfg = _config(args, wl)
        nvrx = cfg["nvrx"]
        print(
            _describe(cfg)
            + f"; {cfg['warmup']} warm-up + {cfg['steps']} measured steps"
            + (
                f" (nvrx: {nvrx.get('warmup', cfg['warmup'])} + {nvrx.get('steps', cfg['steps'])})"
                if nvrx
                else ""
            ),
            flush=True,
        )
        report["workloads"][wl] = cfg
        rows: Dict[str, Dict[str, Any]] = {}
        for system in SYSTEMS:
            if system not in systems:
                continue
            t0 = time.perf_counter()
            try:
                ranks = _launch(dict(cfg, system=system, **(cfg["nvrx"] if system == "nvrx" else {})))
            except Exception as e:  # said in the output, the other systems still run
                rows[system] = {"unavailable": str(e)}
                failed = failed or system != "nvrx"
                print(f"  {system}: unavailable: {str(e).splitlines()[0][:200]}", flush=True)
                continue
            row = _slowest(ranks)
            row["ranks"] = ranks
            if "restore" in ranks[0]:
                row["restore_bit_exact"] = all(r["restore"]["bit_exact"] for r in ranks)
                row["restored_step"] = ranks[0]["restore"]["restored_step"]
                failed = failed or not row["restore_bit_exact"]
            failed = failed or row.get("saves_failed", 0) > 0
            rows[system] = row
            print(f"  {system}: {time.perf_counter() - t0:.0f} s", flush=True)
        for row in rows.values():
            _derive(row, rows.get("none"))
        report["results"][wl] = rows
    report["wall_s"] = time.perf_counter() - t_all
    print()
    print(_table(report["results"]))
    print(
        "\nstep ms: median step (slowest rank); Δ: vs none's median step; direct: mean per step of "
        "ours' hook.step() + fence wait, of nvrx's finalize + save call; %: of none's median step; "
        "+CPU: process CPU per step (threads, joined writers) over none's; memcpys: that in "
        "single-thread copies of the rank's checkpoint bytes; interval: measured steps per save "
        "started; skip/fail: in the measured steps; RSS: private (peak: with forked writers); "
        "store: the node's files on /dev/shm"
    )
    for wl, rows in report["results"].items():
        for line in _notes(wl, rows):
            print(line)
    print(f"total {report['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
