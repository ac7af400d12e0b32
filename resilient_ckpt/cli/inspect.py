"""``resilient-ckpt export | inspect | convert``: the persistent tier from the command line.

- ``export --store-root R --session S --iteration N --to DIR``: write the checkpoints of
  iteration N that this node's store holds (its own ranks' and the replicas it keeps) into the
  DCP directory DIR. One process, no torch.distributed. Run it on every node (concurrently is
  fine) with the same DIR on a shared file system: each rank's data is written once, and the
  run that completes the set writes ``.metadata`` (last), making DIR a complete checkpoint.
  Until then DIR is not loadable and ``inspect`` says which ranks are missing.
- ``inspect DIR``: keys, shapes, dtypes, sizes and the iteration of a DCP checkpoint (ours or
  torch's own); ``--json`` for machines.
- ``convert DIR --to FILE.pt``: the whole checkpoint as one ``torch.save`` file (tensors
  assembled from their chunks, values decoded), built on the metadata-only load planner.

Each returns a process exit code: 0 success, 1 a checkpoint problem (message on stderr), 2 a
usage error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..errors import CheckpointingException


def _human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} B"


def _fail(msg: str) -> int:
    print(f"resilient-ckpt: error: {msg}", file=sys.stderr)
    return 1


# ---- export ------------------------------------------------------------------------------------


def export_main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="resilient-ckpt export",
        description="Write an in-memory checkpoint iteration held by this node's store to a DCP "
        "directory (run on every node with the same --to for a whole-job checkpoint).",
    )
    p.add_argument("--store-root", required=True, help="the node store's root (e.g. /dev/shm/resilient_ckpt)")
    p.add_argument("--session", required=True, help="the job's session id")
    p.add_argument("--iteration", required=True, type=int, help="the iteration to export")
    p.add_argument("--to", required=True, dest="to", help="the DCP checkpoint directory to write")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync (scratch copies only)")
    args = p.parse_args(argv)
    from ..persistent.export import export_store_iteration

    try:
        res = export_store_iteration(
            args.store_root, args.session, args.iteration, args.to, sync_files=not args.no_fsync
        )
    except CheckpointingException as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"{e}")
    print(
        f"exported ranks {list(res.owners_exported) or 'none'} of iteration {res.iteration} "
        f"({_human(res.bytes_written)}) to {res.directory}"
        + (
            f"; ranks {list(res.owners_skipped)} were already exported by another run"
            if res.owners_skipped
            else ""
        )
    )
    if res.complete:
        print(f"checkpoint complete: all {res.world_size} ranks present, metadata written")
    else:
        missing = _missing_owners(Path(res.directory), res.world_size)
        print(
            f"checkpoint not complete yet: ranks {missing[:20]}{' ...' if len(missing) > 20 else ''} "
            f"of {res.world_size} still missing; run export on the nodes that hold them"
        )
    return 0


def _missing_owners(d: Path, world: int) -> List[int]:
    return [o for o in range(world) if not (d / ".export" / f"owner_{o:06d}.json").exists()]


# ---- inspect -------------------------------------------------------------------------------------


def describe(directory: str, allow_pickle: bool = False) -> Dict[str, Any]:
    """What a DCP checkpoint holds (used by ``inspect``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..persistent.layout import METADATA_NAME, is_internal
    from ..persistent.storage import read_manifest, read_metadata_file, stored_lengths

    d = Path(directory)
    manifest = read_manifest(d) if d.is_dir() else None
    md = read_metadata_file(d / METADATA_NAME, allow_pickle)
    stored = stored_lengths(md)
    entries = []
    tensor_bytes = 0
    for fqn in sorted(md.state_dict_metadata):
        v = md.state_dict_metadata[fqn]
        if isinstance(v, TensorStorageMetadata):
            nbytes = math.prod(v.size) * v.properties.dtype.itemsize
            tensor_bytes += nbytes
            entries.append(
                {
                    "key": fqn,
                    "kind": "tensor",
                    "shape": list(v.size),
                    "dtype": str(v.properties.dtype).replace("torch.", ""),
                    "bytes": nbytes,
                    "chunks": len(v.chunks),
                    "internal": is_internal(fqn),
                }
            )
        else:
            entries.append(
                {
                    "key": fqn,
                    "kind": "value",
                    "bytes": stored.get((fqn, None), 0),
                    "internal": is_internal(fqn),
                }
            )
    files = sorted({getattr(i, "relative_path", "?") for i in (md.storage_data or {}).values()})
    return {
        "directory": str(d),
        "iteration": None if manifest is None else manifest.get("iteration"),
        "session": None if manifest is None else manifest.get("session"),
        "world_size": None if manifest is None else manifest.get("world_size"),
        "written_by": "resilient_ckpt" if manifest is not None else "torch.distributed.checkpoint",
        "dcp_version": md.version,
        "tensor_bytes": tensor_bytes,
        "files": files,
        "entries": entries,
    }


def inspect_main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="resilient-ckpt inspect", description="Show what a DCP checkpoint holds."
    )
    p.add_argument("directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--all", action="store_true", help="also list resilient_ckpt's internal entries")
    p.add_argument(
        "--allow-pickle", action="store_true", help="unpickle foreign metadata (trusted input only)"
    )
    args = p.parse_args(argv)
    d = Path(args.directory)
    from ..persistent.layout import METADATA_NAME

    if d.is_dir() and not (d / METADATA_NAME).exists() and (d / ".export").is_dir():
        return _inspect_partial_export(d)
    try:
        info = describe(args.directory, args.allow_pickle)
    except CheckpointingException as e:
        return _fail(str(e))
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    head = [f"checkpoint {info['directory']}"]
    if info["iteration"] is not None:
        head.append(
            f"iteration {info['iteration']} of session {info['session']!r}, world size {info['world_size']}"
        )
    head.append(
        f"written by {info['written_by']} (DCP format {info['dcp_version']}); {len(info['files'])} data file(s)"
    )
    print("\n".join(head))
    shown = [e for e in info["entries"] if args.all or not e["internal"]]
    width = max([len(e["key"]) for e in shown] + [3])
    print(f"{'key':<{width}}  {'dtype':<9} {'shape':<20} {'size':>11}  chunks")
    for e in shown:
        if e["kind"] == "tensor":
            print(
                f"{e['key']:<{width}}  {e['dtype']:<9} {str(tuple(e['shape'])):<20} {_human(e['bytes']):>11}  {e['chunks']}"
            )
        else:
            print(f"{e['key']:<{width}}  {'(value)':<9} {'':<20} {_human(e['bytes']):>11}")
    hidden = len(info["entries"]) - len(shown)
    n_t = sum(1 for e in info["entries"] if e["kind"] == "tensor")
    print(
        f"{n_t} tensors, {_human(info['tensor_bytes'])}; {len(info['entries']) - n_t} values"
        + (f" ({hidden} internal entries hidden, --all shows them)" if hidden else "")
    )
    return 0


