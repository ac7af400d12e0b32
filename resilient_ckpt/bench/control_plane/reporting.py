"""The control-plane benchmark's report: markdown tables (per phase, end to end, simulated, against
the issue's :data:`TARGETS`), fitted exponents (:func:`slope`), the log-log :func:`plot`, and
:func:`report`."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .profiler import CONTROL_PHASES
from .simulated import SIM_RESTORE, SIM_SAVE
from .workload import MIB


def slope(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Least-squares exponent k of y ~ x^k (log-log); None with fewer than 2 usable points."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y and y > 0 and y == y]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


#: the issue's targets (2 ranks, CPU, 50k tensors / 256 MiB per rank; simulated 1,024 / 4,096)
TARGETS = dict(
    cached_staged_s=0.3, first_save_s=3.0, restore_s=3.0, ratio=0.2, planning_s=1.0, wire_bytes=10 * MIB
)


def _fmt_s(x: Optional[float]) -> str:
    if x is None or x != x:
        return "-"
    return f"{x * 1e3:.1f}ms" if x < 1 else f"{x:.2f}s"


def _fmt_b(n: Optional[float]) -> str:
    if not n:
        return "-"
    if n < 1024:
        return f"{int(n)}B"
    if n < MIB:
        return f"{n / 1024:.1f}K"
    return f"{n / MIB:.1f}M"


OPS = ("first save", "cached save", "restore")


def real_tables(real: List[Dict[str, Any]]) -> List[str]:
    """Per operation: the issue's phases (rows) x tensor counts (time, bytes sent/received)."""
    lines: List[str] = []
    counts = [r["tensors"] for r in real]
    for op in OPS:
        lines.append(f"\n### ours, {op} (2 ranks; slowest rank; bytes per rank sent/received)\n")
        lines.append(
            "| phase | " + " | ".join(f"{n // 1000}k: time | {n // 1000}k: bytes" for n in counts) + " |"
        )
        lines.append("|---|" + "---|---|" * len(counts))
        phases = [p for p in list(CONTROL_PHASES) + ["data plane", "housekeeping", "unattributed"]]
        for ph in phases:
            cells = []
            for r in real:
                p = r["ours"][op].get("phases", {}).get(ph)
                if p is None:
                    cells += ["-", "-"]
                else:
                    b = f"{_fmt_b(p['sent'])}/{_fmt_b(p['received'])}" if p["sent"] or p["received"] else "-"
                    cells += [_fmt_s(p["seconds"]), b]
            lines.append(f"| {ph} | " + " | ".join(cells) + " |")
        totals = [("total", "restore_s")] if op == "restore" else [("until staged", "staged_s")]
        if op != "restore":
            totals.append(("until complete", "complete_s"))
        for label, key in totals:
            lines.append(_bold_row(label, [(_fmt_s(r["ours"][op].get(key)), "") for r in real]))
    return lines


def _bold_row(label: str, pairs: Sequence[Tuple[str, str]]) -> str:
    cells = [f"**{a}**" if a else "" for pair in pairs for a in pair]
    return f"| **{label}** | " + " | ".join(cells) + " |"


def e2e_table(real: List[Dict[str, Any]]) -> List[str]:
    lines = [
        "\n### end to end, ours vs reference (2 ranks, slowest rank, median of repetitions)\n",
        "| tensors/rank | bytes/rank | operation | ours | reference | ours/ref |",
        "|---|---|---|---|---|---|",
    ]
    for r in real:
        for op, key in (
            ("build state dict", ("cached save", "build_s")),
            ("first save until staged", ("first save", "staged_s")),
            ("first save until complete", ("first save", "complete_s")),
            ("cached save until staged", ("cached save", "staged_s")),
            ("cached save until complete", ("cached save", "complete_s")),
            ("restore after restart", ("restore", "restore_s")),
        ):
            ours = r["ours"][key[0]].get(key[1])
            ref = r.get("reference", {}).get(key[0], {}).get(key[1])
            ratio = f"{ours / ref:.2f}" if ours and ref else "-"
            lines.append(
                f"| {r['tensors']} | {_fmt_b(r['bytes_per_rank'])} | {op} | {_fmt_s(ours)} | {_fmt_s(ref)} | {ratio} |"
            )
    return lines


