"""Megatron-core's and nvidia-resiliency-ext's ``AsyncCallsQueue`` on a machine without CUDA.

Both queues are CUDA-bound in three places, none of which is about checkpoint bytes:
``torch.cuda.synchronize()`` before forking a worker (D2H copies), the all-reduces that check
"done on every rank" / "same call index" allocating their one-int tensor on
``torch.cuda.current_device()``, and Megatron-core's persistent worker calling
``torch.cuda.set_device(rank % torch.cuda.device_count())`` as it starts. In the rank processes
of these tests (only when CUDA is absent) the first two are pointed at the CPU, and the
persistent worker's entry point is wrapped by :func:`persistent_loop_on_cpu`, a module-level
function a spawned worker can import by name.
"""

from __future__ import annotations

import torch


def _cpu_cuda_stubs() -> None:
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.device_count = lambda: 1


def persistent_loop_on_cpu(owner: str, *args, **kwargs):
    """Entry point of a spawned persistent worker: stubs, then the library's own loop."""
    _cpu_cuda_stubs()
    # A fresh (spawned) process: the class attribute is the library's own loop here.
    return _caller_class(owner).async_loop(*args, **kwargs)


def _caller_class(owner: str):
    if owner == "mcore":
        from megatron.core.dist_checkpointing.strategies import async_utils

        return async_utils.PersistentAsyncCaller
    from nvidia_resiliency_ext.checkpointing.async_ckpt import core

    return core.PersistentAsyncCaller


def queue_class(owner: str):
    """The ``AsyncCallsQueue`` of ``"mcore"`` or ``"nvrx"``, usable on this machine."""
    if owner == "mcore":
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    else:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
    if not torch.cuda.is_available():
        _cpu_cuda_stubs()
        caller = _caller_class(owner)
        if not hasattr(caller, "_original_async_loop"):
            caller._original_async_loop = caller.async_loop
            caller.async_loop = staticmethod(_bound(owner))
    return AsyncCallsQueue


class _bound:
    """``persistent_loop_on_cpu`` with its owner fixed, picklable for a spawned process."""

    def __init__(self, owner: str):
        self.owner = owner

    def __call__(self, *args, **kwargs):
        return persistent_loop_on_cpu(self.owner, *args, **kwargs)
