"""``resilient-ckpt status | ls | drop | pull | secret``: the operator's view of a node.

- ``ls`` lists sessions, iterations, owner ranks, sizes and whether this node holds every
  owner's data ("local copies of N/W owners"). It reads a store root directly
  (``--store-root R``, no daemon needed: a node whose daemon is down, or embedded mode) or asks
  the node's daemon (``--endpoint tcp://HOST:PORT``; ``--peers`` adds which node holds each
  rank across the job's reachable daemons).
- ``drop --session S (--iteration N ... | --all)`` retires checkpoints, asking first unless
  ``--yes``. On a store root every selected header is removed before any data file, so an
  interrupted drop never leaves a header whose bytes are gone; ``--all`` removes the session's
  directory (free pool included), releasing its memory. Through a daemon, the daemon retires
  its own copies.
- ``status --endpoint E`` shows a daemon's node id, versions, store usage against its
  filesystem, peers, in-flight replications and rejected-message counters; exit 0 when it
  answered, so it doubles as a liveness probe.
- ``pull --endpoint E --session S`` has the node's daemon bring checkpoints into its store
  from its peers: by default this node's ranks of the newest complete iteration (what a
  replacement node needs before its trainers start), with a progress bar on a terminal.
- ``secret FILE`` writes a job secret (mode 0600): random, or derived from a cluster key and a
  label (``--derive-from KEY --label JOB``: the same on every node, nothing to distribute).

Human-readable tables by default; ``--json`` prints one JSON document for scripts (its
``format`` key is versioned). Exit codes: 0 success, 1 a store or checkpoint problem (or a drop
that was declined), 2 a usage error, a missing secret, or a daemon that did not answer.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import hmac
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..errors import CheckpointingException, StoreError

#: Bump when a key of the ``--json`` documents changes meaning or disappears.
JSON_FORMAT = 1
EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2
STORE_ROOT_ENV = "RESILIENT_CKPT_STORE_ROOT"
ENDPOINT_ENV = "RESILIENT_CKPT_ENDPOINT"


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
            "created": _iso(self.created_ns),
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

    @property
    def newest_complete(self) -> Optional[int]:
        done = [it.iteration for it in self.iterations if it.complete]
        return max(done) if done else None

    def as_json(self) -> Dict[str, Any]:
        return {
            "session": self.session,
            "data_bytes": self.data_bytes,
            "free_pool_bytes": self.free_pool_bytes,
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


def _open_store(root: str | os.PathLike, session: str):
    from ..memory.store import CheckpointStore

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
    return SessionSummary(session, tuple(iterations), u["data_bytes"], u["free_pool_bytes"], tuple(problems))


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


# ---- formatting helpers --------------------------------------------------------------------------


def human_bytes(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def ranges(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"`` (owner lists of large jobs stay short)."""
    out = []
    vals = sorted(set(values))
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        out.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    return ",".join(out) or "-"


def _iso(ns: int) -> Optional[str]:
    if not ns:
        return None
    return _dt.datetime.fromtimestamp(ns / 1e9).astimezone().isoformat(timespec="seconds")


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(file=sys.stderr if stderr else sys.stdout, highlight=False)


def _fail(msg: str, code: int = EXIT_PROBLEM) -> int:
    print(f"resilient-ckpt: error: {msg}", file=sys.stderr)
    return code


def _print_json(doc: Dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc, indent=1, sort_keys=False) + "\n")


def _owners_cell(it_world: int, owners: Sequence[int]) -> str:
    n = len(owners)
    return f"local copies of {n}/{it_world} owners" + ("" if n == it_world else f" (holds {ranges(owners)})")


def _render_scan(scan: StoreScan) -> None:
    con = _console()
    used = scan.fs_total_bytes - scan.fs_free_bytes
    con.print(
        f"store root {scan.root}: filesystem {human_bytes(used)} used of "
        f"{human_bytes(scan.fs_total_bytes)} ({human_bytes(scan.fs_free_bytes)} free)"
    )
    from ..memory.store import SMALL_SHM_BYTES

    if scan.fs_total_bytes < SMALL_SHM_BYTES:
        con.print(
            f"[yellow]warning: this filesystem has only {human_bytes(scan.fs_total_bytes)} "
            "(containers default /dev/shm to 64 MiB): run with --shm-size or an emptyDir with "
            "medium: Memory[/yellow]"
        )
    _render_sessions(scan)


