"""Tables, JSON and plots of a bench run; everything works from the run's JSON document.

Limits used for "x limit" ratios (lower bounds on this one machine, where all W ranks share
the cores and the memory bus; s = B/2 + B/(2W) bytes a rank saves after dedup, R = B/2
replicated bytes, F = replication factor, rpn = ranks per node):

* stall:              W*s / memcpy                       (all ranks stage their bytes at once)
* durable:            W*s / memcpy + W*s*(F-1) / p2p     (+ every replica over loopback)
* restore (restart):  W*s / shm-memcpy + (W-1)*R / p2p   (read own shards, exchange replicas)
* restore (node loss): restart + rpn*s / p2p             (the lost node's shards from peers)

memcpy / shm-memcpy are the better of the default-thread and 1-thread figures, p2p the better
of gloo send/recv and ZeroMQ, all measured in the same run.

A ``--device cuda`` run (the limits then hold ``d2h_pinned_bps`` / ``h2d_pinned_bps``, GPU <->
page-locked host copies measured in the same run) stages from the GPU and restores into it, so
the copy into host memory is bounded by the device-to-host link instead of memcpy and a restore
also has to move the whole state B of a rank back to its GPU; g = ranks sharing one GPU
(ceil(W / GPUs)):

* stall:              g*s / d2h
* durable:            g*s / d2h + W*s*(F-1) / p2p
* restore (restart):  W*s / shm-memcpy + (W-1)*R / p2p + g*B / h2d
* restore (node loss): restart + rpn*s / p2p

A ``--fabric netns`` run (each node behind its own link of rate L, both directions) is bounded
by the bytes that must cross one node's link (the links work in parallel), ratios given
against the nominal rate and against what the fabric delivered in the same run (durable: gloo
with every node sending to the next at once, per node; node loss: one link alone, the better of
gloo and ZeroMQ):

* durable:            rpn*s*(F-1) / L     (each node's copies leave over its own link)
* restore (node loss): rpn*B / L           (the replacement node's ranks receive their whole state)
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any, Dict, List, Optional

from .workload import expected_saved_bytes, format_size

BASELINE = "baseline"
METRIC_LABELS = {
    "first_stall_s": "save stall, 1st after start",
    "max_stall_s": "save stall, worst save",
    "stall_s": "save stall",
    "durable_s": "time to durable",
    "restore_restart_s": "restore after restart",
    "restore_node_loss_s": "restore after node loss",
    "peak_rss_save_bytes": "peak RSS save",
    "peak_rss_restore_bytes": "peak RSS restore",
    "peak_unshared_restore_restart_bytes": "peak RSS restore, store pages excluded",
    "peak_private_restore_restart_bytes": "private memory, restore",
    "store_bytes_per_rank": "store bytes/rank",
    "host_bytes_per_rank": "host memory/rank",
    "loop_overhead_s": "loop overhead per save",
}
#: metrics bounded by another's limit (every save's stall has the stall's)
_SAME_LIMIT = {"first_stall_s": "stall_s", "max_stall_s": "stall_s"}
TIME_METRICS = ("stall_s", "durable_s", "restore_restart_s", "restore_node_loss_s")
LIMIT_FORMULAS = {
    "stall_s": "W*s/memcpy",
    "durable_s": "W*s/memcpy + W*s*(F-1)/p2p",
    "restore_restart_s": "W*s/shm_memcpy + (W-1)*R/p2p",
    "restore_node_loss_s": "W*s/shm_memcpy + (W-1)*R/p2p + rpn*s/p2p",
}


LINK_LIMIT_FORMULAS = {
    "durable_s": "rpn*s*(F-1)/link",
    "restore_node_loss_s": "rpn*B/link",
}


def link_limit_seconds(
    metric: str, bytes_per_rank: int, world_size: int, ranks_per_node: int, factor: int, link_bps: float
) -> Optional[float]:
    """A node's link's lower bound for ``metric`` (``link_bps``: bits/s), None where none applies."""
    if metric == "durable_s":
        return ranks_per_node * expected_saved_bytes(bytes_per_rank, world_size) * (factor - 1) * 8 / link_bps
    if metric == "restore_node_loss_s":
        return ranks_per_node * bytes_per_rank * 8 / link_bps
    return None


CUDA_LIMIT_FORMULAS = {
    "stall_s": "g*s/d2h",
    "durable_s": "g*s/d2h + W*s*(F-1)/p2p",
    "restore_restart_s": "W*s/shm_memcpy + (W-1)*R/p2p + g*B/h2d",
    "restore_node_loss_s": "W*s/shm_memcpy + (W-1)*R/p2p + g*B/h2d + rpn*s/p2p",
}


def _is_cuda(limits: Optional[Dict[str, Any]]) -> bool:
    return bool(limits) and bool(limits.get("d2h_pinned_bps")) and bool(limits.get("h2d_pinned_bps"))


def limit_formula(metric: str, limits: Optional[Dict[str, Any]]) -> Optional[str]:
    metric = _SAME_LIMIT.get(metric, metric)
    return (CUDA_LIMIT_FORMULAS if _is_cuda(limits) else LIMIT_FORMULAS).get(metric)


def _cuda_limit_seconds(
    metric: str, b: int, w: int, rpn: int, f: int, s: int, limits: Dict[str, Any]
) -> Optional[float]:
    g = -(-w // max(1, int(limits.get("cuda_devices") or 1)))  # ranks per GPU
    p2p, shm = limits["p2p_bps"], max(limits["shm_memcpy_bps"], limits["shm_memcpy_1thread_bps"])
    d2h, h2d = limits["d2h_pinned_bps"], limits["h2d_pinned_bps"]
    if metric == "stall_s":
        return g * s / d2h
    if metric == "durable_s":
        return g * s / d2h + w * s * (f - 1) / p2p
    restart = w * s / shm + (w - 1) * (b // 2) / p2p + g * b / h2d
    if metric == "restore_restart_s":
        return restart
    return restart + rpn * s / p2p


def limit_seconds(
    metric: str,
    bytes_per_rank: int,
    world_size: int,
    ranks_per_node: int,
    replication_factor: int,
    limits: Optional[Dict[str, float]],
) -> Optional[float]:
    """The machine's lower bound for ``metric`` (see module docstring), None where none applies."""
    metric = _SAME_LIMIT.get(metric, metric)
    if not limits or metric not in LIMIT_FORMULAS:
        return None
    w, f = world_size, replication_factor
    s = expected_saved_bytes(bytes_per_rank, world_size)
    if _is_cuda(limits):
        return _cuda_limit_seconds(metric, bytes_per_rank, w, ranks_per_node, f, s, limits)
    r = bytes_per_rank // 2
    p2p = limits["p2p_bps"]
    # the best thread count measured: a bound, not what one configuration happens to get
    memcpy = max(limits["memcpy_bps"], limits["memcpy_1thread_bps"])
    shm = max(limits["shm_memcpy_bps"], limits["shm_memcpy_1thread_bps"])
    if metric == "stall_s":
        return w * s / memcpy
    if metric == "durable_s":
        return w * s / memcpy + w * s * (f - 1) / p2p
    restart = w * s / shm + (w - 1) * r / p2p
    if metric == "restore_restart_s":
        return restart
    return restart + ranks_per_node * s / p2p


