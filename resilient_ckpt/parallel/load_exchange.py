"""Filling a template from a checkpoint: the fully-parallel load exchange and the fill.

``MCoreTensorAwareStateDict.to_state_dict`` is :func:`load_into` on what the checkpoint holds
(:class:`HeldCheckpoint`). With ``fully_parallel``, the shards a rank needs but does not hold
come from the ranks of the parallelization group that do: one metadata all-gather (over the
world when validating integrity, else over the group) gives every rank the same facts, the
verdict (:func:`.load_checks.load_verdict`: strictness, missing keys, absent shards) is raised
on every rank together before anything moves, then the exchange (:mod:`.exchange`) moves only
the needed shards, and :mod:`.fill` writes everything into the template. A template of the
checkpoint's own structure on every rank (``same_structure``) skips the verdict: only the
shards ranks lack are looked up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from ..errors import ValidationError
from ..model import codec
from ..model.mapping import ShardedObject, ShardId, dtype_name, owned_shard_id
from ..model.nested import fill_holes, map_leaves, merge
from ..model.validation import StrictHandling, parse_strict_flag
from . import collectives
from .exchange import ExchangePlan, execute_exchange, plan_exchange
from .exchange import check_algo as check_exchange_algo
from .fill import allocator, fill_template
from .load_checks import (
    LoadRequest,
    absent_error,
    gather_facts,
    load_facts,
    load_verdict,
    raise_absent,
    raise_first_error,
)
from .sharded_planning import plan_exchange_sharded, use_sharded_planning
from .template import prepare_template

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldCheckpoint:
    """What one rank's checkpoint gives a load."""

    common: Dict[str, Any]
    held: Dict[Any, torch.Tensor]  # shard id -> tensor (its own, and replicas it serves)
    objects: Dict[Any, ShardedObject]  # object id -> ShardedObject
    keys: Set[str]  # every key the checkpoint has (tensors and objects)
    device: torch.device  # where its tensors are (received shards land there too)
    #: shard ids this rank's checkpoint holds as its own copy of a rank-local shard: the
    #: exchange looks them up as ``owned_shard_id(sid, rank)`` (its own copy, wherever it is)
    rank_local: FrozenSet[ShardId] = frozenset()
    rank: int = 0  # the checkpoint's owner (world rank)


ALGOS = ("atomic", "fully_parallel")


def check_algo(algo: str) -> bool:
    """Whether ``algo`` (``from_state_dict`` / ``to_state_dict``'s) is the fully parallel one."""
    if algo not in ALGOS:
        raise ValidationError(f"unknown algo {algo!r}; use 'atomic' or 'fully_parallel'")
    return algo == "fully_parallel"


@dataclass(frozen=True)
class LoadOptions:
    algo: str
    exchange_algo: str
    validate_access_integrity: bool
    strict: Any
    return_mismatch_keys: bool
    load_into_template: bool
    same_structure: bool
    #: with ``same_structure``: every rank holds all it needs (agreed by the caller)
    held_everywhere: bool = False


def load_into(
    ckpt: HeldCheckpoint,
    template: Any,
    opts: LoadOptions,
    group: Optional[dist.ProcessGroup],
    validation_group: Optional[dist.ProcessGroup],
):
    """The template filled from ``ckpt`` (collective over ``group``; see the module doc)."""
    n = collectives.group_size(group)
    me = collectives.group_rank(group)
    if opts.same_structure and opts.algo == "fully_parallel":
        return _fill_same_structure(ckpt, template, opts, group, n)
    req, scope, members = _gather_load_facts(ckpt, template, opts, group, validation_group)
    result = map_leaves(lambda v: v, ckpt.common)
    merge(result, req.nonpersistent)
    if not any(g["requested"] for g in members):
        # Nothing requested anywhere (Megatron returns the common state for an empty
        # template): no exchange, no strictness verdict.
        result = fill_holes(result)
        return (result, set(), set()) if opts.return_mismatch_keys else result
    plan, ckpt_keys, unexpected, missing = load_verdict(
        scope, members, me, req.strict, req.fully_parallel, opts.validate_access_integrity, logger
    )
    # Objects the rank lacks come from a rank that holds them (small; msgpack codec).
    objects = _exchange_objects(members, req.held_objects, group, n, me, ckpt_keys)
    targets = req.targets
    loaded = dict(req.held)
    if n > 1:
        loaded.update(
            execute_exchange(plan, req.held, allocator(targets, ckpt.device), group, req.exchange_algo)
        )
    _own_copies(loaded, req)
    merge(result, fill_template(req, loaded, targets, objects, unexpected))
    result = fill_holes(result)
    if req.strict == StrictHandling.IGNORE_ALL:
        missing, unexpected = set(), set()
    elif req.strict == StrictHandling.ASSUME_OK_UNEXPECTED:
        missing = set()
    return (result, missing, unexpected) if opts.return_mismatch_keys else result


