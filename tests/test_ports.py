"""Ports for the processes the tools start on one host (rank groups, daemons): free, and out of
the range the kernel hands to outgoing connections, so nothing else takes one before its
process binds it."""

from __future__ import annotations

import socket

from resilient_ckpt import ports


def test_ports_are_free_below_the_ephemeral_range_and_not_handed_out_twice():
    lo, _ = ports.ephemeral_range()
    seen = [ports.free_port() for _ in range(200)]
    assert len(set(seen)) == len(seen)
    for p in seen[:20]:
        assert max(1024, lo - ports.SPAN) <= p < lo
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # still free: nothing was left bound


def test_a_port_in_use_is_never_returned(monkeypatch):
    lo, _ = ports.ephemeral_range()
    with socket.socket() as held:
        held.bind(("127.0.0.1", lo - 1))
        monkeypatch.setattr(ports, "SPAN", 1)  # the only candidate is the one in use
        p = ports.free_port()
    assert p != lo - 1 and p != 0


def test_without_room_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    p = ports.free_port()
    assert p > 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))
