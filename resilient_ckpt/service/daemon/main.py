"""``resilient-ckpt serve``: the command line of the daemon, and :func:`main`, which runs one
until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
from typing import Optional, Sequence

from ...errors import CheckpointingException
from ...memory.store import DEFAULT_ROOT
from ..wire import ProtocolConfigError, authenticator_from_env
from .config import (
    DEFAULT_BIND,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_CREDIT_BYTES,
    FAULTS_ENV,
    DaemonConfig,
    logger,
    parse_bytes,
    parse_faults,
    parse_peers,
    setup_logging,
    valid_session_name,
)
from .core import Daemon


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="resilient-ckpt serve",
        description="Run this node's checkpoint daemon: stores, replicates and serves in-memory checkpoints.",
    )
    p.add_argument(
        "--store-root",
        default=DEFAULT_ROOT,
        help="tmpfs directory of this node's store (default %(default)s)",
    )
    p.add_argument(
        "--bind",
        default=DEFAULT_BIND,
        help="ZeroMQ endpoint to listen on, tcp://HOST:PORT (default "
        "%(default)s; use the cluster interface's address)",
    )
    p.add_argument(
        "--node-id",
        type=int,
        default=int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", 0))),
        help="this node's index: ranks r with r // ranks_per_node == N live here (default $NODE_RANK or 0)",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--peers",
        type=parse_peers,
        default={},
        help="the other daemons: 0=tcp://h:p,1=tcp://h:p or a file with one 'ID ENDPOINT' per line",
    )
    g.add_argument(
        "--discover",
        metavar="HOST:PORT",
        help="register in and look peers up from a torch.distributed "
        "TCPStore (key resilient_ckpt/daemon/<node-id>)",
    )
    p.add_argument(
        "--discover-master", action="store_true", help="host the --discover TCPStore in this daemon"
    )
    p.add_argument("--advertise", help="endpoint peers should use for this daemon (default: the bound one)")
    p.add_argument(
        "--session",
        action="append",
        dest="sessions",
        metavar="NAME",
        help="serve only these sessions (repeatable; default: any); others are rejected and counted",
    )
    p.add_argument(
        "--secret-file", help="the job's secret (else $RESILIENT_CKPT_SECRET_FILE / $RESILIENT_CKPT_SECRET)"
    )
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument(
        "--metrics-addr", default="0.0.0.0", help="address of the metrics server (default %(default)s)"
    )
    p.add_argument(
        "--memory-budget",
        type=parse_bytes,
        help="bytes this store may hold (K/M/G/T suffixes); replicas "
        "that do not fit are refused with STORE_FULL",
    )
    p.add_argument(
        "--keep-last",
        type=int,
        default=2,
        help="complete iterations kept per session (default %(default)s; 0 = no retention by the daemon)",
    )
    p.add_argument(
        "--recover",
        metavar="SESSION",
        help="at start, pull this node's ranks of SESSION's newest complete "
        "iteration from the peers (a replacement node, before its trainers start)",
    )
    p.add_argument(
        "--recover-timeout", type=float, default=300.0, help="seconds to keep trying (default %(default)s)"
    )
    p.add_argument(
        "--chunk-bytes",
        type=parse_bytes,
        default=DEFAULT_CHUNK_BYTES,
        help="replication chunk size "
        "(default 4M: small enough that each chunk is hashed and copied while in cache)",
    )
    p.add_argument(
        "--credit-bytes",
        type=parse_bytes,
        default=DEFAULT_CREDIT_BYTES,
        help="bytes a peer may have in flight to this daemon (default 64M)",
    )
    p.add_argument(
        "--peer-timeout",
        type=float,
        default=30.0,
        help="seconds before a silent peer fails a transfer (default %(default)s)",
    )
    p.add_argument(
        "--inbound-timeout",
        type=float,
        default=60.0,
        help="seconds before a stalled incoming transfer is dropped (default %(default)s)",
    )
    p.add_argument(
        "--retries", type=int, default=3, help="retries of a failed replication (default %(default)s)"
    )
    p.add_argument("--ping-interval", type=float, default=5.0, help="seconds between peer liveness checks")
    p.add_argument(
        "--orphan-grace",
        type=float,
        default=300.0,
        help="headerless data younger than this many seconds "
        "is a save in progress, not an orphan (default %(default)s)",
    )
    p.add_argument(
        "--log-format", choices=("text", "json"), default="text", help="json: one object per event"
    )
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    return DaemonConfig(
        store_root=args.store_root,
        bind=args.bind,
        node_id=args.node_id,
        peers=args.peers or {},
        discover=args.discover,
        discover_master=args.discover_master,
        advertise=args.advertise,
        sessions=frozenset(args.sessions) if args.sessions else None,
        memory_budget=args.memory_budget,
        keep_last=args.keep_last or None,
        recover=args.recover,
        recover_timeout_s=args.recover_timeout,
        chunk_bytes=args.chunk_bytes,
        credit_bytes=args.credit_bytes,
        peer_timeout_s=args.peer_timeout,
        inbound_timeout_s=args.inbound_timeout,
        retries=args.retries,
        ping_interval_s=args.ping_interval,
        orphan_grace_s=args.orphan_grace,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        faults=parse_faults(os.environ.get(FAULTS_ENV)),
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``resilient-ckpt serve``: run until SIGTERM/SIGINT. Exit 2 on a configuration error."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    setup_logging(args.log_format, getattr(logging, args.log_level))
    # Every import (torch) is done: move those objects out of the cyclic GC's sight, or each
    # full collection walks millions of them while holding the GIL (measured: ~5% of the
    # receiving thread's time during replication).
    gc.collect()
    gc.freeze()
    try:
        if args.sessions:
            bad = [s for s in args.sessions if not valid_session_name(s)]
            if bad:
                raise ProtocolConfigError(f"invalid session names {bad}", fix="use plain names without '/'")
        config = config_from_args(args)
        if config.keep_last == 1:
            # The daemon retires from the files, before the trainers' agreement: see operations.md.
            why = (
                "a save whose agreement fails after every file was published can leave no "
                "iteration whole (the previous one retired here, the new one discarded by the trainers)"
            )
            fix = "use --keep-last 2 (the default) or more"
            logger.warning(
                "--keep-last 1: %s; %s",
                why,
                fix,
                extra={"event": "config_warning", "fields": {"keep_last": 1, "reason": why, "fix": fix}},
            )
        auth = authenticator_from_env(args.secret_file)
        daemon = Daemon(config, auth).start()
    except (CheckpointingException, ValueError) as e:
        logger.error("cannot start: %s", e, extra={"event": "start_failed", "fields": {"reason": str(e)}})
        return 2
    done = threading.Event()

    def _on_signal(signum, frame):
        done.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    while not done.wait(1.0):
        if not daemon.alive:  # the router thread died (a bug, logged): let the supervisor restart us
            logger.error("the daemon stopped serving; exiting", extra={"event": "crashed", "fields": {}})
            daemon.stop(timeout=5)
            return 1
    daemon.event(logging.INFO, "stopping")
    daemon.stop()
    return 0
