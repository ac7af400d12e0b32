"""How the commands show things to a person: store scans, session tables, a daemon's status."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

from rich.console import Console
from rich.table import Table

from ...memory.store import SMALL_SHM_BYTES
from .common import console, duration, human_bytes, iso, ranges
from .store_view import StoreScan


def _owners_cell(it_world: int, owners: Sequence[int]) -> str:
    n = len(owners)
    return f"local copies of {n}/{it_world} owners" + ("" if n == it_world else f" (holds {ranges(owners)})")


def render_scan(scan: StoreScan) -> None:
    con = console()
    used = scan.fs_total_bytes - scan.fs_free_bytes
    con.print(
        f"store root {scan.root}: filesystem {human_bytes(used)} used of "
        f"{human_bytes(scan.fs_total_bytes)} ({human_bytes(scan.fs_free_bytes)} free)"
    )
    if scan.fs_total_bytes < SMALL_SHM_BYTES:
        con.print(
            f"[yellow]warning: this filesystem has only {human_bytes(scan.fs_total_bytes)} "
            "(containers default /dev/shm to 64 MiB): run with --shm-size or an emptyDir with "
            "medium: Memory[/yellow]"
        )
    render_sessions(scan)


def render_sessions(scan: StoreScan) -> None:
    con = console()
    if not scan.sessions:
        con.print("no sessions")
        return
    for s in scan.sessions:
        latest = s.newest_complete
        occupied = "" if s.store_bytes is None else f"{human_bytes(s.store_bytes)} of memory: "
        parity = f" (parity {human_bytes(s.parity_bytes)})" if s.parity_bytes else ""
        con.print(
            f"\nsession [bold]{s.session}[/bold]: {occupied}{human_bytes(s.data_bytes)} in "
            f"checkpoints{parity}, {human_bytes(s.free_pool_bytes)} in reusable segments; newest "
            f"iteration complete here: {'none' if latest is None else latest}"
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
                    (iso(it.created_ns) or "-").replace("T", " "),
                )
            if not any(it.created_ns for it in s.iterations):
                t.columns.pop()  # a daemon's LIST carries no creation times
            con.print(t)
        for p in s.problems:
            # One line however long (paths in it): the terminal wraps it, a grep still finds it.
            con.print(f"[red]unusable: {p.file}: {p.error}[/red]", soft_wrap=True)


# ---- a daemon's status --------------------------------------------------------------------------------


def render_status(endpoint: str, st: Mapping[str, Any], fs: Optional[Mapping[str, int]]) -> None:
    con = console()
    store = st.get("store") or {}
    con.print(
        f"daemon [bold]node {st.get('node_id')}[/bold] at {st.get('endpoint') or endpoint}: resilient_ckpt "
        f"{st.get('version')}, protocol {st.get('protocol_version')}, pid {st.get('pid')}, up "
        f"{duration(st.get('uptime_s'))}"
    )
    con.print(_store_line(store))
    if fs:
        used = fs["total_bytes"] - fs["free_bytes"]
        con.print(
            f"filesystem: {human_bytes(used)} used of {human_bytes(fs['total_bytes'])} "
            f"({human_bytes(fs['free_bytes'])} free)"
        )
    else:
        con.print("filesystem: not visible from here (run status on the daemon's node)")
    _print_sessions(con, store.get("sessions") or [])
    _print_peers(con, st.get("peers") or [])
    _print_in_flight(con, st)
    rec = st.get("recovery")
    if rec:
        con.print(_recovery_line(rec))
    rejected = st.get("rejected") or {}
    con.print(
        "rejected messages: "
        + (", ".join(f"{k} {v}" for k, v in sorted(rejected.items())) if rejected else "none")
    )
    counters = st.get("counters") or {}
    if counters:
        con.print(
            "counters: "
            + ", ".join(
                f"{k} {human_bytes(v) if k.startswith('bytes') else v}" for k, v in sorted(counters.items())
            )
        )


def _store_line(store: Mapping[str, Any]) -> str:
    budget = store.get("memory_budget")
    return (
        f"store {store.get('root')}: {human_bytes(int(store.get('total_bytes') or 0))} in "
        f"{store.get('checkpoints', 0)} checkpoint(s)"
        + (f" of a {human_bytes(int(budget))} budget" if budget else ", no memory budget")
        + (f", keeps the last {store['keep_last']} complete iterations" if store.get("keep_last") else "")
    )


def _print_sessions(con: Console, sessions: List[Dict[str, Any]]) -> None:
    if not sessions:
        return
    t = Table(title="sessions", title_justify="left", show_edge=False, pad_edge=False)
    for col, just in (
        ("session", "left"),
        ("checkpoints", "right"),
        ("data", "right"),
        ("reusable", "right"),
    ):
        t.add_column(col, justify=just, no_wrap=True)
    for s in sessions:
        t.add_row(
            s["session"],
            str(s["checkpoints"]),
            human_bytes(s["data_bytes"]),
            human_bytes(s["free_pool_bytes"]),
        )
    con.print(t)


def _print_peers(con: Console, peers: List[Dict[str, Any]]) -> None:
    up = sum(1 for x in peers if x.get("reachable"))
    con.print(f"peers reachable: {up}/{len(peers)}")
    if not peers:
        return
    t = Table(show_edge=False, pad_edge=False)
    for col in ("node", "endpoint", "reachable", "last answer", "error"):
        t.add_column(col, no_wrap=col != "error", overflow="fold")
    for x in peers:
        r = x.get("reachable")
        t.add_row(
            str(x.get("node")),
            x.get("endpoint") or "-",
            "not checked yet" if r is None else ("yes" if r else "[red]no[/red]"),
            "-" if x.get("last_seen_s") is None else f"{duration(x['last_seen_s'])} ago",
            x.get("error") or "",
        )
    con.print(t)


def _print_in_flight(con: Console, st: Mapping[str, Any]) -> None:
    repl, inbound, serving, pulling = (
        st.get(k) or [] for k in ("replicating", "inbound", "serving", "pulling")
    )
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
                str(r.get("session")),
                str(r.get("iteration")),
                str(r.get("owner")),
                ranges(r.get("holders") or []),
                ranges(r.get("acked") or []),
                human_bytes(int(r.get("bytes_out") or 0)),
                f"{float(r.get('seconds') or 0):.1f}",
            )
        con.print(t)
    for t_ in inbound:
        con.print(
            f"  receiving {t_.get('session')} iteration {t_.get('iteration')} owner {t_.get('owner')} from "
            f"{t_.get('peer')}: {human_bytes(int(t_.get('received') or 0))} of {human_bytes(int(t_.get('total_bytes') or 0))}"
        )
    _print_failures(con, st.get("recent_failures") or [])


def _print_failures(con: Console, failures: List[Dict[str, Any]]) -> None:
    """The newest pushes that did not deliver: to which node, what, when, why."""
    if not failures:
        return
    t = Table(title="replications not delivered (newest last)", title_justify="left", show_edge=False)
    for col in ("at", "to node", "session", "iteration", "owner", "outcome", "reason"):
        t.add_column(col, no_wrap=col != "reason", overflow="fold")
    for f in failures[-10:]:
        outcome = f.get("outcome") or "failed"
        t.add_row(
            str(f.get("at")),
            str(f.get("node")),
            str(f.get("session")),
            str(f.get("iteration")),
            str(f.get("owner")),
            "[red]failed[/red]" if outcome == "failed" else outcome,
            str(f.get("reason") or ""),
        )
    con.print(t)


def _recovery_line(rec: Mapping[str, Any]) -> str:
    extra = rec.get("error") or rec.get("note") or ""
    return (
        f"recovery of session {rec.get('session')!r}: {rec.get('state')}"
        + (
            f" (iteration {rec['iteration']}, ranks {ranges(rec.get('owners') or [])})"
            if "iteration" in rec
            else ""
        )
        + (f" after {rec['seconds']} s" if "seconds" in rec else "")
        + (f": {extra}" if extra else "")
    )