def _render_sessions(scan: StoreScan) -> None:
    from rich.table import Table

    con = _console()
    if not scan.sessions:
        con.print("no sessions")
        return
    for s in scan.sessions:
        latest = s.newest_complete
        con.print(
            f"\nsession [bold]{s.session}[/bold]: {human_bytes(s.data_bytes)} in checkpoints, "
            f"{human_bytes(s.free_pool_bytes)} in reusable segments; newest iteration complete "
            f"here: {'none' if latest is None else latest}"
        )
        if s.iterations:
            t = Table(show_edge=False, pad_edge=False)
            t.add_column("iteration", justify="right", no_wrap=True)
            t.add_column("world", justify="right", no_wrap=True)
            t.add_column("owners held on this node", overflow="fold")
            t.add_column("complete here", no_wrap=True)
            t.add_column("size", justify="right", no_wrap=True)
            t.add_column("created", no_wrap=True)
            for it in s.iterations:
                state = "yes" if it.complete else "no"
                if it.conflicting_world_sizes:
                    state = f"no (headers also say world size {ranges(it.conflicting_world_sizes)})"
                t.add_row(
                    str(it.iteration),
                    str(it.world_size),
                    _owners_cell(it.world_size, it.owners),
                    state,
                    human_bytes(it.data_bytes),
                    (_iso(it.created_ns) or "-").replace("T", " "),
                )
            if not any(it.created_ns for it in s.iterations):
                t.columns.pop()  # a daemon's LIST carries no creation times
            con.print(t)
        for p in s.problems:
            con.print(f"[red]unusable: {p.file}: {p.error}[/red]")


# ---- argument plumbing shared by the commands -------------------------------------------------------


def _add_daemon_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--secret-file", help="the job secret for a daemon (default $RESILIENT_CKPT_SECRET_FILE)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a daemon's answer (default 5)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout, for scripts")


def _add_target(p: argparse.ArgumentParser, daemon_help: str) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--store-root",
        help=f"read/modify the store directly, no daemon needed (default ${STORE_ROOT_ENV} or "
        "/dev/shm/resilient_ckpt)",
    )
    g.add_argument("--endpoint", help=daemon_help + f" (default ${ENDPOINT_ENV})")
    _add_daemon_options(p)


def _target(args: argparse.Namespace) -> Tuple[str, str]:
    """("daemon", endpoint) or ("store", root): an explicit flag wins over the environment."""
    if args.store_root:
        return "store", args.store_root
    if args.endpoint:
        return "daemon", args.endpoint
    if os.environ.get(ENDPOINT_ENV):
        return "daemon", os.environ[ENDPOINT_ENV]
    from ..memory.store import DEFAULT_ROOT

    return "store", os.environ.get(STORE_ROOT_ENV) or DEFAULT_ROOT


def confirm(question: str, assume_yes: bool) -> bool:
    """Ask on the terminal; no answer (EOF, e.g. stdin not a terminal) means no."""
    if assume_yes:
        return True
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    try:
        answer = sys.stdin.readline()
    except (OSError, ValueError):
        answer = ""
    if not answer:
        sys.stderr.write("\n")
        print("resilient-ckpt: no answer on stdin; pass --yes to drop without asking", file=sys.stderr)
        return False
    return answer.strip().lower() in ("y", "yes")


# ---- ls ---------------------------------------------------------------------------------------------


def ls_main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="resilient-ckpt ls",
        description="List the checkpoints this node holds: sessions, iterations, owner ranks, "
        "sizes, and whether every owner's data is here.",
    )
    _add_target(p, "ask the node's daemon at this ZeroMQ endpoint, e.g. tcp://127.0.0.1:7465")
    p.add_argument("--session", help="only this session")
    p.add_argument("--peers", action="store_true", help="with a daemon: also show which node holds each rank, "
                   "across every reachable daemon of the job")
    args = p.parse_args(argv)
    kind, where = _target(args)
    if kind == "daemon":
        return _ls_daemon(args, where)
    if args.peers:
        p.error("--peers needs a daemon (--endpoint): a store root only knows its own node")
    try:
        scan = scan_store(where, args.session)
    except CheckpointingException as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"cannot read the store at {where}: {e}")
    if args.json:
        _print_json(scan.as_json())
    else:
        _render_scan(scan)
    return EXIT_OK


