"""Regenerate the per-case table and the counts in docs/upstream-tests.md from a test run.

    .venv/bin/python tests/upstream/report.py            # runs tests/upstream, then writes
    .venv/bin/python tests/upstream/report.py run.xml    # from an existing --junitxml file

Every ported test id is mapped back to the upstream test id it ports (same parameters; on 2
ranks (tp, pp) = (2, 1) stands for upstream's (2, 4), see docs/upstream-tests.md).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "upstream-tests.md"

NVRX = "nvidia-resiliency-ext v0.4.1 tests/checkpointing/unit/"
MLM = "Megatron-LM core_v0.16.1 tests/unit_tests/dist_checkpointing/"

# ported module::function -> (upstream file::class::function, how ours is checked)
UPSTREAM = {
    "test_nvrx_basic_local::test_basic_save_load_scenarios": (
        "test_basic_local.py::TestLocalCheckpointing::test_basic_save_load_scenarios",
        "store, pickle",
    ),
    "test_nvrx_basic_local::test_find_latest_repl_disable": (
        "test_basic_local.py::TestLocalCheckpointing::test_find_latest_repl_disable",
        "store (D2)",
    ),
    "test_nvrx_cleanup::test_basic_save_load_scenarios": (
        "test_cleanup.py::TestLocalCheckpointing::test_basic_save_load_scenarios",
        "store, pickle, finalize timed",
    ),
    "test_mcore_local::test_filename_to_id": (
        "test_local.py::TestLocalCheckpointingReplication::test_filename_to_id",
        "store",
    ),
    "test_mcore_local::test_replication_sharded_tensors": (
        "test_local.py::TestLocalCheckpointingReplication::test_sharded_tensors",
        "same",
    ),
    "test_mcore_local::test_sharded_tensors": (
        "test_local.py::TestLocalCheckpointing::test_sharded_tensors",
        "D5",
    ),
    "test_mcore_local::test_basic_save_load_scenarios": (
        "test_local.py::TestLocalCheckpointing::test_basic_save_load_scenarios",
        "store",
    ),
    "test_mcore_local::test_failed_save": (
        "test_local.py::TestLocalCheckpointing::test_failed_save",
        "store, fault",
    ),
    "test_mcore_replication::test_all_gather_batch": ("test_replication.py::test_all_gather_batch", "same"),
    "test_mcore_replication::test_repl_save_and_load": (
        "test_replication.py::TestLocalCheckpointingReplication::test_repl_save_and_load",
        "store, node",
    ),
    "test_mcore_strict::test_everything_ok": (
        "test_strict.py::TestStrictLocal::test_everything_ok",
        "same (our TASD)",
    ),
    "test_mcore_strict::test_passthrough": (
        "test_strict.py::TestStrictLocal::test_passthrough",
        "same (our TASD)",
    ),
    "test_mcore_strict::test_passthrough_errors": (
        "test_strict.py::TestStrictLocal::test_passthrough_errors",
        "D4",
    ),
    "test_mcore_strict::test_raise_unexpected": (
        "test_strict.py::TestStrictLocal::test_raise_unexpected",
        "same (our TASD)",
    ),
    "test_mcore_strict::test_raise_all": (
        "test_strict.py::TestStrictLocal::test_raise_all",
        "same (our TASD)",
    ),
}


def upstream_params(func: str, params: list) -> str:
    """Our parameter tokens (impl removed) -> upstream's id tokens."""
    p = list(params)
    tp = {("2", "1"): ["2", "4"], ("1", "1"): ["1", "1"]}
    if func in ("test_basic_save_load_scenarios", "test_failed_save") and len(p) == 5:
        # ours: tp-pp-algo-async-ramdisk ; upstream: algo-async-ramdisk-tp-pp
        return "-".join(p[2:5] + tp[(p[0], p[1])])
    if func == "test_sharded_tensors":  # ours: tp-pp-fsdp2 ; upstream: fsdp2-tp-pp
        return "-".join(p[2:] + tp[(p[0], p[1])])
    if func in ("test_replication_sharded_tensors", "test_all_gather_batch"):
        return "-".join(tp[(p[0], p[1])])
    if func == "test_repl_save_and_load":
        # ours: tp-pp-repl_groupsN-ranks_to_breakN-algo-async ; upstream: repl_groupsN-algo-async-tp-pp
        return "-".join([p[2]] + p[4:6] + tp[(p[0], p[1])])
    if p and p[0] in STRICT_NAMES:
        return "-".join([f"StrictHandling.{p[0]}"] + p[1:])
    return "-".join(p)


