"""Prometheus metrics of one daemon, in its own registry (so in-process daemons coexist)."""

from __future__ import annotations

from typing import Callable, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily

from ..wire import RejectCounters


class _RejectCollector:
    def __init__(self, counters: RejectCounters):
        self.counters = counters

    def describe(self):
        yield CounterMetricFamily(
            "resilient_ckpt_rejected_messages", "Rejected messages by reason", labels=["reason"]
        )

    def collect(self):
        fam = CounterMetricFamily(
            "resilient_ckpt_rejected_messages", "Rejected messages by reason", labels=["reason"]
        )
        for reason, n in sorted(self.counters.snapshot().items()):
            fam.add_metric([reason], n)
        yield fam


class Metrics:
    """The daemon's counters and gauges. ``store_usage`` returns the cached (bytes, checkpoints
    held) of the store, ``peers_up`` how many peers answered the last ping."""

    def __init__(
        self, store_usage: Callable[[], Tuple[int, int]], peers_up: Callable[[], int], rejects: RejectCounters
    ):
        r = self.registry = CollectorRegistry()
        self.bytes = Counter(
            "resilient_ckpt_replicated_bytes",
            "Checkpoint bytes replicated, by direction",
            ["direction"],
            registry=r,
        )
        self.replications = Counter(
            "resilient_ckpt_replications",
            "Replications of a checkpoint to one holder node",
            ["result"],
            registry=r,
        )
        self.fetches = Counter("resilient_ckpt_fetches_served", "FETCH streams served to peers", registry=r)
        self.pulls = Counter("resilient_ckpt_pulls", "Checkpoints pulled from peers", ["result"], registry=r)
        self.seconds = Histogram(
            "resilient_ckpt_replication_seconds",
            "Seconds to replicate a checkpoint to one node",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        Gauge(
            "resilient_ckpt_store_bytes",
            "Bytes in this daemon's store (data and reusable segments)",
            registry=r,
        ).set_function(lambda: store_usage()[0])
        Gauge(
            "resilient_ckpt_checkpoints_held", "Published checkpoints in this daemon's store", registry=r
        ).set_function(lambda: store_usage()[1])
        Gauge("resilient_ckpt_peers_up", "Peer daemons that answered the last ping", registry=r).set_function(
            peers_up
        )
        r.register(_RejectCollector(rejects))
        self._server = None

    def serve(self, port: int, addr: str) -> int:
        result = start_http_server(port, addr=addr, registry=self.registry)
        if isinstance(result, tuple):
            self._server = result[0]
            return self._server.server_address[1]
        return port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


__all__ = ["Metrics"]
