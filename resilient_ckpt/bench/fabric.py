"""Real networks between simulated nodes: each node a Linux network namespace with its own
address, joined by a veth pair to one bridge, every link shaped and broken with ``tc``.

::

    root namespace:   bridge rcf<pid>b ── rcf<pid>h0   rcf<pid>h1   ...   (host ends)
                                              │            │
    node namespaces:                     rcf<pid>v0   rcf<pid>v1          (node ends)
                                         10.231.0.1   10.231.0.2
                                         rcf<pid>n0   rcf<pid>n1          (namespace names)

A node's trainer ranks enter its namespace first thing (:func:`enter`, before any socket or
thread exists), bind gloo to its interface (``GLOO_SOCKET_IFNAME``) and reach node 0's
TCPStore at node 0's address; its daemon runs under ``ip netns exec`` (:meth:`Fabric.popen`).
Loopback inside a namespace stays loopback (a trainer talks to its own node's daemon there).

A link is one node's veth pair; both directions are shaped alike (:class:`LinkShape`):

* ``rate_bps``: an HTB class of that rate on each end (bits per second, like a NIC's speed);
* ``loss``: that fraction of IPv4 packets dropped each way (a classic-BPF filter reading the
  kernel's per-packet random number sends them to a class whose FIFO holds 0 packets);
* ``drop_from_bytes``: IPv4 packets of this total length or more dropped (a power of two):
  small messages pass, bulk data does not — a path MTU black hole, the peer that answers
  pings and handshakes but cannot take data;
* ``delay_s``: netem, only where the kernel has it (:func:`unavailable_shape` says why not).

:meth:`Fabric.cut` takes a node's link down at the bridge (the node sees no carrier; every
packet to and from it is dropped, no connection is reset — a partition), :meth:`Fabric.heal`
brings it back.

Everything the fabric creates is named ``rcf<pid>…`` (``pid``: the creating process) — the
bridge, the veths, the namespaces, and the scratch directory ``/dev/shm/rcf<pid>`` that holds
the nodes' stores. :meth:`Fabric.close` (also run at exit, and by ``with``) kills what still
runs in the namespaces and removes them all; a new fabric first removes leftovers of creators
that are no longer alive (a run that was SIGKILLed). :func:`unavailable` says why namespaces
cannot be made here (not root, no ``ip``), so callers can skip with the reason.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ..errors import CheckpointingException, ValidationError
from ..memory.store import _pid_alive

PREFIX = "rcf"
SUBNET = "10.231.0"
SCRATCH = "/dev/shm"
#: the port node 0's TCPStore listens on (every namespace is fresh: nothing else uses it)
MASTER_PORT = 29500
_CLONE_NEWNET = 0x40000000
#: HTB handles: 1: root, 1:10 the link's traffic, 1:20 the drop class (its FIFO holds 0 packets)
_PASS, _DROP = "1:10", "1:20"
_UNSHAPED_BPS = 100 * 10**9  # "no limit": far above what a veth pair moves on one host
_NAME = re.compile(rf"^{PREFIX}(\d+)([bhvn])(\d*)$")


class FabricError(CheckpointingException):
    """The fabric could not be built or changed (the message names the command and the fix)."""


# --------------------------------------------------------------------------- what a rank needs


@dataclass(frozen=True)
class NodeNet:
    """What a process of node ``node`` needs to live on the fabric (picklable)."""

    node: int
    netns: str  # the namespace's name (/var/run/netns/<netns>)
    ifname: str  # the node's interface inside it (GLOO_SOCKET_IFNAME)
    address: str  # the node's address
    master_addr: str  # node 0's address: where the job's TCPStore listens

    def env(self) -> Dict[str, str]:
        """The launcher variables of a rank on this node."""
        return {"GLOO_SOCKET_IFNAME": self.ifname, "MASTER_ADDR": self.master_addr}


def enter(net: NodeNet) -> None:
    """Move the calling process into ``net``'s namespace. Call it first thing in a new process,
    before any socket or thread exists (sockets and threads made later live there)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/var/run/netns/{net.netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise FabricError(
                f"setns into network namespace {net.netns} failed: {os.strerror(err)}; the process "
                "needs CAP_SYS_ADMIN (run as root)"
            )
    finally:
        os.close(fd)


def join(net: Optional[NodeNet]) -> Dict[str, str]:
    """What a rank process does first: enter its node's namespace (``net``; None: stay on
    loopback) and return the launcher variables that go with it, ``MASTER_ADDR`` (where node
    0's TCPStore listens) and ``GLOO_SOCKET_IFNAME`` (the interface gloo binds to)."""
    if net is None:
        return {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    enter(net)
    return net.env()


# --------------------------------------------------------------------------- commands


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise FabricError(
            f"`{' '.join(argv)}` failed ({p.returncode}): {(p.stderr or p.stdout).strip()}; the fabric "
            "needs root (CAP_NET_ADMIN) and iproute2 (ip, tc)"
        )
    return p


def _batch(lines: Iterable[str], *, netns: Optional[str] = None, tool: str = "ip") -> None:
    """Run ``ip``/``tc`` commands in one process (``-batch``): one fork per change, not per line."""
    text = "".join(f"{line}\n" for line in lines)
    if not text:
        return
    argv = [tool, *(["-n", netns] if netns else []), "-batch", "-"]
    p = subprocess.run(argv, input=text, capture_output=True, text=True)
    if p.returncode != 0:
        raise FabricError(
            f"`{' '.join(argv)}` failed ({p.returncode}) on:\n{text}{p.stderr.strip()}\nthe fabric needs "
            "root (CAP_NET_ADMIN), iproute2 and the kernel's HTB, u32 and BPF classifiers"
        )


_unavailable: Dict[str, Optional[str]] = {}


def unavailable() -> Optional[str]:
    """Why a fabric cannot be built on this machine (None when it can); probed once."""
    if "reason" not in _unavailable:
        _unavailable["reason"] = _probe()
    return _unavailable["reason"]


def _probe() -> Optional[str]:
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    name = f"{PREFIX}{os.getpid()}p"
    p = _run(["ip", "netns", "add", name], check=False)
    if p.returncode != 0:
        return f"`ip netns add` is not permitted here ({p.stderr.strip()}): needs root / CAP_NET_ADMIN"
    _run(["ip", "netns", "del", name], check=False)
    return None


def unavailable_shape(shape: "LinkShape") -> Optional[str]:
    """Why ``shape`` cannot be applied on this kernel (only delay needs a qdisc, netem, that
    kernels may leave out); None when it can."""
    if not shape.delay_s:
        return None
    return None if _has_netem() else "the kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): no delay"


_netem: Dict[str, bool] = {}


def _has_netem() -> bool:
    if "ok" not in _netem:
        ns = f"{PREFIX}{os.getpid()}p"
        ok = _run(["ip", "netns", "add", ns], check=False).returncode == 0
        if ok:
            ok = (
                _run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem"], check=False).returncode
                == 0
            )
            _run(["ip", "netns", "del", ns], check=False)
        _netem["ok"] = ok
    return _netem["ok"]


# --------------------------------------------------------------------------- link shapes


def parse_rate(text: str) -> int:
    """``"10G"``, ``"25gbit"``, ``"200M"``, ``"1e9"`` → bits per second (decimal units, like NICs)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmgt]?)(?:bit|b|bps)?(?:/s)?\s*", str(text).lower())
    if not m:
        raise ValidationError(f"{text!r} is not a link rate; use e.g. 1G, 10gbit, 200M (bits per second)")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    if value < 8000:
        raise ValidationError(f"link rate {text!r} is below 8 kbit/s; give bits per second, e.g. 10G")
    return int(value)


def format_rate(bps: float) -> str:
    for unit, div in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= div:
            return f"{bps / div:.4g} {unit}"
    return f"{bps:g} bit/s"


@dataclass(frozen=True)
class LinkShape:
    """How one node's link behaves, the same each way (see the module docstring)."""

    rate_bps: Optional[int] = None
    loss: float = 0.0
    drop_from_bytes: Optional[int] = None
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_bps is not None and self.rate_bps < 8000:
            raise ValidationError(f"rate_bps={self.rate_bps}: give bits per second >= 8000 (e.g. 10**10)")
        if not 0.0 <= self.loss < 1.0:
            raise ValidationError(f"loss={self.loss}: a fraction of packets in [0, 1), e.g. 0.05 for 5 %")
        d = self.drop_from_bytes
        if d is not None and (d < 64 or d > 32768 or d & (d - 1)):
            raise ValidationError(
                f"drop_from_bytes={d}: a power of two in [64, 32768] (the filter masks the IPv4 length)"
            )
        if self.delay_s < 0:
            raise ValidationError(f"delay_s={self.delay_s}: seconds >= 0")

    @property
    def plain(self) -> bool:
        return self == LinkShape()

    def tc_lines(self, dev: str) -> List[str]:
        """``tc -batch`` lines that give ``dev``'s egress this shape (after its root is reset)."""
        if self.plain:
            return []
        rate = self.rate_bps or _UNSHAPED_BPS
        # burst: 2 ms of the rate (at least 64 KiB), so a late timer tick does not cap the rate
        burst = max(64 << 10, rate // 8 // 500)
        lines = [
            f"qdisc add dev {dev} root handle 1: htb default 10",
            f"class add dev {dev} parent 1: classid {_PASS} htb rate {rate}bit ceil {rate}bit "
            f"burst {burst} cburst {burst} quantum 200000",
            f"class add dev {dev} parent 1: classid {_DROP} htb rate 8kbit quantum 1514",
            f"qdisc add dev {dev} parent {_DROP} handle 20: pfifo limit 0",
        ]
        if self.delay_s:
            lines.append(
                f"qdisc add dev {dev} parent {_PASS} handle 10: netem delay {self.delay_s * 1e3:g}ms"
            )
        if self.loss:
            # classic BPF: A = random u32; A >= threshold -> 0 (no match), else -1 (the class)
            threshold = int(self.loss * 2**32)
            code = f"4,32 0 0 {(2**32 - 0x1000 + 56)},53 1 0 {threshold},6 0 0 4294967295,6 0 0 0"
            lines.append(
                f'filter add dev {dev} parent 1: prio 1 protocol ip bpf bytecode "{code}" classid {_DROP}'
            )
        if self.drop_from_bytes:
            # IPv4 total length (bytes 2-3 of the header) below the power of two: passes; the rest drops
            mask = 0xFFFF & ~(self.drop_from_bytes - 1)
            lines += [
                f"filter add dev {dev} parent 1: prio 2 protocol ip u32 match u16 0 {mask:#06x} at 2 classid {_PASS}",
                f"filter add dev {dev} parent 1: prio 3 protocol ip u32 match u32 0 0 classid {_DROP}",
            ]
        return lines

    def describe(self) -> str:
        parts = []
        if self.rate_bps:
            parts.append(format_rate(self.rate_bps))
        if self.loss:
            parts.append(f"{self.loss:.1%} loss")
        if self.drop_from_bytes:
            parts.append(f"packets >= {self.drop_from_bytes} B dropped")
        if self.delay_s:
            parts.append(f"{self.delay_s * 1e3:g} ms delay")
        return ", ".join(parts) or "unshaped"


# --------------------------------------------------------------------------- leftovers


def _netns_names() -> List[str]:
    out = _run(["ip", "-j", "netns", "list"], check=False).stdout.strip()
    try:
        return [e["name"] for e in json.loads(out or "[]")]
    except (ValueError, KeyError, TypeError):
        return [line.split()[0] for line in out.splitlines() if line.strip()]


def _link_names() -> List[str]:
    out = _run(["ip", "-j", "link", "show"], check=False).stdout.strip()
    try:
        return [e["ifname"] for e in json.loads(out or "[]")]
    except (ValueError, KeyError, TypeError):
        return []


def _kill_netns_processes(netns: str, spare: Iterable[int] = ()) -> None:
    """SIGKILL every process still inside ``netns`` (what this fabric, or a dead run's one,
    started there), then wait until they are gone."""
    keep = set(spare)
    pids = [int(p) for p in _run(["ip", "netns", "pids", netns], check=False).stdout.split() if p.isdigit()]
    pids = [p for p in pids if p not in keep]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _pid_alive(p) and not _zombie(p)]
        if pids:
            time.sleep(0.02)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def sweep_leftovers(*, only_pid: Optional[int] = None) -> List[str]:
    """Remove fabrics whose creator is gone (or, with ``only_pid``, that process's fabric):
    processes inside their namespaces, the namespaces, links and scratch directories.
    Returns what was removed."""
    removed: List[str] = []

    def stale(pid: int) -> bool:
        return pid == only_pid if only_pid is not None else not _pid_alive(pid)

    for ns in _netns_names():
        m = _NAME.match(ns)
        if m and m.group(2) == "n" and stale(int(m.group(1))):
            _kill_netns_processes(ns, spare=[os.getpid()])
            _run(["ip", "netns", "del", ns], check=False)
            removed.append(f"netns {ns}")
    for link in _link_names():
        m = _NAME.match(link.split("@")[0])
        if m and m.group(2) in "bh" and stale(int(m.group(1))):
            _run(["ip", "link", "del", m.group(0)], check=False)
            removed.append(f"link {m.group(0)}")
    for d in Path(SCRATCH).glob(f"{PREFIX}[0-9]*"):
        m = re.fullmatch(rf"{PREFIX}(\d+)", d.name)
        if m and d.is_dir() and stale(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(f"directory {d}")
    return removed


# --------------------------------------------------------------------------- the fabric


class Fabric:
    """``nodes`` simulated nodes on one bridge; ``shape`` applies to every link at start.

    Use as a context manager (or call :meth:`close`): everything is removed on exit, on an
    exception, at interpreter exit, and — after a SIGKILL — by the next fabric made on this
    machine. One fabric per process at a time (names carry the pid).
    """

    _live: Dict[int, "Fabric"] = {}

    def __init__(self, nodes: int, shape: LinkShape = LinkShape(), *, scratch: str = SCRATCH):
        if not isinstance(nodes, int) or nodes < 1 or nodes > 250:
            raise ValidationError(f"nodes={nodes!r}: give 1 to 250 simulated nodes")
        reason = unavailable()
        if reason is not None:
            raise FabricError(f"cannot build a network fabric here: {reason}")
        why = unavailable_shape(shape)
        if why is not None:
            raise FabricError(f"link shape {shape.describe()} is not possible here: {why}")
        pid = os.getpid()
        if pid in Fabric._live:
            raise FabricError(f"this process already has a fabric ({Fabric._live[pid].tag}); close it first")
        self.pid = pid
        self.tag = f"{PREFIX}{pid}"
        self.nodes = nodes
        self.root = Path(scratch) / self.tag
        self.shapes: Dict[int, LinkShape] = {n: LinkShape() for n in range(nodes)}
        self._cut: set = set()
        self._procs: List[subprocess.Popen] = []
        self._closed = False
        sweep_leftovers()
        sweep_leftovers(only_pid=pid)  # this pid's own, from an earlier process that had it
        Fabric._live[pid] = self
        atexit.register(self.close)
        try:
            self._build()
            for n in range(nodes):
                self.shape(n, shape)
        except BaseException:
            self.close()
            raise

    # -- names -----------------------------------------------------------------------------

    def netns(self, node: int) -> str:
        return f"{self.tag}n{self._node(node)}"

    def host_end(self, node: int) -> str:
        """The link's end on the bridge (root namespace)."""
        return f"{self.tag}h{self._node(node)}"

    def ifname(self, node: int) -> str:
        """The node's interface inside its namespace."""
        return f"{self.tag}v{self._node(node)}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{self._node(node) + 1}"

    def net(self, node: int) -> NodeNet:
        return NodeNet(node, self.netns(node), self.ifname(node), self.address(node), self.address(0))

    def store_root(self, node: int) -> str:
        return str(self.root / f"node{self._node(node)}")

    def _node(self, node: int) -> int:
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < self.nodes:
            raise ValidationError(f"node {node!r} is not one of this fabric's nodes 0..{self.nodes - 1}")
        return node

    # -- building ----------------------------------------------------------------------------

    def _build(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        bridge = f"{self.tag}b"
        root_lines = [f"link add {bridge} type bridge", f"link set {bridge} up"]
        for n in range(self.nodes):
            _run(["ip", "netns", "add", self.netns(n)])
            root_lines += [
                f"link add {self.host_end(n)} type veth peer name {self.ifname(n)} netns {self.netns(n)}",
                f"link set {self.host_end(n)} master {bridge} up",
            ]
        _batch(root_lines)
        for n in range(self.nodes):
            _batch(
                [
                    "link set lo up",
                    f"addr add {self.address(n)}/24 dev {self.ifname(n)}",
                    f"link set {self.ifname(n)} up",
                ],
                netns=self.netns(n),
            )

    # -- shaping and faults ------------------------------------------------------------------

    def shape(self, node: int, shape: LinkShape) -> None:
        """Give node ``node``'s link ``shape`` (both directions), replacing its previous one."""
        why = unavailable_shape(shape)
        if why is not None:
            raise FabricError(f"link shape {shape.describe()} is not possible here: {why}")
        host, inner = self.host_end(node), self.ifname(node)
        for dev, netns in ((host, None), (inner, self.netns(node))):
            _run(["tc", *(["-n", netns] if netns else []), "qdisc", "del", "dev", dev, "root"], check=False)
            _batch(shape.tc_lines(dev), netns=netns, tool="tc")
        self.shapes[node] = shape

    def reshape(self, node: int, **changes) -> LinkShape:
        """Change some of node ``node``'s link properties (``rate_bps=``, ``loss=``, ...)."""
        shape = replace(self.shapes[self._node(node)], **changes)
        self.shape(node, shape)
        return shape

    def cut(self, node: int) -> None:
        """Partition node ``node``: its link goes down at the bridge; packets to and from it
        are dropped, connections are not reset."""
        _run(["ip", "link", "set", self.host_end(node), "down"])
        self._cut.add(node)

    def heal(self, node: int) -> None:
        """Bring node ``node``'s link back (after :meth:`cut`)."""
        _run(["ip", "link", "set", self.host_end(node), "up"])
        self._cut.discard(node)

    def is_cut(self, node: int) -> bool:
        return node in self._cut

    def link_bytes(self, node: int) -> Tuple[int, int]:
        """(bytes sent to node ``node``, bytes it sent) over its link so far."""
        stats = Path("/sys/class/net") / self.host_end(node) / "statistics"
        return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())

    def dropped_packets(self, node: int) -> int:
        """Packets node ``node``'s link dropped on purpose so far (loss, black hole; both ends)."""
        total = 0
        for netns, dev in ((None, self.host_end(node)), (self.netns(node), self.ifname(node))):
            argv = ["tc", *(["-n", netns] if netns else []), "-s", "qdisc", "show", "dev", dev]
            text = _run(argv).stdout
            m = re.search(r"qdisc pfifo 20: .*?\n\s*Sent \d+ bytes \d+ pkt \(dropped (\d+)", text)
            total += int(m.group(1)) if m else 0
        return total

    # -- processes ---------------------------------------------------------------------------

    def command(self, node: int, argv: Sequence[str]) -> List[str]:
        """``argv`` run inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.netns(node), *argv]

    def popen(self, node: int, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside node ``node``'s namespace; killed by :meth:`close` at the latest."""
        p = subprocess.Popen(self.command(node, argv), **kw)
        self._procs.append(p)
        return p

    def run(
        self, node: int, argv: Sequence[str], *, timeout: float = 60, **kw
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside node ``node``'s namespace to the end (output captured as text)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.command(node, argv), timeout=timeout, **kw)

    # -- teardown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Kill what runs in the namespaces, remove namespaces, links and the scratch directory."""
        if self._closed:
            return
        self._closed = True
        Fabric._live.pop(self.pid, None)
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if os.getpid() == self.pid:  # a forked child inherits the object, never the teardown
            sweep_leftovers(only_pid=self.pid)

    def __enter__(self) -> "Fabric":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> str:
        shapes = {s.describe() for s in self.shapes.values()}
        return f"{self.nodes} nodes in network namespaces {self.tag}n*, links: {' / '.join(sorted(shapes))}"