# ---- drop -------------------------------------------------------------------------------------------


def drop_main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="resilient-ckpt drop",
        description="Retire checkpoints of a session from this node (asks first unless --yes).",
    )
    _add_target(p, "have the node's daemon drop them, e.g. tcp://127.0.0.1:7465")
    p.add_argument("--session", required=True, help="the job's session id")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--iteration", type=int, action="append", metavar="N", help="drop iteration N (repeatable)"
    )
    what.add_argument("--all", action="store_true", help="drop the whole session, releasing all its memory")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    args = p.parse_args(argv)
    kind, where = _target(args)
    if kind == "daemon":
        return _drop_daemon(args, where)
    try:
        scan = scan_store(where, args.session)
        question = _drop_question(scan.sessions[0], args, where)
    except CheckpointingException as e:
        return _fail(str(e))
    except _Exit as e:
        return _fail(str(e), e.code)
    s = scan.sessions[0]
    if not confirm(question, args.yes):
        return _fail("nothing was dropped")
    try:
        res = drop_session(where, s.session) if args.all else drop_iterations(where, s.session, args.iteration)
    except CheckpointingException as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"drop in {where} failed: {e}")
    if args.json:
        _print_json(res.as_json())
    else:
        what_ = "session" if res.whole_session else f"iteration(s) {ranges(sorted({i for i, _ in res.dropped}))} of session"
        _console().print(
            f"dropped {what_} {res.session!r}: {len(res.dropped)} checkpoint(s), "
            f"{human_bytes(res.released_bytes)} released"
        )
    return EXIT_OK


def _drop_question(s: SessionSummary, args: argparse.Namespace, where: str) -> str:
    """What the confirmation prompt says; _Exit if an asked-for iteration is not held."""
    if args.all:
        return (
            f"Drop session {s.session!r} from {where}: {len(s.iterations)} iteration(s), "
            f"{human_bytes(s.data_bytes + s.free_pool_bytes)} released?"
        )
    held = {it.iteration: it for it in s.iterations}
    absent = [i for i in args.iteration if i not in held]
    if absent:
        raise _Exit(
            EXIT_PROBLEM,
            f"session {s.session!r} at {where} holds no iteration {ranges(absent)} "
            f"(it holds: {ranges(sorted(held)) if held else 'none'}); nothing was dropped",
        )
    chosen = [held[i] for i in sorted(set(args.iteration))]
    question = (
        f"Drop iteration(s) {ranges([c.iteration for c in chosen])} of session {s.session!r} "
        f"from {where}: {sum(len(c.owners) for c in chosen)} checkpoint(s), "
        f"{human_bytes(sum(c.data_bytes for c in chosen))}?"
    )
    latest = s.newest_complete
    if latest is not None and latest in {c.iteration for c in chosen}:
        older = [it.iteration for it in s.iterations if it.complete and it.iteration < latest]
        question += (
            f" Iteration {latest} is the newest complete one here; a restart would fall back to "
            + (f"iteration {max(older)}." if older else "nothing held on this node.")
        )
    return question


# ---- secret -----------------------------------------------------------------------------------------


def derive_secret(cluster_key: bytes, label: str) -> bytes:
    """A job secret that every node computes alike from a cluster key and the job's label.

    Lets a Slurm prolog give each job its own secret without distributing anything per job:
    only the cluster key (a 0600 file on every node, like munge's key) is shared, and a job's
    secret reveals nothing about the key or about other jobs' secrets (HMAC-SHA256).
    """
    if not label:
        raise StoreError("derive_secret needs a non-empty label (the job id)")
    mac = hmac.new(bytes(cluster_key), b"resilient-ckpt job secret\x00" + label.encode("utf-8"), hashlib.sha256)
    return mac.hexdigest().encode("ascii")


