"""Export: a node's store to a DCP directory, in one process, without torch.distributed.

A node store holds its own ranks' checkpoints and replicas of some peers'. Run the export on
every node (concurrently is fine): each owner is written once (a claim file under
``.export/`` decides who), each node records what it wrote beside the data
(``.export/owner_<r>.json``: the owner's local plan and where each item landed), and whichever
run finds all ``world_size`` owners present plans the global save from those records
(:func:`~.save_planner.build_global_save_plan`, as a collective save would) and writes
``.metadata`` last, making the directory a complete checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import CorruptCheckpointError, ForeignCheckpointError, StoreError
from ..memory.store import CheckpointStore
from .layout import MANIFEST_NAME, new_manifest, writer_id
from .save_planner import LocalPlanData, ResilientSavePlanner, build_global_save_plan
from .snapshot import StoreSnapshot
from .storage import ResilientFileSystemWriter, read_manifest, write_json_atomic

_EXPORT_DIR = ".export"


@dataclass(frozen=True)
class ExportResult:
    directory: str
    iteration: int
    owners_exported: Tuple[int, ...]
    owners_skipped: Tuple[int, ...]
    world_size: int
    complete: bool
    bytes_written: int


def _record_path(meta_dir: Path, owner: int, suffix: str) -> Path:
    return meta_dir / f"owner_{owner:06d}.{suffix}"


def _stored_headers(store: CheckpointStore, iteration: int) -> Tuple[Dict[int, object], int]:
    """The store's headers of ``iteration`` per owner, and the job's world size."""
    ids = [c for c in store.list() if c.iteration == iteration]
    if not ids:
        held = sorted({c.iteration for c in store.list()})
        raise StoreError(
            f"store {store.dir} holds no checkpoint of iteration {iteration} (it holds "
            f"{held[-10:] if held else 'none'}); pick one of those with --iteration"
        )
    headers = {c.owner: store.read_header(c) for c in ids}
    worlds = {h.world_size for h in headers.values()}
    if len(worlds) != 1:
        raise CorruptCheckpointError(
            f"store {store.dir}: iteration {iteration} was saved with world sizes {sorted(worlds)}"
        )
    (world,) = worlds
    return headers, world


def _check_target(out: Path, session: str, iteration: int) -> None:
    existing = read_manifest(out) if (out / MANIFEST_NAME).exists() else None
    if existing is not None and (
        existing.get("session") != session or existing.get("iteration") != iteration
    ):
        raise ForeignCheckpointError(
            f"{out} already holds iteration {existing.get('iteration')} of session "
            f"{existing.get('session')!r}; export into an empty directory"
        )


def _claim(meta_dir: Path, owner: int) -> bool:
    """Claim ``owner`` for this run (False: another run already has)."""
    try:
        fd = os.open(_record_path(meta_dir, owner, "claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{writer_id()}\n")
    return True


def export_store_iteration(
    store_root: str | os.PathLike,
    session: str,
    iteration: int,
    directory: str | os.PathLike,
    *,
    sync_files: bool = True,
) -> ExportResult:
    """Write every owner's checkpoint of ``iteration`` held in this node's store to the DCP
    directory ``directory``, and its metadata once every owner of the job is there.

    A node store holds its own ranks' checkpoints and replicas of some peers'. Run this on
    every node (concurrently is fine): each owner is written once (a claim file under
    ``.export/`` decides who), each node records what it wrote beside its data, and whichever
    run finds all ``world_size`` owners present writes ``.metadata`` (last), making the
    directory a complete checkpoint that :class:`PersistentTier` and plain DCP load.
    """
    store = CheckpointStore(store_root, session)
    headers, world = _stored_headers(store, iteration)
    out = Path(directory)
    meta_dir = out / _EXPORT_DIR
    meta_dir.mkdir(parents=True, exist_ok=True)
    _check_target(out, session, iteration)
    exported, skipped = [], []
    written = 0
    for owner in sorted(headers):
        if not _claim(meta_dir, owner):
            skipped.append(owner)
            continue
        try:
            written += _export_owner(store, iteration, owner, out, meta_dir, session, world, sync_files)
        except BaseException:
            with contextlib.suppress(OSError):
                _record_path(meta_dir, owner, "claim").unlink()
            raise
        exported.append(owner)
    complete = _finalize_export(out, meta_dir, session, iteration, world)
    return ExportResult(str(out), iteration, tuple(exported), tuple(skipped), world, complete, written)


def _export_owner(store, iteration, owner, out: Path, meta_dir: Path, session, world, sync_files) -> int:
    with StoreSnapshot(store, iteration, owner) as snap:
        planner = ResilientSavePlanner(enable_plan_caching=False, dedup_replicas=False)
        planner.set_up_planner(snap.state_dict(), is_coordinator=owner == 0)
        local = planner.create_local_plan()
        writer = FileSystemWriter(out, sync_files=sync_files, overwrite=True)
        writer.set_up_storage_writer(owner == 0)
        local = writer.prepare_local_plan(local)
        final = dataclasses.replace(local, storage_data=_StoragePrefix(f"__{owner}_"))
        final = planner.finish_plan(final)
        results = writer.write_data(final, planner).wait()
        snap.verify()
    record = {
        "owner": owner,
        "iteration": iteration,
        "session": session,
        "world_size": world,
        "items": [_item_record(i) for i in local.items],
        "mains": [[f, list(o)] for f, o in local.planner_data.mains],
        "mappings": [[f, list(p)] for f, p in local.planner_data.mappings],
        "results": [
            [
                r.index.fqn,
                None if r.index.offset is None else list(r.index.offset),
                r.storage_data.relative_path,
                int(r.storage_data.offset),
                int(r.storage_data.length),
            ]
            for r in results
        ],
    }
    write_json_atomic(_record_path(meta_dir, owner, "json"), record)
    return planner.stats.bytes_written


def _item_record(item: WriteItem) -> list:
    if item.type == WriteItemType.BYTE_IO:
        return ["bytes", item.index.fqn]
    td = item.tensor_data
    return [
        "tensor",
        item.index.fqn,
        list(td.chunk.offsets),
        list(td.chunk.sizes),
        list(td.size),
        str(td.properties.dtype).replace("torch.", ""),
    ]


def _plan_from_record(rec: dict) -> SavePlan:
    items = []
    for it in rec["items"]:
        if it[0] == "bytes":
            items.append(
                WriteItem(
                    index=MetadataIndex(it[1]), type=WriteItemType.BYTE_IO, bytes_io_data=BytesIOWriteData(0)
                )
            )
        else:
            _, fqn, off, sizes, gsize, dtype = it
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, off),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(sizes)),
                        properties=TensorProperties(dtype=getattr(torch, dtype)),
                        size=torch.Size(gsize),
                    ),
                )
            )
    pd = LocalPlanData(
        mappings=tuple((f, tuple(p)) for f, p in rec["mappings"]),
        mains=tuple((f, tuple(o)) for f, o in rec["mains"]),
    )
    return SavePlan(items, planner_data=pd)


def _chosen_results(plan: SavePlan, record: dict) -> List[WriteResult]:
    """The write results of the items the global plan kept for this owner."""
    chosen = {(i.index.fqn, None if i.index.offset is None else tuple(i.index.offset)) for i in plan.items}
    results = []
    for fqn, off, rel, offset, length in record["results"]:
        key = (fqn, None if off is None else tuple(off))
        if key in chosen:
            results.append(
                WriteResult(
                    index=MetadataIndex(fqn, off),
                    size_in_bytes=length,
                    storage_data=_StorageInfo(rel, offset, length),
                )
            )
    return results


def _finalize_export(out: Path, meta_dir: Path, session: str, iteration: int, world: int) -> bool:
    records = {}
    for owner in range(world):
        try:
            records[owner] = json.loads(_record_path(meta_dir, owner, "json").read_text())
        except FileNotFoundError:
            return False
    plans = [_plan_from_record(records[o]) for o in range(world)]
    final_plans, metadata, _ = build_global_save_plan(plans, dedup=True)
    results = []
    for owner, plan in enumerate(final_plans):
        results.extend(_chosen_results(plan, records[owner]))
    manifest = new_manifest(
        "export", session=session, iteration=iteration, world_size=world, group_size=world, writer=writer_id()
    )
    writer = ResilientFileSystemWriter(out, manifest=manifest)
    writer.set_up_storage_writer(True)
    writer.finish(metadata, [results])
    return True