def sim_table(sim: List[Dict[str, Any]]) -> List[str]:
    worlds = [s["world"] for s in sim]
    s0 = sim[0]["shards_per_rank"] if sim else 0
    lines = [
        f"\n### simulated, per rank ({s0} shards/rank; time = what every rank computes on the gathered data)\n",
        "| computation | " + " | ".join(f"W={w}: time | W={w}: sent/received" for w in worlds) + " |",
        "|---|" + "---|---|" * len(worlds),
    ]
    names = list(sim[0]["rows"]) if sim else []
    for name in names:
        cells = []
        for s in sim:
            r = s["rows"][name]
            b = f"{_fmt_b(r['sent'])}/{_fmt_b(r['received'])}" if r["sent"] or r["received"] else "-"
            cells += [_fmt_s(r["seconds"] * r.get("calls", 1)), b]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for key, label in (
        ("save_planning_s", "first-save planning"),
        ("restore_planning_s", "restore planning"),
    ):
        lines.append(_bold_row(label, [(_fmt_s(s["totals"][key]), "") for s in sim]))
    lines.append(
        _bold_row(
            "received per rank, all gathers", [("", _fmt_b(s["totals"]["received_bytes"])) for s in sim]
        )
    )
    return lines


def exponents(real: List[Dict[str, Any]], sim: List[Dict[str, Any]]) -> Dict[str, Dict[str, Optional[float]]]:
    """Fitted exponents: per issue phase (summed over first save + cached save + restore)
    against tensors per rank; per simulated computation against world size."""
    out: Dict[str, Dict[str, Optional[float]]] = {"tensors": {}, "ranks": {}}
    if len(real) >= 2:
        xs = [r["tensors"] for r in real]
        for ph in CONTROL_PHASES:
            ys = [
                sum(r["ours"][op].get("phases", {}).get(ph, {}).get("seconds", 0) for op in OPS) for r in real
            ]
            out["tensors"][ph] = slope(xs, ys)
        for op, key in (("first save", "staged_s"), ("cached save", "staged_s"), ("restore", "restore_s")):
            out["tensors"][f"{op} ({key})"] = slope(xs, [r["ours"][op].get(key) for r in real])
            if all(r.get("reference") for r in real):
                out["tensors"][f"reference {op} ({key})"] = slope(
                    xs, [r["reference"][op].get(key) for r in real]
                )
    if len(sim) >= 2:
        xs = [s["world"] for s in sim]
        for name in sim[0]["rows"]:
            out["ranks"][name] = slope(xs, [s["rows"][name]["seconds"] for s in sim])
        for key in ("save_planning_s", "restore_planning_s", "received_bytes"):
            out["ranks"][key] = slope(xs, [s["totals"][key] for s in sim])
    return out


def targets_table(real: List[Dict[str, Any]], sim: List[Dict[str, Any]]) -> List[str]:
    lines = [
        "\n### against the issue's targets\n",
        "| target | measured | ratio to target |",
        "|---|---|---|",
    ]
    big = max(real, key=lambda r: r["tensors"]) if real else None

    def row(label, value, target, fmt=_fmt_s):
        ratio = f"{value / target:.1f}x" if value and value == value else "-"
        lines.append(f"| {label} <= {fmt(target)} | {fmt(value)} | {ratio} |")

    if big:
        n = big["tensors"]
        o = big["ours"]
        row(
            f"cached save until staged ({n} tensors)",
            o["cached save"].get("staged_s"),
            TARGETS["cached_staged_s"],
        )
        row(f"first save until staged ({n})", o["first save"].get("staged_s"), TARGETS["first_save_s"])
        row(f"first save until complete ({n})", o["first save"].get("complete_s"), TARGETS["first_save_s"])
        row(f"restore after restart ({n})", o["restore"].get("restore_s"), TARGETS["restore_s"])
        ref = big.get("reference")
        if ref:
            for op, key in (
                ("cached save", "staged_s"),
                ("first save", "staged_s"),
                ("restore", "restore_s"),
            ):
                a, b = o[op].get(key), ref[op].get(key)
                if a and b:
                    lines.append(
                        f"| {op} ours/reference <= 0.2 | {a / b:.2f} | {a / b / TARGETS['ratio']:.1f}x |"
                    )
    for s in sim:
        if s["world"] in (1024, 4096) or s is sim[-1]:
            t = s["totals"]
            row(
                f"planning per rank, W={s['world']} (first save)", t["save_planning_s"], TARGETS["planning_s"]
            )
            row(
                f"planning per rank, W={s['world']} (restore)", t["restore_planning_s"], TARGETS["planning_s"]
            )
            row(
                f"metadata received per rank, W={s['world']} (all gathers)",
                t["received_bytes"],
                TARGETS["wire_bytes"],
                _fmt_b,
            )
            row(
                f"metadata received per rank, W={s['world']} (largest gather)",
                t["largest_gather_received_bytes"],
                TARGETS["wire_bytes"],
                _fmt_b,
            )
    return lines


