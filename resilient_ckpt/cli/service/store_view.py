"""What a store root holds, read directly (no daemon needed: a node whose daemon is down, or
embedded mode), and dropping from it."""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ...errors import CheckpointingException, StoreError
from ...memory.store import CheckpointStore
from .common import JSON_FORMAT, STORE_ROOT_ENV, iso

# ---- what a store root holds (pure reading, no daemon) -------------------------------------------


@dataclass(frozen=True)
class IterationSummary:
    """One iteration of one session as this node's store holds it."""

    iteration: int
    world_size: int
    owners: Tuple[int, ...]
    data_bytes: int
    created_ns: int
    #: other world sizes found among this iteration's headers (a mixed-up store)
    conflicting_world_sizes: Tuple[int, ...] = ()

    @property
    def complete(self) -> bool:
        """Every owner 0..world_size-1 has a readable copy in this store."""
        return not self.conflicting_world_sizes and self.owners == tuple(range(self.world_size))

    @property
    def missing_owners(self) -> Tuple[int, ...]:
        held = set(self.owners)
        return tuple(o for o in range(self.world_size) if o not in held)

    def as_json(self) -> Dict[str, Any]:
        return {
            "iteration": self.iteration,
            "world_size": self.world_size,
            "owners": list(self.owners),
            "local_owners": len(self.owners),
            "missing_owners": list(self.missing_owners),
            "complete": self.complete,
            "data_bytes": self.data_bytes,
            "created_ns": self.created_ns,
            "created": iso(self.created_ns),
            "conflicting_world_sizes": list(self.conflicting_world_sizes),
        }


@dataclass(frozen=True)
class Problem:
    """A file of the store that is not a usable checkpoint, and why."""

    file: str
    error: str


@dataclass(frozen=True)
class SessionSummary:
    session: str
    iterations: Tuple[IterationSummary, ...]
    data_bytes: int
    free_pool_bytes: int
    problems: Tuple[Problem, ...] = ()
    #: host memory the session occupies on this node (allocated blocks of all its files)
    store_bytes: Optional[int] = None
    #: of which parity files (redundancy="parity")
    parity_bytes: int = 0

    @property
    def newest_complete(self) -> Optional[int]:
        done = [it.iteration for it in self.iterations if it.complete]
        return max(done) if done else None

    def as_json(self) -> Dict[str, Any]:
        return {
            "session": self.session,
            "data_bytes": self.data_bytes,
            "free_pool_bytes": self.free_pool_bytes,
            "store_bytes": self.store_bytes,
            "parity_bytes": self.parity_bytes,
            "newest_complete": self.newest_complete,
            "iterations": [it.as_json() for it in self.iterations],
            "problems": [asdict(p) for p in self.problems],
        }


@dataclass(frozen=True)
class StoreScan:
    root: str
    fs_total_bytes: int
    fs_free_bytes: int
    sessions: Tuple[SessionSummary, ...] = field(default_factory=tuple)

    def as_json(self) -> Dict[str, Any]:
        return {
            "format": JSON_FORMAT,
            "source": "store",
            "root": self.root,
            "filesystem": {"total_bytes": self.fs_total_bytes, "free_bytes": self.fs_free_bytes},
            "sessions": [s.as_json() for s in self.sessions],
        }


def _is_session_dir(d: Path) -> bool:
    """A directory a CheckpointStore made: it has a free pool, a lock or a header."""
    if not d.is_dir() or d.name.startswith("."):
        return False
    if (d / "free").is_dir() or (d / ".lock").exists():
        return True
    with contextlib.suppress(OSError):
        return any(p.name.endswith(".hdr") for p in d.iterdir())
    return False


def session_names(root: str | os.PathLike) -> List[str]:
    """Sessions present under a store root (sorted); StoreError if the root is missing."""
    r = Path(root)
    if not r.is_dir():
        raise StoreError(
            f"no store at {r}: the directory does not exist; pass the node's store root "
            f"(--store-root, default /dev/shm/resilient_ckpt, or ${STORE_ROOT_ENV})"
        )
    return sorted(d.name for d in r.iterdir() if _is_session_dir(d))


def _open_store(root: str | os.PathLike, session: str) -> CheckpointStore:
    return CheckpointStore(root, session)


