"""Smoke test of the main job (``resilient-ckpt demo``): real worker processes lose a node (or a
rank), restart, restore from memory and finish bit-exactly like the uninterrupted run."""

from __future__ import annotations

import json

import pytest

from resilient_ckpt.demo import orchestrator

STEPS, INTERVAL = 24, 6  # saves after steps 5, 11, 17; the failure comes after step 19


def _demo(tmp_path, failure: str, mode: str = "embedded", extra=()) -> dict:
    out = tmp_path / "result.json"
    # one flag and its value per line
    # fmt: off
    rc = orchestrator.main([
        "--steps", str(STEPS), "--interval", str(INTERVAL), "--failure", failure, "--mode", mode,
        "--json", str(out), "--plot", str(tmp_path / "loss.png"), "--workdir", str(tmp_path / "nodes"),
        *extra,
    ])
    # fmt: on
    result = json.loads(out.read_text())
    assert rc == 0, result
    if not result.get("resized"):
        assert (tmp_path / "loss.png").stat().st_size > 0
    assert list((tmp_path / "nodes").iterdir()) == [], "the demo removes its node stores"
    return result


def _check_resumed_bit_exactly(result: dict) -> None:
    assert result["bit_exact_losses"] is True
    assert result["bit_exact_params"] is True
    assert result["failure_step"] == 19
    # The newest checkpoint agreed complete before the failure: usually step 17, or an earlier
    # one when the failure interrupted that save's replication or agreement.
    resumed = result["resumed_from_step"]
    assert resumed - 1 in (5, 11, 17)
    assert [r["rank"] for r in result["restores"]] == [0, 1, 2, 3]
    assert all(r["iteration"] == resumed - 1 for r in result["restores"])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_demo_node_loss_restores_the_lost_nodes_ranks_from_peers_bit_exactly(tmp_path):
    result = _demo(tmp_path, "node")
    _check_resumed_bit_exactly(result)
    assert result["killed_ranks"] == [2, 3]
    sources = {r["rank"]: (r["source"], r["source_rank"]) for r in result["restores"]}
    # Node 1's store was deleted with it: its ranks' data comes from replicas on node 0.
    assert sources[2][0] == "peer" and sources[3][0] == "peer"
    assert sources[2][1] in (0, 1) and sources[3][1] in (0, 1)
    assert sources[0] == ("local", 0) and sources[1] == ("local", 1)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_demo_rank_crash_restores_the_killed_rank_from_its_own_node(tmp_path):
    result = _demo(tmp_path, "rank")
    _check_resumed_bit_exactly(result)
    assert result["killed_ranks"] == [3]
    assert all(r["source"] == "local" for r in result["restores"]), result["restores"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_demo_in_service_mode_recovers_a_lost_node_through_its_replacement_daemon(tmp_path):
    result = _demo(tmp_path, "node", mode="service")
    _check_resumed_bit_exactly(result)
    # The replacement node's daemon pulled its ranks' data before the trainers started.
    assert [r["source"] for r in result["restores"]] == ["local"] * 4


def test_demo_rejects_a_failure_step_outside_the_run():
    with pytest.raises(SystemExit, match=r"--fail-step must be in \[0, 22\]"):
        orchestrator.main(["--steps", "24", "--fail-step", "23"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("extra, after", [(["--no-replacement"], 2), (["--restart-nodes", "3"], 6)])
def test_demo_without_a_replacement_node_or_grown_resumes_resharded_from_memory(tmp_path, extra, after):
    result = _demo(tmp_path, "node", extra=extra)
    assert (result["world_before"], result["world_after"]) == (4, after)
    # the restarted job and an uninterrupted job of the new size from the same checkpoint agree
    assert result["bit_exact_losses"] is True and result["bit_exact_params"] is True
    assert result["resumed_from_step"] - 1 in (5, 11, 17)
    assert [r["source"] for r in result["restores"]] == ["resharded"] * after
