"""The system we are measured against: Megatron-core + nvidia-resiliency-ext local checkpoints.

Save (what Megatron-LM does for ``--non-persistent-ckpt-type local --async-save``):
``MCoreTensorAwareStateDict.from_state_dict(ssd, algo="fully_parallel",
parallelization_group=<dp group>, cached_metadata=<distribution cached after the 1st save>)``,
then ``LocalCheckpointManager.save(tasd, iteration, is_async=True)`` (replicates over a
``CliqueReplicationStrategy`` - jump = ranks per node, factor 2 - and clones the tensors),
then the returned ``AsyncRequest`` goes to nvrx's own ``AsyncCallsQueue(persistent=False)``:
the ``TemporalAsyncCaller`` forks a process that runs ``save_fn`` (``torch.save`` into files
under the node's store root on /dev/shm). That is the async path Megatron-core defaults to
(``AsyncCallsQueue(persistent=False)``); the persistent (spawned) worker cannot take this
request at all, since its ``save_fn`` is bound to a manager holding process groups, which do
not pickle.

* stall   = from_state_dict + manager.save + schedule_async_request (fork) - the loop may mutate
  its tensors afterwards (they were cloned; the child sees a copy-on-write snapshot);
* durable = ``maybe_finalize_async_calls(blocking=True, no_dist=True)`` returned: the child was
  joined, then the finalize_fn ran ``find_latest()`` - an all-gather that confirms the
  iteration is complete on every rank. ``no_dist=True`` only skips the two 1-element
  all-reduces (on CUDA tensors) that merely cross-check call indices.

:class:`BaselineInlineSystem` (``baseline-inline``) runs the same request inside the rank
instead of a forked writer: the baseline's best case for time to durable.

Restore = ``find_latest()`` + ``load()`` (replica retrieval included) +
``tasd.to_state_dict(template, algo="fully_parallel", parallelization_group=<dp group>)``.

On a machine without CUDA both libraries fail on a few calls; :data:`PATCHED_FOR_CPU` lists
the substitutes (each maps a CUDA step to its CPU equivalent, the data movement is unchanged).

With CUDA (``resilient-ckpt bench --device cuda``) both run unpatched - real
``torch.cuda.synchronize()``, D2H clones, ``.cuda()`` staging and CUDA exchange buffers - except
for one thing the benchmark's gloo groups cannot do that nvrx's NCCL groups can:
:data:`ADAPTED_FOR_GLOO` (point-to-point send/recv of a CUDA tensor; gloo's own CUDA
collectives bounce through host memory the same way).
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from typing import Any, Dict, Optional

import torch
from torch.overrides import TorchFunctionMode

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed")
    from megatron.core.dist_checkpointing import tensor_aware_state_dict as _mcore_tasd
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
    LocalCheckpointManager,
)
from nvidia_resiliency_ext.checkpointing.local.replication import group_utils as _nvrx_groups
from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
    CliqueReplicationStrategy,
)

from ..errors import CheckpointingException, ValidationError
from .launcher import RankContext
from .runner import SaveHandle

PATCHED_FOR_CPU = (
    "torch.cuda.synchronize() -> no-op (nvrx LocalCheckpointManager.save and "
    "TemporalAsyncCaller.schedule_async_call wait for D2H copies; megatron "
    "MCoreTensorAwareStateDict._insert_sharded_data waits for the exchange)",
    "Tensor.cuda() / device='cuda' -> CPU inside nvrx GroupWrapper.isend_state_dict and "
    "irecv_state_dict (replica retrieval stages every tensor through the GPU)",
    "Tensor.cuda() / device='cuda' -> CPU inside megatron exchange_by_distribution (the "
    "fully parallel load exchange broadcasts from GPU buffers)",
)


class _CudaAsCpu(TorchFunctionMode):
    """Within its scope, CUDA placement requests (``.cuda()``, ``device="cuda"``) mean CPU.

    A torch function mode rather than edits of the libraries' code: the three functions it
    wraps keep their own logic (including their extra copies), only the device changes.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) == "cuda":
            return args[0].cpu()
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def _on_cpu(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _CudaAsCpu():
            return fn(*args, **kwargs)

    wrapper.__wrapped_for_cpu__ = True
    return wrapper


ADAPTED_FOR_GLOO = (
    "dist.send/recv of a CUDA tensor over gloo -> through host memory inside nvrx "
    "GroupWrapper.isend_state_dict / irecv_state_dict (replica retrieval; gloo point-to-point "
    "takes CPU tensors only, nvrx is written for NCCL)",
)


def _noop_synchronize(device=None) -> None:
    return None


def _is_gloo(group) -> bool:
    import torch.distributed as dist

    return "gloo" in str(dist.get_backend(group)).lower()


class _GlooHostBounce:
    """``torch.distributed`` as nvrx's ``group_utils`` module sees it, except that send/recv of
    a CUDA tensor on a gloo group goes through host memory (gloo would hand the device pointer
    to the socket: "writev: Bad address"). Every other name is torch.distributed's own."""

    def __getattr__(self, name: str) -> Any:
        import torch.distributed as dist

        return getattr(dist, name)

    def send(self, tensor, dst=None, group=None, tag=0, **kw):
        import torch.distributed as dist

        if tensor.is_cuda and _is_gloo(group):
            tensor = tensor.cpu()
        return dist.send(tensor, dst, group=group, tag=tag, **kw)

    def recv(self, tensor, src=None, group=None, tag=0, **kw):
        import torch.distributed as dist

        if not (tensor.is_cuda and _is_gloo(group)):
            return dist.recv(tensor, src, group=group, tag=tag, **kw)
        host = torch.empty_like(tensor, device="cpu")
        out = dist.recv(host, src, group=group, tag=tag, **kw)
        tensor.copy_(host)
        return out


def apply_gloo_cuda_adaptation() -> bool:
    """Install :data:`ADAPTED_FOR_GLOO` once per process when CUDA is present; True if so."""
    if not torch.cuda.is_available():
        return False
    if not isinstance(_nvrx_groups.dist, _GlooHostBounce):
        _nvrx_groups.dist = _GlooHostBounce()
    return True


def apply_cpu_patches() -> bool:
    """Install :data:`PATCHED_FOR_CPU` once per process when CUDA is absent; True if applied."""
    if torch.cuda.is_available():
        return False
    torch.cuda.synchronize = _noop_synchronize
    gw = _nvrx_groups.GroupWrapper
    for meth in ("isend_state_dict", "irecv_state_dict"):
        fn = getattr(gw, meth)
        if not getattr(fn, "__wrapped_for_cpu__", False):
            setattr(gw, meth, _on_cpu(fn))
    # tensor_aware_state_dict imported the name; patch where it is looked up
    fn = _mcore_tasd.exchange_by_distribution
    if not getattr(fn, "__wrapped_for_cpu__", False):
        _mcore_tasd.exchange_by_distribution = _on_cpu(fn)
    return True


class BaselineSystem:
    """Megatron-core MCoreTensorAwareStateDict + nvrx LocalCheckpointManager (clique, F=2)."""

    name = "baseline"
    flavour = "mcore"

    @classmethod
    def patches(cls, device: str) -> tuple:
        """What this system changes in the libraries for a run on ``device`` (reported).

        Decided from the device asked for, not from ``torch.cuda.is_available()``: this module
        is imported by the bench's fork server, and initialising CUDA there would leave every
        rank forked from it unable to use the GPU.
        """
        return ADAPTED_FOR_GLOO if device == "cuda" else PATCHED_FOR_CPU

    @classmethod
    def memory_estimate(cls, bytes_per_rank: int, world_size: int) -> int:
        # Per rank (measured at 1 GiB, W=2: peak RSS 2.8 GiB, files 1.5 GiB): ~0.5 GiB of
        # libraries + the state B + clones and received replica 2 x 0.75 B, plus /dev/shm files
        # (own + replica, 1.5 B) for two iterations while the older one awaits cleanup.
        return world_size * ((1 << 29) + int(bytes_per_rank * (1 + 1.5 + 3.0)))

    def setup(self, ctx: RankContext) -> None:
        apply_cpu_patches() or apply_gloo_cuda_adaptation()
        logging.getLogger("nvidia_resiliency_ext").setLevel(logging.ERROR)
        self.group = ctx.dp_group
        if ctx.world_size % (ctx.ranks_per_node * ctx.replication_factor):
            raise ValidationError(
                f"nvrx CliqueReplicationStrategy needs world size ({ctx.world_size}) divisible by "
                f"ranks per node x replication factor ({ctx.ranks_per_node} x "
                f"{ctx.replication_factor}); pick --ranks-per-node accordingly"
            )
        repl = CliqueReplicationStrategy.from_replication_params(
            replication_jump=ctx.ranks_per_node, replication_factor=ctx.replication_factor
        )
        self.manager = LocalCheckpointManager(ctx.store_root, session_id=ctx.session, repl_strategy=repl)
        self.queue = AsyncCallsQueue(persistent=False)
        self.cached_metadata: Optional[Any] = None
        self.saved_tensors = 0

    def _request(self, state: Dict[str, Any], iteration: int):
        """Megatron-LM's local save: build the state dict (cached distribution), then
        ``LocalCheckpointManager.save(is_async=True)``; returns (request, saved bytes, details)."""
        t0 = time.perf_counter()
        tasd, self.cached_metadata = MCoreTensorAwareStateDict.from_state_dict(
            state,
            algo="fully_parallel",
            parallelization_group=self.group,
            cached_metadata=self.cached_metadata,
        )
        tensors = list(tasd.tensors)
        self.saved_tensors = len(tensors)  # the last save's (read by benchmarks/per_step_loop.py)
        saved = sum(t.nbytes for t in tensors)
        t1 = time.perf_counter()
        request = self.manager.save(tasd, iteration, is_async=True)
        t2 = time.perf_counter()
        return request, saved, {"from_state_dict_s": t1 - t0, "replicate_and_clone_s": t2 - t1}

    def save(self, state: Dict[str, Any], iteration: int) -> SaveHandle:
        request, saved, details = self._request(state, iteration)
        marks: Dict[str, float] = {}
        # first finalize step: the writer process has been joined (for the breakdown only)
        request = request._replace(
            finalize_fns=[lambda: marks.setdefault("joined", time.perf_counter()), *request.finalize_fns]
        )
        t2 = time.perf_counter()
        self.queue.schedule_async_request(request)
        details["fork_writer_s"] = time.perf_counter() - t2

        def wait() -> None:
            w0 = time.perf_counter()
            self.queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
            w1 = time.perf_counter()
            details["writer_s"] = marks["joined"] - w0
            details["finalize_find_latest_s"] = w1 - marks["joined"]

        return SaveHandle(wait, saved_bytes=saved, details=details)

    def restore(self, template: Dict[str, Any]) -> Dict[str, Any]:
        iteration = self.manager.find_latest()
        if iteration < 0:
            raise CheckpointingException(
                "baseline: find_latest() found no complete local checkpoint under "
                f"{self.manager.root_local_ckpt_dir}; was the save phase run?"
            )
        tasd, _ = self.manager.load()
        return tasd.to_state_dict(template, algo="fully_parallel", parallelization_group=self.group)

    def teardown(self) -> None:
        self.queue.close()


class BaselineInlineSystem(BaselineSystem):
    """The baseline with its AsyncRequest run inside the rank after the stall is measured.

    Same stall as :class:`BaselineSystem`; ``wait()`` runs ``save_fn`` in the rank process
    (as nvrx's ``AsyncRequest.execute_sync`` does, without its barrier: ``find_latest`` in the
    finalize step is the agreement). No fork: the write is not slowed by copy-on-write faults
    or by sharing the cores with the trainer - the baseline's best case for time to durable.
    """

    name = "baseline-inline"

    def save(self, state: Dict[str, Any], iteration: int) -> SaveHandle:
        request, saved, details = self._request(state, iteration)

        def wait() -> None:
            w0 = time.perf_counter()
            request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)
            w1 = time.perf_counter()
            for fn in request.finalize_fns:
                fn()
            details["writer_s"] = w1 - w0
            details["finalize_find_latest_s"] = time.perf_counter() - w1

        return SaveHandle(wait, saved_bytes=saved, details=details)
