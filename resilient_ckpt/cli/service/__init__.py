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

Modules: :mod:`.common` (exit codes, formatting, argument plumbing, talking to a daemon),
:mod:`.store_view` (reading and dropping from a store root), :mod:`.render` (tables and the
status view), :mod:`.commands` (ls, drop, secret, status), :mod:`.pull`.
"""

from __future__ import annotations

from .commands import derive_secret, drop_main, ls_main, secret_main, status_main
from .common import (
    ENDPOINT_ENV,
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_USAGE,
    JSON_FORMAT,
    STORE_ROOT_ENV,
    confirm,
    human_bytes,
    ranges,
)
from .pull import pull_main
from .store_view import (
    DropResult,
    IterationSummary,
    Problem,
    SessionSummary,
    StoreScan,
    drop_iterations,
    drop_session,
    scan_store,
    session_names,
    summarize_session,
)

__all__ = [
    "DropResult",
    "ENDPOINT_ENV",
    "EXIT_OK",
    "EXIT_PROBLEM",
    "EXIT_USAGE",
    "IterationSummary",
    "JSON_FORMAT",
    "Problem",
    "STORE_ROOT_ENV",
    "SessionSummary",
    "StoreScan",
    "confirm",
    "derive_secret",
    "drop_iterations",
    "drop_main",
    "drop_session",
    "human_bytes",
    "ls_main",
    "pull_main",
    "ranges",
    "scan_store",
    "secret_main",
    "session_names",
    "status_main",
    "summarize_session",
]