def _fill_same_structure(ckpt: HeldCheckpoint, template, opts: LoadOptions, group, n: int):
    """:func:`load_into` for a template of this checkpoint's own structure on every rank: only
    the shards ranks lack are looked up — one gather of them and (only if any) one of who holds
    them; from SHARDED_PLANNING_MIN_WORLD ranks, planned by key instead
    (``plan_exchange_sharded``: each rank's traffic is its own needs and holdings)."""
    if opts.held_everywhere:
        req, plan = _prepare_load(ckpt, template, opts), ExchangePlan((), {})
        exchange_algo = req.exchange_algo
        if req.lacking:  # the caller's agreement says otherwise: a bug, not a user error
            lacking = [st.shard_id for st in req.lacking_shards()[:4]]
            raise AssertionError(f"held_everywhere, but this rank lacks shards {lacking}")
    elif use_sharded_planning(n):
        req, plan = _plan_same_structure_sharded(ckpt, template, opts, group)
        exchange_algo = "p2p"  # each rank knows its own transfers only
    else:
        req, plan = _plan_same_structure_gathered(ckpt, template, opts, group, n)
        exchange_algo = req.exchange_algo
    targets = req.targets
    loaded = dict(req.held)
    if plan.transfers:
        loaded.update(execute_exchange(plan, req.held, allocator(targets, ckpt.device), group, exchange_algo))
    _own_copies(loaded, req)
    result = map_leaves(lambda v: v, ckpt.common)
    merge(result, req.nonpersistent)
    merge(result, fill_template(req, loaded, targets, {}, set()))
    result = fill_holes(result)
    return (result, set(), set()) if opts.return_mismatch_keys else result


def _prepare_or_fail_together(ckpt, template, opts, group) -> LoadRequest:
    local_exc: Optional[BaseException] = None
    req = None
    try:
        req = _prepare_load(ckpt, template, opts)
    except Exception as e:  # reported to every rank below
        local_exc = e
    collectives.gather_or_fail(None, local_exc, "preparing the restore", group)
    assert req is not None
    return req


def _plan_same_structure_sharded(ckpt, template, opts, group):
    req = _prepare_or_fail_together(ckpt, template, opts, group)
    held = req.held
    need = [(st.key, st.global_offset) for st in req.lacking_shards()]
    holdings = [(sid[0], sid[1], dtype_name(t.dtype), tuple(t.shape)) for sid, t in held.items()]
    plan, first_absent = plan_exchange_sharded(need, holdings, group)
    if first_absent is not None:
        dst, sid = first_absent
        raise absent_error(collectives.global_rank(group, dst), sid)
    return req, plan


def _plan_same_structure_gathered(ckpt, template, opts, group, n):
    local_exc: Optional[BaseException] = None
    req: Optional[LoadRequest] = None
    facts: Dict[str, Any] = {"rank": collectives.world_rank(), "error": None, "need": [], "held": []}
    try:
        req = _prepare_load(ckpt, template, opts)
        facts["need"] = [[st.key, list(st.global_offset)] for st in req.lacking_shards()]
    except Exception as e:  # reported to every rank below
        local_exc = e
        facts["error"] = f"{type(e).__name__}: {e}"
    members = collectives.all_gather_msgpack(facts, group) if n > 1 else [facts]
    raise_first_error(members, local_exc)
    assert req is not None
    wanted = {(key, tuple(off)) for g in members for key, off in g["need"]}
    plan = ExchangePlan((), {})
    if wanted:
        held_wanted = [
            [sid[0], list(sid[1]), dtype_name(t.dtype), list(t.shape)]
            for sid, t in req.held.items()
            if sid in wanted
        ]
        holders = collectives.all_gather_msgpack(held_wanted, group) if n > 1 else [held_wanted]
        plan, absent = plan_exchange([{"need": g["need"], "held": h} for g, h in zip(members, holders)])
        raise_absent(absent, members, None)
    return req, plan


def _gather_load_facts(ckpt, template, opts, group, validation_group):
    """Local preparation, then the one metadata all-gather. A local error is not raised here
    but travels with the gather, so every rank raises together instead of leaving peers in a
    collective. Returns (this rank's request, the scope's facts, the group's)."""
    local_exc: Optional[BaseException] = None
    req: Optional[LoadRequest] = None
    facts: Dict[str, Any] = {
        "rank": collectives.world_rank(),
        "error": None,
        **load_facts((), (), (), (), (), False),
    }
    try:
        req = _prepare_load(ckpt, template, opts)
        facts.update(req.facts(opts.validate_access_integrity))
    except Exception as e:  # reported to every rank below
        local_exc = e
        facts["error"] = f"{type(e).__name__}: {e}"
    scope, members = gather_facts(
        facts, group, world_scope=opts.validate_access_integrity, scope_group=validation_group
    )
    raise_first_error(scope, local_exc)
    assert req is not None
    return req, scope, members