STRICT_NAMES = {
    "ASSUME_OK_UNEXPECTED",
    "LOG_UNEXPECTED",
    "LOG_ALL",
    "RAISE_UNEXPECTED",
    "RAISE_ALL",
    "RETURN_UNEXPECTED",
    "RETURN_ALL",
    "IGNORE_ALL",
}


def _why(text: str) -> str:
    """The first error line of the first failing rank, shortened (for a bare AssertionError:
    the failing assert's file, line and source)."""
    lines = [ln[1:].strip() if ln.startswith("E ") else ln.strip() for ln in text.splitlines()]
    for i, line in enumerate(lines):
        if re.match(r"^--- rank \d+: FAILED", line):
            lines = lines[i + 1 :]
            break
    where, bare = "", False
    for i, line in enumerate(lines):
        m = re.match(r'^File "([^"]+)", line (\d+), in (\w+)', line)
        if m and "tests/upstream/pool.py" not in m.group(1):
            src = lines[i + 1] if i + 1 < len(lines) else ""
            where = f"{Path(m.group(1)).name}:{m.group(2)} `{src}`"
        if re.match(r"^AssertionError:?$", line):
            if where:
                return f"AssertionError at {where}"
            bare = True  # the summary line before the traceback: its last frame follows
            continue
        if re.match(r"^[A-Za-z_.]*(Error|Exception|Failed|Interrupt)[A-Za-z]*: ", line):
            line = re.sub(r"^[a-z_.]+\.(?=[A-Z])", "", line)
            return (line[:110] + "...") if len(line) > 110 else line
        if "did not finish" in line:
            return line[:110]
    return "AssertionError" if bare else "failed"


def parse(xml_path: Path):
    rows = defaultdict(dict)  # (module::func, param tokens) -> {impl: (ok, why)}
    for tc in ET.parse(xml_path).iter("testcase"):
        module = tc.get("classname").split(".")[-1]
        m = re.match(r"^(\w+)(?:\[(.*)\])?$", tc.get("name"))
        func, ids = m.group(1), m.group(2)
        key = f"{module}::{func}"
        if key not in UPSTREAM or ids is None:
            continue
        tokens = ids.split("-")
        impl = tokens.pop()
        failure = tc.find("failure")
        if failure is None:
            failure = tc.find("error")
        ok = failure is None and tc.find("skipped") is None
        rows[(key, tuple(tokens))][impl] = (
            ok,
            "" if ok else _why(failure.text or failure.get("message", "")),
        )
    return rows


def table(rows) -> tuple[str, dict]:
    lines = [
        "| upstream case | ported as (`tests/upstream/…`, + `-reference` / `-ours`) "
        "| ours checked | reference | ours |",
        "|---|---|---|---|---|",
    ]
    counts = defaultdict(lambda: [0, 0])
    for (key, tokens), res in sorted(rows.items(), key=lambda kv: (list(UPSTREAM).index(kv[0][0]), kv[0][1])):
        module, func = key.split("::")
        up, how = UPSTREAM[key]
        up_file = NVRX if module.startswith("test_nvrx") else MLM
        upstream_id = f"{up}[{upstream_params(func, list(tokens))}]" if tokens else up
        ported = f"{module}.py::{func}[{'-'.join(tokens)}]" if tokens else f"{module}.py::{func}"
        cells = []
        for impl in ("reference", "ours"):
            ok, why = res.get(impl, (False, "not run"))
            counts[impl][0] += ok
            counts[impl][1] += 1
            cells.append("pass" if ok else f"**FAIL** {why}".replace("|", "\\|"))
        short = "nvrx " if up_file == NVRX else "MLM "
        lines.append(f"| {short}`{upstream_id}` | `{ported}` | {how} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines), counts


def replace(doc: str, tag: str, body: str) -> str:
    begin, end = f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", doc)


def main(argv) -> int:
    if len(argv) > 1:
        xml_path, wall = Path(argv[1]), None
    else:
        xml_path = Path(tempfile.mkdtemp()) / "upstream.xml"
        t0 = time.monotonic()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/upstream",
                f"--junitxml={xml_path}",
            ],
            cwd=ROOT,
        )
        wall = time.monotonic() - t0
    rows = parse(xml_path)
    body, counts = table(rows)
    ref, ours = counts["reference"], counts["ours"]
    summary = (
        f"Upstream cases ported: **{ref[1]}**. Reference: **{ref[0]}/{ref[1]}** pass. "
        f"Ours: **{ours[0]}/{ours[1]}** pass"
        + (
            f". Whole run of tests/upstream (both implementations, the pool's own tests and "
            f"test_deliberate.py included): {wall:.0f} s."
            if wall
            else "."
        )
    )
    doc = DOC.read_text()
    doc = replace(doc, "counts", summary)
    doc = replace(doc, "table", body)
    DOC.write_text(doc)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
