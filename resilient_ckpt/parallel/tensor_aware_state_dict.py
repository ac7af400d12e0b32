"""``MCoreTensorAwareStateDict``: the checkpoint unit handed to managers and stores.

Same public API and defaults as Megatron-core's class of that name (so Megatron-LM and
nvidia-resiliency-ext's ``LocalCheckpointManager`` accept it), with these differences:

- device bookkeeping is explicit state (``_devices``), not attributes patched onto tensors;
- the hollow form is small and serializes with msgpack (:meth:`to_bytes`), no pickle;
- ``to_state_dict`` plans the load exchange from what ranks actually hold, moves only needed
  shards, drops unexpected keys when ``strict`` says so (Megatron asserts or hangs), and fails
  on every rank together instead of leaving peers blocked in a collective;
- ``from_state_dict`` works on shallow copies of the caller's ShardedTensors (Megatron sets
  their ``data`` to None), so the same sharded state dict can be saved again.

Its collaborators: :mod:`.template` (a state dict or template taken apart), :mod:`.snapshot`
(the cached save's one walk), :mod:`.hollow` (the hollow bytes), :mod:`.load_checks` (the
gathered load verdict, :func:`~.load_checks.check_restorable`), :mod:`.load_exchange`
(``to_state_dict``: the fully-parallel load exchange and the fill, on what the checkpoint
holds) and :mod:`.fill` (writing the restored data into the template).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict

from ..bits import bits, copy_bits
from ..errors import HollowStateError, ValidationError
from ..model import codec, shard_table
from ..model.mapping import ShardedObject, ShardedTensor, dtype_name, owned_shard_id
from ..model.mapping import adapt as _adapt_leaf
from ..model.nested import map_leaves
from ..model.validation import (
    StrictHandling,
    object_record,
    shard_record,
    validate_sharding_integrity,
)
from . import collectives
from .distribution import (
    ShardDistribution,
    check_cached,
    compute_distribution,
    fingerprint_records,
)
from .hollow import HOLLOW_FORMAT, HollowEncoding, encode_hollow, hollow_parts, tree_from_skeleton
from .load_checks import gather_facts, raise_first_error
from .load_exchange import HeldCheckpoint, LoadOptions, check_algo, load_into
from .sharded_planning import plan_sharded, use_sharded_planning
from .snapshot import SnapshotParts, from_parts
from .template import preprocess, sharded_leaves, sharded_objects, sharded_tensors

logger = logging.getLogger(__name__)


def _check_not_meta(shards: Sequence[ShardedTensor]) -> None:
    for sh in shards:
        if sh.data is not None and sh.data.is_meta:
            raise ValidationError(
                f"ShardedTensor {sh.key!r} at offset {sh.global_offset} has meta data (no "
                "values); materialize the tensor before saving"
            )


def _drop_unsaved(shards: Sequence[ShardedTensor], distribution: ShardDistribution, me: int) -> None:
    """Keep the shards this rank saves: those the distribution gave it, and its rank-local ones
    (every holder saves its own copy: deduplicating them would restore one rank's value on all)."""
    for sh in shards:
        if not sh.rank_local and distribution.main_rank_for_shard[sh.shard_id] != me:
            sh.data = None


def _plan_gathered(shards, objects, group, validation_group, local_exc) -> Optional[ShardDistribution]:
    """One all-gather carries everything (integrity records, object records, structure
    fingerprint) and any local error, so a bad state dict on one rank fails every rank
    instead of leaving the others blocked in a collective; every rank checks every record and
    computes the group's distribution from the same data."""
    payload = {"rank": collectives.world_rank(), "error": None, "shards": [], "objects": [], "fp": ""}
    if local_exc is None:
        try:
            records = [shard_record(sh) for sh in shards]  # made once: sent and digested
            payload["shards"] = [list(r) for r in records]
            payload["objects"] = [list(object_record(o)) for o in objects]
            payload["fp"] = fingerprint_records(records)
        except Exception as e:  # reported to every rank below
            local_exc = e
    if local_exc is not None:
        payload["error"] = f"{type(local_exc).__name__}: {local_exc}"
    everyone, members = gather_facts(payload, group, world_scope=True, scope_group=validation_group)
    raise_first_error(everyone, local_exc)
    validate_sharding_integrity([g["shards"] for g in everyone], [g["objects"] for g in everyone])
    if collectives.group_size(group) > 1:
        return compute_distribution(shards, group, members)
    return None


@dataclass
class MCoreTensorAwareStateDict(TensorAwareStateDict):
    """Common state + sharded state, with this rank's saved tensors tracked explicitly."""

    common: Dict[str, Any]
    sharded_state_dict: Dict[str, Any]
    _is_hollow: bool = False
    #: for each ShardedTensor of ``sharded_state_dict`` (nested order): does this rank save it
    _saved: Tuple[bool, ...] = field(default=None)  # type: ignore[assignment]
    #: per saved tensor: the device type to restore it to, when its data lives elsewhere (or is
    #: popped). The type, not the index: a restarted process, or a peer holding the replica,
    #: restores onto its own current device (as Megatron-core and nvidia-resiliency-ext do).
    _devices: List[Optional[str]] = field(default=None)  # type: ignore[assignment]
    #: per saved tensor: data is already a private copy (copy_tensors_to_cpu need not clone)
    _private: List[bool] = field(default=None)  # type: ignore[assignment]
    #: (the tree it was listed from, its ShardedTensors in nested order): listing 50k leaves
    #: costs tens of ms, and a save or restore asks for them many times
    _listed: Optional[Tuple[Any, List[ShardedTensor]]] = field(default=None, repr=False, compare=False)
    #: (tree, (skeleton, shard rows)) as decoded by from_bytes: what the same-structure check
    #: compares a template with, without walking the tree again
    _decoded_structure: Optional[Tuple[Any, Tuple[Any, Any]]] = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        sts = self._all_sharded_tensors()
        if self._saved is None:
            self._saved = tuple(st.data is not None for st in sts)
        elif len(self._saved) != len(sts):
            raise ValidationError(f"saved mask has {len(self._saved)} entries for {len(sts)} sharded tensors")
        n = sum(self._saved)
        if self._devices is None:
            self._devices = [None] * n
        if self._private is None:
            self._private = [False] * n
        if len(self._devices) != n or len(self._private) != n:
            raise ValidationError(
                f"device bookkeeping has {len(self._devices)} entries for {n} saved tensors"
            )

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def from_state_dict(
        cls,
        sharded_state_dict: Dict[str, Any],
        algo: str = "fully_parallel",
        parallelization_group: Optional[dist.ProcessGroup] = None,
        cached_metadata: Optional[ShardDistribution] = None,
        *,
        validation_group: Optional[dist.ProcessGroup] = None,
        parts: Optional[SnapshotParts] = None,
        preprocessed: Optional[Tuple[Any, Any, Any, Any]] = None,
    ) -> Tuple["MCoreTensorAwareStateDict", Optional[ShardDistribution]]:
        """Split common/sharded state; with ``fully_parallel`` keep only the shards this rank
        saves (balanced across ``parallelization_group``).

        Without ``cached_metadata`` this is one all-gather over the whole world (integrity is
        validated job-wide, as Megatron does; the group's distribution is computed from the
        same data) and every rank raises together on a bad state dict. With
        ``cached_metadata`` (the distribution an earlier call returned) there is no collective.
        The caller's ShardedTensors are never modified. ``validation_group`` (our extension): a
        group of every rank, in global-rank order, for the job-wide gather instead of the world
        group (a checkpoint manager passes its own, so a stuck peer surfaces after the
        manager's timeout and the job's own groups are never used). ``parts`` (our extension):
        :func:`snapshot_parts` of ``sharded_state_dict``, when the caller has them: the tree is
        then rebuilt from them instead of walked again; ``preprocessed``: its
        :func:`preprocess`, when the caller made it (a state dict that is not plain)."""
        fully_parallel = check_algo(algo)
        group = collectives.default_group(parallelization_group)
        n = collectives.group_size(group)
        distribution = None
        if cached_metadata is not None:
            return cls.from_validated(
                preprocessed or preprocess(sharded_state_dict),
                cached_metadata if fully_parallel else None,
                group,
            )

        local_exc: Optional[BaseException] = None
        sharded = common = None
        shards: List[ShardedTensor] = []
        objects: List[ShardedObject] = []
        try:
            if parts is not None:
                sharded, common, shards, objects = from_parts(parts)
            else:
                sharded, common, _nonpersistent, _factories = preprocessed or preprocess(sharded_state_dict)
                shards, objects = sharded_leaves(sharded)
            _check_not_meta(shards)
        except Exception as e:  # reported to every rank by the planning collectives
            local_exc = e
        # Integrity is a property of the whole job (Megatron checks it over the world): a
        # data-parallel subgroup only sees part of each tensor-parallel tensor.
        scope = collectives.default_group(validation_group)
        if scope is not None and use_sharded_planning(collectives.group_size(scope)):
            # Thousands of ranks: each rank plans some keys (parallel/sharded_planning.py).
            distribution = plan_sharded(shards, objects, group, scope, local_exc)
        else:
            distribution = _plan_gathered(shards, objects, group, validation_group, local_exc)
        if not (fully_parallel and n > 1):
            distribution = None  # validated; nothing to deduplicate
        if distribution is not None:
            _drop_unsaved(shards, distribution, collectives.group_rank(group))
        return cls(common=common, sharded_state_dict=sharded, _listed=(sharded, shards)), distribution

    @classmethod
    def from_validated(
        cls,
        preprocessed: Tuple[Any, Any, Any, Any],
        distribution: Optional[ShardDistribution],
        group: Optional[dist.ProcessGroup],
    ) -> Tuple["MCoreTensorAwareStateDict", Optional[ShardDistribution]]:
        """:meth:`from_state_dict` without a collective, for a structure whose integrity and
        ``distribution`` (None: nothing to deduplicate) were established by an earlier call:
        ``preprocessed`` is :func:`preprocess` of the state dict. Errors stay local, so the
        caller must know that every rank takes this path (a checkpoint manager votes on it)."""
        sharded, common, _nonpersistent, _factories = preprocessed
        shards = sharded_tensors(sharded)
        _check_not_meta(shards)
        n = collectives.group_size(group)
        if distribution is not None and n > 1:
            me = collectives.group_rank(group)
            check_cached(distribution, shards, me, n)
            _drop_unsaved(shards, distribution, me)
        else:
            distribution = None
        return cls(common=common, sharded_state_dict=sharded, _listed=(sharded, shards)), distribution

    # ---- tensor access -----------------------------------------------------------------

    @property
    def is_hollow(self) -> bool:
        return self._is_hollow

    def structure(self) -> Tuple[Any, List[tuple]]:
        """The sharded tree's skeleton and shard rows (as ``to_bytes`` stores them)."""
        known = self._decoded_structure
        if known is not None and known[0] is self.sharded_state_dict:
            return known[1]
        return hollow_parts(self.sharded_state_dict)[:2]

    def _all_sharded_tensors(self) -> List[ShardedTensor]:
        """The tree's ShardedTensors (listed again if ``sharded_state_dict`` was replaced)."""
        listed = self._listed
        if listed is None or listed[0] is not self.sharded_state_dict:
            listed = self._listed = (self.sharded_state_dict, sharded_tensors(self.sharded_state_dict))
        return listed[1]

    def _saved_sharded_tensors(self) -> List[ShardedTensor]:
        return [st for st, s in zip(self._all_sharded_tensors(), self._saved) if s]

    @property
    def tensors(self) -> Iterable[torch.Tensor]:
        if self._is_hollow:
            raise HollowStateError("state dict is hollow: its tensors were popped; insert_tensors() first")
        return [st.data for st in self._saved_sharded_tensors()]

    @property
    def common_state_dict(self) -> Dict[str, Any]:
        return self.common

    @property
    def tensor_metadata(self) -> List[ShardedTensor]:
        """The saved shards' metadata, in the order of :attr:`tensors`."""
        return self._saved_sharded_tensors()

    @classmethod
    def can_adapt(cls, tasd: Any) -> bool:
        """Ours, or shaped like Megatron-core's class (common state + a sharded state dict)."""
        return isinstance(tasd, cls) or all(
            hasattr(tasd, a) for a in ("common", "sharded_state_dict", "is_hollow")
        )

    @classmethod
    def adapt(cls, tasd: Any) -> "MCoreTensorAwareStateDict":
        """Ours, unchanged; or Megatron-core's ``MCoreTensorAwareStateDict`` (what Megatron-LM
        hands a local checkpoint manager) converted to ours: same common state, its ShardedTensors
        adapted, the shards it kept data for are the saved ones. Tensors are not copied."""
        if isinstance(tasd, cls):
            return tasd
        if not cls.can_adapt(tasd):
            raise ValidationError(
                f"expected a sharded state dict or an MCoreTensorAwareStateDict, got {type(tasd).__name__}"
            )
        if tasd.is_hollow:
            raise HollowStateError(
                f"{type(tasd).__name__} is hollow (its tensors were popped); insert them before saving"
            )
        sharded = map_leaves(_adapt_leaf, tasd.sharded_state_dict)
        return cls(common=tasd.common, sharded_state_dict=sharded)

    def holding_nothing(self) -> "MCoreTensorAwareStateDict":
        """The same structure and common state, holding no tensors: for a rank whose own saved
        shards are served by other ranks on load (its node was lost)."""
        sts = sharded_tensors(self.sharded_state_dict)
        for st in sts:
            st.data = None
        return MCoreTensorAwareStateDict(
            common=self.common,
            sharded_state_dict=self.sharded_state_dict,
            _is_hollow=False,
            _saved=tuple(False for _ in sts),
        )

    @property
    def pending_devices(self) -> List[Optional[str]]:
        """Per saved tensor: the device type it returns to on ``restore_tensor_device`` (None:
        already there)."""
        return list(self._devices)

    def pop_tensors(self) -> List[torch.Tensor]:
        if self._is_hollow:
            raise HollowStateError("pop_tensors() on a hollow state dict: tensors were already popped")
        out = []
        for i, st in enumerate(self._saved_sharded_tensors()):
            out.append(st.data)
            if self._devices[i] is None:
                self._devices[i] = st.data.device.type
            st.data = None
        self._is_hollow = True
        return out

    def insert_tensors(
        self, tensor_data: Iterable[torch.Tensor], layouts: Optional[Sequence[Any]] = None
    ) -> None:
        """Put the saved shards' tensors back, checked against their metadata. ``layouts``
        (our extension): per tensor, the stored layout (``dtype`` name, ``shape``) it was made
        or read for — each shard is then checked against its layout in plain Python instead of
        asking each tensor (a restore of 50k tensors: torch attribute reads dominate)."""
        if not self._is_hollow:
            raise HollowStateError("insert_tensors() needs a hollow state dict; call pop_tensors() first")
        tensors = list(tensor_data)
        targets = self._saved_sharded_tensors()
        if len(tensors) != len(targets) or (layouts is not None and len(layouts) != len(targets)):
            raise ValidationError(
                f"insert_tensors() got {len(tensors)} tensors for {len(targets)} saved shards"
            )
        if layouts is not None:
            for st, lay in zip(targets, layouts):
                if lay.dtype != dtype_name(st.dtype) or lay.shape != st.local_shape:
                    raise ValidationError(
                        f"insert_tensors(): {st.key!r} at offset {st.global_offset} expects "
                        f"{st.dtype} {st.local_shape}, the stored tensor is {lay.dtype} {lay.shape}"
                    )
        else:
            for st, t in zip(targets, tensors):
                if not isinstance(t, torch.Tensor):
                    raise ValidationError(
                        f"insert_tensors(): {st.key!r} got a {type(t).__name__}, not a tensor"
                    )
                if t.dtype != st.dtype or tuple(t.shape) != st.local_shape:
                    raise ValidationError(
                        f"insert_tensors(): {st.key!r} at offset {st.global_offset} expects "
                        f"{st.dtype} {st.local_shape}, got {t.dtype} {tuple(t.shape)}"
                    )
        for i, (st, t) in enumerate(zip(targets, tensors)):
            st.data = t
            if self._devices[i] == ("cpu" if t.is_cpu else t.device.type):
                self._devices[i] = None
            # The caller may still use these tensors: copy_tensors_to_cpu must copy them.
            self._private[i] = False
        self._is_hollow = False

    def init_tensors(self) -> None:
        if not self._is_hollow:
            raise HollowStateError("init_tensors() needs a hollow state dict")
        for i, st in enumerate(self._saved_sharded_tensors()):
            st.init_data(self._devices[i] or "cpu")
            self._devices[i] = None
            self._private[i] = True
        self._is_hollow = False

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        if self._is_hollow:
            raise HollowStateError("copy_tensors_to_cpu() on a hollow state dict")
        for i, st in enumerate(self._saved_sharded_tensors()):
            t = st.data
            if t.device.type == "cpu":
                if not self._private[i]:
                    st.data = t.clone()
            else:
                if self._devices[i] is None:
                    self._devices[i] = t.device.type
                dst = torch.empty(
                    t.shape, dtype=t.dtype, pin_memory=non_blocking and torch.cuda.is_available()
                )
                st.data = copy_bits(dst, t.detach(), non_blocking=non_blocking)
            self._private[i] = True

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        if self._is_hollow:
            raise HollowStateError("restore_tensor_device() on a hollow state dict")
        for i, st in enumerate(self._saved_sharded_tensors()):
            dev = self._devices[i]
            if dev is not None:
                if st.data.device.type != dev:
                    st.data = bits(st.data).to(dev, non_blocking=non_blocking).view(st.data.dtype)
                self._devices[i] = None

    # ---- serialization of the hollow form ------------------------------------------------

    def to_bytes(self, allow_pickle: bool = False) -> bytes:
        """msgpack encoding of a hollow instance (metadata + common state; no tensor bytes).
        ``allow_pickle``: values the codec cannot encode are pickled (local data only).

        Format 2: the sharded tree is stored as a *skeleton* whose ShardedTensor leaves are
        their index in a shard table (:mod:`..model.shard_table`, packed in C) and whose
        ShardedObject leaves are ``-1 - j`` for the j-th object of ``objects`` (a sharded tree
        holds no other ints)."""
        return self.hollow_encoding(allow_pickle).meta

    def hollow_encoding(
        self,
        allow_pickle: bool = False,
        parts: Optional[SnapshotParts] = None,
        devices: Optional[Sequence[Optional[str]]] = None,
    ) -> "HollowEncoding":
        """:meth:`to_bytes` with the parts a cached save reuses. ``parts``: the
        :func:`snapshot_parts` this instance was built from (``from_state_dict(parts=...)``),
        whose skeleton and rows are this tree's: not derived again. With ``parts``, ``devices``
        (each saved tensor's device type, as :meth:`pop_tensors` records them) encodes the
        state dict as if popped, with its tensors left in place: the encoding reads the parts,
        never the tree (a save then pops and re-inserts nothing: 50k checks of each tensor)."""
        if devices is not None and parts is not None:
            if len(devices) != len(self._devices):
                raise ValidationError(f"{len(devices)} device types for {len(self._devices)} saved tensors")
            devices = [d if known is None else known for d, known in zip(devices, self._devices)]
        elif not self._is_hollow and any(self._saved):
            raise HollowStateError("to_bytes() needs a hollow state dict; call pop_tensors() first")
        else:
            devices = self._devices
        if parts is not None:
            skeleton, rows, objects = parts.skeleton, parts.rows, parts.objects
        else:
            skeleton, rows, objects = hollow_parts(self.sharded_state_dict)
        skeleton_bytes = codec.encode(skeleton)
        table_bytes = shard_table.encode_rows(rows)
        meta = encode_hollow(
            self.common, skeleton_bytes, table_bytes, objects, self.stored_mask, devices, allow_pickle
        )
        return HollowEncoding(meta, skeleton, rows, skeleton_bytes, table_bytes)

    @property
    def saved_mask(self) -> Tuple[bool, ...]:
        """Per ShardedTensor of the sharded tree (nested order): does this rank save it."""
        return self._saved

    @property
    def stored_mask(self) -> Tuple[int, ...]:
        """:attr:`saved_mask` as the hollow bytes store it: 0 not saved, 1 saved, 2 saved as
        this rank's own copy of a rank-local shard (read back as saved by any reader)."""
        return tuple(
            (2 if st.rank_local else 1) if s else 0 for st, s in zip(self._all_sharded_tensors(), self._saved)
        )

    @classmethod
    def from_bytes(cls, data: bytes, allow_pickle: bool = False) -> "MCoreTensorAwareStateDict":
        """Inverse of ``to_bytes``; pickled values only with ``allow_pickle`` (runs code).
        Reads format 1 (the whole sharded tree through the codec) too."""
        d = codec.decode(data, allow_pickle=allow_pickle)
        try:
            structure = None
            if d.get("format") == HOLLOW_FORMAT:
                rows, shards = shard_table.decode_table(d["shards"])
                objects = d["objects"]
                skeleton = codec.decode(d["skeleton"])
                sharded = tree_from_skeleton(skeleton, shards, objects)
                structure = (sharded, (skeleton, list(rows)))
            else:
                sharded = d["sharded"]
            inst = cls(
                common=d["common"],
                sharded_state_dict=sharded,
                _is_hollow=True,
                _saved=tuple(bool(s) for s in d["saved"]),
                _devices=list(d["devices"]),
                _decoded_structure=structure,
            )
            for st, s in zip(inst._all_sharded_tensors(), d["saved"]):
                if s == 2:
                    st.rank_local = True
        except (KeyError, TypeError, IndexError, AttributeError) as e:
            raise ValidationError(f"hollow state dict bytes lack field {e} or hold it damaged") from e
        return inst

    @staticmethod
    def saved_shard_ids_from_bytes(data: bytes, allow_pickle: bool = False) -> List[Any]:
        """The shard ids of the hollow ``data``'s saved tensors (:attr:`tensor_metadata`), in
        order, from the shard table's rows without rebuilding its tree or making a
        ShardedTensor: what a rank looking for its template's shards in another owner's copy
        needs."""
        d = codec.decode(data, allow_pickle=allow_pickle)
        if d.get("format") != HOLLOW_FORMAT:
            return [
                st.shard_id for st in MCoreTensorAwareStateDict.from_bytes(data, allow_pickle).tensor_metadata
            ]
        try:
            ids = shard_table.shard_ids(shard_table.decode_rows(d["shards"]))
            return [sid for sid, s in zip(ids, d["saved"]) if s]
        except (KeyError, TypeError) as e:
            raise ValidationError(f"hollow state dict bytes lack field {e} or hold it damaged") from e

    # ---- load ------------------------------------------------------------------------------

    def to_state_dict(
        self,
        sharded_state_dict: Dict[str, Any],
        algo: str = "atomic",
        exchange_algo: str = "broadcast",
        validate_access_integrity: bool = True,
        parallelization_group: Optional[dist.ProcessGroup] = None,
        strict: StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
        return_mismatch_keys: bool = False,
        *,
        load_into_template: bool = False,
        extra_held: Optional[Dict[Any, torch.Tensor]] = None,
        validation_group: Optional[dist.ProcessGroup] = None,
        same_structure: bool = False,
        held_everywhere: bool = False,
    ):
        """Fill ``sharded_state_dict`` (the template) with this checkpoint's data.

        ``load_into_template`` (our extension): where a template ShardedTensor has ``data`` of
        the stored dtype and shape, the bytes are written into it in place (received shards
        arrive there directly) and the result holds that tensor — no new allocation, which on
        restore is most of the cost (fresh pages), and the model is loaded as a side effect.
        ``extra_held`` (our extension): more shards this rank can serve, by shard id — e.g. the
        tensors of a lost rank's replica kept on this rank's node. ``validation_group`` (our
        extension): as for :meth:`from_state_dict`. ``same_structure`` (our extension, with
        ``fully_parallel``): :func:`check_restorable` returned ``SAME_STRUCTURE`` for this
        template on every rank, so keys, shapes, dtypes and objects match by construction and
        only the shards ranks lack are looked up (nothing travels when every rank has its own).
        ``held_everywhere`` (our extension, with ``same_structure``): the caller agreed with every
        rank that each holds every shard its template asks for — not even that lookup runs
        (no collective at all).

        With ``fully_parallel``, shards this rank did not save come from the ranks of
        ``parallelization_group`` that did. One metadata all-gather (over the world when
        ``validate_access_integrity``, else over the group), then the exchange within the group;
        every error found before the exchange is raised on all ranks together.
        """
        if self._is_hollow:
            raise HollowStateError("to_state_dict() on a hollow state dict; insert_tensors() first")
        return load_into(
            self.held(extra_held),
            sharded_state_dict,
            LoadOptions(
                algo=algo,
                exchange_algo=exchange_algo,
                validate_access_integrity=validate_access_integrity,
                strict=strict,
                return_mismatch_keys=return_mismatch_keys,
                load_into_template=load_into_template,
                same_structure=same_structure,
                held_everywhere=held_everywhere and same_structure,
            ),
            collectives.default_group(parallelization_group),
            validation_group,
        )

    def held(self, extra: Optional[Dict[Any, torch.Tensor]] = None) -> HeldCheckpoint:
        """What this checkpoint gives a load: its common state, the shards it holds by shard id
        (and ``extra`` ones, e.g. a lost rank's replica this rank serves), its objects, keys."""
        me = collectives.world_rank()
        held = {}
        for st in self._saved_sharded_tensors():
            held[st.shard_id] = st.data
            if st.rank_local:  # this rank's own copy, as the exchange asks for it
                held[owned_shard_id(st.shard_id, me)] = st.data
        for sid, t in (extra or {}).items():
            held.setdefault(sid, t)
        objects = {o.object_id: o for o in sharded_objects(self.sharded_state_dict)}
        sts = self._all_sharded_tensors()
        keys = {st.key for st in sts} | {o.key for o in objects.values()}
        device = next((st.data.device for st in self._saved_sharded_tensors()), torch.device("cpu"))
        own = frozenset(st.shard_id for st in sts if st.rank_local)
        return HeldCheckpoint(self.common, held, objects, keys, device, own, me)