def _prepare_load(ckpt: HeldCheckpoint, template, opts: LoadOptions) -> LoadRequest:
    """The local half of a load (no collective): parse the arguments and the template, list
    what this rank holds. Raises on a bad argument or a local shape mismatch."""
    fully_parallel = check_algo(opts.algo)
    exchange_algo = check_exchange_algo(opts.exchange_algo)
    strict = parse_strict_flag(opts.strict)
    prepared = prepare_template(template)
    req = LoadRequest(
        prepared.sharded,
        prepared.nonpersistent,
        prepared.factories,
        prepared.shards,
        prepared.objects,
        dict(ckpt.held),
        ckpt.objects,
        set(ckpt.keys),
        fully_parallel,
        exchange_algo,
        strict,
        prepared.targets() if opts.load_into_template else {},
        prepared.structure[0] if prepared.structure is not None else None,
        rank_local=ckpt.rank_local,
        rank=ckpt.rank,
    )
    req.lacking = _check_local_shapes(req)
    return req


def _check_local_shapes(req: LoadRequest) -> List[int]:
    """Raise if a held tensor has another dtype or shape than its template shard asks for. A
    held tensor that *is* the shard's target was read into it in place: ``shard_targets``
    checked it already. Returns the indexes of the shards not held (the same pass); a
    rank-local shard counts as held only as this rank's own copy."""
    lacking: List[int] = []
    held, targets, rank_local = req.held, req.targets, req.rank_local
    for i, st in enumerate(req.template_shards):
        sid = st.shard_id
        t = held.get(owned_shard_id(sid, req.rank) if sid in rank_local else sid)
        if t is None:
            lacking.append(i)
            continue
        if t is st.data and targets.get(sid) is t:
            continue
        if t.dtype != st.dtype:
            raise ValidationError(
                f"{st.key!r} at offset {st.global_offset}: checkpoint has dtype {t.dtype}, the "
                f"state dict asks for {st.dtype}"
            )
        if tuple(t.shape) != st.local_shape and not st.allow_shape_mismatch:
            raise ValidationError(
                f"{st.key!r} at offset {st.global_offset}: checkpoint has shape "
                f"{tuple(t.shape)}, the state dict asks for {st.local_shape} (set "
                "allow_shape_mismatch=True to accept the stored shape)"
            )
    return lacking


def _own_copies(loaded: Dict[Any, torch.Tensor], req: LoadRequest) -> None:
    """The rank-local shards this rank received (or held) as its own copy, under their plain
    ids for the fill (a plain id held may be another rank's copy)."""
    for sid in req.rank_local:
        t = loaded.get(owned_shard_id(sid, req.rank))
        if t is not None:
            loaded[sid] = t


def _exchange_objects(members, held_objects, group, n: int, me: int, ckpt_keys) -> Dict[Tuple, Any]:
    """The ShardedObjects this rank's template asks for and some rank holds: one all-gather
    of the encoded objects (an unencodable one fails every rank together)."""
    # Objects of keys no checkpoint has are unexpected keys: strictness handled them.
    wanted = set()
    for g in members:
        for key, off, shape in g["need_obj"]:
            if key in ckpt_keys:
                wanted.add((key, tuple(off), tuple(shape)))
    if not wanted:
        return {}
    holders: Dict[Tuple, int] = {}
    for r, g in enumerate(members):
        for key, off, shape in g["held_obj"]:
            holders.setdefault((key, tuple(off), tuple(shape)), r)
    # (Every wanted object has a holder: load_verdict checked it.)
    mine = {oid: held_objects[oid].data for oid, r in holders.items() if r == me and oid in wanted}
    # An unencodable object must not leave the other ranks waiting: the error travels in the
    # gathered bytes (first byte 1) and every rank raises.
    local_exc = None
    try:
        payload = b"\x00" + codec.encode(
            [[[oid[0], list(oid[1]), list(oid[2])], v] for oid, v in mine.items()]
        )
    except Exception as e:
        local_exc = e
        payload = b"\x01" + f"{type(e).__name__}: {e}".encode("utf-8", "replace")
    blobs = collectives.all_gather_bytes(payload, group) if n > 1 else [payload]
    failed = [(r, b[1:].decode("utf-8", "replace")) for r, b in enumerate(blobs) if b[:1] == b"\x01"]
    if failed:
        if local_exc is not None:
            raise local_exc
        r, msg = failed[0]
        raise ValidationError(
            f"rank {members[r]['rank']} could not send its ShardedObjects, so every rank stops: {msg}"
        )
    out = {}
    for blob in blobs:
        for (key, off, shape), v in codec.decode(memoryview(blob)[1:]):
            out[(key, tuple(off), tuple(shape))] = v
    return out