def _median(run: Dict[str, Any], metric: str) -> Optional[float]:
    m = run["metrics"].get(metric)
    return None if m is None else m["median"]


def comparisons(doc: Dict[str, Any]) -> List[Dict[str, Any]]:
    """For each metric, size and world size: ours, baseline, ours/baseline, the limit and
    ours/limit, one row per non-baseline system (``system`` None and ``ours`` None where only
    the baseline ran)."""
    runs = doc["runs"]
    keys = sorted({(r.get("link_rate_bps") or 0, r["world_size"], r["bytes_per_rank"]) for r in runs})
    out = []
    for rate, w, b in keys:
        here = [
            r
            for r in runs
            if ((r.get("link_rate_bps") or 0), r["world_size"], r["bytes_per_rank"]) == (rate, w, b)
        ]
        ref = next((r for r in here if r["system"] == BASELINE), None)
        mine = [r for r in here if r["system"] != BASELINE] or [None]
        any_run = here[0]
        rpn, factor = any_run["ranks_per_node"], any_run["replication_factor"]
        link = (doc.get("links") or {}).get(str(rate), {}) if rate else {}
        for metric in METRIC_LABELS:
            if rate:  # --fabric netns: the link bounds it (nominal rate; what it delivered)
                lim = link_limit_seconds(metric, b, w, rpn, factor, rate)
                # every node replicates at once (the ring figure), a restore loads one link
                measured = link.get("ring_bps" if metric == "durable_s" else "link_bps") or link.get(
                    "link_bps"
                )
                got = link_limit_seconds(metric, b, w, rpn, factor, measured * 8) if measured else None
                formula = LINK_LIMIT_FORMULAS.get(metric)
            else:
                lim = limit_seconds(metric, b, w, rpn, factor, doc.get("limits"))
                got, formula = None, limit_formula(metric, doc.get("limits"))
            bl = _median(ref, metric) if ref is not None else None
            for r in mine:
                ours = _median(r, metric) if r is not None else None
                out.append(
                    {
                        "metric": metric,
                        "bytes_per_rank": b,
                        "world_size": w,
                        "system": None if r is None else r["system"],
                        "ours": ours,
                        "baseline": bl,
                        "ratio": (ours / bl) if ours is not None and bl else None,
                        "limit": lim,
                        "limit_formula": formula,
                        "ratio_to_limit": (ours / lim) if ours is not None and lim else None,
                        "baseline_ratio_to_limit": (bl / lim) if bl is not None and lim else None,
                        **(
                            {
                                "link_rate_bps": rate,
                                "measured_limit": got,
                                "ratio_to_measured_limit": (ours / got) if ours is not None and got else None,
                            }
                            if rate
                            else {}
                        ),
                    }
                )
    return out