def secret_main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="resilient-ckpt secret",
        description="Write a job secret (64 hex characters) to FILE with mode 0600, for "
        "RESILIENT_CKPT_SECRET_FILE / serve --secret-file: a random one, or with --derive-from "
        "one every node computes alike from a cluster key and --label.",
    )
    p.add_argument("file")
    p.add_argument("--force", action="store_true", help="replace an existing file (rotation)")
    p.add_argument("--derive-from", metavar="KEY_FILE", help="derive the secret from this cluster key (a 0600 "
                   "file, the same on every node) and --label, instead of drawing a random one")
    p.add_argument("--label", help="what the derived secret is for, e.g. the job id (needs --derive-from)")
    args = p.parse_args(argv)
    if bool(args.derive_from) != bool(args.label):
        p.error("--derive-from and --label go together")
    from ..service.wire.auth import load_secret, write_secret_file

    if os.path.exists(args.file) and not args.force:
        return _fail(f"{args.file} exists; pass --force to replace it (every daemon and trainer must then reload)")
    try:
        secret = derive_secret(load_secret(args.derive_from), args.label) if args.derive_from else None
        write_secret_file(args.file, secret)
    except CheckpointingException as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"cannot write {args.file}: {e}")
    how = f"derived for {args.label!r}" if args.derive_from else "new random"
    print(f"wrote a {how} job secret to {args.file} (mode 0600)")
    return EXIT_OK


# ---- talking to a daemon --------------------------------------------------------------------------


class _Exit(Exception):
    """Ends a command with an exit code and a one-line message on stderr."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


@contextlib.contextmanager
def _daemon_errors(endpoint: str, timeout: float):
    """Turn a daemon conversation's failures into one clear line and an exit code."""
    from ..service.client import DaemonError
    from ..service.wire.protocol import PeerTimeout, PeerUnreachable, ProtocolConfigError

    try:
        yield
    except (PeerTimeout, PeerUnreachable) as e:
        skew = getattr(e, "clock_skew_s", None)
        raise _Exit(
            EXIT_USAGE,
            f"no answer from a daemon at {endpoint} within {timeout:g} s: it is not running there, "
            "or it does not use this job's secret (it drops messages it cannot authenticate without "
            "answering). Check the daemon (systemctl status resilient-ckpt, kubectl logs, the Slurm "
            f"prolog log), the endpoint, and --secret-file ({type(e).__name__})"
            + ("" if skew is None else
               f". Also, an answer came back timestamped {skew:+.1f} s from this host's clock: synchronise "
               "clocks (NTP/chrony), a skew beyond the replay window makes each side drop the other's messages"),
        ) from None
    except ProtocolConfigError as e:  # no or unusable secret, bad endpoint
        raise _Exit(EXIT_USAGE, str(e)) from None
    except DaemonError as e:
        hint = ""
        if getattr(e, "code", None) is not None and e.code.value == "WRONG_SESSION":
            hint = "; pass --session with a session the daemon serves (its --session list)"
        raise _Exit(EXIT_PROBLEM, f"the daemon at {endpoint} refused: {e}{hint}") from None
    except CheckpointingException as e:
        raise _Exit(EXIT_PROBLEM, str(e)) from None


def _client(endpoint: str, session: str, args: argparse.Namespace):
    from ..service.wire.auth import authenticator_from_env
    from ..service.client import DaemonClient

    # Operator commands ask once: a retry would only double the wait for an absent daemon.
    return DaemonClient(endpoint, session, authenticator_from_env(args.secret_file), timeout_s=args.timeout, retries=0)


#: DaemonClient needs a session; STATUS does not look at it. Any plain name passes the
#: daemon's check unless it serves an explicit --session list (then pass one of them).
_ANY_SESSION = "-"


def _fs_usage(status: Mapping[str, Any]) -> Optional[Dict[str, int]]:
    """The store filesystem's size: from the daemon if it says, else read here when the
    daemon's store root is visible on this machine (the usual case: status on the node)."""
    store = status.get("store") or {}
    if "fs_total_bytes" in store and "fs_free_bytes" in store:
        return {"total_bytes": int(store["fs_total_bytes"]), "free_bytes": int(store["fs_free_bytes"])}
    root = store.get("root")
    if not root:
        return None
    try:
        st = os.statvfs(root)
    except OSError:
        return None
    return {"total_bytes": st.f_blocks * st.f_frsize, "free_bytes": st.f_bavail * st.f_frsize}


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    parts = [f"{d}d"] * bool(d) + [f"{h}h"] * bool(h) + [f"{m}m"] * bool(m)
    return " ".join(parts + [f"{s}s"]) if not d else " ".join(parts)


# ---- status -----------------------------------------------------------------------------------------


