"""What a user feels of checkpointing inside a training loop, and host memory as they size it.

* the runner's loop phase (one rank, :func:`run_loop` twice): a training loop whose compute between saves outlasts a save
  (calibrated from the save phase's time to durable), run twice in the same process — without
  saves, then saving every ``SAVE_EVERY`` steps — and the difference per save: the **loop
  overhead per save**. A step is compute that reads the state (matrix products on the
  workload's device) and then an update that mutates every saved tensor in place, as an
  optimizer step does; before the update the loop calls the pending save's ``fence`` (when
  the system offers one: ours orders the update after the copies on the GPU, without a CPU
  wait), and before a save it waits for the previous one (a bounded queue). The state
  restored afterwards is not checked here: the save phase's bit-exact restore checks the
  same ordering.
* :class:`PrivateMemory`: the peak of private resident memory (``RssAnon``: heap, private
  copies, page-locked host allocations where the driver counts them there) of this process
  and (``Pss_Anon``: a forked writer's copy-on-write pages counted once) its children,
  sampled every 10 ms (children every 100 ms). With the store's bytes (tmpfs files, shared) it is
  what a node must have: counting ``VmHWM`` instead would count the store's pages twice in a
  process that maps them.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict, Optional, Tuple

SAVE_EVERY = 4
#: compute between two saves, as a multiple of the save's time to durable
COMPUTE_MARGIN = 1.5


def _private_bytes(pid: str = "self") -> int:
    """Proportional anonymous memory (``Pss_Anon``: a forked child's copy-on-write pages count
    once between it and its parent), else ``RssAnon``."""
    for path, field_name in ((f"/proc/{pid}/smaps_rollup", "Pss_Anon:"), (f"/proc/{pid}/status", "RssAnon:")):
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith(field_name):
                        return int(line.split()[1]) * 1024
        except OSError:
            continue
    return 0


def _status_bytes() -> Tuple[int, int]:
    """This process's private memory (``RssAnon``) and its resident pages that are not shared
    memory (``RssAnon + RssFile``: RSS without the store's tmpfs pages it maps, which count
    once, as the store's bytes)."""
    anon = file = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
                elif line.startswith("RssFile:"):
                    file = int(line.split()[1]) * 1024
    except OSError:
        pass
    return anon, anon + file


def _children(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return f.read().split()
    except OSError:
        return []


class PrivateMemory:
    """Context manager: ``peak`` = max over samples of the private memory of this process and
    its children (see :func:`_private_bytes`)."""

    def __init__(self, interval_s: float = 0.01):
        self.interval_s = interval_s
        self.peak = 0
        #: peak of this process's RSS without shared memory (see _resident_unshared)
        self.peak_unshared = 0
        self._tick = 0
        self._children = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def sample(self) -> int:
        # /proc/<pid>/status is cheap; smaps_rollup walks the page tables (with the mmap lock
        # held: sampled every 10 ms it slowed every process measured, the reference's too), so
        # it is read only for children (a forked writer's copy-on-write pages), every 100 ms.
        own, unshared = _status_bytes()
        self._tick += 1
        if self._tick % 10 == 1:
            self._children = sum(_private_bytes(c) for c in _children(os.getpid()))
        total = own + self._children
        self.peak = max(self.peak, total)
        self.peak_unshared = max(self.peak_unshared, unshared)
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "PrivateMemory":
        self.sample()
        self._thread = threading.Thread(target=self._run, name="bench-rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()


def pinned_host_bytes() -> int:
    """Bytes torch's page-locked host allocator holds (peak), 0 without CUDA."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return 0
    try:
        return int(stats().get("reserved_bytes.current.peak", stats().get("reserved_bytes.peak", 0)) or 0)
    except Exception:
        return 0


class Compute:
    """A step's compute on ``device``: square matrix products, calibrated to ``seconds``."""

    def __init__(self, device, seconds: float):
        import torch

        self.device = device
        n = 2048 if device.type == "cuda" else 256
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.a = torch.randn(n, n, device=device, dtype=dtype)
        self.b = torch.randn(n, n, device=device, dtype=dtype)
        self.reps = 1
        one = self._time(4) / 4
        self.reps = max(1, int(seconds / max(one, 1e-6)))

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _time(self, reps: int) -> float:
        self._sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            self.a @ self.b
        self._sync()
        return time.perf_counter() - t0

    def step(self) -> None:
        for _ in range(self.reps):
            self.a @ self.b


def run_loop(wl, compute: Compute, system, steps: int, first_iteration: int, save: bool) -> Dict[str, Any]:
    """``steps`` steps of compute + update, saving every SAVE_EVERY steps when ``save``."""
    import torch

    pending = None
    saves = 0
    compute._sync()
    t0 = time.perf_counter()
    for step in range(steps):
        iteration = first_iteration + step
        compute.step()
        fence = getattr(pending, "fence", None)
        if fence is not None:
            fence()  # the update below mutates what the pending save copies
        wl.advance(iteration)
        if save and (step + 1) % SAVE_EVERY == 0:
            if pending is not None:
                pending.wait()
            pending = system.save(wl.sharded_state_dict(), iteration)
            saves += 1
    if pending is not None:
        pending.wait()
    compute._sync()
    if wl.device.type == "cuda":
        torch.cuda.synchronize(wl.device)
    return {"seconds": time.perf_counter() - t0, "saves": saves}
