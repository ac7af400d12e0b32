"""Option groups of ``CheckpointManager``: one small frozen dataclass per concern.

``CheckpointManager(..., replication=ReplicationOptions(factor=2), persistent=PersistentOptions(
directory="/lustre/run7", flush_every=50), service=ServiceOptions(endpoint="tcp://..."))`` —
or today's flat keyword arguments, which keep working. :func:`resolve` merges both into one
:class:`ManagerOptions` and refuses a value given twice with two different meanings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Mapping, Optional

from ..errors import ValidationError
from ..memory.store import DEFAULT_ROOT
from ..replication.parity import check_parameters as check_parity_parameters

PLACEMENTS = ("ring", "clique")
REDUNDANCY = ("replicas", "parity")
MODES = ("embedded", "service")


@dataclass(frozen=True)
class ReplicationOptions:
    """Where copies of each rank's data go and how they travel."""

    #: copies of each rank's data (1 = no replication)
    factor: int = 2
    #: rank distance between copies (default: ranks per node, so copies land on other nodes)
    jump: Optional[int] = None
    #: ``"ring"`` (any world size) or ``"clique"`` (nvidia-resiliency-ext parity)
    placement: str = "ring"
    #: ranks per node (default: ``LOCAL_WORLD_SIZE``)
    ranks_per_node: Optional[int] = None
    #: backend of the checkpoint groups: gloo moves host-memory bytes without PCIe copies and
    #: without sharing NCCL resources with training; ``"nccl"`` bounces through the device
    backend: str = "gloo"
    #: ``"replicas"``: full copies (``factor``); ``"parity"``: erasure-coded parity groups of
    #: ``parity_group`` data members + ``parity_shares`` parity shares, one member per node
    #: (each rank stores parity_shares/parity_group of its own bytes; any parity_shares nodes
    #: of a group may be lost). Embedded mode only.
    redundancy: str = "replicas"
    #: k: data blocks per stripe (a group spans k + parity_shares nodes)
    parity_group: int = 4
    #: m: 1 (XOR) or 2 (Reed-Solomon, zfec)
    parity_shares: int = 1


@dataclass(frozen=True)
class PersistentOptions:
    """The persistent tier (torch.distributed.checkpoint on a shared file system)."""

    directory: Optional[str] = None
    #: flush every this many complete saves (0: only on demand or SIGTERM)
    flush_every: int = 0
    flush_on_sigterm: bool = False


@dataclass(frozen=True)
class ServiceOptions:
    """Service mode: this node's daemon owns the store and replicates."""

    #: e.g. ``tcp://127.0.0.1:7555`` (default: ``RESILIENT_CKPT_ENDPOINT``)
    endpoint: Optional[str] = None


@dataclass(frozen=True)
class ManagerOptions:
    """Everything a manager was configured with, resolved."""

    store_root: str = DEFAULT_ROOT
    keep_last: int = 1
    #: keep the next save's segment populated (GPU state: page-locked) between saves
    spare_segment: bool = True
    #: stage GPU tensors through a copy within the GPU first: "auto" (when no page-locked
    #: segment is ready and the GPU has room), "always", "never"
    device_snapshot: str = "auto"
    #: nice levels below the training thread for a save's background threads (0: the same)
    background_nice: int = 0
    memory_budget: Optional[int] = None
    timeout_s: float = 120.0
    exchange_algo: str = "p2p"
    fault_hook: Optional[Callable[[str], None]] = None
    allow_pickle: bool = False
    mode: str = "embedded"
    replication: ReplicationOptions = ReplicationOptions()
    persistent: PersistentOptions = PersistentOptions()
    service: ServiceOptions = ServiceOptions()


#: flat keyword argument -> (group, field) it stands for
FLAT = {
    "replication_factor": ("replication", "factor"),
    "replication_jump": ("replication", "jump"),
    "placement": ("replication", "placement"),
    "ranks_per_node": ("replication", "ranks_per_node"),
    "replication_backend": ("replication", "backend"),
    "redundancy": ("replication", "redundancy"),
    "parity_group": ("replication", "parity_group"),
    "parity_shares": ("replication", "parity_shares"),
    "persistent_dir": ("persistent", "directory"),
    "flush_every": ("persistent", "flush_every"),
    "flush_on_sigterm": ("persistent", "flush_on_sigterm"),
    "endpoint": ("service", "endpoint"),
}


