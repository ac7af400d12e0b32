"""The network fabric the multi-node tests and ``resilient-ckpt bench --fabric netns`` run on
(``resilient_ckpt.bench.fabric``): real namespaces, veth pairs, a bridge and tc, built and
removed for real; skipped with the reason where namespaces cannot be made."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from resilient_ckpt.bench import fabric as fabric_mod
from resilient_ckpt.bench.fabric import Fabric, LinkShape, parse_rate
from resilient_ckpt.errors import ValidationError

# one fabric at a time on the host (its bridge and addresses are the host's): one xdist worker
pytestmark = pytest.mark.xdist_group("netns")

needs_netns = pytest.mark.skipif(
    fabric_mod.unavailable() is not None,
    reason=f"network namespaces are not available here: {fabric_mod.unavailable()}",
)


def _ours(tag: str) -> dict:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {
        "netns": sorted(line.split()[0] for line in netns.splitlines() if line.startswith(tag)),
        "links": sorted(
            line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if f" {tag}" in line
        ),
        "scratch": (Path(fabric_mod.SCRATCH) / tag).exists(),
    }


def test_rates_and_shapes_are_checked_with_the_fix_in_the_message():
    assert (
        parse_rate("10G") == 10**10 and parse_rate("25gbit") == 25 * 10**9 and parse_rate("200M") == 2 * 10**8
    )
    for bad in ("fast", "-1G", "10 parsecs"):
        with pytest.raises(ValidationError, match="e.g. 1G"):
            parse_rate(bad)
    with pytest.raises(ValidationError, match="fraction"):
        LinkShape(loss=5)
    with pytest.raises(ValidationError, match="power of two"):
        LinkShape(drop_from_bytes=1000)
    assert "1 Gbit/s" in LinkShape(rate_bps=10**9, loss=0.05).describe()


def test_where_namespaces_cannot_be_made_the_reason_is_named(monkeypatch):
    monkeypatch.setattr(fabric_mod.shutil, "which", lambda name: None)
    assert "iproute2" in fabric_mod._probe()


@needs_netns
@pytest.mark.multiprocess
def test_ranks_on_a_fabric_talk_over_their_nodes_links_and_everything_is_removed_afterwards(tmp_path):
    with Fabric(2, LinkShape(rate_bps=10**9)) as fab:
        tag = fab.tag
        assert _ours(tag) == {
            "netns": [f"{tag}n0", f"{tag}n1"],
            "links": sorted([f"{tag}b", f"{tag}h0", f"{tag}h1"]),
            "scratch": True,
        }
        before = fab.link_bytes(1)
        out = run_ranks(_all_reduce_4mib, 2, str(fab.root), ranks_per_node=1, fabric=fab)
        assert out == [("10.231.0.1", True), ("10.231.0.2", True)]
        sent, received = (a - b for a, b in zip(fab.link_bytes(1), before))
        assert sent >= 4 << 20 and received >= 4 << 20, (sent, received)  # gloo crossed the veth
    assert _ours(tag) == {"netns": [], "links": [], "scratch": False}


def _all_reduce_4mib(ctx):
    import socket

    t = torch.full((1 << 20,), float(ctx.rank + 1))
    dist.all_reduce(t)
    # this process lives in its node's namespace: the node's address is local here
    s = socket.socket()
    s.bind((ctx.net.address, 0))
    s.close()
    return ctx.net.address, bool(torch.all(t == 3.0))


@needs_netns
def test_a_link_moves_no_faster_than_its_rate():
    rate = 100 * 10**6
    nbytes = 4 << 20
    with Fabric(2, LinkShape(rate_bps=rate)) as fab:
        sink = fab.popen(
            1,
            [sys.executable, "-c", _SINK, fab.address(1)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert sink.stdout.readline().strip() == "listening"
        t0 = time.monotonic()
        src = fab.run(0, [sys.executable, "-c", _SOURCE, fab.address(1), str(nbytes)], timeout=60)
        assert src.returncode == 0, src.stderr
        got = int(sink.stdout.readline())
        seconds = time.monotonic() - t0
    assert got == nbytes
    # the shaped rate is an upper bound (the HTB burst lets a 64 KiB head through at once)
    assert nbytes * 8 / seconds <= rate * 1.1, nbytes * 8 / seconds


_SINK = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 5001)); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
print(n, flush=True)
"""
_SOURCE = """
import socket, sys
s = socket.create_connection((sys.argv[1], 5001)); s.sendall(bytes(int(sys.argv[2]))); s.close()
"""


@needs_netns
def test_a_fabric_left_behind_by_a_killed_run_is_removed_with_what_ran_in_it():
    creator = subprocess.Popen(
        [sys.executable, "-c", _LEAVE_BEHIND],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    tag, orphan = creator.stdout.readline().split()
    creator.send_signal(signal.SIGKILL)  # no atexit, no finally: everything stays
    creator.wait()
    assert _ours(tag)["netns"] and _ours(tag)["scratch"]
    assert Path(f"/proc/{orphan}").exists()  # a process it started inside node 0
    with Fabric(1):
        pass  # a new fabric sweeps what dead creators left
    assert _ours(tag) == {"netns": [], "links": [], "scratch": False}
    deadline = time.monotonic() + 10
    while Path(f"/proc/{orphan}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not Path(f"/proc/{orphan}").exists()


_LEAVE_BEHIND = """
import time
from resilient_ckpt.bench.fabric import Fabric
f = Fabric(2)
p = f.popen(0, ["sleep", "300"])
(f.root / "node0").mkdir()
print(f.tag, p.pid, flush=True)
time.sleep(300)
"""


# ---- resilient-ckpt bench --fabric netns ------------------------------------------------------------


def test_bench_link_rates_need_the_netns_fabric():
    from resilient_ckpt.bench import main as bench

    with pytest.raises(ValidationError, match="--fabric netns"):
        bench.main(["--link-rates", "10G", "--no-limits"])


@needs_netns
@pytest.mark.multiprocess
def test_bench_on_the_fabric_runs_once_per_link_rate_against_the_link_limit(tmp_path):
    import json

    from resilient_ckpt.bench import main as bench

    out = tmp_path / "fabric.json"
    # fmt: off
    rc = bench.main([
        "--fabric", "netns", "--link-rates", "1G", "--sizes", "4M", "--world-sizes", "2",
        "--ranks-per-node", "1", "--reps", "1", "--warmup-saves", "1", "--no-limits",
        "--systems", "ours-embedded", "--json", str(out),
    ])
    # fmt: on
    assert rc == 0
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert run["errors"] == [] and run["link_rate_bps"] == 10**9 and doc["config"]["fabric"] == "netns"
    durable = next(c for c in doc["comparisons"] if c["metric"] == "durable_s")
    # each node sends its copy of the 3 MiB it saves over its own 1 Gbit/s link
    assert durable["limit"] == pytest.approx(3 * 2**20 * 8 / 1e9)
    assert durable["ours"] > durable["limit"]  # the link is real: nothing beats it
    assert not [line for line in _ours(f"{fabric_mod.PREFIX}{os.getpid()}")["netns"]]