def status_main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="resilient-ckpt status",
        description="Show a node daemon's health. Exit 0 when it answered (usable as a liveness "
        "probe), 2 when it did not.",
    )
    p.add_argument("--endpoint", default=os.environ.get(ENDPOINT_ENV), help="the daemon's ZeroMQ endpoint, e.g. "
                   f"tcp://127.0.0.1:7465 (default ${ENDPOINT_ENV})")
    p.add_argument("--session", default=_ANY_SESSION, help="a session the daemon serves (only needed when it "
                   "was started with --session)")
    _add_daemon_options(p)
    args = p.parse_args(argv)
    if not args.endpoint:
        p.error(f"--endpoint is required (or set ${ENDPOINT_ENV})")
    try:
        with _daemon_errors(args.endpoint, args.timeout):
            with _client(args.endpoint, args.session, args) as c:
                st = c.status()
    except _Exit as e:
        return _fail(str(e), e.code)
    fs = _fs_usage(st)
    if args.json:
        _print_json({"format": JSON_FORMAT, "endpoint": args.endpoint, "filesystem": fs, "daemon": st})
    else:
        _render_status(args.endpoint, st, fs)
    return EXIT_OK


def _render_status(endpoint: str, st: Mapping[str, Any], fs: Optional[Mapping[str, int]]) -> None:
    from rich.table import Table

    con = _console()
    store = st.get("store") or {}
    con.print(
        f"daemon [bold]node {st.get('node_id')}[/bold] at {st.get('endpoint') or endpoint}: resilient_ckpt "
        f"{st.get('version')}, protocol {st.get('protocol_version')}, pid {st.get('pid')}, up "
        f"{_duration(st.get('uptime_s'))}"
    )
    budget = store.get("memory_budget")
    line = (
        f"store {store.get('root')}: {human_bytes(int(store.get('total_bytes') or 0))} in "
        f"{store.get('checkpoints', 0)} checkpoint(s)"
        + (f" of a {human_bytes(int(budget))} budget" if budget else ", no memory budget")
        + (f", keeps the last {store['keep_last']} complete iterations" if store.get("keep_last") else "")
    )
    con.print(line)
    if fs:
        used = fs["total_bytes"] - fs["free_bytes"]
        con.print(
            f"filesystem: {human_bytes(used)} used of {human_bytes(fs['total_bytes'])} "
            f"({human_bytes(fs['free_bytes'])} free)"
        )
    else:
        con.print("filesystem: not visible from here (run status on the daemon's node)")
    sessions = store.get("sessions") or []
    if sessions:
        t = Table(title="sessions", title_justify="left", show_edge=False, pad_edge=False)
        for col, just in (("session", "left"), ("checkpoints", "right"), ("data", "right"), ("reusable", "right")):
            t.add_column(col, justify=just, no_wrap=True)
        for s in sessions:
            t.add_row(s["session"], str(s["checkpoints"]), human_bytes(s["data_bytes"]), human_bytes(s["free_pool_bytes"]))
        con.print(t)
    peers = st.get("peers") or []
    up = sum(1 for x in peers if x.get("reachable"))
    con.print(f"peers reachable: {up}/{len(peers)}")
    if peers:
        t = Table(show_edge=False, pad_edge=False)
        for col in ("node", "endpoint", "reachable", "last answer", "error"):
            t.add_column(col, no_wrap=col != "error", overflow="fold")
        for x in peers:
            r = x.get("reachable")
            t.add_row(
                str(x.get("node")), x.get("endpoint") or "-",
                "not checked yet" if r is None else ("yes" if r else "[red]no[/red]"),
                "-" if x.get("last_seen_s") is None else f"{_duration(x['last_seen_s'])} ago",
                x.get("error") or "",
            )
        con.print(t)
    repl, inbound, serving, pulling = (st.get(k) or [] for k in ("replicating", "inbound", "serving", "pulling"))
    con.print(
        f"in flight: {len(repl)} replication(s) out, {len(inbound)} transfer(s) in, {len(serving)} fetch(es) "
        f"served, {len(pulling)} pull(s); {st.get('replications_failed', 0)} failed replication(s) on record"
    )
    if repl:
        t = Table(show_edge=False, pad_edge=False)
        for col in ("session", "iteration", "owner", "holders", "acknowledged", "sent", "seconds"):
            t.add_column(col, no_wrap=True)
        for r in repl:
            t.add_row(
                str(r.get("session")), str(r.get("iteration")), str(r.get("owner")),
                ranges(r.get("holders") or []), ranges(r.get("acked") or []),
                human_bytes(int(r.get("bytes_out") or 0)), f"{float(r.get('seconds') or 0):.1f}",
            )
        con.print(t)
    for t_ in inbound:
        con.print(
            f"  receiving {t_.get('session')} iteration {t_.get('iteration')} owner {t_.get('owner')} from "
            f"{t_.get('peer')}: {human_bytes(int(t_.get('received') or 0))} of {human_bytes(int(t_.get('total_bytes') or 0))}"
        )
    rec = st.get("recovery")
    if rec:
        extra = rec.get("error") or rec.get("note") or ""
        con.print(
            f"recovery of session {rec.get('session')!r}: {rec.get('state')}"
            + (f" (iteration {rec['iteration']}, ranks {ranges(rec.get('owners') or [])})" if "iteration" in rec else "")
            + (f" after {rec['seconds']} s" if "seconds" in rec else "")
            + (f": {extra}" if extra else "")
        )
    rejected = st.get("rejected") or {}
    con.print(
        "rejected messages: "
        + (", ".join(f"{k} {v}" for k, v in sorted(rejected.items())) if rejected else "none")
    )
    counters = st.get("counters") or {}
    if counters:
        con.print("counters: " + ", ".join(
            f"{k} {human_bytes(v) if k.startswith('bytes') else v}" for k, v in sorted(counters.items())
        ))