def summarize_session(root: str | os.PathLike, session: str) -> SessionSummary:
    """Read every header of one session (verifying it and its data file's size)."""
    store = _open_store(root, session)
    by_iter: Dict[int, list] = {}
    problems = []
    for cid in store.list():
        try:
            reader = store.open(cid)  # header checksum, names, and the data file's length
        except CheckpointingException as e:
            problems.append(Problem(store.header_path(cid).name, str(e)))
            continue
        by_iter.setdefault(cid.iteration, []).append(reader.header)
    iterations = []
    for it in sorted(by_iter):
        headers = by_iter[it]
        sizes = sorted({h.world_size for h in headers})
        # The world size most owners agree on names the iteration; others are reported.
        main = max(sizes, key=lambda w: sum(h.world_size == w for h in headers))
        iterations.append(
            IterationSummary(
                iteration=it,
                world_size=main,
                owners=tuple(sorted(h.owner for h in headers)),
                data_bytes=sum(h.data_nbytes for h in headers),
                created_ns=max(h.created_ns for h in headers),
                conflicting_world_sizes=tuple(w for w in sizes if w != main),
            )
        )
    u = store.usage()
    parity = 0
    for pid in store.list_parity():
        with contextlib.suppress(OSError):
            parity += store.data_path(pid).stat().st_size
    return SessionSummary(
        session,
        tuple(iterations),
        u["data_bytes"],
        u["free_pool_bytes"],
        tuple(problems),
        store_bytes=u["store_bytes"],
        parity_bytes=parity,
    )


def scan_store(root: str | os.PathLike, session: Optional[str] = None) -> StoreScan:
    """What a store root holds: every session, or only ``session`` (StoreError if absent)."""
    names = session_names(root)
    if session is not None:
        if session not in names:
            raise StoreError(
                f"no session {session!r} under {root}"
                + (f" (sessions there: {', '.join(names)})" if names else " (it holds no sessions)")
                + "; check --session (the job's session_id, TORCHELASTIC_RUN_ID under torchrun)"
            )
        names = [session]
    st = os.statvfs(root)
    return StoreScan(
        str(root),
        st.f_blocks * st.f_frsize,
        st.f_bavail * st.f_frsize,
        tuple(summarize_session(root, s) for s in names),
    )


# ---- dropping from a store root ---------------------------------------------------------------------


@dataclass(frozen=True)
class DropResult:
    session: str
    dropped: Tuple[Tuple[int, int], ...]  # (iteration, owner)
    released_bytes: int
    whole_session: bool = False

    def as_json(self) -> Dict[str, Any]:
        return {
            "format": JSON_FORMAT,
            "session": self.session,
            "whole_session": self.whole_session,
            "dropped": [{"iteration": i, "owner": o} for i, o in self.dropped],
            "released_bytes": self.released_bytes,
        }


def drop_iterations(root: str | os.PathLike, session: str, iterations: Iterable[int]) -> DropResult:
    """Retire every owner's checkpoint of ``iterations`` from a store root, releasing memory.

    All selected headers go first (none of those checkpoints is visible afterwards), then
    the data files; an interruption leaves only header-less data, which the next store
    sweep recycles.
    """
    store = _open_store(root, session)
    wanted = set(int(i) for i in iterations)
    ids = [c for c in store.list() if c.iteration in wanted]
    for cid in ids:
        with contextlib.suppress(FileNotFoundError):
            store.header_path(cid).unlink()
    released = 0
    for cid in ids:
        with contextlib.suppress(FileNotFoundError):
            released += store.data_path(cid).stat().st_size
        # recycle=False: an operator drops to get memory back, not to grow the free pool
        store.discard(cid, recycle=False)
    return DropResult(session, tuple((c.iteration, c.owner) for c in ids), released)


def drop_session(root: str | os.PathLike, session: str) -> DropResult:
    """Remove a session from a store root entirely (headers first, then everything else)."""
    store = _open_store(root, session)
    ids = store.list()
    for cid in ids:
        with contextlib.suppress(FileNotFoundError):
            store.header_path(cid).unlink()
    released = store.usage()["total_bytes"]
    store.destroy()
    return DropResult(session, tuple((c.iteration, c.owner) for c in ids), released, whole_session=True)
