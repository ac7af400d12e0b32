"""The in-memory holder: checkpoints as files of a tmpfs directory, mapped into memory.

:class:`CheckpointStore` owns one session's directory: reserving, claiming, publishing and
retiring files, the free pool and the memory budget, scanning and sweeping. What the files
hold is :mod:`.layout`'s (names, headers, tensor layout); mapping a data file read-write is
:mod:`.segment`'s, reading a published one :mod:`.reader`'s.

Layout under ``{root}/{session}/``::

    iter_{iteration:020d}.owner_{owner:06d}.data   tensor bytes, one contiguous segment
    iter_{iteration:020d}.owner_{owner:06d}.hdr    msgpack header, published last (atomic rename)
    iter_{iteration:020d}.parity_{holder:06d}.data parity blocks rank ``holder`` keeps for its group
    iter_{iteration:020d}.parity_{holder:06d}.hdr  their header (:class:`ParityHeader`), published last
    free/seg_{n}.data                              retired segments kept for reuse
    .lock                                          flock for free-pool and budget decisions

A checkpoint exists iff its header exists; the header is written after every byte of the
segment, under a temporary name, then renamed, so a torn write is never taken for a
checkpoint. Files outlive the trainer process (tmpfs), which is the point.

Steady state allocates nothing: retired segments go to the free pool and the next save takes
one of the same size (tmpfs pages stay populated; a fresh tmpfs page costs ~10x a memcpy on
a VM). New segments are ``posix_fallocate``-d (~8x faster than faulting pages on write).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import itertools
import logging
import os
import re
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

from .. import fork_safe_locks
from ..errors import CorruptCheckpointError, ForeignCheckpointError, StoreError, StoreFullError
from .layout import (
    OWNER,
    PARITY,
    PARITY_MAGIC,
    CheckpointHeader,
    CheckpointId,
    ParityId,
    parse_name,
    unpack_envelope,
)
from .reader import CheckpointReader
from .segment import Segment

logger = logging.getLogger(__name__)

DEFAULT_ROOT = "/dev/shm/resilient_ckpt"
SMALL_SHM_BYTES = 1 << 30
_PARSED_HEADERS = 64  # per store: a node's ranks x a few retained iterations
# Unique file names within a process: two threads (prefetcher, replication) may reserve in the
# same nanosecond, and O_CREAT on a shared name would hand both the same file.
_UNIQUE = itertools.count()


class CheckpointStore:
    """One node's holder for one session (job). Safe for several processes of a node."""

    def __init__(
        self,
        root: str | os.PathLike = DEFAULT_ROOT,
        session: str = "default",
        world_size: Optional[int] = None,
        memory_budget: Optional[int] = None,
    ):
        validate_session_id(session)
        self.root = Path(root)
        self.session = session
        self.world_size = world_size
        self.memory_budget = memory_budget
        self.dir = self.root / session
        self.free_dir = self.dir / "free"
        try:
            self.free_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"cannot create the store directory {self.free_dir}: {e}; fix: point store_root at "
                "a writable tmpfs directory (default /dev/shm/resilient_ckpt)"
            ) from e
        for d in (self.dir, self.free_dir):
            if d.is_symlink():
                raise StoreError(
                    f"{d} is a symbolic link (to {os.readlink(d)}); the store never follows links "
                    "out of its root. Fix: remove the link (or point store_root at the real "
                    "directory)"
                )
        self._lock_path = self.dir / ".lock"
        # Parsed headers by path, valid while the file is the same one (inode, size, mtime):
        # a restore reads each header several times (holdings, checks, retrieval, decode), and
        # one of a 50k-tensor checkpoint takes ~0.5 s to parse. Published headers are never
        # rewritten in place (a new one is renamed over it: a new inode).
        self._parsed: "collections.OrderedDict[Path, Tuple[Tuple[int, int, int], CheckpointHeader]]" = (
            collections.OrderedDict()
        )
        self._parsed_lock = threading.Lock()
        _warn_if_small_shm(self.root)

    # ---- locking -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # A child forked meanwhile must not keep the node's store locked after we close.
            fork_safe_locks.hold(fd, str(self._lock_path))
            yield
        finally:
            fork_safe_locks.release(fd)
            os.close(fd)  # releases the lock, also when this process is killed

    # ---- paths -----------------------------------------------------------------------------

    def data_path(self, cid: CheckpointId) -> Path:
        return self.dir / f"{cid.stem()}.data"

    def header_path(self, cid: CheckpointId) -> Path:
        return self.dir / f"{cid.stem()}.hdr"

    def _id(self, iteration: int, owner: int) -> CheckpointId:
        return CheckpointId(int(iteration), int(owner), self.session)

    # ---- space -----------------------------------------------------------------------------

    def usage(self) -> Dict[str, int]:
        """Bytes held: published data, free pool, total, what the store occupies; and the
        filesystem's free bytes."""
        data, free, occupied = self._sizes()
        st = os.statvfs(self.dir)
        return {
            "data_bytes": data,
            "free_pool_bytes": free,
            "total_bytes": data + free,
            "store_bytes": occupied,
            "fs_free_bytes": st.f_bavail * st.f_frsize,
            "fs_total_bytes": st.f_blocks * st.f_frsize,
        }

    def store_bytes(self) -> int:
        """Host memory this session's store occupies on the node: allocated blocks
        (``st_blocks``) of every file in it — own data, replicas, parity, headers, the free
        pool and reservations (a segment being filled counts only the pages it has)."""
        return self._sizes()[2]

    def _sizes(self) -> Tuple[int, int, int]:
        """(bytes of ``.data`` files, bytes of the free pool, allocated bytes of every file):
        one lstat per file."""
        data = free = occupied = 0
        for d in (self.dir, self.free_dir):
            for p in _entries(d):
                try:
                    st = os.lstat(p)
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                occupied += st.st_blocks * 512
                if d is self.free_dir:
                    free += st.st_size
                elif p.suffix == ".data":
                    data += st.st_size
        return data, free, occupied

    def _preflight(self, need: int, candidate: Optional[Path] = None) -> None:
        """Raise StoreFullError, before anything is written, if ``need`` bytes do not fit.

        ``candidate`` is the pooled segment the write will reuse; other idle pooled segments are
        released first when the budget would otherwise be exceeded (never a stored checkpoint).
        """
        reusable = _size(candidate) if candidate is not None else 0
        fresh = max(0, need - reusable)
        u = self.usage()
        if self.memory_budget is not None and u["total_bytes"] + fresh > self.memory_budget:
            self.trim_free_pool(locked=True, spare=candidate)
            u = self.usage()
        if self.memory_budget is not None and u["total_bytes"] + fresh > self.memory_budget:
            raise StoreFullError(
                f"a checkpoint segment of {_human(need)} would bring store {self.dir} to "
                f"{_human(u['total_bytes'] + fresh)} ({_human(u['data_bytes'])} in stored "
                f"checkpoints, {_human(u['free_pool_bytes'])} in reusable segments), over its "
                f"memory budget of {_human(self.memory_budget)}; nothing was written or removed. "
                "Fix: raise memory_budget (at least (keep_last + 1) x (own + replicated bytes) "
                "per node), lower keep_last, or save fewer bytes per rank"
            )
        if fresh > u["fs_free_bytes"]:
            raise StoreFullError(
                f"a checkpoint segment needs {_human(fresh)} more in {self.root} but only "
                f"{_human(u['fs_free_bytes'])} of {_human(u['fs_total_bytes'])} is free; nothing "
                "was written or removed. Fix: enlarge the shared-memory filesystem (docker run "
                "--shm-size, Kubernetes emptyDir medium: Memory with sizeLimit), lower keep_last, "
                "or point store_root at a larger tmpfs"
            )

    # ---- write path ----------------------------------------------------------------------------

    def reserve(self, nbytes: int, populate: bool = True) -> Segment:
        """A mapped, writable segment of ``nbytes`` not yet tied to a checkpoint.

        Recycled from the free pool when possible (no new pages), else fallocated. Reserved
        files are invisible to other processes' pools. Raises StoreFullError (nothing written
        or removed) if space or budget is short.
        """
        path = self.free_dir / f"rsv_{os.getpid()}_{time.time_ns()}_{next(_UNIQUE)}.data"
        with self._locked():
            candidate = self._pick_free(nbytes)
            self._preflight(nbytes, candidate)
            if candidate is not None:
                os.replace(candidate, path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            if size > nbytes:
                os.ftruncate(fd, nbytes)
            elif size < nbytes:
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as e:
                    os.close(fd)
                    fd = -1
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                    if e.errno == errno.ENOSPC:
                        raise StoreFullError(
                            f"out of space allocating {_human(nbytes)} in {self.root}; nothing "
                            "stored was removed. Fix: enlarge the shared-memory filesystem "
                            "(docker run --shm-size, Kubernetes emptyDir medium: Memory) or "
                            "lower keep_last"
                        ) from e
                    raise StoreError(f"cannot allocate {_human(nbytes)} in {self.root}: {e}") from e
        finally:
            if fd >= 0:
                os.close(fd)
        return Segment(path, nbytes, populate=populate)

    def claim(self, segment: Segment, iteration: int, owner: int) -> CheckpointId:
        """Give a reserved segment its checkpoint name (the mapping stays valid)."""
        cid = self._id(iteration, owner)
        if self.header_path(cid).exists():
            try:
                self.read_header(cid)
            except (ForeignCheckpointError, CorruptCheckpointError) as e:
                raise StoreError(
                    f"cannot store {cid.stem()} in {self.dir}: a checkpoint this build cannot use "
                    f"holds that name ({e}). Fix: remove it (`resilient-ckpt drop`, or delete "
                    f"{self.header_path(cid)}) or use another session id"
                ) from e
            except StoreError:
                pass  # removed meanwhile: the claim below goes ahead
            else:
                raise StoreError(
                    f"checkpoint {cid.stem()} is already published in {self.dir}; iterations must "
                    "increase (discard it first to overwrite)"
                )
        target = self.data_path(cid)
        os.replace(segment.path, target)
        segment.path = target
        return cid

    def release(self, segment: Segment, recycle: bool = True) -> None:
        """Return an unpublished segment to the pool (a save that failed before publish, a
        spare not needed), or free its memory (``recycle=False``)."""
        segment.close()
        if not recycle:
            with contextlib.suppress(FileNotFoundError):
                segment.path.unlink()
        elif segment.path.exists():
            with self._locked():
                with contextlib.suppress(FileNotFoundError):
                    os.replace(segment.path, self._pool_name())

    def allocate(self, iteration: int, owner: int, nbytes: int, populate: bool = True) -> Segment:
        seg = self.reserve(nbytes, populate=populate)
        try:
            self.claim(seg, iteration, owner)
        except BaseException:
            self.release(seg)
            raise
        return seg

    def _pool_name(self) -> Path:
        return self.free_dir / f"seg_{os.getpid()}_{time.time_ns()}_{next(_UNIQUE)}.data"

    def _pick_free(self, nbytes: int) -> Optional[Path]:
        """Smallest pooled segment that fits, else the largest (grown by fallocate)."""
        best = None
        best_size = -1
        for p in _pool_files(self.free_dir, "seg_"):
            s = _size(p)
            if best is None:
                better = True
            elif s >= nbytes:
                better = best_size < nbytes or s < best_size
            else:
                better = best_size < nbytes and s > best_size
            if better:
                best, best_size = p, s
        return best

    def publish(self, segment: Segment, header: CheckpointHeader) -> CheckpointId:
        """Make the checkpoint visible: header written under a temp name, then renamed."""
        cid = header.id
        if cid.session != self.session:
            raise StoreError(f"header session {cid.session!r} does not match store {self.session!r}")
        if segment.path != self.data_path(cid):
            raise StoreError(f"segment {segment.path} does not belong to {cid.stem()}")
        self.write_header(header)
        return cid

    def write_header(self, header: CheckpointHeader) -> None:
        path = self.header_path(header.id)
        st = self._publish_header(header.id, header.pack())
        if header.created_ns and header.writer:
            # What a read of this file would parse (the fields pack fills in are set): later
            # reads of it (retention, restore) need not parse 50k tensor entries again.
            self._remember_parsed(path, (st.st_ino, st.st_size, st.st_mtime_ns), header)

    def write_raw_header(self, raw: bytes, expect: CheckpointId) -> CheckpointHeader:
        """Publish a header received from a peer after checking it describes ``expect``."""
        header = CheckpointHeader.unpack(raw, source=f"replica header for {expect.stem()}")
        if header.id != expect:
            raise CorruptCheckpointError(f"replica header describes {header.id}, expected {expect}")
        self.write_header(header)
        return header

    # ---- read path ---------------------------------------------------------------------------

    def list(self) -> List[CheckpointId]:
        """Published checkpoints of this session (headers present), sorted."""
        out = []
        for p in _entries(self.dir):
            name = parse_name(p.name)
            if name is not None and name.kind == OWNER and name.suffix == "hdr":
                if _regular(p):
                    out.append(self._id(name.iteration, name.rank))
                elif os.path.lexists(p):  # else retired meanwhile (another rank of the node)
                    _ignore(p, "a checkpoint name on something that is not a regular file")
            elif not (p.name in ("free", ".lock") or name is not None or p.name.startswith(".")):
                _ignore(p, "not a file this store writes")
        return sorted(out)

    def list_parity(self) -> List[ParityId]:
        """Published parity files of this session (headers present), sorted."""
        out = []
        for p in _entries(self.dir):
            name = parse_name(p.name)
            if name is not None and name.kind == PARITY and name.suffix == "hdr" and _regular(p):
                out.append(ParityId(name.iteration, name.rank, self.session))
        return sorted(out)

    def claim_parity(self, segment: Segment, pid: ParityId) -> None:
        """Give a reserved segment a parity file's name (one left by an abandoned save of the
        same iteration is replaced: parity is recomputed by every save)."""
        self.discard(pid)
        target = self.data_path(pid)
        os.replace(segment.path, target)
        segment.path = target

    def write_parity_header(self, raw: bytes, pid: ParityId) -> None:
        self._publish_header(pid, raw)

    def _publish_header(self, fid: Any, raw: bytes) -> os.stat_result:
        """Write a header under a temporary name and rename it into place (a reader sees
        all of it or nothing); returns the written file's stat."""
        tmp = self.dir / f".{fid.stem()}.hdr.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(raw)
            st = os.fstat(f.fileno())
        os.replace(tmp, self.header_path(fid))
        return st

    def read_parity_header(self, pid: ParityId) -> Dict[str, Any]:
        """The parity header's fields (verified envelope, magic, version, session, id)."""
        path = self.header_path(pid)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise StoreError(f"no parity file {pid.stem()} in {self.dir}") from None
        d = unpack_envelope(raw, str(path), PARITY_MAGIC)
        if d.get("session") != self.session or (d.get("iteration"), d.get("holder")) != (
            pid.iteration,
            pid.holder,
        ):
            raise CorruptCheckpointError(f"{path} does not describe {pid.stem()} of session {self.session!r}")
        return d

    def read_header(self, cid: CheckpointId) -> CheckpointHeader:
        path = self.header_path(cid)
        header = self.read_header_any_world(cid)
        if self.world_size is not None and header.world_size != self.world_size:
            raise ForeignCheckpointError(
                f"{path} was written by a job of world size {header.world_size}, this job has "
                f"{self.world_size}; it cannot be restored here (restore with the original world "
                "size, or drop the store with `resilient-ckpt drop`)"
            )
        return header

    def read_header_any_world(self, cid: CheckpointId) -> CheckpointHeader:
        """:meth:`read_header` without the world-size filter (a checkpoint of another world
        size is restored resharded); parsed at most once per file, like every header."""
        path = self.header_path(cid)
        try:
            header = self._parse_header(path)
        except FileNotFoundError:
            raise StoreError(f"no checkpoint {cid.stem()} in {self.dir}") from None
        if header.session != self.session:
            raise ForeignCheckpointError(
                f"{path} belongs to session {header.session!r}, this store serves session "
                f"{self.session!r}; it is not loaded (restore it with session_id="
                f"{header.session!r}, or remove the file)"
            )
        if header.id != cid:
            raise CorruptCheckpointError(
                f"{path} describes {header.id.stem()} (file name and header disagree); it is not loaded"
            )
        return header

    def _parse_header(self, path: Path) -> CheckpointHeader:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            with self._parsed_lock:  # the save thread and the caller's thread share the store
                hit = self._parsed.get(path)
                if hit is not None and hit[0] == key:
                    self._parsed.move_to_end(path)
                    return hit[1]
            header = CheckpointHeader.unpack(f.read(), source=str(path))
        self._remember_parsed(path, key, header)
        return header

    def _remember_parsed(self, path: Path, key: tuple, header: CheckpointHeader) -> None:
        with self._parsed_lock:
            self._parsed[path] = (key, header)
            self._parsed.move_to_end(path)
            while len(self._parsed) > _PARSED_HEADERS:
                self._parsed.popitem(last=False)

    def open(self, cid: CheckpointId) -> CheckpointReader:
        header = self.read_header(cid)
        try:
            return CheckpointReader(header, self.data_path(cid))
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{self.data_path(cid)} is missing although its header is published"
            ) from None

    def other_sessions(self) -> List[str]:
        """Sessions under the same root that hold published checkpoints (for diagnostics)."""
        out = []
        with contextlib.suppress(OSError):
            for d in self.root.iterdir():
                if d.name == self.session or d.is_symlink() or not d.is_dir():
                    continue
                with contextlib.suppress(OSError):
                    if any(_is_checkpoint_header(p.name) for p in d.iterdir()):
                        out.append(d.name)
        return sorted(out)

    # ---- retire ------------------------------------------------------------------------------

    def _unpublish(self, cid: CheckpointId) -> None:
        """Remove ``cid``'s header file and forget its parsed header (a header of 50k tensors
        is megabytes: retired ones must not stay in the cache until 64 newer ones push them
        out — with ``keep_last=1`` that was a trainer's memory growing save after save)."""
        path = self.header_path(cid)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        with self._parsed_lock:
            self._parsed.pop(path, None)

    def discard(self, cid: CheckpointId, recycle: bool = True) -> None:
        """Unpublish (header first, so no reader takes it as complete) and recycle the data."""
        self._unpublish(cid)
        data = self.data_path(cid)
        if not data.exists():
            return
        if recycle:
            with self._locked():
                with contextlib.suppress(FileNotFoundError):
                    os.replace(data, self._pool_name())
        else:
            with contextlib.suppress(FileNotFoundError):
                data.unlink()

    def unpublish_mapped(self, cid: CheckpointId, segment: Segment) -> bool:
        """Retire ``cid`` whose data ``segment`` this process still maps: header removed, data
        renamed to a reservation of this process (other processes' pools never take it) and
        the segment moved with it, ready to be written again. False (nothing done but the
        header) if its data is gone."""
        self._unpublish(cid)
        path = self.free_dir / f"rsv_{os.getpid()}_{time.time_ns()}_{next(_UNIQUE)}.data"
        try:
            os.replace(self.data_path(cid), path)
        except FileNotFoundError:
            return False
        segment.path = path
        return True

    def retain(
        self, keep_iterations: Iterable[int], owners: Optional[Iterable[int]] = None
    ) -> List[CheckpointId]:
        """Discard checkpoints (of ``owners``, default all) whose iteration is not kept."""
        keep = set(keep_iterations)
        owner_set = None if owners is None else set(owners)
        dropped = []
        for cid in self.list():
            if cid.iteration not in keep and (owner_set is None or cid.owner in owner_set):
                self.discard(cid)
                dropped.append(cid)
        return dropped

    def sweep_orphans(self, in_flight: Iterable[CheckpointId] = ()) -> None:
        """Data files without a header (a crashed save) go to the free pool."""
        busy = {self.data_path(c) for c in in_flight}
        published = {self.data_path(c) for c in [*self.list(), *self.list_parity()]}
        with contextlib.suppress(FileNotFoundError):
            for p in self.dir.iterdir():
                name = parse_name(p.name)
                if (
                    name is not None
                    and name.suffix == "data"
                    and p not in published
                    and p not in busy
                    and _regular(p)
                ):
                    logger.info("recycling %s: data without a header (a save that did not finish)", p)
                    with self._locked():
                        with contextlib.suppress(FileNotFoundError):
                            os.replace(p, self._pool_name())
                elif p.name.endswith(".tmp") and p.name.startswith("."):
                    # A header being written when its process died: never published, remove.
                    pid = p.name.rsplit(".", 2)[-2]
                    if pid.isdigit() and not _pid_alive(int(pid)):
                        with contextlib.suppress(FileNotFoundError):
                            p.unlink()
        # Reservations of processes that died (SIGKILL mid-save) go back to the pool too.
        for p in _pool_files(self.free_dir, "rsv_"):
            pid = p.name.split("_")[1]
            if not pid.isdigit():
                _ignore(p, "a reservation name without a process id")
            elif not _pid_alive(int(pid)):
                with self._locked():
                    with contextlib.suppress(FileNotFoundError):
                        os.replace(p, self._pool_name())

    def trim_free_pool(self, keep_bytes: int = 0, locked: bool = False, spare: Optional[Path] = None) -> int:
        """Release pooled segments beyond ``keep_bytes``; returns bytes released.

        ``spare`` (a segment about to be reused) is never released nor counted.
        """
        released = 0
        with contextlib.nullcontext() if locked else self._locked():
            files = sorted((p for p in _pool_files(self.free_dir, "seg_") if p != spare), key=_size)
            total = sum(_size(p) for p in files)
            for p in reversed(files):
                if total <= keep_bytes:
                    break
                s = _size(p)
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                total -= s
                released += s
        return released

    def destroy(self) -> None:
        """Remove this session's store entirely (operator action)."""
        shutil.rmtree(self.dir, ignore_errors=True)