# --- terminal --------------------------------------------------------------------------------


def console():
    from rich.console import Console

    con = Console()
    # redirected output (CI logs, pytest): no 80-column wrapping of tables and messages
    return con if con.is_terminal else Console(width=200, soft_wrap=True)


def _fmt(metric: str, v: Optional[float]) -> str:
    if v is None:
        return "-"
    if metric.endswith("_s"):
        return f"{v:.3f} s"
    return f"{v / (1 << 30):.2f} GiB"


def _ratio(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}x"


def format_limits(limits: Dict[str, float]) -> str:
    gib = 1 << 30
    cuda = ""
    if _is_cuda(limits):
        cuda = (
            f"; GPU -> pinned host {limits['d2h_pinned_bps'] / gib:.2f} GiB/s, pinned host -> GPU "
            f"{limits['h2d_pinned_bps'] / gib:.2f} GiB/s"
        )
    return (
        f"limits: memcpy {limits['memcpy_bps'] / gib:.2f} GiB/s ({limits['threads']} threads), "
        f"{limits['memcpy_1thread_bps'] / gib:.2f} GiB/s (1 thread); /dev/shm mmap memcpy "
        f"{limits['shm_memcpy_bps'] / gib:.2f} GiB/s ({limits['shm_memcpy_1thread_bps'] / gib:.2f}"
        f" 1 thread); memcpy into fresh pages {limits['fresh_memcpy_1thread_bps'] / gib:.2f} GiB/s "
        f"(1 thread, page faults included); gloo p2p {limits['gloo_p2p_bps'] / gib:.2f} GiB/s; ZeroMQ "
        f"{limits['zmq_bps'] / gib:.2f} GiB/s (64 MiB zero-copy frames)" + cuda
    )


def render(doc: Dict[str, Any], con=None) -> None:
    """Rich tables: one per world size, rows = metric x size, columns = systems and ratios."""
    from rich.table import Table

    con = con or console()
    if any(r.get("link_rate_bps") for r in doc["runs"]):
        _render_links(doc, con)
        return
    runs = doc["runs"]
    systems = list(dict.fromkeys(r["system"] for r in runs))
    others = [s for s in systems if s != BASELINE]
    by_key = {(r["system"], r["bytes_per_rank"], r["world_size"]): r for r in runs}
    for w in sorted({r["world_size"] for r in runs}):
        sizes = sorted({r["bytes_per_rank"] for r in runs if r["world_size"] == w})
        rpn = next(r["ranks_per_node"] for r in runs if r["world_size"] == w)
        t = Table(
            title=f"W={w} ranks, {rpn} per node, replication factor "
            f"{runs[0]['replication_factor']} (medians over reps)"
        )
        t.add_column("metric")
        t.add_column("B/rank", justify="right")
        for s in systems:
            t.add_column(s, justify="right")
        for s in others:
            if BASELINE in systems:
                t.add_column(f"{s}\n/ baseline", justify="right")
            t.add_column(f"{s}\n/ limit", justify="right")
        t.add_column("limit", justify="right")
        for metric, label in METRIC_LABELS.items():
            for b in sizes:
                row = [label, format_size(b)]
                vals = {
                    s: (_median(by_key[(s, b, w)], metric) if (s, b, w) in by_key else None) for s in systems
                }
                row += [_fmt(metric, vals[s]) for s in systems]
                lim = limit_seconds(metric, b, w, rpn, runs[0]["replication_factor"], doc.get("limits"))
                for s in others:
                    if BASELINE in systems:
                        bl = vals[BASELINE]
                        row.append(_ratio(vals[s] / bl if vals[s] is not None and bl else None))
                    row.append(_ratio(vals[s] / lim if vals[s] is not None and lim else None))
                row.append(_fmt(metric, lim) if lim is not None else "")
                t.add_row(*row)
        con.print(t)
    if doc.get("limits"):
        con.print(format_limits(doc["limits"]), markup=False, highlight=False)
    con.print(f"peak RSS: {doc['rss_method']}", markup=False, highlight=False)
    _render_every_save(runs, con)
    _render_restore_phases(runs, con)
    patched = doc.get("patched", doc.get("patched_for_cpu"))
    if patched:
        device = doc.get("config", {}).get("device", "cpu")
        label = "patched for CPU" if device == "cpu" else f"adapted for {device} on gloo"
        con.print(f"{label}: " + "; ".join(patched), markup=False, highlight=False)
    for s in doc.get("skipped", []):
        where = f" {format_size(s['bytes_per_rank'])} W={s['world_size']}" if "bytes_per_rank" in s else ""
        con.print(f"skipped {s['system']}{where}: {s['reason']}", markup=False, highlight=False)
    for r in runs:
        for e in r["errors"]:
            con.print(
                f"ERROR {r['system']} {format_size(r['bytes_per_rank'])} W={r['world_size']}: {e}",
                markup=False,
                highlight=False,
            )


