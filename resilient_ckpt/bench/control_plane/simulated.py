"""The control-plane benchmark's simulated part: W ranks' synthetic metadata (:class:`SimLayout`),
their all-gather payloads through the real encoder and the pure planning functions every rank
runs on them, per rank (:func:`run_simulated`); :data:`SIM_SAVE` / :data:`SIM_RESTORE` and
:func:`sim_totals` sum the rows."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence, Tuple

from .workload import FIRST_ITERATION, MIB, SESSION


@dataclass(frozen=True)
class SimLayout:
    """W ranks x S shards: TP-sharded parameters replicated over DP, optimizer state sharded
    over every rank, one ShardedObject per rank. The parallelization group is the world (the
    manager's default, and the largest planning problem)."""

    world: int
    shards: int
    tp: int = 8
    ranks_per_node: int = 8
    keep_last: int = 2
    replication_factor: int = 2

    @property
    def tp_size(self) -> int:
        return min(self.tp, self.world)

    def rows(self, i: int) -> int:
        return 16 + (i * 37) % 64

    def n_params(self) -> int:
        return self.shards // 2

    def entries(self, rank: int):
        """(key, offset, local shape, global shape, is_main) per shard of ``rank``."""
        tp = self.tp_size
        t, d = rank % tp, rank // tp
        out = []
        for i in range(self.shards):
            rows = self.rows(i)
            if i < self.n_params():
                out.append((f"decoder.{i}.weight", (t * rows, 0), (rows, 64), (tp * rows, 64), d == 0))
            else:
                out.append(
                    (f"optimizer.{i}.exp_avg", (rank * rows, 0), (rows, 64), (self.world * rows, 64), True)
                )
        return out

    def sharded_tensors(self, rank: int, data: bool = False):
        """Real ShardedTensors of ``rank`` (no data, or meta tensors), for checks and the
        per-rank local phases."""
        import torch

        from ...model.mapping import ShardedTensor

        tp = self.tp_size
        out = []
        for key, off, shape, gshape, _main in self.entries(rank):
            replica = (rank // tp) if key.startswith("decoder") else 0
            t = torch.empty(shape, dtype=torch.float32, device="meta") if data else None
            out.append(
                ShardedTensor(key, t, torch.float32, shape, gshape, off, (gshape[0] // shape[0], 1), replica)
            )
        return out

    def state_dict(self, rank: int, data: bool = False) -> Dict[str, Any]:
        from ...model.mapping import ShardedObject

        sts = self.sharded_tensors(rank, data)
        return {
            "model": {f"t{i}": st for i, st in enumerate(sts)},
            "rng_state": ShardedObject("rng_state", {"seed": rank}, (self.world,), (rank,)),
            "iteration": 0,
        }


def _records(lay: SimLayout, rank: int) -> List[list]:
    """shard_record() of every shard of ``rank``, as msgpack delivers it (lists)."""
    return [
        [key, list(off), list(shape), list(gshape), "float32", main, False]
        for key, off, shape, gshape, main in lay.entries(rank)
    ]


def _fingerprint_of(lay: SimLayout, rank: int) -> str:
    from ...parallel.distribution import fingerprint_records

    return fingerprint_records(
        (key, tuple(off), tuple(shape), tuple(g), "float32", main, False)
        for key, off, shape, g, main in lay.entries(rank)
    )


class _Rank:
    """One simulated rank's metadata in decoded form (what ``all_gather_msgpack`` returns for
    it on every rank). Lists are shared between payloads where the real ones are equal (the
    computations only read them)."""

    def __init__(self, lay: SimLayout, rank: int):
        self.rank = rank
        self.records = _records(lay, rank)
        self.obj = ["rng_state", [rank], [lay.world]]
        self.obj_record = ["rng_state", [rank], [lay.world], True]
        self.keys = sorted({r[0] for r in self.records} | {"rng_state"})
        self.fp = _fingerprint_of(lay, rank)
        self.held: List[list] = []
        self.need_all: List[list] = []
        self.need_rest: List[list] = []

    def dist_payload(self) -> dict:
        """What ``from_state_dict`` contributes to the world all-gather (first save)."""
        return {
            "rank": self.rank,
            "error": None,
            "shards": self.records,
            "objects": [self.obj_record],
            "fp": self.fp,
        }

    def set_saved(self, saved: set) -> None:
        self.held = [[r[0], r[1], "float32", r[2]] for r in self.records if (r[0], tuple(r[1])) in saved]
        self.need_all = [[r[0], r[1], "float32", r[2], False] for r in self.records]
        self.need_rest = [n for n in self.need_all if (n[0], tuple(n[1])) not in saved]

    def facts_payload(self, need_all: bool) -> dict:
        """What ``check_restorable`` (``need_all``) or ``to_state_dict`` contributes to its
        all-gather: :func:`load_checks.load_facts` with validation records (the
        manager validates in both)."""
        head: Dict[str, Any] = {"rank": self.rank, "error": None}
        if need_all:
            head["unknown"] = False
        return {
            **head,
            "held": self.held,
            "need": self.need_all if need_all else self.need_rest,
            "need_obj": [self.obj] if need_all else [],
            "held_obj": [self.obj],
            "ckpt_keys": self.keys,
            "requested": self.keys,
            "records": self.records,
            "obj_records": [self.obj_record],
        }


def _holdings_payload(lay: SimLayout, rank: int, nbytes: Sequence[int]) -> dict:
    """What ``gather_holdings`` contributes: the rank's node store listing (its node's ranks'
    checkpoints and the replicas ring placement puts there, ``keep_last`` iterations)."""
    rpn = lay.ranks_per_node
    node = rank // rpn
    nodes = -(-lay.world // rpn)
    owners = list(range(node * rpn, min(lay.world, (node + 1) * rpn)))
    if lay.replication_factor > 1 and nodes > 1:
        prev = (node - 1) % nodes
        owners += list(range(prev * rpn, min(lay.world, (prev + 1) * rpn)))
    its = [FIRST_ITERATION + 10 * k for k in range(lay.keep_last)]
    ids = sorted([it, o, nbytes[o]] for it in its for o in owners)
    return {"e": "", "p": {"store": f"node{node}:2049:{1000 + node}", "ids": ids, "foreign": []}}


def _check_synthetic(lay: SimLayout, ranks: Sequence[_Rank]) -> None:
    """The synthetic payloads equal what the real code builds from real ShardedTensors."""
    import msgpack

    from ...model.mapping import dtype_name
    from ...model.validation import object_record, shard_record
    from ...parallel.distribution import structure_fingerprint
    from ...parallel.load_checks import load_facts
    from ...parallel.template import preprocess, sharded_objects, sharded_tensors

    def rt(x):
        return msgpack.unpackb(msgpack.packb(x, use_bin_type=True), raw=False, strict_map_key=False)

    for rank in sorted({0, lay.world // 2, lay.world - 1}):
        sd = lay.state_dict(rank)
        sharded, *_ = preprocess(sd)
        shards = sharded_tensors(sharded)
        objects = sharded_objects(sharded)
        real = {
            "rank": rank,
            "error": None,
            "shards": [list(shard_record(s)) for s in shards],
            "objects": [list(object_record(o)) for o in objects],
            "fp": structure_fingerprint(shards),
        }
        mine = ranks[rank]
        if rt(real) != mine.dist_payload():
            raise AssertionError(f"synthetic distribution payload differs from the real one (rank {rank})")
        held_ids = {(h[0], tuple(h[1])) for h in mine.held}
        held = [
            (s.shard_id, dtype_name(s.dtype), tuple(s.local_shape)) for s in shards if s.shard_id in held_ids
        ]
        keys = {s.key for s in shards} | {o.key for o in objects}
        for need_all in (True, False):
            facts = load_facts(shards, objects, held, objects, keys, True, need_all=need_all)
            head = {"rank": rank, "error": None, **({"unknown": False} if need_all else {})}
            if rt({**head, **facts}) != mine.facts_payload(need_all):
                raise AssertionError(
                    f"synthetic load facts differ from the real ones (rank {rank}, need_all={need_all})"
                )


def _timed(fn: Callable[..., Any], *args: Any) -> Tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def _facts_of(ranks: Sequence["_Rank"], need_all: bool, rank: int) -> dict:
    return ranks[rank].facts_payload(need_all)


def _holdings_table(gathered: List[dict]):
    """``gather_holdings``' code after its gather: the Holdings every rank builds."""
    from ...manager.restore import Holdings

    ps = [g["p"] for g in gathered]
    return Holdings(
        store_keys=tuple(g["store"] for g in ps),
        ids=tuple({(int(it), int(o)): int(n) for it, o, n in g["ids"]} for g in ps),
        foreign=tuple(tuple(g["foreign"]) for g in ps),
    )


def _retrieval_plan(holdings, world: int):
    """The newest complete iteration, then ``plan_retrieval`` as the restore calls it."""
    from ...replication.placement import plan_retrieval

    it = holdings.complete_iterations(world)[0]
    return plan_retrieval(
        {r: r for r in range(world)}, holdings.available(it), holdings.node_of, holdings.nbytes(it)
    )


def _gather(make: Callable[[int], Any], world: int) -> Tuple[Dict[str, float], List[Any]]:
    """An all-gather of ``make(rank)`` payloads, as every rank sees it: each encoded with the
    real encoder (msgpack, as ``all_gather_msgpack``), then all W decoded, timed, as
    ``all_gather_msgpack`` does on every rank. Returns the row (bytes of rank 0: sent = its
    payload, received = the other ranks'; gloo pads each to the largest: ``received_padded``)
    and the decoded payloads, which the planning functions are then fed."""
    import msgpack

    raws = [msgpack.packb(make(r), use_bin_type=True) for r in range(world)]
    t0 = time.perf_counter()
    decoded = [msgpack.unpackb(raw, raw=False, strict_map_key=False, use_list=True) for raw in raws]
    t = time.perf_counter() - t0
    sizes = [len(r) for r in raws]
    del raws
    if decoded[0] != make(0):
        raise AssertionError("a synthetic payload does not survive msgpack unchanged")
    row = dict(
        seconds=t,
        sent=sizes[0],
        received=sum(sizes) - sizes[0],
        received_padded=max(sizes) * (world - 1),
        max_payload=max(sizes),
    )
    return row, decoded


def _local_phases(lay: SimLayout, dist_, rows: Dict[str, Dict[str, float]]) -> None:
    """Rank 0's local phases (no gathered data: independent of W but for the object grid):
    structure walk, fingerprint, hollow encoding / decoding, header pack / unpack."""
    from ...memory.layout import CheckpointHeader, plan_layout
    from ...parallel.distribution import check_cached, structure_fingerprint
    from ...parallel.load_checks import same_structure
    from ...parallel.template import prepare_template, preprocess, sharded_tensors
    from ...parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict

    sd = lay.state_dict(0, data=True)
    t, (sharded, *_rest) = _timed(preprocess, sd)
    shards = sharded_tensors(sharded)
    rows["structure walk"] = dict(seconds=t)
    t, _ = _timed(structure_fingerprint, shards)
    rows["fingerprint"] = dict(seconds=t)
    t, _ = _timed(check_cached, dist_, shards, 0, lay.world)
    rows["fingerprint (cached check)"] = dict(seconds=t)
    saved = tuple(dist_.main_rank_for_shard[s.shard_id] == 0 for s in shards)
    for s in shards:
        s.data = None
    hollow = MCoreTensorAwareStateDict(common={}, sharded_state_dict=sharded, _is_hollow=True, _saved=saved)
    t, meta = _timed(hollow.to_bytes)
    rows["hollow encoding"] = dict(seconds=t, encoded=len(meta))
    t, decoded = _timed(MCoreTensorAwareStateDict.from_bytes, meta)
    rows["hollow decoding"] = dict(seconds=t)
    # a restart's template, walked once, compared with the decoded checkpoint's structure
    template = lay.state_dict(0, data=True)
    t0 = time.perf_counter()
    same = same_structure(prepare_template(template), decoded)
    rows["restore check (same structure)"] = dict(seconds=time.perf_counter() - t0)
    if not same:
        raise AssertionError("the simulated template does not have its checkpoint's structure")
    kept = [s for s, k in zip(shards, saved) if k]
    layouts, total = plan_layout([(s.dtype, s.local_shape) for s in kept])
    header = CheckpointHeader(
        session=SESSION,
        iteration=FIRST_ITERATION,
        owner=0,
        world_size=lay.world,
        tensors=tuple(layouts),
        data_nbytes=total,
        meta=meta,
        replication={
            "kind": "ring",
            "factor": 2,
            "jump": lay.ranks_per_node,
            "ranks_per_node": lay.ranks_per_node,
        },
    )
    t, raw = _timed(header.pack)
    # p2p, not gathered: sent to each holder (factor - 1), one received per replica held
    rows["header pack"] = dict(
        seconds=t, encoded=len(raw), sent=len(raw) * (lay.replication_factor - 1), received=len(raw)
    )
    t, _ = _timed(CheckpointHeader.unpack, raw)
    rows["header unpack"] = dict(seconds=t)


def _planners(keys: Sequence[str], world: int) -> Tuple[Dict[str, int], Dict[int, int], int]:
    """Each key's planner, keys per planner, and the busiest planner (every key is held by
    every rank in the simulated layout, so the one with the most keys)."""
    from ...parallel.sharded_planning import planner_of

    planner = {k: planner_of(k, world) for k in keys}
    keys_of: Dict[int, int] = {}
    for p in planner.values():
        keys_of[p] = keys_of.get(p, 0) + 1
    return planner, keys_of, max(keys_of, key=lambda p: (keys_of[p], -p))


def _all_to_all(outgoing: Callable[[int, int], Any], world: int, busiest: int):
    """An all_to_all_msgpack as rank 0 sends (``outgoing(0, d)`` to every d) and the busiest
    planner receives (``outgoing(r, busiest)`` from every r, decoded and timed). Returns the
    row and the decoded messages."""
    import msgpack

    sent = sum(len(msgpack.packb(outgoing(0, d), use_bin_type=True)) for d in range(world))
    raws = [msgpack.packb(outgoing(r, busiest), use_bin_type=True) for r in range(world)]
    t0 = time.perf_counter()
    received = [msgpack.unpackb(raw, raw=False, strict_map_key=False, use_list=True) for raw in raws]
    row = dict(seconds=time.perf_counter() - t0, sent=sent, received=sum(len(r) for r in raws))
    return row, received


def _sim_sharded_save(lay: SimLayout, ranks: Sequence["_Rank"], rows: Dict[str, Dict[str, float]]) -> None:
    """The sharded planner (parallel/sharded_planning.py) as rank 0 sends and as the busiest
    planner receives and computes: messages built and encoded as the real code does
    (``_outgoing``'s records + tag, ``all_to_all_msgpack``'s msgpack), decoded and planned
    with the real ``_plan``. The parallelization group is the world (the largest problem)."""
    import msgpack

    from ...parallel import sharded_planning as sp

    world = lay.world
    rows["planning: error gather: all-gather"], _ = _gather(lambda r: {"e": "", "p": None}, world)
    planner, keys_of, busiest = _planners(ranks[0].keys, world)
    load: Dict[int, int] = {}
    for rec in ranks[0].records:
        load[planner[rec[0]]] = load.get(planner[rec[0]], 0) + 1

    def outgoing(r: int, dest: int) -> dict:
        tag = [0, r, world]
        out = {"t": [[*rec, *tag] for rec in ranks[r].records if planner[rec[0]] == dest], "o": []}
        if planner["rng_state"] == dest:
            out["o"].append(ranks[r].obj_record)
        return out

    rows["planning: records: all-to-all"], received = _all_to_all(outgoing, world, busiest)
    rows["planning: records: all-to-all"]["planner_keys"] = keys_of[busiest]
    t, (problems, answers) = _timed(sp._plan, received, busiest, world)
    if problems:
        raise AssertionError(f"the simulated layout fails its integrity check: {problems[:3]}")
    rows["planning: checks + assignment"] = dict(seconds=t)
    # rank 0 gets, from every planner, one 0/1 per record it sent there
    back = [msgpack.packb([1] * load.get(q, 0), use_bin_type=True) for q in range(world)]
    t0 = time.perf_counter()
    for raw in back:
        msgpack.unpackb(raw, raw=False, use_list=True)
    t = time.perf_counter() - t0
    rows["planning: answers: all-to-all"] = dict(
        seconds=t,
        sent=sum(len(msgpack.packb(a, use_bin_type=True)) for a in answers),
        received=sum(len(b) for b in back),
    )
    rows["planning: problem count: all-reduce"] = dict(seconds=float("nan"), sent=8, received=8)
    rows["planning: group facts: all-gather"], _ = _gather(lambda r: [1 << 30, ranks[r].fp], world)


def _sim_same_structure_fill(ranks: Sequence["_Rank"], world: int, rows: Dict[str, Dict[str, float]]) -> None:
    """``to_state_dict(same_structure=True)`` for every rank's missing shards (here every
    shard it did not save: an upper bound, replicas in the node's store would cover some).
    From SHARDED_PLANNING_MIN_WORLD ranks, planned by key (``plan_exchange_sharded``, as rank 0
    sends and the busiest planner receives and plans); below, a gather of the missing shards,
    a gather of their holders and the exchange plan every rank computes."""
    import msgpack

    from ...parallel import sharded_planning as sp
    from ...parallel.exchange import plan_exchange

    if not sp.use_sharded_planning(world):
        rows["to_state_dict: needs: all-gather"], needs = _gather(
            lambda r: {"rank": r, "error": None, "need": [n[:2] for n in ranks[r].need_rest], "held": []},
            world,
        )
        wanted = {(key, tuple(off)) for g in needs for key, off in g["need"]}
        rows["to_state_dict: holders: all-gather"], holders = _gather(
            lambda r: [h for h in ranks[r].held if (h[0], tuple(h[1])) in wanted], world
        )
        t, (xplan, _absent) = _timed(
            plan_exchange, [{"need": g["need"], "held": h} for g, h in zip(needs, holders)]
        )
        rows["exchange planning"] = dict(seconds=t, transfers=len(xplan.transfers))
        return
    rows["to_state_dict: error gather: all-gather"], _ = _gather(lambda r: {"e": "", "p": None}, world)
    planner, keys_of, busiest = _planners(ranks[0].keys, world)

    def outgoing(r: int, dest: int) -> dict:
        rk = ranks[r]
        return {
            "n": [[n[0], n[1], i] for i, n in enumerate(rk.need_rest) if planner[n[0]] == dest],
            "h": [h for h in rk.held if planner[h[0]] == dest],
        }

    sent = sum(len(msgpack.packb(outgoing(0, d), use_bin_type=True)) for d in range(world))
    raws = [msgpack.packb(outgoing(r, busiest), use_bin_type=True) for r in range(world)]
    t0 = time.perf_counter()
    received = [msgpack.unpackb(raw, raw=False, strict_map_key=False, use_list=True) for raw in raws]
    t = time.perf_counter() - t0
    rows["to_state_dict: needs + holdings: all-to-all"] = dict(
        seconds=t, sent=sent, received=sum(map(len, raws))
    )
    del raws
    t, (per_rank, absent) = _timed(sp._match, received, world)
    if absent:
        raise AssertionError("the simulated restore needs a shard nobody holds")
    rows["exchange planning"] = dict(seconds=t, transfers=sum(len(x) for x in per_rank) // 2)
    rows["to_state_dict: absent count: all-reduce"] = dict(seconds=float("nan"), sent=8, received=8)
    # rank 0 receives its transfers from every planner: at most one row per shard it lacks,
    # one per (shard, receiver) it serves; the busiest planner's rows to rank 0 stand for a
    # planner's, their share of rank 0's transfers scaled to all of them
    mine = per_rank[0]
    t0 = time.perf_counter()
    raw = msgpack.packb(mine, use_bin_type=True)
    msgpack.unpackb(raw, raw=False, use_list=True)
    t = time.perf_counter() - t0
    share = max(1, keys_of[busiest]) / max(1, len(ranks[0].keys))
    rows["to_state_dict: transfers: all-to-all"] = dict(
        seconds=t / share,
        sent=int(sum(len(msgpack.packb(x, use_bin_type=True)) for x in per_rank)),
        received=int(len(raw) / share),
    )


def run_simulated(
    world: int, shards: int, tp: int = 8, check: bool = True, log: Callable[[str], None] = print
):
    """One simulated world size: per-rank seconds of every planning computation and the bytes
    each rank contributes to / receives from every all-gather (rank 0's figures)."""
    from ...model.validation import validate_sharding_integrity
    from ...parallel.distribution import compute_distribution
    from ...parallel.sharded_planning import use_sharded_planning

    lay = SimLayout(world, shards, tp)
    rows: Dict[str, Dict[str, float]] = {}
    t_start = time.perf_counter()
    ranks = [_Rank(lay, r) for r in range(world)]
    gen_s = time.perf_counter() - t_start

    # first save: the gathered planner (W < SHARDED_PLANNING_MIN_WORLD) or the sharded one
    if use_sharded_planning(world):
        _sim_sharded_save(lay, ranks, rows)
        t_untimed = time.perf_counter()  # the assignment the restore part needs (not timed)
        dist_ = compute_distribution((), None, [rk.dist_payload() for rk in ranks])
        gen_s += time.perf_counter() - t_untimed
    else:
        rows["distribution: all-gather"], gathered = _gather(lambda r: ranks[r].dist_payload(), world)
        shards_by_rank, objects_by_rank = [g["shards"] for g in gathered], [g["objects"] for g in gathered]
        t, _ = _timed(validate_sharding_integrity, shards_by_rank, objects_by_rank)
        rows["validation (save)"] = dict(seconds=t)
        t, dist_ = _timed(compute_distribution, (), None, gathered)
        rows["distribution compute"] = dict(seconds=t)
        del gathered, shards_by_rank, objects_by_rank
    saved_by: Dict[int, set] = {r: set() for r in range(world)}
    for sid, r in dist_.main_rank_for_shard.items():
        saved_by[r].add(sid)
    for rk in ranks:
        rk.set_saved(saved_by[rk.rank])
    del saved_by
    if check:
        _check_synthetic(lay, ranks)
    rows["agreement: all-reduce"] = dict(seconds=float("nan"), sent=8, received=8)
    _local_phases(lay, dist_, rows)

    # restore: holdings, retrieval plan, then (the restart's template is the saved structure on
    # every rank) one all-reduce for the checks and to_state_dict's two small gathers
    nbytes = list(dist_.rank_bytes)
    del dist_
    rows["holdings gather: all-gather"], gathered = _gather(
        lambda r: _holdings_payload(lay, r, nbytes), world
    )
    t, holdings = _timed(_holdings_table, gathered)
    rows["holdings gather (table)"] = dict(seconds=t)
    t, plan = _timed(_retrieval_plan, holdings, world)
    if len(plan) != world:
        raise AssertionError("retrieval plan incomplete")
    rows["retrieval planning"] = dict(seconds=t, calls=2)  # _check_template and retrieve
    del gathered, holdings, plan
    rows["restore check: all-reduce"] = dict(seconds=float("nan"), sent=8, received=8)
    _sim_same_structure_fill(ranks, world, rows)
    for r in rows.values():
        r.setdefault("sent", 0)
        r.setdefault("received", 0)
    out = dict(world=world, shards_per_rank=shards, tp=lay.tp_size, rows=rows, generate_s=gen_s)
    out["totals"] = sim_totals(rows)
    out["seconds"] = time.perf_counter() - t_start
    log(
        f"  simulated W={world:>5d} x {shards} shards: first-save planning {out['totals']['save_planning_s']:.2f}s, "
        f"restore planning {out['totals']['restore_planning_s']:.2f}s, received per rank "
        f"{out['totals']['received_bytes'] / MIB:.1f} MiB ({out['seconds']:.0f}s)"
    )
    return out


#: simulated rows making up a first save's planning: the gathered planner's (every rank, on
#: the gathered data), or the sharded planner's (the busiest planner's share)
SIM_SAVE = (
    "distribution: all-gather",
    "validation (save)",
    "distribution compute",
    "planning: error gather: all-gather",
    "planning: records: all-to-all",
    "planning: checks + assignment",
    "planning: answers: all-to-all",
    "planning: group facts: all-gather",
)
#: a restore's: holdings, retrieval plan (x2), the same-structure comparison, to_state_dict's
#: gathers of missing shards and of their holders, the exchange plan
SIM_RESTORE = (
    "holdings gather: all-gather",
    "holdings gather (table)",
    "retrieval planning",
    "restore check (same structure)",
    "to_state_dict: needs: all-gather",
    "to_state_dict: holders: all-gather",
    "to_state_dict: error gather: all-gather",
    "to_state_dict: needs + holdings: all-to-all",
    "to_state_dict: transfers: all-to-all",
    "exchange planning",
)


def sim_totals(rows: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    def s(name):
        r = rows[name]
        return r["seconds"] * r.get("calls", 1) if r["seconds"] == r["seconds"] else 0.0

    wire = [r for n, r in rows.items() if n.endswith(("all-gather", "all-to-all"))]
    return dict(
        save_planning_s=sum(s(n) for n in SIM_SAVE if n in rows),
        restore_planning_s=sum(s(n) for n in SIM_RESTORE if n in rows),
        received_bytes=sum(r["received"] for r in wire),
        received_padded_bytes=sum(r.get("received_padded", 0) for r in rows.values()),
        sent_bytes=sum(r["sent"] for r in wire),
        largest_gather_received_bytes=max(r["received"] for r in wire),
    )
