"""benchmarks/per_step_loop.py --quick: a checkpoint every step, none / ours / nvrx side by side on
both workloads, real rank processes; every figure the JSON promises is there and plausible (no
thresholds on times: figures are measured, not promised, in tests)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "per_step_loop.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("per-step") / "out.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_every_workload_and_system_ran_with_positive_step_times(run):
    report, stdout = run
    assert set(report["results"]) == {"a", "b"}
    for wl, rows in report["results"].items():
        assert set(rows) == {"none", "ours", "nvrx"}, wl
        for system, row in rows.items():
            assert "unavailable" not in row, (wl, system, row.get("unavailable"))
            assert row["steps"] > 0 and row["step_s_median"] > 0, (wl, system)
            assert row["cpu_s_per_step"] > 0 and row["state_tensors"] > 0, (wl, system)
            assert len(row["ranks"]) == report["world_size"] == 2
            assert f"{wl}  {system}" in stdout  # its row of the table
        for system in ("ours", "nvrx"):
            row = rows[system]
            assert row["ckpt_bytes"] > 0 and row["memcpy_s"] > 0, (wl, system)
            assert row["store_end"] > 0 and row["rss_peak"] >= row["rss_start"] > 0, (wl, system)
            for key in ("blocked_delta_pct", "blocked_direct_pct", "extra_cpu_s_per_step", "store_growth"):
                assert key in row, (wl, system, key)


def test_ours_saves_at_an_interval_of_at_least_one_step_without_failures_and_restores(run):
    report, _ = run
    for wl, rows in report["results"].items():
        ours = rows["ours"]
        assert ours["saves_failed"] == 0 and ours["hook_saves_failed"] == 0, wl
        assert ours["saves_started"] <= ours["steps"], wl
        assert ours["saves_started"] + ours["saves_skipped"] == ours["steps"], wl
        # at most one save a step; hook.metrics says 0 until two saves started (a loaded machine
        # may skip every due save of the few quick steps while the first one replicates)
        assert ours["hook_saves_started"] >= 1, wl
        if ours["hook_saves_started"] >= 2:
            assert ours["hook_interval_steps"] >= 1.0, (wl, ours["hook_interval_steps"])
        else:
            assert ours["hook_interval_steps"] == 0.0, wl
        # every rank restored the last step into a freshly built model and optimizer, bit for bit
        last = ours["warmup"] + ours["steps"] - 1
        assert ours["restore_bit_exact"] is True and ours["restored_step"] == last, wl


def test_nvrx_saved_every_step(run):
    report, _ = run
    for wl, rows in report["results"].items():
        nvrx = rows["nvrx"]
        assert nvrx["saves_started"] == nvrx["steps"] and nvrx["saves_skipped"] == 0, wl
        assert nvrx["find_latest"] == nvrx["warmup"] + nvrx["steps"] - 1, wl
