"""``resilient-ckpt ls | drop | secret | status``: on a store root directly, or through the
node's daemon."""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ...errors import CheckpointingException, StoreError
from ...service.client import complete_iterations
from ...service.wire import load_secret, write_secret_file
from .common import (
    ANY_SESSION,
    ENDPOINT_ENV,
    EXIT_OK,
    EXIT_PROBLEM,
    JSON_FORMAT,
    CommandExit,
    add_daemon_options,
    add_target,
    client,
    confirm,
    console,
    daemon_errors,
    fail,
    fs_usage,
    human_bytes,
    print_json,
    ranges,
    target,
)
from .render import render_scan, render_sessions, render_status
from .store_view import (
    DropResult,
    IterationSummary,
    SessionSummary,
    StoreScan,
    drop_iterations,
    drop_session,
    scan_store,
)

# ---- ls ---------------------------------------------------------------------------------------------


def ls_main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="resilient-ckpt ls",
        description="List the checkpoints this node holds: sessions, iterations, owner ranks, "
        "sizes, and whether every owner's data is here.",
    )
    add_target(p, "ask the node's daemon at this ZeroMQ endpoint, e.g. tcp://127.0.0.1:7465")
    p.add_argument("--session", help="only this session")
    p.add_argument(
        "--peers",
        action="store_true",
        help="with a daemon: also show which node holds each rank, across every reachable daemon of the job",
    )
    args = p.parse_args(argv)
    kind, where = target(args)
    if kind == "daemon":
        return _ls_daemon(args, where)
    if args.peers:
        p.error("--peers needs a daemon (--endpoint): a store root only knows its own node")
    try:
        scan = scan_store(where, args.session)
    except CheckpointingException as e:
        return fail(str(e))
    except OSError as e:
        return fail(f"cannot read the store at {where}: {e}")
    if args.json:
        print_json(scan.as_json())
    else:
        render_scan(scan)
    return EXIT_OK


# ---- drop -------------------------------------------------------------------------------------------