# ---- robust scanning -----------------------------------------------------------------------
# A store root is shared with operators and other jobs: anything this store did not write
# (a stray file, a directory where a segment should be, a symbolic link) is ignored and
# logged once, never followed and never a reason to fail — so every node reaches the same
# outcome whatever lies in its store.

_IGNORED: set = set()
_SESSION = re.compile(r"^[A-Za-z0-9_+=@:-][A-Za-z0-9._+=@:-]{0,199}$")


class InvalidSessionError(StoreError, ValueError):
    """A session id that cannot name a store directory."""


def validate_session_id(session: object) -> str:
    """A session id names a directory of the store root: 1-200 characters of letters,
    digits and ``. _ + = @ : -``, not starting with a dot (no path separators, no NUL)."""
    if not isinstance(session, str) or not _SESSION.match(session):
        raise InvalidSessionError(
            f"invalid session id {session!r}: use a plain name of 1-200 letters, digits and "
            "'._+=@:-' that does not start with '.' (no '/', no NUL, not empty) — e.g. the job's "
            "name or its scheduler id"
        )
    return session


def _is_checkpoint_header(name: str) -> bool:
    parsed = parse_name(name)
    return parsed is not None and parsed.kind == OWNER and parsed.suffix == "hdr"


def _entries(d: Path) -> List[Path]:
    try:
        return list(d.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _regular(p: Path) -> bool:
    """A regular file, not followed through a link."""
    try:
        return stat.S_ISREG(os.lstat(p).st_mode)
    except FileNotFoundError:
        return False


def _pool_files(free_dir: Path, prefix: str) -> List[Path]:
    out = []
    for p in _entries(free_dir):
        if not p.name.startswith(prefix):
            continue
        if _regular(p):
            out.append(p)
        elif p.exists() or p.is_symlink():
            _ignore(p, "not a regular file")
    return out


def _ignore(p: Path, why: str) -> None:
    if str(p) not in _IGNORED:
        _IGNORED.add(str(p))
        logger.warning("ignoring %s in the checkpoint store: %s (remove it to silence this)", p, why)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return 0


def _human(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1, plus the exact count."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


_WARNED_SMALL = set()


def _warn_if_small_shm(root: Path) -> None:
    try:
        st = os.statvfs(root)
    except OSError:
        return
    total = st.f_blocks * st.f_frsize
    if total < SMALL_SHM_BYTES and str(root) not in _WARNED_SMALL:
        _WARNED_SMALL.add(str(root))
        logger.warning(
            "store root %s is on a filesystem of only %s (containers default /dev/shm to 64 MiB); "
            "checkpoints larger than that will fail: run the container with --shm-size, or mount "
            "an emptyDir with medium: Memory, or set store_root to a larger tmpfs",
            root,
            _human(total),
        )