# ---- ls / drop through a daemon --------------------------------------------------------------------


def _summary_from_holdings(session: str, holdings, node: Optional[int], usage: Mapping[str, Any]) -> SessionSummary:
    """A SessionSummary of the holdings one node has (``node``; None: every holding given)."""
    by_iter: Dict[int, list] = {}
    for h in holdings:
        if node is None or h.node is None or h.node == node:
            by_iter.setdefault(h.iteration, []).append(h)
    its = []
    for it in sorted(by_iter):
        hs = by_iter[it]
        sizes = sorted({h.world_size for h in hs})
        main = max(sizes, key=lambda w: sum(h.world_size == w for h in hs))
        its.append(IterationSummary(it, main, tuple(sorted({h.owner for h in hs})), sum(h.total_bytes for h in hs), 0,
                                    tuple(w for w in sizes if w != main)))
    return SessionSummary(session, tuple(its), int(usage.get("data_bytes", 0)), int(usage.get("free_pool_bytes", 0)))


def _ls_daemon(args: argparse.Namespace, endpoint: str) -> int:
    from ..service.client import complete_iterations

    doc: Dict[str, Any] = {"format": JSON_FORMAT, "source": "daemon", "endpoint": endpoint}
    try:
        with _daemon_errors(endpoint, args.timeout):
            with _client(endpoint, args.session or _ANY_SESSION, args) as c:
                st = c.status()
            node = st.get("node_id")
            usage = {s["session"]: s for s in (st.get("store") or {}).get("sessions") or []}
            names = [args.session] if args.session else sorted(usage)
            if args.peers and not args.session:
                names = sorted(set(names) | _peer_sessions(st, args))
            if args.session and args.session not in usage and not args.peers:
                raise _Exit(EXIT_PROBLEM, f"the daemon at {endpoint} (node {node}) holds no session "
                            f"{args.session!r}" + (f" (it holds: {', '.join(sorted(usage))})" if usage else ""))
            sessions = []
            for name in names:
                with _client(endpoint, name, args) as c:
                    holdings = c.list(peers=args.peers)
                summary = _summary_from_holdings(name, holdings, node, usage.get(name, {}))
                job = None
                if args.peers:
                    job = {
                        "complete_iterations": sorted(complete_iterations(holdings)),
                        "holders": _holders(holdings),
                    }
                sessions.append((summary, job))
    except _Exit as e:
        return _fail(str(e), e.code)
    fs = _fs_usage(st)
    doc.update(node_id=node, filesystem=fs, sessions=[])
    for summary, job in sessions:
        d = summary.as_json()
        if job is not None:
            d["job"] = job
        doc["sessions"].append(d)
    if args.json:
        _print_json(doc)
        return EXIT_OK
    con = _console()
    con.print(f"daemon node {node} at {endpoint}" + (
        f"; filesystem {human_bytes(fs['total_bytes'] - fs['free_bytes'])} used of {human_bytes(fs['total_bytes'])}"
        if fs else ""))
    scan = StoreScan(str((st.get("store") or {}).get("root")), 0, 0, tuple(s for s, _ in sessions))
    _render_sessions(scan)
    for summary, job in sessions:
        if job is not None:
            done = job["complete_iterations"]
            con.print(
                f"session {summary.session} across the job's reachable daemons: complete iterations "
                f"{ranges(done) if done else 'none'}"
            )
            by_iter: Dict[int, List[str]] = {}
            for e in job["holders"]:
                by_iter.setdefault(e["iteration"], []).append(f"rank {e['owner']} on node(s) {ranges(e['nodes'])}")
            for it, spread in sorted(by_iter.items()):
                con.print(f"  iteration {it}: " + "; ".join(spread), overflow="fold")
    return EXIT_OK