def _inspect_partial_export(d: Path) -> int:
    recs = sorted((d / ".export").glob("owner_*.json"))
    if not recs:
        return _fail(f"{d} has no .metadata and no exported ranks: not a DCP checkpoint")
    first = json.loads(recs[0].read_text())
    world = int(first["world_size"])
    missing = _missing_owners(d, world)
    print(
        f"{d}: incomplete export of iteration {first['iteration']} (session {first['session']!r}): "
        f"{world - len(missing)} of {world} ranks written, missing ranks {missing[:20]}"
        f"{' ...' if len(missing) > 20 else ''}; not loadable until every rank is exported"
    )
    return 1


# ---- convert --------------------------------------------------------------------------------------


def convert_main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="resilient-ckpt convert",
        description="Convert a DCP checkpoint into one torch.save file (loads everything in this process).",
    )
    p.add_argument("directory")
    p.add_argument("--to", required=True, dest="to", help="the output file (e.g. model.pt)")
    p.add_argument("--keys", nargs="*", default=None, help="only these keys (or key prefixes)")
    p.add_argument("--allow-pickle", action="store_true", help="unpickle foreign values (trusted input only)")
    args = p.parse_args(argv)
    import torch

    from ..persistent.local_load import load_metadata_only

    try:
        state = load_metadata_only(args.directory, args.keys, allow_pickle=args.allow_pickle)
    except CheckpointingException as e:
        return _fail(str(e))
    out = Path(args.to)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        torch.save(state, tmp)
        tmp.replace(out)
    except OSError as e:
        return _fail(f"cannot write {out}: {e}")
    print(f"wrote {out} ({_human(out.stat().st_size)})")
    return 0
