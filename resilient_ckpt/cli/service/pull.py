"""``resilient-ckpt pull``: have a node's daemon bring checkpoints into its store from its
peers, by default this node's ranks of the newest complete iteration, with a progress bar."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from ...errors import CheckpointingException, NoReplicaError
from ...service.client import DaemonClient, DaemonError, FetchResult, plan_recovery
from ...service.wire import PeerTimeout
from .common import (
    ENDPOINT_ENV,
    EXIT_OK,
    JSON_FORMAT,
    CommandExit,
    add_daemon_options,
    client,
    console,
    daemon_errors,
    fail,
    human_bytes,
    print_json,
    ranges,
)

#: (owner rank, holder nodes to try in order; empty: any holder)
Sources = List[Tuple[int, Sequence[int]]]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="resilient-ckpt pull",
        description="Have this node's daemon bring checkpoints into its store from its peers. By default: "
        "this node's ranks of the newest iteration complete across the job (a replacement node, before "
        "its trainers start).",
    )
    p.add_argument(
        "--endpoint", default=os.environ.get(ENDPOINT_ENV), help=f"the node daemon (default ${ENDPOINT_ENV})"
    )
    p.add_argument("--session", required=True, help="the job's session id")
    p.add_argument("--iteration", type=int, help="pull this iteration (with --owner) instead of the plan")
    p.add_argument(
        "--owner", type=int, action="append", help="owner rank to pull (repeatable; needs --iteration)"
    )
    p.add_argument("--from-node", type=int, help="pull from this node's daemon (default: any holder)")
    p.add_argument(
        "--transfer-timeout", type=float, default=600.0, help="seconds one checkpoint may take (default 600)"
    )
    add_daemon_options(p)
    return p


def pull_main(argv: Optional[List[str]] = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if not args.endpoint:
        p.error(f"--endpoint is required (or set ${ENDPOINT_ENV})")
    if (args.iteration is None) != (args.owner is None):
        p.error("--iteration and --owner go together (or give neither to pull this node's ranks)")
    t0 = time.monotonic()
    try:
        with daemon_errors(args.endpoint, args.timeout):
            with client(args.endpoint, args.session, args) as c:
                node = c.status()["node_id"]
                everywhere = c.list(iteration=args.iteration, peers=True)
            planned = _what_to_pull(args, node, everywhere)
            if planned is None:
                return _nothing_to_pull(args)
            iteration, sources = planned
            sizes = {h.owner: h.total_bytes for h in everywhere if h.iteration == iteration}
            pulled = _pull_with_progress(args, iteration, sources, sizes)
    except CommandExit as e:
        return fail(str(e), e.code)
    _report(args, node, iteration, pulled, time.monotonic() - t0)
    return EXIT_OK


def _what_to_pull(args: argparse.Namespace, node: int, everywhere) -> Optional[Tuple[int, Sources]]:
    """(iteration, sources): the owners asked for, else this node's ranks of the newest
    iteration complete across the job (None: no iteration is)."""
    if args.iteration is not None:
        src = (args.from_node,) if args.from_node is not None else ()
        return args.iteration, [(o, src) for o in sorted(set(args.owner))]
    local = [(h.iteration, h.owner) for h in everywhere if h.node == node]
    plan = plan_recovery(everywhere, node, held_locally=local)
    if plan is None:
        return None
    return plan.iteration, list(plan.sources)


def _nothing_to_pull(args: argparse.Namespace) -> int:
    print(
        f"nothing to pull: no iteration of session {args.session!r} is complete on the "
        "reachable daemons (a fresh job, or more nodes lost than replicas)",
        file=sys.stderr,
    )
    if args.json:
        print_json({"format": JSON_FORMAT, "session": args.session, "iteration": None, "pulled": []})
    return EXIT_OK


def _report(
    args: argparse.Namespace, node: int, iteration: int, pulled: List[FetchResult], seconds: float
) -> None:
    total = sum(r.total_bytes for r in pulled if not r.already)
    if args.json:
        print_json(
            {
                "format": JSON_FORMAT,
                "session": args.session,
                "iteration": iteration,
                "seconds": round(seconds, 3),
                "pulled": [
                    {
                        "owner": r.owner,
                        "source_node": r.source_node,
                        "already": r.already,
                        "total_bytes": r.total_bytes,
                    }
                    for r in pulled
                ],
            }
        )
    else:
        console().print(
            f"node {node} now holds ranks {ranges([r.owner for r in pulled]) if pulled else '-'} of iteration "
            f"{iteration} of session {args.session!r}: {human_bytes(total)} pulled in {seconds:.1f} s"
            + (f" ({sum(r.already for r in pulled)} already here)" if any(r.already for r in pulled) else "")
        )


def _fetch_owner(args: argparse.Namespace, iteration: int, owner: int, nodes: Sequence[int]) -> Any:
    """Have the daemon pull one owner's checkpoint, trying its holder nodes in order."""
    # One client per call, used only in this worker thread (ZeroMQ sockets have one owner).
    with client(args.endpoint, args.session, args) as c:
        errors = []
        for src in list(nodes) or [None]:
            try:
                return c.fetch(iteration, owner, from_node=src, timeout=args.transfer_timeout)
            except (DaemonError, PeerTimeout) as e:
                errors.append(f"{'any holder' if src is None else f'node {src}'}: {e}")
        raise NoReplicaError(f"could not pull rank {owner} of iteration {iteration}: " + "; ".join(errors))


def _bytes_arriving(poller: DaemonClient, args: argparse.Namespace, iteration: int, owner: int) -> int:
    """Bytes of ``owner``'s checkpoint the daemon received so far (its STATUS ``inbound``)."""
    try:
        inbound = poller.status().get("inbound") or []
    except CheckpointingException:
        inbound = []
    return sum(
        int(t.get("received") or 0)
        for t in inbound
        if t.get("session") == args.session and t.get("iteration") == iteration and t.get("owner") == owner
    )


def _pull_with_progress(
    args: argparse.Namespace, iteration: int, sources: Sources, sizes: Mapping[int, int]
) -> list:
    """Fetch each owner (trying its holder nodes in order) in a worker thread, polling the
    daemon's in-flight transfers for a byte-level progress bar when a person is watching."""
    err = console(stderr=True)
    show = err.is_terminal and not args.json
    results = []
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err, disable=not show) as prog, ThreadPoolExecutor(1) as pool:
        total = sum(sizes.get(o, 0) for o, _ in sources)
        task = prog.add_task(f"iteration {iteration}", total=total or None)
        done = 0
        poller = client(args.endpoint, args.session, args) if show else None
        try:
            for owner, nodes in sources:
                prog.update(task, description=f"iteration {iteration} rank {owner}")
                fut = pool.submit(_fetch_owner, args, iteration, owner, nodes)
                while show and not fut.done():
                    prog.update(task, completed=done + _bytes_arriving(poller, args, iteration, owner))
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
