"""`resilient-ckpt bench --quick` as CI's smoke run: every system, real processes, JSON with
ours / baseline / ratio / limits for each metric (no thresholds asserted: figures are measured,
not promised, in tests). And the tools extra: the demo and the benchmark say in one line that
they need it, while the trainer library imports without it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from resilient_ckpt.cli import extras

TOOLS_MESSAGE = "resilient-ckpt {} needs the tools extra (missing: {}): pip install 'resilient-ckpt[tools]'"


def _python_without(blocked, code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter where importing ``blocked`` fails, as without the extra."""
    prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "command,blocked",
    [
        ("demo", ["matplotlib"]),
        ("bench", ["psutil"]),
        ("bench", ["matplotlib", "psutil", "rich"]),
    ],
)
def test_a_tool_command_without_the_tools_extra_says_so_in_one_line(command, blocked):
    proc = _python_without(
        blocked, f"from resilient_ckpt.cli.main import main; sys.exit(main([{command!r}]))"
    )
    assert proc.returncode != 0
    assert proc.stderr.splitlines() == [TOOLS_MESSAGE.format(command, ", ".join(sorted(blocked)))]
    assert proc.stdout == ""  # nothing started


@pytest.mark.parametrize(
    "module,command,argv",
    [
        ("demo.orchestrator", "demo", []),
        ("bench.main", "bench", ["--quick"]),
    ],
)
def test_the_tool_mains_check_for_the_extra_before_any_work(module, command, argv):
    proc = _python_without(
        ["matplotlib"], f"from resilient_ckpt.{module} import main; sys.exit(main({argv!r}))"
    )
    assert proc.returncode != 0
    assert proc.stderr.splitlines()[-1] == TOOLS_MESSAGE.format(command, "matplotlib")
    assert proc.stdout == ""


def test_the_trainer_library_and_the_daemon_import_without_the_tools_extra():
    proc = _python_without(
        ["matplotlib", "psutil", "rich"],
        (
            "import resilient_ckpt\n"
            "from resilient_ckpt import CheckpointHook, CheckpointManager, MCoreTensorAwareStateDict, TrainState\n"
            "import resilient_ckpt.service.daemon, resilient_ckpt.persistent.tier\n"
            "from resilient_ckpt.cli.main import main\n"
            "sys.exit(main(['--help']))\n"
        ),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "demo" in proc.stdout and "bench" in proc.stdout


def test_the_tools_extra_lists_what_the_tools_import_and_the_runtime_does_not():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]

    def names(reqs):
        return {
            r.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower()
            for r in reqs
        }

    runtime, tools = names(project["dependencies"]), names(project["optional-dependencies"]["tools"])
    needed = {m for mods in extras.TOOL_MODULES.values() for m in mods}
    assert needed <= tools
    # rich stays a runtime dependency while the operator commands (status, ls, drop) use it
    assert not (needed - {"rich"}) & runtime


@pytest.mark.multiprocess
@pytest.mark.slow
def test_bench_quick_compares_every_system_with_the_baseline_and_the_limits(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    # One warm-up save instead of three: the smoke run checks the comparison, not steady state.
    cmd = [sys.executable, "-m", "resilient_ckpt.cli.main", "bench", "--quick", "--warmup-saves", "1"]
    proc = subprocess.run(
        cmd + ["--json", str(out), "--plot", str(png)], capture_output=True, text=True, timeout=300
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
    # Where each rank's restore went, by phase: a restart reads its node's copies, a node loss
    # moves the lost node's copies from the peer; the phases add up to the restore's time.
    (ours,) = [r for r in doc["runs"] if r["system"] == "ours-embedded"]
    for case, moved_by in (("restart", "reads+checksums"), ("node_loss", "peer transfer")):
        (ranks,) = ours["restore_phases"][case]  # one repetition
        assert len(ranks) == 2
        assert any(p.get(moved_by, 0) > 0 for p in ranks), (case, ranks)
        assert all(p["collectives"] > 0 and p["other"] >= 0 for p in ranks)
        total = ours["metrics"][f"restore_{case}_s"]["median"]
        assert max(sum(v for k, v in p.items() if "/" not in k) for p in ranks) <= total * 1.05
    assert "restore breakdown, ours-embedded 64M W=2 restart, rank 0" in proc.stdout


# ---- --device ----------------------------------------------------------------------------------


def test_bench_device_defaults_to_cpu_and_accepts_only_cpu_or_cuda(capsys):
    from resilient_ckpt.bench import main as bench

    parser = bench.build_parser()
    assert parser.parse_args([]).device == "cpu"
    assert parser.parse_args(["--device", "cuda"]).device == "cuda"
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--device", "gpu"])
    assert e.value.code == 2
    assert "argument --device: invalid choice: 'gpu'" in capsys.readouterr().err


def test_bench_device_cuda_without_a_gpu_is_refused_at_once_naming_the_problem(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    out = tmp_path / "never.json"
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from resilient_ckpt.cli.main import main; sys.exit(main())"]
        + ["bench", "--device", "cuda", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2  # argparse's usage error, not a crash
    assert "Traceback" not in proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("resilient-ckpt bench: error: --device cuda: torch ")
    assert "sees no CUDA device" in last and "use --device cpu" in last
    assert proc.stdout == "" and not out.exists()  # refused before measuring or launching anything
