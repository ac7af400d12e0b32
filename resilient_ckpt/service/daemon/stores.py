"""The daemon's store root (one :class:`CheckpointStore` per session, created when first
written) and the memory it hands out: read-only mappings that replication and FETCH send
from, and the reservations inbound checkpoints are written into within the memory budget."""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ...errors import CheckpointingException, CorruptCheckpointError, StoreError, StoreFullError
from ...memory.layout import OWNER, CheckpointHeader, CheckpointId, FileName, parse_name
from ...memory.store import CheckpointStore
from ..client import Holding, header_digest
from .config import logger, valid_session_name


def read_or_none(path: Path) -> Optional[bytes]:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


class Stores:
    """The daemon's store root: one CheckpointStore per session (created when first written)."""

    def __init__(self, root: str, node_id: int):
        self.root = Path(root)
        self.node_id = node_id
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"cannot create the store root {self.root}: {e}; fix: pass --store-root pointing at a "
                "writable tmpfs directory"
            ) from e
        self._stores: Dict[str, CheckpointStore] = {}
        self._cache: Dict[Tuple[str, str], Tuple[Tuple[int, int, int], Holding]] = {}
        self._lock = threading.Lock()
        # Inbound reservations (router thread: pushes; workers: pulls) and every budget
        # decision about them: one lock, so two admissions never both take the last room.
        self._inflight: Dict[int, "Reservation"] = {}
        self._budget_lock = threading.RLock()

    def get(self, session: str, create: bool = False) -> Optional[CheckpointStore]:
        with self._lock:
            store = self._stores.get(session)
        if store is not None:
            return store
        if not create and not (self.root / session).is_dir():
            return None
        store = CheckpointStore(self.root, session)
        with self._lock:
            return self._stores.setdefault(session, store)

    def sessions(self) -> List[str]:
        out = []
        with contextlib.suppress(FileNotFoundError):
            for p in self.root.iterdir():
                if valid_session_name(p.name) and p.is_dir():
                    out.append(p.name)
        return sorted(out)

    @staticmethod
    def raw_header(store: CheckpointStore, cid: CheckpointId) -> Optional[bytes]:
        return read_or_none(store.header_path(cid))

    def holdings(self, session: str) -> List[Holding]:
        """Published checkpoints of a session, read from the headers (the store is the truth:
        trainers publish and retire without telling the daemon). Parsed headers are cached."""
        store = self.get(session)
        if store is None:
            return []
        out = []
        seen = set()
        with contextlib.suppress(FileNotFoundError):
            for p in store.dir.iterdir():
                name = parse_name(p.name)
                if name is None or name.kind != OWNER or name.suffix != "hdr":
                    continue
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                key = (session, p.name)
                seen.add(key)
                holding = self._cached_holding(key, p, name, (st.st_ino, st.st_mtime_ns, st.st_size))
                if holding is not None:
                    out.append(holding)
        with self._lock:
            for key in [k for k in self._cache if k[0] == session and k not in seen]:
                del self._cache[key]
        return sorted(out, key=lambda h: (h.iteration, h.owner))

    def _cached_holding(
        self, key: Tuple[str, str], path: Path, name: FileName, stamp: Tuple[int, int, int]
    ) -> Optional[Holding]:
        """The holding a header file describes: cached while the file's stamp is unchanged."""
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        holding = self._read_holding(key[0], path, name.iteration, name.rank)
        if holding is not None:
            with self._lock:
                self._cache[key] = (stamp, holding)
        return holding

    def _read_holding(self, session: str, path: Path, iteration: int, owner: int) -> Optional[Holding]:
        """The holding of one header file; None (logged) if unreadable or not what its name says."""
        raw = read_or_none(path)
        if raw is None:
            return None
        try:
            h = CheckpointHeader.unpack(raw, source=str(path))
        except CheckpointingException as e:
            logger.warning("skipping unreadable header %s: %s", path, e)
            return None
        if h.session != session or (h.iteration, h.owner) != (iteration, owner):
            logger.warning("skipping %s: it describes %s", path, h.id)
            return None
        rpn = h.replication.get("ranks_per_node")
        rpn = rpn if isinstance(rpn, int) and not isinstance(rpn, bool) and rpn >= 1 else None
        return Holding(
            iteration=h.iteration,
            owner=h.owner,
            world_size=h.world_size,
            total_bytes=h.data_nbytes,
            header_digest=header_digest(raw),
            replica=None if rpn is None else (h.owner // rpn != self.node_id),
            node=self.node_id,
            ranks_per_node=rpn,
        )

    def usage(self) -> Dict[str, Dict[str, int]]:
        """Bytes per session as the store counts them, except that an inbound reservation
        counts the memory it holds (allocated bytes), not the size its sender announced."""
        out = {}
        with self._budget_lock:  # no reservation appears or is renamed away mid-scan
            for s in self.sessions():
                store = self.get(s)
                if store is not None:
                    with contextlib.suppress(OSError):
                        out[s] = store.usage()
            for res in self._inflight.values():
                u = out.get(res.session)
                if u is not None:
                    held = res.allocated()
                    u["free_pool_bytes"] += held - res.total
                    u["total_bytes"] += held - res.total
        return out

    def total_bytes(self) -> int:
        return sum(u["total_bytes"] for u in self.usage().values())

    def check_budget(
        self,
        budget: Optional[int],
        session: str,
        need: int,
        *,
        exclude: Optional["Reservation"] = None,
        what: Optional[str] = None,
    ) -> None:
        """StoreFullError unless ``need`` more bytes fit the daemon-wide memory budget (all
        sessions' data, reusable pools and the memory inbound transfers hold); idle pooled
        segments and the not-yet-granted tails of inbound reservations (``exclude`` aside) are
        released first. Stored checkpoints are never evicted to make room."""
        if budget is None:
            return
        with self._budget_lock:
            total = self.total_bytes()
            if total + need <= budget:
                return
            for s in self.sessions():
                store = self.get(s)
                if store is not None:
                    with contextlib.suppress(OSError):
                        store.trim_free_pool()
            for res in self._inflight.values():
                if res is not exclude:
                    res.reclaim()
            total = self.total_bytes()
            if total + need <= budget:
                return
        if what is None:
            raise StoreFullError(
                f"a replica of {need} bytes for session {session!r} would bring this daemon's store "
                f"{self.root} to {total + need} bytes, over its memory budget of {budget} bytes; "
                "nothing was written or removed. Fix: raise --memory-budget (at least (keep_last + 1) x "
                "(own + replicated bytes) per node), lower --keep-last, or save fewer bytes per rank"
            )
        raise StoreFullError(
            f"{what}: {need} more bytes would bring this daemon's store {self.root} to {total + need} "
            f"bytes, over its memory budget of {budget} bytes (replicas arriving at the same time took "
            "the room since this one was admitted); the partial replica was discarded, nothing stored was "
            "removed. Fix: COMMIT again once the other transfers finished, or raise --memory-budget"
        )

    # ---- inbound reservations ----------------------------------------------------------------

    def open_inbound(
        self, store: CheckpointStore, session: str, total: int, window: int, budget: Optional[int]
    ) -> "Reservation":
        """Admit an inbound checkpoint of ``total`` bytes (StoreFullError unless all of it fits
        next to what is held) and reserve its segment, backed for the first credit window."""
        with self._budget_lock:
            self.check_budget(budget, session, total)
            res = Reservation(store, session, total)
            self._inflight[id(res)] = res
            try:
                # Admission counted all of it, so the first window needs no second check.
                res.grow(window)
            except BaseException:
                self.forget(res)
                res.release(store)
                raise
        return res

    def grow_inbound(self, res: "Reservation", claim: int, budget: Optional[int], what: str) -> None:
        """Back ``[0, claim)`` of ``res`` before credit for it is granted (StoreFullError if the
        budget has no room left for the growth)."""
        with self._budget_lock:
            need = max(0, min(claim, res.total) - res.backed)
            if need:
                self.check_budget(budget, res.session, need, exclude=res, what=what)
            res.grow(claim)

    def forget(self, res: "Reservation") -> None:
        """``res`` stops being in flight (before it is claimed or released: renamed away)."""
        with self._budget_lock:
            self._inflight.pop(id(res), None)

    def sweep(self, grace_s: float) -> None:
        """Orphan data (no header) of crashed saves or transfers goes back to the pools; a data
        file claimed within ``grace_s`` may be a save in progress and is left alone."""
        now = time.time()
        for s in self.sessions():
            store = self.get(s)
            if store is None:
                continue
            recent = []
            with contextlib.suppress(FileNotFoundError):
                for p in store.dir.iterdir():
                    name = parse_name(p.name)
                    if name is not None and name.kind == OWNER and name.suffix == "data":
                        with contextlib.suppress(FileNotFoundError):
                            if now - p.stat().st_ctime < grace_s:  # claim = rename, sets ctime
                                recent.append(CheckpointId(name.iteration, name.rank, s))
            try:
                store.sweep_orphans(in_flight=recent)
            except OSError as e:
                logger.warning("could not sweep orphans in %s: %s", store.dir, e)


class ReadOnlyMap:
    """A read-only mapping of a published segment: what replication and FETCH send from
    (zero-copy: the frames handed to ZeroMQ are slices of this mapping)."""

    def __init__(self, path: Path, nbytes: int):
        self.nbytes = nbytes
        self._mm: Optional[mmap.mmap] = None
        if nbytes == 0:
            self.view = memoryview(b"")
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise CorruptCheckpointError(f"{path} has {size} bytes, its header says {nbytes} (truncated)")
            # Populated: one batched fault-in instead of a page fault per 4 KiB on first touch.
            self._mm = mmap.mmap(
                fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ
            )
        finally:
            os.close(fd)
        self.view = memoryview(self._mm)

    def close(self) -> None:
        # ZeroMQ may still reference slices (zero-copy frames being sent); then the mapping
        # goes when the last of them does.
        with contextlib.suppress(BufferError):
            self.view.release()
        if self._mm is not None:
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None


_RSV_SEQ = itertools.count()
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; as segment.Segment.populate_pages


class Reservation:
    """The segment an inbound checkpoint is written into, backed by memory only as far as its
    sender may have written.

    ``[0, claim)`` is what the sender may write (credit granted plus one window) and is always
    allocated; ``[0, backed)`` is allocated (reused pool pages, or fallocated ahead); beyond is a
    hole. So a sender that announces N bytes and stalls holds one credit window, not N, and
    reused pages beyond ``claim`` can be handed back under budget pressure (:meth:`reclaim`).
    Writes never touch a hole: a full tmpfs then fails fallocate with STORE_FULL instead of
    killing the daemon with SIGBUS. Quacks like a store Segment (``path``, ``close()``) for
    ``CheckpointStore.claim``; the file is named ``free/rsv_<pid>_…`` like store reservations,
    so a crashed daemon's is recycled by the next start's sweep.
    """

    def __init__(self, store: CheckpointStore, session: str, total: int):
        self.session, self.total = session, total
        self.claim = 0
        self.backed = 0
        self.path = store.free_dir / f"rsv_{os.getpid()}_{time.time_ns()}_{next(_RSV_SEQ)}.data"
        candidate = None
        if total:
            # Reuse a pooled segment's pages (fresh tmpfs pages cost ~10x a memcpy); under the
            # store's lock, which the node's trainers take to pick from the same pool.
            with store._locked():
                candidate = store._pick_free(total)
                if candidate is not None:
                    os.replace(candidate, self.path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._mm: Optional[mmap.mmap] = None
        try:
            st = os.fstat(self._fd)
            if candidate is not None and st.st_blocks * 512 >= st.st_size:  # no holes: all reusable
                self.backed = min(st.st_size, total)
            if st.st_size != total:
                os.ftruncate(self._fd, total)  # shrinking frees the excess, growing adds a hole
            if total:
                self._mm = mmap.mmap(
                    self._fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
                )
        except BaseException:
            self.close()
            with contextlib.suppress(OSError):
                self.path.unlink()
            raise
        self.array = np.frombuffer(self._mm, dtype=np.uint8) if total else None

    def allocated(self) -> int:
        """Bytes of memory the file holds now."""
        try:
            return os.fstat(self._fd).st_blocks * 512
        except OSError:
            return 0

    def grow(self, claim: int) -> None:
        """Make ``[0, claim)`` writable: allocate what is a hole and map it in one batch."""
        claim = min(claim, self.total)
        if claim <= self.claim:
            return
        if claim > self.backed:
            end = min(self.total, -(-claim // _PAGE) * _PAGE)
            try:
                os.posix_fallocate(self._fd, self.backed, end - self.backed)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise StoreFullError(
                        f"out of space for {end - self.backed} more bytes of an incoming replica in "
                        f"{self.path.parent.parent}; the partial replica was discarded, nothing stored was "
                        "removed. Fix: enlarge the shared-memory filesystem (docker run --shm-size, "
                        "Kubernetes emptyDir medium: Memory) or lower --keep-last"
                    ) from e
                raise StoreError(f"cannot allocate {end - self.backed} bytes in {self.path}: {e}") from e
            self.backed = end
        start = self.claim // _PAGE * _PAGE
        with contextlib.suppress(OSError, ValueError):  # older kernel: pages fault in on first write
            self._mm.madvise(_MADV_POPULATE_WRITE, start, claim - start)
        self.claim = claim

    def reclaim(self) -> int:
        """Free the allocated bytes beyond ``claim`` (budget pressure); returns how many."""
        start = min(self.backed, -(-self.claim // _PAGE) * _PAGE)
        n = self.backed - start
        if n <= 0 or self._mm is None:
            return 0
        try:
            self._mm.madvise(mmap.MADV_REMOVE, start, n)  # punches a hole in the file
        except (OSError, ValueError, AttributeError):  # a filesystem that cannot: keep them
            return 0
        self.backed = start
        return n

    def _unmap(self) -> None:
        self.array = None
        if self._mm is not None:
            # Views may still be alive elsewhere: the mapping then goes with the last of them.
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None

    def close(self) -> None:
        self._unmap()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def release(self, store: CheckpointStore) -> None:
        """Back to the pool (a transfer that did not complete), holes cut off: pooled
        segments are fully allocated, which is what their reuse counts on."""
        self._unmap()
        if self._fd >= 0 and self.backed < self.total:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self.backed)
        self.close()
        store.release(self)  # type: ignore[arg-type]  # duck-typed Segment