def drop_main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="resilient-ckpt drop",
        description="Retire checkpoints of a session from this node (asks first unless --yes).",
    )
    add_target(p, "have the node's daemon drop them, e.g. tcp://127.0.0.1:7465")
    p.add_argument("--session", required=True, help="the job's session id")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--iteration", type=int, action="append", metavar="N", help="drop iteration N (repeatable)"
    )
    what.add_argument("--all", action="store_true", help="drop the whole session, releasing all its memory")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    args = p.parse_args(argv)
    kind, where = target(args)
    if kind == "daemon":
        return _drop_daemon(args, where)
    try:
        scan = scan_store(where, args.session)
        question = _drop_question(scan.sessions[0], args, where)
    except CheckpointingException as e:
        return fail(str(e))
    except CommandExit as e:
        return fail(str(e), e.code)
    s = scan.sessions[0]
    if not confirm(question, args.yes):
        return fail("nothing was dropped")
    try:
        res = (
            drop_session(where, s.session) if args.all else drop_iterations(where, s.session, args.iteration)
        )
    except CheckpointingException as e:
        return fail(str(e))
    except OSError as e:
        return fail(f"drop in {where} failed: {e}")
    if args.json:
        print_json(res.as_json())
    else:
        what_ = (
            "session"
            if res.whole_session
            else f"iteration(s) {ranges(sorted({i for i, _ in res.dropped}))} of session"
        )
        console().print(
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
        raise CommandExit(
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
        question += f" Iteration {latest} is the newest complete one here; a restart would fall back to " + (
            f"iteration {max(older)}." if older else "nothing held on this node."
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
    mac = hmac.new(
        bytes(cluster_key), b"resilient-ckpt job secret\x00" + label.encode("utf-8"), hashlib.sha256
    )
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
    p.add_argument(
        "--derive-from",
        metavar="KEY_FILE",
        help="derive the secret from this cluster key (a 0600 "
        "file, the same on every node) and --label, instead of drawing a random one",
    )
    p.add_argument("--label", help="what the derived secret is for, e.g. the job id (needs --derive-from)")
    args = p.parse_args(argv)
    if bool(args.derive_from) != bool(args.label):
        p.error("--derive-from and --label go together")
    if os.path.exists(args.file) and not args.force:
        return fail(
            f"{args.file} exists; pass --force to replace it (every daemon and trainer must then reload)"
        )
    try:
        secret = derive_secret(load_secret(args.derive_from), args.label) if args.derive_from else None
        write_secret_file(args.file, secret)
    except CheckpointingException as e:
        return fail(str(e))
    except OSError as e:
        return fail(f"cannot write {args.file}: {e}")
    how = f"derived for {args.label!r}" if args.derive_from else "new random"
    print(f"wrote a {how} job secret to {args.file} (mode 0600)")
    return EXIT_OK


# ---- status -----------------------------------------------------------------------------------------


def status_main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="resilient-ckpt status",
        description="Show a node daemon's health. Exit 0 when it answered (usable as a liveness "
        "probe), 2 when it did not.",
    )
    p.add_argument(
        "--endpoint",
        default=os.environ.get(ENDPOINT_ENV),
        help=f"the daemon's ZeroMQ endpoint, e.g. tcp://127.0.0.1:7465 (default ${ENDPOINT_ENV})",
    )
    p.add_argument(
        "--session",
        default=ANY_SESSION,
        help="a session the daemon serves (only needed when it was started with --session)",
    )
    add_daemon_options(p)
    args = p.parse_args(argv)
    if not args.endpoint:
        p.error(f"--endpoint is required (or set ${ENDPOINT_ENV})")
    try:
        with daemon_errors(args.endpoint, args.timeout):
            with client(args.endpoint, args.session, args) as c:
                st = c.status()
    except CommandExit as e:
        return fail(str(e), e.code)
    fs = fs_usage(st)
    if args.json:
        print_json({"format": JSON_FORMAT, "endpoint": args.endpoint, "filesystem": fs, "daemon": st})
    else:
        render_status(args.endpoint, st, fs)
    return EXIT_OK


# ---- ls / drop through a daemon --------------------------------------------------------------------


def _summary_from_holdings(
    session: str, holdings, node: Optional[int], usage: Mapping[str, Any]
) -> SessionSummary:
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
        its.append(
            IterationSummary(
                it,
                main,
                tuple(sorted({h.owner for h in hs})),
                sum(h.total_bytes for h in hs),
                0,
                tuple(w for w in sizes if w != main),
            )
        )
    return SessionSummary(
        session, tuple(its), int(usage.get("data_bytes", 0)), int(usage.get("free_pool_bytes", 0))
    )


#: One session as ``ls`` through a daemon shows it: this node's summary, and with ``--peers``
#: the job-wide view ({"complete_iterations", "holders"}).
_DaemonSession = Tuple[SessionSummary, Optional[Dict[str, Any]]]


def _ls_daemon(args: argparse.Namespace, endpoint: str) -> int:
    try:
        with daemon_errors(endpoint, args.timeout):
            st, sessions = _daemon_sessions(args, endpoint)
    except CommandExit as e:
        return fail(str(e), e.code)
    node = st.get("node_id")
    fs = fs_usage(st)
    doc: Dict[str, Any] = {"format": JSON_FORMAT, "source": "daemon", "endpoint": endpoint}
    doc.update(node_id=node, filesystem=fs, sessions=[])
    for summary, job in sessions:
        d = summary.as_json()
        if job is not None:
            d["job"] = job
        doc["sessions"].append(d)
    if args.json:
        print_json(doc)
        return EXIT_OK
    con = console()
    con.print(
        f"daemon node {node} at {endpoint}"
        + (
            f"; filesystem {human_bytes(fs['total_bytes'] - fs['free_bytes'])} used of {human_bytes(fs['total_bytes'])}"
            if fs
            else ""
        )
    )
    scan = StoreScan(str((st.get("store") or {}).get("root")), 0, 0, tuple(s for s, _ in sessions))
    render_sessions(scan)
    for summary, job in sessions:
        if job is not None:
            _render_job_view(summary.session, job)
    return EXIT_OK


def _daemon_sessions(
    args: argparse.Namespace, endpoint: str
) -> Tuple[Mapping[str, Any], List[_DaemonSession]]:
    """The daemon's STATUS and, for each session asked about (or held), what ``ls`` shows."""
    with client(endpoint, args.session or ANY_SESSION, args) as c:
        st = c.status()
    node = st.get("node_id")
    usage = {s["session"]: s for s in (st.get("store") or {}).get("sessions") or []}
    names = [args.session] if args.session else sorted(usage)
    if args.peers and not args.session:
        names = sorted(set(names) | _peer_sessions(st, args))
    if args.session and args.session not in usage and not args.peers:
        raise CommandExit(
            EXIT_PROBLEM,
            f"the daemon at {endpoint} (node {node}) holds no session "
            f"{args.session!r}" + (f" (it holds: {', '.join(sorted(usage))})" if usage else ""),
        )
    sessions = []
    for name in names:
        with client(endpoint, name, args) as c:
            holdings = c.list(peers=args.peers)
        summary = _summary_from_holdings(name, holdings, node, usage.get(name, {}))
        job = None
        if args.peers:
            job = {
                "complete_iterations": sorted(complete_iterations(holdings)),
                "holders": _holders(holdings),
            }
        sessions.append((summary, job))
    return st, sessions


def _render_job_view(session: str, job: Mapping[str, Any]) -> None:
    con = console()
    done = job["complete_iterations"]
    con.print(
        f"session {session} across the job's reachable daemons: complete iterations "
        f"{ranges(done) if done else 'none'}"
    )
    by_iter: Dict[int, List[str]] = {}
    for e in job["holders"]:
        by_iter.setdefault(e["iteration"], []).append(f"rank {e['owner']} on node(s) {ranges(e['nodes'])}")
    for it, spread in sorted(by_iter.items()):
        con.print(f"  iteration {it}: " + "; ".join(spread), overflow="fold")


def _peer_sessions(st: Mapping[str, Any], args: argparse.Namespace) -> set:
    """Sessions the reachable peer daemons hold (this node may hold none: a replacement)."""
    found = set()
    for peer in st.get("peers") or []:
        if not peer.get("endpoint") or peer.get("reachable") is False:
            continue
        try:
            with client(peer["endpoint"], ANY_SESSION, args) as c:
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
        with daemon_errors(endpoint, args.timeout):
            with client(endpoint, args.session, args) as c:
                holdings = c.list()
                if not holdings:
                    raise CommandExit(
                        EXIT_PROBLEM,
                        f"the daemon at {endpoint} holds nothing of session "
                        f"{args.session!r}; nothing was dropped",
                    )
                question = _drop_question(
                    _summary_from_holdings(args.session, holdings, None, {}), args, endpoint
                )
                ids = [
                    (h.iteration, h.owner) for h in holdings if args.all or h.iteration in set(args.iteration)
                ]
                if not confirm(question, args.yes):
                    raise CommandExit(EXIT_PROBLEM, "nothing was dropped")
                dropped = c.drop(ids)
    except CommandExit as e:
        return fail(str(e), e.code)
    sizes = {(h.iteration, h.owner): h.total_bytes for h in holdings}
    res = DropResult(args.session, tuple(sorted(ids)), sum(sizes[i] for i in ids), whole_session=args.all)
    if args.json:
        doc = res.as_json()
        doc["dropped_by_daemon"] = dropped
        print_json(doc)
    else:
        console().print(
            f"the daemon at {endpoint} dropped {dropped} checkpoint(s) of session {args.session!r} "
            f"({human_bytes(res.released_bytes)})"
        )
    return EXIT_OK