def _render_links(doc: Dict[str, Any], con) -> None:
    """--fabric netns: one table per world size, rows = metric x size x link rate, columns =
    systems, ours / baseline, ours / link limit (nominal and as measured)."""
    from rich.table import Table

    from .fabric import format_rate

    rows = [c for c in doc.get("comparisons") or comparisons(doc) if c["metric"] in TIME_METRICS]
    for w in sorted({c["world_size"] for c in rows}):
        t = Table(title=f"W={w} ranks on network namespaces, one link per node (medians over reps)")
        for col in (
            "metric",
            "B/rank",
            "link",
            "system",
            "ours",
            "baseline",
            "/ baseline",
            "link limit",
            "/ limit",
            "/ measured",
        ):
            t.add_column(col, justify="left" if col in ("metric", "system") else "right")
        for c in rows:
            if c["world_size"] != w:
                continue
            t.add_row(
                METRIC_LABELS[c["metric"]],
                format_size(c["bytes_per_rank"]),
                format_rate(c["link_rate_bps"]),
                c["system"] or "-",
                _fmt(c["metric"], c["ours"]),
                _fmt(c["metric"], c["baseline"]),
                _ratio(c["ratio"]),
                _fmt(c["metric"], c["limit"]) if c["limit"] else "",
                _ratio(c["ratio_to_limit"]),
                _ratio(c.get("ratio_to_measured_limit")),
            )
        con.print(t)
    for rate, link in sorted((doc.get("links") or {}).items(), key=lambda kv: int(kv[0])):
        gib = 1 << 30
        ring = f", every node at once {link['ring_bps'] / gib:.2f} GiB/s each" if link.get("ring_bps") else ""
        con.print(
            f"link {format_rate(int(rate))}: gloo p2p {link['gloo_p2p_bps'] / gib:.2f} GiB/s, ZeroMQ "
            f"{link['zmq_bps'] / gib:.2f} GiB/s through one link{ring} ({link['describe']})",
            markup=False,
            highlight=False,
        )
    for s in doc.get("skipped", []):
        where = f" {format_size(s['bytes_per_rank'])} W={s['world_size']}" if "bytes_per_rank" in s else ""
        con.print(f"skipped {s['system']}{where}: {s['reason']}", markup=False, highlight=False)
    for r in doc["runs"]:
        for e in r["errors"]:
            con.print(
                f"ERROR {r['system']} {format_size(r['bytes_per_rank'])}: {e}", markup=False, highlight=False
            )


def _render_every_save(runs: List[Dict[str, Any]], con) -> None:
    """What the table's medians summarise: the stall of every save from the first after a
    start (no warm-up hidden), and how host memory is counted."""
    con.print(
        "host memory/rank: store bytes/rank + peak private memory (RssAnon of the rank, Pss_Anon of its "
        "children, sampled) + page-locked host allocations, during the saves",
        markup=False,
        highlight=False,
    )
    for r in runs:
        stalls = r["metrics"].get("stalls_s", {}).get("values") or []
        if stalls and stalls[0]:
            each = ", ".join(f"{v:.3f}" for v in stalls[0])
            con.print(
                f"stall of every save, {r['system']} {format_size(r['bytes_per_rank'])} "
                f"W={r['world_size']} (rep 1, s): {each}",
                markup=False,
                highlight=False,
            )