def _peer_sessions(st: Mapping[str, Any], args: argparse.Namespace) -> set:
    """Sessions the reachable peer daemons hold (this node may hold none: a replacement)."""
    found = set()
    for peer in st.get("peers") or []:
        if not peer.get("endpoint") or peer.get("reachable") is False:
            continue
        try:
            with _client(peer["endpoint"], _ANY_SESSION, args) as c:
                found.update(s["session"] for s in (c.status().get("store") or {}).get("sessions") or [])
        except CheckpointingException:
            continue  # unreachable or refusing: ls shows what the others hold
    return found


def _holders(holdings) -> List[Dict[str, Any]]:
    """``[{"iteration", "owner", "nodes"}]``: which daemons hold each checkpoint id."""
    out: Dict[Tuple[int, int], set] = {}
    for h in holdings:
        nodes = out.setdefault((h.iteration, h.owner), set())
        if h.node is not None:
            nodes.add(h.node)
    return [{"iteration": i, "owner": o, "nodes": sorted(n)} for (i, o), n in sorted(out.items())]


def _drop_daemon(args: argparse.Namespace, endpoint: str) -> int:
    """Drop through the node's daemon (its own store only: run it on each node to drop everywhere)."""
    try:
        with _daemon_errors(endpoint, args.timeout):
            with _client(endpoint, args.session, args) as c:
                holdings = c.list()
                if not holdings:
                    raise _Exit(EXIT_PROBLEM, f"the daemon at {endpoint} holds nothing of session "
                                f"{args.session!r}; nothing was dropped")
                question = _drop_question(_summary_from_holdings(args.session, holdings, None, {}), args, endpoint)
                ids = [(h.iteration, h.owner) for h in holdings if args.all or h.iteration in set(args.iteration)]
                if not confirm(question, args.yes):
                    raise _Exit(EXIT_PROBLEM, "nothing was dropped")
                dropped = c.drop(ids)
    except _Exit as e:
        return _fail(str(e), e.code)
    sizes = {(h.iteration, h.owner): h.total_bytes for h in holdings}
    res = DropResult(args.session, tuple(sorted(ids)), sum(sizes[i] for i in ids), whole_session=args.all)
    if args.json:
        doc = res.as_json()
        doc["dropped_by_daemon"] = dropped
        _print_json(doc)
    else:
        _console().print(
            f"the daemon at {endpoint} dropped {dropped} checkpoint(s) of session {args.session!r} "
            f"({human_bytes(res.released_bytes)})"
        )
    return EXIT_OK


# ---- pull -------------------------------------------------------------------------------------------


