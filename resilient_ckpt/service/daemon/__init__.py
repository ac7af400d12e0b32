"""The per-node checkpoint daemon: ``resilient-ckpt serve`` (docs/protocol.md, "Daemon behaviour").

One daemon per node owns the node's store root (one :class:`CheckpointStore` per session) and:

* replicates what local trainers COMMIT to the placement's holder nodes' daemons, in the
  background, so a replica lands even if the trainer dies right after COMMIT;
* receives replicas from peers into reserved segments and publishes a header only after the
  last byte was verified (a cut transfer leaves nothing visible);
* serves FETCH streams to peers and pulls checkpoints for local clients (FETCH ``pull``);
* answers LIST / DROP / STATUS; retires old iterations (``--keep-last``) and refuses replicas
  beyond ``--memory-budget``; restores a replacement node's ranks from its peers (``--recover``).

Modules, each importing only those listed before it:

* :mod:`.config` — :class:`DaemonConfig`, command-line value parsers, logging;
* :mod:`.stores` — the store root, read-only mappings, inbound reservations within the budget;
* :mod:`.peers` — where the other daemons are (``--peers`` / ``--discover``);
* :mod:`.metrics` — Prometheus metrics;
* :mod:`.context` — what the parts share (:class:`~.context.DaemonContext`), answering;
* :mod:`.inbound` — receiving and verifying replicas (REPLICATE_BEGIN / CHUNK / END);
* :mod:`.replication` — COMMIT's records and the pusher thread per holder node;
* :mod:`.fetch` — serving FETCH streams, pulling from peers, LIST across peers;
* :mod:`.handlers` — the request handlers and the STATUS report;
* :mod:`.maintenance` — pings, retention, ``--recover``;
* :mod:`.core` — :class:`Daemon`: its threads and the router loop;
* :mod:`.main` — ``resilient-ckpt serve``'s parser and :func:`main`.
"""

from __future__ import annotations

from .config import (
    DEFAULT_BIND,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_CREDIT_BYTES,
    DISCOVERY_PREFIX,
    FAULT_NAMES,
    FAULTS_ENV,
    SOCKET_BUFFER_BYTES,
    DaemonConfig,
    JsonFormatter,
    parse_bytes,
    parse_faults,
    parse_peers,
    setup_logging,
    valid_session_name,
)
from .context import DaemonContext
from .core import Daemon
from .main import build_parser, config_from_args, main
from .replication import holder_nodes

__all__ = [
    "DEFAULT_BIND",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_CREDIT_BYTES",
    "DISCOVERY_PREFIX",
    "Daemon",
    "DaemonConfig",
    "DaemonContext",
    "FAULTS_ENV",
    "FAULT_NAMES",
    "JsonFormatter",
    "SOCKET_BUFFER_BYTES",
    "build_parser",
    "config_from_args",
    "holder_nodes",
    "main",
    "parse_bytes",
    "parse_faults",
    "parse_peers",
    "setup_logging",
    "valid_session_name",
]