def restore_phase_lines(run: Dict[str, Any]) -> List[str]:
    """Per restore case and rank: the median over repetitions of each phase's seconds
    (``resilient_ckpt.timing``; phases are self time, "other" is what none covered)."""
    from ..timing import COLLECTIVES, COPY, DECODE, DEVICE, OTHER, PEERS, READS

    order = [READS, PEERS, COLLECTIVES, DECODE, COPY, DEVICE, OTHER]
    lines = []
    for case, reps in (run.get("restore_phases") or {}).items():
        for rank in range(len(reps[0]) if reps else 0):
            per = [rep[rank] for rep in reps if rank < len(rep)]
            keys = {k for p in per for k in p}
            med = {k: statistics.median(p.get(k, 0.0) for p in per) for k in keys}
            mine = [k for k in order if k in med] + sorted(k for k in keys - set(order) if "/" not in k)
            parts = ", ".join(f"{k} {med[k]:.3f}" for k in mine if med[k] or k == OTHER)
            readers = ", ".join(
                f"{k.split('/', 1)[1]} {med[k]:.3f}" for k in sorted(keys) if k.startswith("readers/")
            )
            lines.append(
                f"restore breakdown, {run['system']} {format_size(run['bytes_per_rank'])} "
                f"W={run['world_size']} {case}, rank {rank} (s, median of {len(per)}): {parts}; "
                f"sum {sum(med[k] for k in mine):.3f}"
                + (f" | reader threads (s, summed): {readers}" if readers else "")
            )
    return lines


def _render_restore_phases(runs: List[Dict[str, Any]], con) -> None:
    for r in runs:
        for line in restore_phase_lines(r):
            con.print(line, markup=False, highlight=False)


# --- files ---------------------------------------------------------------------------------


def write_json(doc: Dict[str, Any], path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


_METRIC_COLORS = dict(zip(TIME_METRICS, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
_MARKERS = ["o", "s", "^", "D", "v", "P"]


def _plot_systems(ax, runs: List[Dict[str, Any]], w: int, systems: List[str]) -> None:
    """A line per system and time metric: median seconds vs MiB per rank."""
    for si, s in enumerate(systems):
        rs = sorted(
            (r for r in runs if r["system"] == s and r["world_size"] == w),
            key=lambda r: r["bytes_per_rank"],
        )
        for metric in TIME_METRICS:
            pts = [(r["bytes_per_rank"] / (1 << 20), _median(r, metric)) for r in rs]
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                ax.plot(
                    *zip(*pts),
                    marker=_MARKERS[si % len(_MARKERS)],
                    linestyle="-" if s != BASELINE else ":",
                    color=_METRIC_COLORS[metric],
                    label=f"{s}: {METRIC_LABELS[metric]}",
                )


def _plot_limits(ax, doc: Dict[str, Any], w: int, sizes: List[int]) -> None:
    """The machine's limit for each time metric, dashed (nothing without limits or runs)."""
    rs = [r for r in doc["runs"] if r["world_size"] == w]
    if not (doc.get("limits") and rs):
        return
    rpn, factor = rs[0]["ranks_per_node"], rs[0]["replication_factor"]
    for metric in TIME_METRICS:
        pts = [(b / (1 << 20), limit_seconds(metric, b, w, rpn, factor, doc["limits"])) for b in sizes]
        ax.plot(
            *zip(*pts),
            linestyle="--",
            linewidth=1,
            color=_METRIC_COLORS[metric],
            alpha=0.6,
            label=f"limit: {METRIC_LABELS[metric]}",
        )


def _style_panel(ax, w: int, sizes: List[int]) -> None:
    if sizes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([b / (1 << 20) for b in sizes], [format_size(b) for b in sizes])
        ax.minorticks_off() if len(sizes) > 1 else None
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("seconds")
    ax.set_title(f"W={w}")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6, loc="upper left")


def plot(doc: Dict[str, Any], path: str) -> None:
    """PNG: seconds vs bytes per rank, one panel per world size, a line per system and
    metric, the machine's limits as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    worlds = sorted({r["world_size"] for r in runs}) or [0]
    systems = list(dict.fromkeys(r["system"] for r in runs))
    fig, axes = plt.subplots(1, len(worlds), figsize=(6.5 * len(worlds), 5), squeeze=False)
    for ax, w in zip(axes[0], worlds):
        sizes = sorted({r["bytes_per_rank"] for r in runs if r["world_size"] == w})
        _plot_systems(ax, runs, w, systems)
        _plot_limits(ax, doc, w, sizes)
        _style_panel(ax, w, sizes)
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
