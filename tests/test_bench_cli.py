"""`resilient-ckpt bench --quick` as CI's smoke run: every system, real processes, JSON with
ours / baseline / ratio / limits for each metric (no thresholds asserted: figures are measured,
not promised, in tests)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.multiprocess
@pytest.mark.slow
def test_bench_quick_compares_every_system_with_the_baseline_and_the_limits(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_ckpt.cli.main", "bench", "--quick", "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {r["system"] for r in doc["runs"]} == {"baseline", "ours-embedded", "ours-service"}
    assert all(r["errors"] == [] for r in doc["runs"]), [r["errors"] for r in doc["runs"]]
    comparisons = doc["comparisons"]
    assert comparisons, "ratios ours/baseline and ours/limit are reported"
    text = json.dumps(comparisons)
    for metric in ("stall", "durable", "restore"):
        assert metric in text
    assert png.stat().st_size > 0
    assert "ours-embedded" in proc.stdout and "baseline" in proc.stdout