def resolve(
    flat: Mapping[str, Any],
    replication: Optional[ReplicationOptions] = None,
    persistent: Optional[PersistentOptions] = None,
    service: Optional[ServiceOptions] = None,
    mode: Optional[str] = None,
    **plain: Any,
) -> ManagerOptions:
    """Merge option groups with the flat keyword arguments. A flat argument left at its
    default (the group field's default) defers to its group; one that contradicts its
    group's value raises, naming both."""
    defaults = {
        "replication": ReplicationOptions(),
        "persistent": PersistentOptions(),
        "service": ServiceOptions(),
    }
    groups: Dict[str, Any] = {
        "replication": replication or ReplicationOptions(),
        "persistent": persistent or PersistentOptions(),
        "service": service or ServiceOptions(),
    }
    given = {"replication": replication, "persistent": persistent, "service": service}
    for name, value in flat.items():
        group, field = FLAT[name]
        if value == getattr(defaults[group], field):
            continue
        current = getattr(groups[group], field)
        if given[group] is not None and current != value:
            raise ValidationError(
                f"{name}={value!r} contradicts {type(groups[group]).__name__}({field}="
                f"{current!r}); pass it in one place only"
            )
        groups[group] = replace(groups[group], **{field: value})
    opts = ManagerOptions(mode=_mode(mode, groups["service"]), **plain, **groups)
    _check(opts)
    return opts


def _mode(mode: Optional[str], service: ServiceOptions) -> str:
    if mode is not None and mode not in MODES:
        raise ValidationError(f"mode must be 'embedded' or 'service', got {mode!r}")
    return mode or ("service" if service.endpoint else "embedded")


DEVICE_SNAPSHOT = ("auto", "always", "never")


def _check(opts: ManagerOptions) -> None:
    if opts.keep_last < 1:
        raise ValidationError(f"keep_last must be >= 1, got {opts.keep_last}")
    nice = opts.background_nice
    if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
        raise ValidationError(
            f"background_nice must be an int from 0 (the training thread's priority) to 19 "
            f"(the lowest), got {nice!r}"
        )
    if opts.device_snapshot not in DEVICE_SNAPSHOT:
        raise ValidationError(
            f"device_snapshot must be one of {DEVICE_SNAPSHOT}, got {opts.device_snapshot!r}"
        )
    if opts.replication.placement not in PLACEMENTS:
        raise ValidationError(f"placement must be 'ring' or 'clique', got {opts.replication.placement!r}")
    rep = opts.replication
    if rep.redundancy not in REDUNDANCY:
        raise ValidationError(f"redundancy must be 'replicas' or 'parity', got {rep.redundancy!r}")
    if rep.redundancy == "parity":
        check_parity_parameters(rep.parity_group, rep.parity_shares)
        if rep.factor != ReplicationOptions.factor:
            raise ValidationError(
                f"replication_factor={rep.factor} and redundancy='parity' are two redundancy schemes; "
                "pass one: parity_group/parity_shares for parity, or redundancy='replicas'"
            )
        if opts.mode == "service":
            raise ValidationError(
                "redundancy='parity' is embedded-mode only: the node daemon stores and serves full "
                "replicas. Use mode='embedded' (no endpoint) for parity, or redundancy='replicas' "
                "with the daemon"
            )


def service_endpoint(opts: ManagerOptions) -> str:
    """The daemon endpoint service mode talks to (explicit, else the environment)."""
    endpoint = opts.service.endpoint or os.environ.get("RESILIENT_CKPT_ENDPOINT")
    if not endpoint:
        raise ValidationError(
            "service mode needs the node daemon's endpoint: pass endpoint='tcp://HOST:PORT' "
            "or set RESILIENT_CKPT_ENDPOINT (start it with `resilient-ckpt serve`)"
        )
    return endpoint


def ranks_per_node(opts: ManagerOptions) -> Optional[int]:
    return opts.replication.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or None


__all__ = [
    "ManagerOptions",
    "PersistentOptions",
    "ReplicationOptions",
    "ServiceOptions",
    "resolve",
]
