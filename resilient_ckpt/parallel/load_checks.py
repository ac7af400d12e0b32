"""The checks of a load, decided from gathered facts so every rank reaches the same verdict.

Each rank prepares its side locally (:class:`LoadRequest`: the template's shards and objects,
what it holds) and contributes :func:`load_facts` to one all-gather (:func:`gather_facts`;
a rank's local error travels in it and every rank raises: :func:`raise_first_error`; the
first save's records travel the same way). :func:`load_verdict` then decides, identically on
every rank, template integrity, shards nobody saved, atomic holdings, dtype and shape of what
arrives, strictness and ShardedObjects nobody saved, and plans the exchange.
:func:`check_restorable` runs the same verdict before any byte of a restore is written (or,
when every rank's template has its own checkpoint's structure, one all-reduce instead).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist

from ..errors import ValidationError
from ..model.mapping import ShardedObject, ShardedTensor, ShardId, dtype_name, owned_shard_id, plain_shard_id
from ..model.validation import (
    StrictHandling,
    apply_strictness,
    object_record,
    parse_strict_flag,
    shard_record,
    validate_sharding_integrity,
)
from . import collectives
from .exchange import plan_exchange
from .hollow import hollow_parts
from .template import PreparedTemplate, prepare_template, sharded_leaves, sharded_objects


class SavedCheckpoint(Protocol):
    """What the checks read of a saved checkpoint's (hollow)
    :class:`~.tensor_aware_state_dict.MCoreTensorAwareStateDict`."""

    sharded_state_dict: Any

    @property
    def tensor_metadata(self) -> List[ShardedTensor]: ...

    def structure(self) -> Tuple[Any, List[tuple]]: ...


def gather_facts(payload: dict, group, world_scope: bool, scope_group=None) -> Tuple[List[dict], List[dict]]:
    """One all-gather of ``payload``: ``(scope, members)``.

    ``members`` are the payloads of ``group`` in group-rank order. With ``world_scope`` the
    gather runs over every rank of the job — on ``scope_group`` when given (a group of all
    ranks in global-rank order, e.g. a checkpoint manager's own), else the world group — and
    ``members`` is picked out of it, so validation sees every rank at the price of no extra
    collective.
    """
    if not dist.is_initialized():
        return [payload], [payload]
    n = collectives.group_size(group)
    if world_scope and (n != dist.get_world_size() or (scope_group is not None and scope_group is not group)):
        everyone = collectives.all_gather_msgpack(payload, scope_group)
        members = [everyone[collectives.global_rank(group, i)] for i in range(n)]
        return everyone, members
    if n == 1:
        return [payload], [payload]
    gathered = collectives.all_gather_msgpack(payload, group)
    return gathered, gathered


def raise_first_error(gathered: Sequence[dict], local_exc: Optional[BaseException]) -> None:
    """Raise on every rank if any rank reported an error (its own exception where it has one)."""
    errors = [(g["rank"], g["error"]) for g in gathered if g["error"]]
    if not errors:
        return
    if local_exc is not None:
        raise local_exc
    r, msg = errors[0]
    more = f" (and {len(errors) - 1} other rank(s))" if len(errors) > 1 else ""
    raise ValidationError(f"rank {r}{more} failed, so every rank stops: {msg}")


def load_facts(
    template_shards, template_objects, held, held_objects, ckpt_keys, validate, need_all=False, needs=None
) -> dict:
    """What one rank contributes to a load's gathered verdict: the shards it holds
    (``(shard id, dtype name, shape)``), the template shards it needs from others (``need_all``:
    every template shard and object, so each is checked against what was saved; ``needs``:
    the shards it lacks, when the caller listed them), its objects, the checkpoint keys it
    knows, the keys it requests, and (``validate``) the template's records for the integrity
    check."""
    held_ids = set() if need_all else {sid for sid, _, _ in held}
    if need_all or needs is None:
        need_shards = [st for st in template_shards if st.shard_id not in held_ids]
    else:
        need_shards = needs
    held_oids = set() if need_all else {o.object_id for o in held_objects}
    facts = dict(
        held=[[sid[0], list(sid[1]), dtype, list(shape)] for sid, dtype, shape in held],
        need=[
            [
                st.key,
                list(st.global_offset),
                dtype_name(st.dtype),
                list(st.local_shape),
                st.allow_shape_mismatch,
            ]
            for st in need_shards
        ],
        need_obj=[
            [o.key, list(o.global_offset), list(o.global_shape)]
            for o in template_objects
            if o.object_id not in held_oids
        ],
        held_obj=[[o.key, list(o.global_offset), list(o.global_shape)] for o in held_objects],
        ckpt_keys=sorted(ckpt_keys),
        requested=sorted({st.key for st in template_shards} | {o.key for o in template_objects}),
        records=[],
        obj_records=[],
    )
    if validate:
        facts["records"] = [list(shard_record(st)) for st in template_shards]
        facts["obj_records"] = [list(object_record(o)) for o in template_objects]
    return facts


class RestoreCheck(enum.IntEnum):
    """What :func:`check_restorable` established (the same on every rank; falsy: nothing)."""

    UNCHECKED = 0  # some rank could not vouch: the load runs its own checks
    CHECKED = 1  # the full gathered check passed: the template's integrity is established
    SAME_STRUCTURE = 2  # every rank's template has its own checkpoint's structure


def check_restorable(
    template: Any,
    saved: Optional[Sequence[SavedCheckpoint]],
    group: Optional[dist.ProcessGroup],
    strict: StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
    validation_group: Optional[dist.ProcessGroup] = None,
    local_error: Optional[BaseException] = None,
    own: Optional[SavedCheckpoint] = None,
) -> RestoreCheck:
    """Decide, before any byte of a restore is written, whether :meth:`to_state_dict` into
    ``template`` will pass its checks (collective over ``group``; ``validation_group`` as for
    :meth:`MCoreTensorAwareStateDict.from_state_dict`).

    ``saved``: hollow state dicts of the checkpoints this rank vouches for; across the ranks
    every saved checkpoint of the iteration appears exactly once (which rank lists which does
    not matter: the checks depend on their union; None: this rank cannot vouch for its share,
    and every rank skips the checks, which then run inside the load). Every template shard counts as needed, so
    its dtype and shape are checked against what was saved. Raises on every rank together
    (a rank whose preparation failed passes ``local_error``). Returns whether the checks ran
    (the same on every rank): then the template's sharding integrity is established and
    ``to_state_dict`` into the same template may skip it (``validate_access_integrity=False``).

    ``own``: this rank's own saved checkpoint (hollow), when it has it. The usual restart
    restores into the structure it saved: if every rank's template has exactly its own
    checkpoint's structure (tree, every shard's and object's metadata), the save's checks
    (integrity validated job-wide at the first save of that structure) already cover it and
    one all-reduce decides, instead of gathering and checking every shard record."""
    group = collectives.default_group(group)
    local = {"rank": collectives.world_rank(), "error": None, "unknown": saved is None}
    saved = saved or []
    template = None if local_error is not None else _prepare_or_error(template)
    if isinstance(template, BaseException):
        local_error, template = template, None
    if _all_same_structure(template, own, validation_group, local_error):
        return RestoreCheck.SAME_STRUCTURE
    try:
        if local_error is not None:
            raise local_error
        strict = parse_strict_flag(strict)
        held = [
            (st.shard_id, dtype_name(st.dtype), tuple(st.local_shape))
            for h in saved
            for st in h.tensor_metadata
        ]
        objects: List[ShardedObject] = []
        keys = set()
        for h in saved:
            sts, objs = sharded_leaves(h.sharded_state_dict)
            objects += objs
            keys |= {st.key for st in sts}
        keys |= {o.key for o in objects}
        local.update(load_facts(template.shards, template.objects, held, objects, keys, True, need_all=True))
    except Exception as e:  # reported to every rank below
        local_error = e
        local["error"] = f"{type(e).__name__}: {e}"
    scope, members = gather_facts(local, group, world_scope=True, scope_group=validation_group)
    raise_first_error(scope, local_error)
    if any(g["unknown"] for g in scope) or not any(g["requested"] for g in members):
        return RestoreCheck.UNCHECKED
    load_verdict(scope, members, collectives.group_rank(group), strict, True, True, _SilentLog)
    return RestoreCheck.CHECKED


def _prepare_or_error(template: Any):
    try:
        return prepare_template(template)
    except Exception as e:  # travels with the next collective
        return e


def _all_same_structure(template, own, validation_group, local_error) -> bool:
    """Collective over every rank of the job (``validation_group`` or the world, as the full
    check's gather; one all-reduce, also with an error, which then travels in that gather):
    does every rank's template have its own checkpoint's structure?"""
    same = False
    if local_error is None and template is not None and own is not None:
        try:
            same = same_structure(template, own)
        except Exception:  # e.g. a template leaf the walk cannot take: the full check decides
            same = False
    scope = collectives.default_group(validation_group)
    return same if scope is None else collectives.all_agree(same, scope)


def same_structure(template: PreparedTemplate, saved: SavedCheckpoint) -> bool:
    t_skeleton, t_rows = template.structure or hollow_parts(template.sharded)[:2]
    s_skeleton, s_rows = saved.structure()
    return (
        t_rows == s_rows
        and t_skeleton == s_skeleton
        and [object_record(o) for o in template.objects]
        == [object_record(o) for o in sharded_objects(saved.sharded_state_dict)]
        and _str_keys_above_sharded(t_skeleton)
    )


def _str_keys_above_sharded(skeleton: Any) -> bool:
    # == treats 1, 1.0 and True alike: only str keys make the comparison exact.
    if isinstance(skeleton, dict):
        return all(type(k) is str and _str_keys_above_sharded(v) for k, v in skeleton.items())
    if isinstance(skeleton, list):
        return all(_str_keys_above_sharded(v) for v in skeleton)
    return True


def load_verdict(scope, members, me, strict, fully_parallel, validate_access_integrity, log):
    """Every check of a load, decided from gathered facts so every rank reaches the same
    verdict: template integrity, shards nobody saved, atomic holdings, dtype/shape of what
    arrives, strictness, ShardedObjects nobody saved. Raises ValidationError (or strictness's
    error) on every rank together; returns (exchange plan, checkpoint keys, this rank's
    unexpected keys, missing keys). Pure: used before any byte is written
    (:func:`check_restorable`) and by :meth:`MCoreTensorAwareStateDict.to_state_dict`."""
    if validate_access_integrity:
        validate_sharding_integrity([g["records"] for g in scope], [g["obj_records"] for g in scope])
    global_ckpt_keys = set().union(*(g["ckpt_keys"] for g in members))
    plan, absent_shards = plan_exchange(members)
    raise_absent(absent_shards, members, global_ckpt_keys)
    if not fully_parallel:
        # Atomic: a rank's checkpoint must hold every shard it asks for (the others are held
        # by another rank, or the check above would have failed).
        for g in members:
            absent = [x for x in g["need"] if x[0] in global_ckpt_keys]
            if absent:
                raise ValidationError(
                    f"rank {g['rank']}: shard {absent[0][0]!r} at offset {tuple(absent[0][1])} "
                    "is not in this rank's checkpoint; load with algo='fully_parallel' to "
                    "fetch it from the rank that saved it"
                )
    # Shards that will arrive from another rank must be what the template asks for.
    for g in members:
        for key, off, dtype, shape, mismatch_ok in g["need"]:
            spec = plan.specs.get((key, tuple(off)))
            if spec is None:
                continue
            if spec[0] != dtype or (tuple(spec[1]) != tuple(shape) and not mismatch_ok):
                raise ValidationError(
                    f"rank {g['rank']}: {key!r} at offset {tuple(off)}: checkpoint has "
                    f"{spec[0]} {tuple(spec[1])}, the state dict asks for {dtype} "
                    f"{tuple(shape)} (set allow_shape_mismatch=True to accept the stored shape)"
                )
    # Strictness is decided from gathered data, so every rank reaches the same verdict.
    # Megatron's definitions: unexpected = requested but absent from the checkpoint (per
    # rank); missing = in the checkpoint but requested by no rank (same on every rank).
    unexpected_by_rank = [set(g["requested"]) - global_ckpt_keys for g in members]
    mine_unexpected = unexpected_by_rank[me]
    missing = global_ckpt_keys - set().union(*(g["requested"] for g in members))
    check_missing = strict in (StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL)
    if not check_missing:
        missing = set()
    # Raise decisions use every rank's unexpected keys; logging reports this rank's own.
    apply_strictness(strict, missing, set().union(*unexpected_by_rank), _SilentLog)
    apply_strictness(strict, missing, mine_unexpected, log)
    _objects_nobody_saved(members, global_ckpt_keys)
    return plan, global_ckpt_keys, mine_unexpected, missing


def raise_absent(absent_shards, members, ckpt_keys) -> None:
    """Shards of keys the checkpoint has (``ckpt_keys``; None: every key), but at offsets
    nobody saved: a sharding mismatch, never silently skipped."""
    for r, sids in sorted(absent_shards.items()):
        bad = [s for s in sids if ckpt_keys is None or plain_shard_id(s)[0] in ckpt_keys]
        if bad:
            raise absent_error(members[r]["rank"], bad[0])


def absent_error(rank: int, sid) -> ValidationError:
    return ValidationError(
        f"rank {rank}: shard {sid[0]!r} at offset {sid[1]} is in no rank's checkpoint (parallel "
        "layout changed between save and load?); the layout at load must match the one at save"
    )


def _objects_nobody_saved(members, ckpt_keys) -> None:
    held = {(key, tuple(off), tuple(shape)) for g in members for key, off, shape in g["held_obj"]}
    nobody = sorted(
        (key, tuple(off), tuple(shape))
        for g in members
        for key, off, shape in g["need_obj"]
        if key in ckpt_keys and (key, tuple(off), tuple(shape)) not in held
    )
    if nobody:
        raise ValidationError(
            f"ShardedObject {nobody[0][0]!r} at offset {nobody[0][1]} with global shape "
            f"{nobody[0][2]} is in no rank's checkpoint; the layout at load must match the "
            "one at save"
        )


@dataclass
class LoadRequest:
    """One rank's side of a load, prepared locally before the gathered verdict."""

    sharded: Any  # the template's sharded part (a structural copy)
    nonpersistent: Any
    factories: Any
    template_shards: List[ShardedTensor]
    template_objects: List[ShardedObject]
    held: Dict[Any, torch.Tensor]  # shard id -> tensor this rank can serve
    held_objects: Dict[Any, ShardedObject]
    ckpt_keys: set
    fully_parallel: bool
    exchange_algo: str
    strict: StrictHandling
    #: the template tensors received shards land in (``template.ShardTargets``; empty unless
    #: the load fills the template in place)
    targets: Mapping[Any, torch.Tensor] = field(default_factory=dict)
    #: the sharded part's skeleton (ints index ``template_shards`` / ``template_objects``),
    #: when the template was taken apart in one walk: the fill builds the tree from it once
    skeleton: Optional[Any] = None
    #: indexes into ``template_shards`` of the shards this rank does not hold (found with the
    #: local checks, in the same pass)
    lacking: List[int] = field(default_factory=list)
    #: shard ids the rank's checkpoint holds as its own copy of a rank-local shard (its owner:
    #: ``rank``): asked for in the exchange as ``owned_shard_id(sid, rank)``
    rank_local: FrozenSet[ShardId] = frozenset()
    rank: int = 0

    def lacking_shards(self) -> List[ShardedTensor]:
        """The template shards this rank needs from others, as the exchange names them (a
        rank-local one as this rank's own copy: ``owned_shard_id``)."""
        out = [self.template_shards[i] for i in self.lacking]
        if self.rank_local:
            out = [
                replace(st, key=owned_shard_id(st.shard_id, self.rank)[0])
                if st.shard_id in self.rank_local
                else st
                for st in out
            ]
        return out

    def facts(self, validate: bool) -> dict:
        held = [(sid, dtype_name(t.dtype), tuple(t.shape)) for sid, t in self.held.items()]
        return load_facts(
            self.template_shards,
            self.template_objects,
            held,
            self.held_objects.values(),
            self.ckpt_keys,
            validate,
            needs=self.lacking_shards(),
        )


class _SilentLog:
    @staticmethod
    def warning(*_a, **_k):
        pass
