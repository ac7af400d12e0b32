"""Overhead of local checkpoints inside a Lightning run, against the same run without them (CPU).

    .venv/bin/python benchmarks/lightning_overhead.py                 # defaults below
    .venv/bin/python benchmarks/lightning_overhead.py --param-mib 64 --steps 60 --every 10 --reps 3
    .venv/bin/python benchmarks/lightning_overhead.py --batchnorm       # with BatchNorm buffers

One process, Lightning on CPU (devices=1), an MLP of ``--param-mib`` MiB of fp32 parameters
trained with Adam (so a save holds 3x that: weights, exp_avg, exp_avg_sq), ``--steps`` steps.
Runs alternate, ``--reps`` times each: **baseline** (no local checkpoints) and **local** (our
``LocalCheckpointCallback`` every ``--every`` steps, ``HierarchicalCheckpointIO`` with
``async_save=True`` over an embedded ``CheckpointManager`` whose store is on /dev/shm).

Measured per run: the period of every step (between consecutive ``on_train_batch_start``), the
time inside the callback's save (Lightning's checkpoint dump, then our conversion and the start of
the copies), the time the next optimizer update waited for the copies (the fence), and the
process's CPU time (all threads: the copies, checksums and publishing on the save thread too).

Reported: the overhead per save in wall-clock time = the excess of each save's window (the step
that saves and the ones after it until the next save) over as many median baseline steps, median
over all windows of all reps, next to the same figure for the baseline runs' windows (the noise
floor); what blocks the training step per save (save call + fence, medians); the CPU time per
save; the whole-run difference per save, which bursts of other work on a shared machine dominate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Optional


def _run(local: bool, args, store_root: str, session: str) -> dict:
    import lightning.pytorch as pl
    import torch

    from resilient_ckpt import CheckpointManager
    from resilient_ckpt.integrations.lightning import HierarchicalCheckpointIO, LocalCheckpointCallback

    width = 1024
    layers = max(1, int(args.param_mib * 2**20 / 4 / (width * width)))

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            blocks = []
            for _ in range(layers):  # with --batchnorm a BatchNorm1d after each layer: buffers
                blocks += [torch.nn.Linear(width, width)] + (
                    [torch.nn.BatchNorm1d(width)] if args.batchnorm else []
                )
            self.net = torch.nn.Sequential(*blocks)

        def training_step(self, batch, batch_idx):
            x = torch.randn(args.batch, width)
            return self.net(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.arange(args.steps + 1), batch_size=1)

    starts, cpu = [], []

    class Periods(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            cpu.append(time.process_time())  # every thread of the process: the save thread's work too

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            starts.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module):
            starts.append(time.perf_counter())
            if io is not None:
                io.finish()  # the last save's background work counts
            cpu.append(time.process_time())

    callbacks, plugins, manager, io = [Periods()], [], None, None
    timings = {"save": [], "fence": [], "ours": []}
    handles = []  # the saves' SaveHandles: their metrics time the save thread's work
    if local:
        manager = CheckpointManager(session_id=session, store_root=store_root, replication_factor=1)
        io = HierarchicalCheckpointIO(None, manager, lambda path: -1, async_save=True)
        cb = LocalCheckpointCallback(every_n_train_steps=args.every)
        _timed(cb, "_save_last_checkpoint", timings["save"])
        _timed(io, "fence", timings["fence"])
        _timed(io, "save_checkpoint", timings["ours"], handles)
        callbacks.append(cb)
        plugins.append(io)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False if not local else True,
        callbacks=callbacks,
        plugins=plugins,
        default_root_dir=store_root,
    )
    trainer.fit(Net())
    periods = [b - a for a, b in zip(starts, starts[1:])]
    out = {
        "periods": periods,
        "saves": len(timings["save"]),
        "save_call_s": timings["save"],
        "ours_s": timings["ours"],
        "background": [
            {k: getattr(h.wait(), k) for k in ("staging_s", "checksum_s", "publish_s", "durable_s")}
            for h in handles
        ],
        "cpu_s": cpu[1] - cpu[0],
        "fence_wait_s": [t for t in timings["fence"] if t > 0],
        "saved_bytes": 0,
    }
    if manager is not None:
        m = manager.last_save_metrics
        out["saved_bytes"] = m.bytes_staged if m is not None else 0
        out["failed_saves"] = io.failed_saves
        manager.close()
    return out


def _window_excess(runs, args, step: float) -> list:
    out = []
    for r in runs:
        periods = r["periods"]
        for g in range(args.every, args.steps, args.every):  # saves after steps every, 2*every, ...
            window = periods[g - 1 : g - 1 + args.every]
            if len(window) == args.every:
                out.append(sum(window) - args.every * step)
    return out


def _quartiles(values: list) -> list:
    return statistics.quantiles(values, n=4) if len(values) > 1 else list(values)


def _timed(obj, name: str, sink: list, results: Optional[list] = None) -> None:
    real = getattr(obj, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            out = real(*a, **kw)
            if results is not None and out is not None:
                results.append(out)
            return out
        finally:
            sink.append(time.perf_counter() - t0)

    setattr(obj, name, wrapper)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--param-mib", type=float, default=32.0, help="fp32 parameters, MiB (default 32; 4 MiB layers)"
    )
    p.add_argument("--batch", type=int, default=16)
    p.add_argument(
        "--batchnorm",
        action="store_true",
        help="a BatchNorm1d after each layer (buffers the next forward writes: copied at the save "
        "since issue 40, a fence at the next batch start before)",
    )
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10, help="local checkpoint every N steps")
    p.add_argument("--reps", type=int, default=5, help="runs of each kind, alternating")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: a core is left to the save thread)"
    )
    p.add_argument("--store", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    import logging

    import torch

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)

    runs = {"baseline": [], "local": []}
    with tempfile.TemporaryDirectory(dir=args.store, prefix="rc-lightning-bench-") as root:
        _run(False, args, root, "warmup")  # imports, allocator, first-touch
        for rep in range(args.reps):
            for kind in ("baseline", "local"):
                runs[kind].append(_run(kind == "local", args, root, f"bench-{rep}"))
    overheads, calls, fences, ours, cpus = [], [], [], [], []
    for base, loc in zip(runs["baseline"], runs["local"]):
        overheads.append((sum(loc["periods"]) - sum(base["periods"])) / max(1, loc["saves"]))
        cpus.append((loc["cpu_s"] - base["cpu_s"]) / max(1, loc["saves"]))
        calls.append(statistics.median(loc["save_call_s"]))
        ours.append(statistics.median(loc["ours_s"]))
        fences.append(sum(loc["fence_wait_s"]) / max(1, loc["saves"]))
    step_base = statistics.median(p for r in runs["baseline"] for p in r["periods"])
    # Robust to bursts of other work on the machine: the excess of every save's window (the step
    # whose end saves and the every-1 steps after it, where the copies, checksums and publishing
    # run) over as many median baseline steps, the median over all windows of all reps; the same
    # windows of the baseline runs give the noise floor (no saves there).
    window_excess = _window_excess(runs["local"], args, step_base)
    noise_floor = _window_excess(runs["baseline"], args, step_base)
    loc0 = runs["local"][0]
    result = {
        "param_mib": args.param_mib,
        "saved_mib": loc0["saved_bytes"] / 2**20,
        "steps": args.steps,
        "every": args.every,
        "saves_per_run": loc0["saves"],
        "reps": args.reps,
        "step_s_baseline_median": step_base,
        "overhead_per_save_s_median": statistics.median(window_excess),
        "overhead_per_save_s_quartiles": _quartiles(window_excess),
        "noise_floor_s_median": statistics.median(noise_floor),
        "noise_floor_s_quartiles": _quartiles(noise_floor),
        "windows": len(window_excess),
        "save_call_s_median": statistics.median(calls),
        "ours_in_save_call_s_median": statistics.median(ours),
        "fence_wait_per_save_s_median": statistics.median(fences),
        "cpu_per_save_s_median": statistics.median(cpus),
        **{
            f"save_thread_{k}_median": statistics.median(b[k] for r in runs["local"] for b in r["background"])
            for k in ("staging_s", "checksum_s", "publish_s", "durable_s")
        },
        "cpu_per_save_s_each_rep": cpus,
        "run_total_difference_per_save_s_each_rep": overheads,
        "failed_saves": sum(r.get("failed_saves", 0) for r in runs["local"]),
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "torch": torch.__version__,
    }

    def ms(values):
        return ", ".join(f"{v * 1e3:.1f}" for v in values)

    print(
        f"Lightning, CPU, {result['saved_mib'] / 3:.0f} MiB parameters + Adam ({result['saved_mib']:.0f} MiB per save), "
        f"{args.steps} steps, a local save every {args.every} ({result['saves_per_run']} per run), "
        f"{args.reps} reps each, {args.threads} torch thread(s):\n"
        f"  step (baseline, median)            {step_base * 1e3:8.1f} ms\n"
        f"  overhead per save (wall clock)     {result['overhead_per_save_s_median'] * 1e3:8.1f} ms"
        f"   (median of {len(window_excess)} save windows; quartiles {ms(result['overhead_per_save_s_quartiles'])})\n"
        f"  the same windows without saves     {result['noise_floor_s_median'] * 1e3:8.1f} ms"
        f"   (noise floor; quartiles {ms(result['noise_floor_s_quartiles'])})\n"
        f"  blocking the step, per save:\n"
        f"    the save call                     {result['save_call_s_median'] * 1e3:8.1f} ms"
        f" (Lightning's dump, then ours: {result['ours_in_save_call_s_median'] * 1e3:.1f} ms conversion"
        " and copies started)\n"
        f"    the fence before the update       {result['fence_wait_per_save_s_median'] * 1e3:8.1f} ms\n"
        f"  off the step, on the save thread (medians): staging wait {result['save_thread_staging_s_median'] * 1e3:.1f} ms,"
        f" checksums {result['save_thread_checksum_s_median'] * 1e3:.1f} ms,"
        f" publish {result['save_thread_publish_s_median'] * 1e3:.1f} ms;"
        f" save to durable {result['save_thread_durable_s_median'] * 1e3:.1f} ms\n"
        f"  CPU time per save (all threads)    {result['cpu_per_save_s_median'] * 1e3:8.1f} ms   (each rep: {ms(cpus)})\n"
        f"  whole-run difference per save      (each rep: {ms(overheads)})\n"
        f"  failed saves                       {result['failed_saves']:8d}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