def plot(result: Dict[str, Any], path: str) -> None:
    """Log-log: left, each control phase (seconds summed over a first save, a cached save and
    a restore) and the three operations' totals against tensors per rank; right, each
    W-dependent planning computation and the per-rank totals against simulated ranks, with the
    metadata each rank receives on a second axis. Legends carry the fitted exponents."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    real, sim = result.get("real", []), result.get("simulated", [])
    ex = result.get("exponents", {})
    colors = plt.get_cmap("tab20").colors

    def label(name, k):
        return f"{name} (k={k:.2f})" if k is not None else name

    fig, axes = plt.subplots(1, 2, figsize=(16, 7))
    ax = axes[0]
    if real:
        xs = [r["tensors"] for r in real]
        for i, ph in enumerate(CONTROL_PHASES):
            ys = [
                sum(r["ours"][op].get("phases", {}).get(ph, {}).get("seconds", 0) for op in OPS) for r in real
            ]
            if all(y > 0 for y in ys):
                ax.plot(xs, ys, "o-", color=colors[i % 20], label=label(ph, ex.get("tensors", {}).get(ph)))
        for op, key, style in (
            ("first save", "staged_s", "k--"),
            ("cached save", "staged_s", "k:"),
            ("restore", "restore_s", "k-."),
        ):
            ys = [r["ours"][op].get(key) for r in real]
            k = ex.get("tensors", {}).get(f"{op} ({key})")
            ax.plot(xs, ys, style[1:], color="k", lw=2, label=label(f"ours: {op} ({key[:-2]})", k))
            if all(r.get("reference") for r in real):
                ys = [r["reference"][op].get(key) for r in real]
                k = ex.get("tensors", {}).get(f"reference {op} ({key})")
                ax.plot(xs, ys, style[1:], color="tab:gray", lw=2, label=label(f"reference: {op}", k))
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("tensors per rank (2 real ranks)")
    ax.set_ylabel("seconds (phases: first save + cached save + restore; slowest rank)")
    ax.set_title("cost vs tensors per rank")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    ax = axes[1]
    if sim:
        xs = [s["world"] for s in sim]
        names = [n for n in SIM_SAVE + SIM_RESTORE if n in sim[0]["rows"]]
        for i, name in enumerate(names):
            ys = [s["rows"][name]["seconds"] * s["rows"][name].get("calls", 1) for s in sim]
            if all(y > 0 for y in ys):
                ax.plot(xs, ys, "o-", color=colors[i % 20], label=label(name, ex.get("ranks", {}).get(name)))
        for key, style in (("save_planning_s", "k--"), ("restore_planning_s", "k-.")):
            ys = [s["totals"][key] for s in sim]
            ax.plot(
                xs,
                ys,
                style,
                lw=2,
                label=label(key.replace("_s", "").replace("_", " "), ex["ranks"].get(key)),
            )
        ax.axhline(TARGETS["planning_s"], color="tab:red", lw=1, label="target: 1 s per rank")
        ax2 = ax.twinx()
        ys = [s["totals"]["received_bytes"] / MIB for s in sim]
        k = ex.get("ranks", {}).get("received_bytes")
        ax2.plot(xs, ys, color="tab:purple", lw=2, ls=(0, (1, 1)), label=label("MiB received per rank", k))
        ax2.axhline(TARGETS["wire_bytes"] / MIB, color="tab:purple", lw=1, label="target: 10 MiB")
        ax2.set_yscale("log")
        ax2.set_ylabel("MiB received per rank (all gathers)")
        ax2.legend(loc="lower right", fontsize=7)
        ax.set_xscale("log")
        ax.set_yscale("log")
    s0 = sim[0]["shards_per_rank"] if sim else 0
    ax.set_xlabel(f"ranks (simulated, {s0} shards per rank)")
    ax.set_ylabel("seconds per rank (every rank computes the whole plan)")
    ax.set_title("cost vs ranks")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: Dict[str, Any]) -> str:
    lines: List[str] = []
    real, sim = result.get("real", []), result.get("simulated", [])
    if real:
        lines += real_tables(real)
        lines += e2e_table(real)
    if sim:
        lines += sim_table(sim)
    ex = result.get("exponents", {})
    if ex.get("tensors") or ex.get("ranks"):
        lines.append("\n### fitted exponents k (cost ~ x^k, least squares on log-log)\n")
        for axis, label in (("tensors", "vs tensors per rank"), ("ranks", "vs simulated ranks")):
            for name, k in ex.get(axis, {}).items():
                if k is not None:
                    lines.append(f"- {label}: {name}: k = {k:.2f}")
    lines += targets_table(real, sim)
    return "\n".join(lines)
