"""The daemon's background duties outside the router thread:

* :class:`Maintenance` (thread ``rc-daemon-maint``): peer liveness pings, discovery refresh,
  usage figures, and retention (``--keep-last``);
* :class:`Recovery` (thread ``rc-daemon-recover``): ``--recover``, pulling this node's ranks
  of a session's newest complete iteration from the peers at start.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Dict, List, Optional, Tuple

from ...errors import CheckpointingException, ReplicationError
from ...memory.layout import CheckpointId
from ..client import ClockSkewError, DaemonError, RecoveryPlan, Rpc, complete_iterations, plan_recovery
from ..wire import ProtocolError
from .config import logger
from .context import DaemonContext
from .fetch import Puller, gather_peers, peer_rpc
from .inbound import TransferError
from .replication import ReplicationTable

#: At most one retention pass per this many seconds (each may LIST every peer).
RETENTION_MIN_INTERVAL_S = 0.5


class Maintenance:
    """Pings peers every ``--ping-interval`` and runs a retention pass when one is due (a
    replica was stored, a replication finished), at most every 0.5 s."""

    def __init__(self, ctx: DaemonContext, table: ReplicationTable):
        self.ctx, self.table = ctx, table

    def run(self) -> None:
        ctx = self.ctx
        rpcs: Dict[int, Rpc] = {}
        next_ping = 0.0
        last_retention = 0.0
        try:
            while not ctx.stopping.is_set():
                now = time.monotonic()
                if now >= next_ping:
                    self._ping_peers(rpcs)
                    with contextlib.suppress(Exception):
                        ctx.refresh_usage()
                    next_ping = time.monotonic() + ctx.config.ping_interval_s
                    continue
                due = self._retention_due()
                if due and now - last_retention >= RETENTION_MIN_INTERVAL_S:
                    ctx.retention_due.clear()
                    last_retention = now
                    self._retention_pass_logged(rpcs)
                    continue
                self._sleep(due, now, next_ping, last_retention)
        finally:
            for r in rpcs.values():
                r.close()

    def _retention_due(self) -> bool:
        ctx = self.ctx
        due = ctx.retention_due.is_set()
        if due and not ctx.config.keep_last:
            ctx.retention_due.clear()  # retention is off: nothing will ever clear it
            due = False
        return due

    def _sleep(self, due: bool, now: float, next_ping: float, last_retention: float) -> None:
        until_ping = max(0.01, next_ping - now)
        if due:  # at most one pass per interval: sleep until the next one is allowed
            self.ctx.stopping.wait(
                max(0.01, min(until_ping, RETENTION_MIN_INTERVAL_S - (now - last_retention)))
            )
        else:
            self.ctx.retention_due.wait(until_ping)

    def _retention_pass_logged(self, rpcs: Dict[int, Rpc]) -> None:
        try:
            self.retention_pass(rpcs)
        except Exception:
            logger.exception("retention pass failed")

    # ---- pings -----------------------------------------------------------------------------

    def _ping_peers(self, rpcs: Dict[int, Rpc]) -> None:
        ctx = self.ctx
        with contextlib.suppress(Exception):
            ctx.peers.refresh()
        for node in ctx.peers.nodes():
            if ctx.stopping.is_set():
                return
            endpoint = ctx.peers.endpoint(node)
            if endpoint is None:
                continue
            ok, err = self._ping(node, endpoint, rpcs)
            was = ctx.ledger.record_ping(node, ok, err)
            if was is not None and was != ok:
                ctx.event(
                    logging.INFO if ok else logging.WARNING,
                    "peer_up" if ok else "peer_down",
                    peer=f"node-{node}",
                    endpoint=endpoint,
                    reason=err,
                )

    def _ping(self, node: int, endpoint: str, rpcs: Dict[int, Rpc]) -> Tuple[bool, Optional[str]]:
        """HELLO to a peer: (reachable, why not / what is wrong with it)."""
        ctx = self.ctx
        rpc, _ = peer_rpc(ctx, node, endpoint, rpcs)
        sessions = sorted(ctx.config.sessions) if ctx.config.sessions else ctx.stores.sessions()
        try:
            rpc.hello(sessions[0] if sessions else "-", timeout_s=min(2.0, ctx.config.peer_timeout_s))
            return True, None
        except ClockSkewError as e:  # up, but nothing will work until the clocks agree
            return True, str(e)[:300]
        except DaemonError:  # an authenticated answer (e.g. it serves other sessions): it is up
            return True, None
        except (ProtocolError, CheckpointingException) as e:
            rpc.reset()
            return False, str(e)[:300]

    # ---- retention -------------------------------------------------------------------------

    def retention_pass(self, rpcs: Dict[int, Rpc]) -> None:
        """Keep the newest ``keep_last`` complete iterations per session (complete: every rank's
        checkpoint held by some reachable daemon), and everything newer; never the newest
        complete one, never an id being sent. Unreachable peers only make it keep more."""
        ctx = self.ctx
        for session in ctx.stores.sessions():
            local = ctx.stores.holdings(session)
            if not local:
                continue
            others, _ = gather_peers(ctx, session, rpcs=rpcs)
            complete = complete_iterations(local + others)
            if complete:
                self._retire_older(session, local, complete)
        ctx.ledger.count(retention_passes=1)

    def _retire_older(self, session: str, local: List[Any], complete: List[int]) -> None:
        ctx = self.ctx
        keep = ctx.config.keep_last
        threshold = min(complete[:keep])
        store = ctx.stores.get(session)
        for h in local:
            if h.iteration >= threshold:
                continue
            if not self.table.retire((session, h.iteration, h.owner)):
                ctx.retention_due.set()  # being sent or replicated: try again later
                continue
            store.discard(CheckpointId(h.iteration, h.owner, session))
            ctx.event(
                logging.INFO,
                "retired",
                session=session,
                iteration=h.iteration,
                owner=h.owner,
                reason=f"older than the {keep} newest complete iterations {complete[:keep]}",
            )


class Recovery:
    """``--recover SESSION``: pull this node's ranks of the newest iteration complete across
    the peers, retrying until done or ``--recover-timeout``; STATUS reports how it went."""

    def __init__(self, ctx: DaemonContext, puller: Puller):
        self.ctx, self.puller = ctx, puller

    def run(self, session: str) -> None:
        ctx = self.ctx
        t0 = time.monotonic()
        ctx.ledger.set_recovery({"session": session, "state": "running"})
        ctx.event(logging.INFO, "recovery_started", session=session)
        rpcs: Dict[int, Rpc] = {}
        try:
            outcome = self._attempts(session, t0, rpcs)
            self._set(outcome[0], session, t0, **outcome[1])
        except Exception as e:
            logger.exception("recovery failed")
            self._set("failed", session, t0, error=f"{type(e).__name__}: {e}")
        finally:
            for r in rpcs.values():
                r.close()

    def _attempts(self, session: str, t0: float, rpcs: Dict[int, Rpc]) -> Tuple[str, Dict[str, Any]]:
        """Try until done, nothing to do, or the deadline: (final state, its details)."""
        ctx = self.ctx
        deadline = t0 + ctx.config.recover_timeout_s
        last_error = ""
        while not ctx.stopping.is_set():
            with contextlib.suppress(Exception):
                ctx.peers.refresh()  # discovery: peers may register after this daemon
            if not ctx.peers.nodes() and not ctx.config.discover:
                return "failed", {
                    "error": "no peers to recover from: start the daemon with --peers (or "
                    "--discover) naming the other nodes' daemons"
                }
            outcome, last_error = self._attempt(session, rpcs, last_error)
            if outcome is not None:
                return outcome
            if time.monotonic() >= deadline:
                break
            ctx.stopping.wait(0.5)
        return "failed", {"error": last_error or "stopped"}

    def _attempt(
        self, session: str, rpcs: Dict[int, Rpc], last_error: str
    ) -> Tuple[Optional[Tuple[str, Dict[str, Any]]], str]:
        """One look at the peers and, if there is a plan, one try at it: (final outcome or
        None to try again, the latest error)."""
        ctx = self.ctx
        everywhere, unreachable = gather_peers(ctx, session, rpcs=rpcs)
        local = ctx.stores.holdings(session)
        plan = None
        try:
            plan = plan_recovery(
                everywhere + local, ctx.node_id, held_locally=[(h.iteration, h.owner) for h in local]
            )
        except ReplicationError as e:
            last_error = str(e)
        if plan is None and not last_error:
            if ctx.peers.nodes() and not unreachable:
                return (
                    "nothing",
                    {"note": "no complete iteration on any peer: nothing to restore (a fresh job)"},
                ), ""
            last_error = f"no complete iteration among reachable peers (unreachable: {unreachable})"
        if plan is not None:
            failed = self._carry_out(plan, session)
            if not failed:
                return ("done", {"iteration": plan.iteration, "owners": list(plan.owners)}), last_error
            last_error = "; ".join(failed)
        return None, last_error

    def _carry_out(self, plan: RecoveryPlan, session: str) -> List[str]:
        failed = []
        for owner, nodes in plan.sources:
            errors = []
            for node in nodes:
                try:
                    self.puller.pull(session, plan.iteration, owner, node)
                    break
                except (TransferError, ProtocolError, CheckpointingException, OSError) as e:
                    errors.append(f"node {node}: {getattr(e, 'text', None) or e}")
            else:
                failed.append(f"rank {owner}: " + ", ".join(errors))
        return failed

    def _set(self, state: str, session: str, t0: float, **extra: Any) -> None:
        rec = {"session": session, "state": state, "seconds": round(time.monotonic() - t0, 3), **extra}
        self.ctx.ledger.set_recovery(rec)
        self.ctx.event(
            logging.INFO if state != "failed" else logging.ERROR,
            f"recovery_{state}",
            **{k: v for k, v in rec.items() if k != "state"},
        )