def pull_main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="resilient-ckpt pull",
        description="Have this node's daemon bring checkpoints into its store from its peers. By default: "
        "this node's ranks of the newest iteration complete across the job (a replacement node, before "
        "its trainers start).",
    )
    p.add_argument("--endpoint", default=os.environ.get(ENDPOINT_ENV), help=f"the node daemon (default ${ENDPOINT_ENV})")
    p.add_argument("--session", required=True, help="the job's session id")
    p.add_argument("--iteration", type=int, help="pull this iteration (with --owner) instead of the plan")
    p.add_argument("--owner", type=int, action="append", help="owner rank to pull (repeatable; needs --iteration)")
    p.add_argument("--from-node", type=int, help="pull from this node's daemon (default: any holder)")
    p.add_argument("--transfer-timeout", type=float, default=600.0, help="seconds one checkpoint may take (default 600)")
    _add_daemon_options(p)
    args = p.parse_args(argv)
    if not args.endpoint:
        p.error(f"--endpoint is required (or set ${ENDPOINT_ENV})")
    if (args.iteration is None) != (args.owner is None):
        p.error("--iteration and --owner go together (or give neither to pull this node's ranks)")
    import time

    from ..service.client import plan_recovery

    t0 = time.monotonic()
    try:
        with _daemon_errors(args.endpoint, args.timeout):
            with _client(args.endpoint, args.session, args) as c:
                node = c.status()["node_id"]
                everywhere = c.list(iteration=args.iteration, peers=True)
            if args.iteration is None:
                local = [(h.iteration, h.owner) for h in everywhere if h.node == node]
                plan = plan_recovery(everywhere, node, held_locally=local)
                if plan is None:
                    print(f"nothing to pull: no iteration of session {args.session!r} is complete on the "
                          "reachable daemons (a fresh job, or more nodes lost than replicas)", file=sys.stderr)
                    if args.json:
                        _print_json({"format": JSON_FORMAT, "session": args.session, "iteration": None, "pulled": []})
                    return EXIT_OK
                iteration, sources = plan.iteration, list(plan.sources)
            else:
                iteration = args.iteration
                src = (args.from_node,) if args.from_node is not None else ()
                sources = [(o, src) for o in sorted(set(args.owner))]
            sizes = {h.owner: h.total_bytes for h in everywhere if h.iteration == iteration}
            pulled = _pull_with_progress(args, iteration, sources, sizes)
    except _Exit as e:
        return _fail(str(e), e.code)
    seconds = time.monotonic() - t0
    total = sum(r.total_bytes for r in pulled if not r.already)
    if args.json:
        _print_json({
            "format": JSON_FORMAT, "session": args.session, "iteration": iteration, "seconds": round(seconds, 3),
            "pulled": [{"owner": r.owner, "source_node": r.source_node, "already": r.already,
                        "total_bytes": r.total_bytes} for r in pulled],
        })
    else:
        _console().print(
            f"node {node} now holds ranks {ranges([r.owner for r in pulled]) if pulled else '-'} of iteration "
            f"{iteration} of session {args.session!r}: {human_bytes(total)} pulled in {seconds:.1f} s"
            + (f" ({sum(r.already for r in pulled)} already here)" if any(r.already for r in pulled) else "")
        )
    return EXIT_OK


def _pull_with_progress(args: argparse.Namespace, iteration: int, sources, sizes: Mapping[int, int]) -> list:
    """Fetch each owner (trying its holder nodes in order) in a worker thread, polling the
    daemon's in-flight transfers for a byte-level progress bar when a person is watching."""
    from concurrent.futures import ThreadPoolExecutor

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from ..errors import NoReplicaError
    from ..service.client import DaemonError
    from ..service.wire.protocol import PeerTimeout

    def fetch_one(owner: int, nodes) -> Any:
        # One client per call, used only in this worker thread (ZeroMQ sockets have one owner).
        with _client(args.endpoint, args.session, args) as c:
            errors = []
            for src in list(nodes) or [None]:
                try:
                    return c.fetch(iteration, owner, from_node=src, timeout=args.transfer_timeout)
                except (DaemonError, PeerTimeout) as e:
                    errors.append(f"{'any holder' if src is None else f'node {src}'}: {e}")
            raise NoReplicaError(f"could not pull rank {owner} of iteration {iteration}: " + "; ".join(errors))

    err = _console(stderr=True)
    show = err.is_terminal and not args.json
    results = []
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, disable=not show) as prog, ThreadPoolExecutor(1) as pool:
        total = sum(sizes.get(o, 0) for o, _ in sources)
        task = prog.add_task(f"iteration {iteration}", total=total or None)
        done = 0
        poller = _client(args.endpoint, args.session, args) if show else None
        try:
            for owner, nodes in sources:
                prog.update(task, description=f"iteration {iteration} rank {owner}")
                fut = pool.submit(fetch_one, owner, nodes)
                while show and not fut.done():
                    try:
                        inbound = poller.status().get("inbound") or []
                    except CheckpointingException:
                        inbound = []
                    now = sum(int(t.get("received") or 0) for t in inbound
                              if t.get("session") == args.session and t.get("iteration") == iteration
                              and t.get("owner") == owner)
                    prog.update(task, completed=done + now)
                    with contextlib.suppress(Exception):
                        fut.exception(timeout=0.2)
                res = fut.result()
                results.append(res)
                done += sizes.get(owner, res.total_bytes)
                prog.update(task, completed=done)
        finally:
            if poller is not None:
                poller.close()
    return results
