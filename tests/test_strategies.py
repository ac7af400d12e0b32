"""Save/load strategies: the registry, backend/version checks, the dcp and memory backends."""

from __future__ import annotations

import json

import pytest
import torch

from resilient_ckpt import ShardedObject, ShardedTensor
from resilient_ckpt.errors import (
    CheckpointingException,
    CorruptCheckpointError,
    ForeignCheckpointError,
    ValidationError,
)
from resilient_ckpt.persistent.strategies import (
    DcpLoadCommonStrategy,
    DcpLoadShardedStrategy,
    DcpSaveCommonStrategy,
    DcpSaveShardedStrategy,
    LoadShardedStrategy,
    MemoryLoadShardedStrategy,
    MemorySaveShardedStrategy,
    StrategyAction,
    TwoStageDcpLoadShardedStrategy,
    get_default_strategy,
    read_checkpoint_format,
    register_default_strategy,
    verify_checkpoint_and_load_strategy,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _sharded(step: int):
    g = torch.Generator().manual_seed(step)
    w = torch.randn(4, 3, generator=g)
    return {
        "layer": {
            "w0": ShardedTensor.from_rank_offsets("layer.w", w[:2].clone(), (0, 0, 2)),
            "w1": ShardedTensor.from_rank_offsets("layer.w", w[2:].clone(), (0, 1, 2)),
        },
        "rng": ShardedObject("rng", {"seed": step}, (1,), (0,)),
    }, w


def test_registry_gives_default_strategies_for_both_backends():
    assert isinstance(get_default_strategy(StrategyAction.SAVE_SHARDED, "dcp", 1), DcpSaveShardedStrategy)
    assert isinstance(get_default_strategy(StrategyAction.SAVE_COMMON, "dcp", 1), DcpSaveCommonStrategy)
    assert isinstance(get_default_strategy(StrategyAction.LOAD_COMMON, "dcp", 1), DcpLoadCommonStrategy)
    plain = get_default_strategy("load_sharded", "dcp", 1)
    assert type(plain) is DcpLoadShardedStrategy
    assert isinstance(
        get_default_strategy(StrategyAction.LOAD_SHARDED, "dcp", 1, data_parallel_group=object()),
        TwoStageDcpLoadShardedStrategy,
    )
    mgr = object()
    s = get_default_strategy(StrategyAction.SAVE_SHARDED, "memory", 1, manager=mgr)
    assert isinstance(s, MemorySaveShardedStrategy) and s.manager is mgr
    assert (s.backend, s.version) == ("memory", 1) and s.can_handle_sharded_objects
    assert isinstance(
        get_default_strategy(StrategyAction.LOAD_SHARDED, "memory", 1, manager=mgr), MemoryLoadShardedStrategy
    )


def test_lookups_that_match_nothing_say_what_exists():
    with pytest.raises(
        ValidationError, match=r"unknown checkpoint backend 'zarr'; registered backends: \['dcp', 'memory'\]"
    ):
        get_default_strategy(StrategyAction.SAVE_SHARDED, "zarr", 1)
    with pytest.raises(
        ValidationError, match=r"no save_sharded strategy for format version 7; available versions: \[1\]"
    ):
        get_default_strategy(StrategyAction.SAVE_SHARDED, "dcp", 7)
    with pytest.raises(ValidationError, match="memory backend keeps the common state inside"):
        get_default_strategy(StrategyAction.SAVE_COMMON, "memory", 1)
    with pytest.raises(ValidationError, match="unknown strategy action 'copy'"):
        get_default_strategy("copy", "dcp", 1)
    with pytest.raises(ValidationError, match="needs manager="):
        get_default_strategy(StrategyAction.LOAD_SHARDED, "memory", 1)


def test_a_registered_strategy_becomes_the_default():
    class V2(DcpLoadShardedStrategy):
        supported_versions = (1, 2)

    register_default_strategy(StrategyAction.LOAD_SHARDED, "dcp", 2, V2)
    try:
        assert isinstance(get_default_strategy(StrategyAction.LOAD_SHARDED, "dcp", 2), V2)
    finally:
        from resilient_ckpt.persistent import strategies

        del strategies._REGISTRY[(StrategyAction.LOAD_SHARDED, "dcp", 2)]


def test_load_strategies_refuse_other_backends_and_unknown_versions_naming_both():
    s = DcpLoadShardedStrategy()
    s.check_compatibility("dcp", 1)
    with pytest.raises(
        ForeignCheckpointError, match="reads backend 'dcp', the checkpoint was written with backend 'memory'"
    ):
        s.check_backend_compatibility("memory")
    with pytest.raises(
        ForeignCheckpointError, match=r"reads 'dcp' format versions \[1\], the checkpoint has version 3"
    ):
        s.check_version_compatibility(3)


def test_dcp_strategies_round_trip_sharded_objects_and_common_state(tmp_path):
    sd, w = _sharded(1)
    save = get_default_strategy(StrategyAction.SAVE_SHARDED, "dcp", 1, sync_files=False)
    assert save.can_handle_sharded_objects
    save.save(sd, tmp_path)
    get_default_strategy(StrategyAction.SAVE_COMMON, "dcp", 1).save(
        {"iteration": 1, "args": {"lr": 0.5}}, tmp_path
    )
    assert read_checkpoint_format(tmp_path) == ("dcp", 1)
    sharded, common = verify_checkpoint_and_load_strategy(tmp_path)
    assert common.load(tmp_path) == {"iteration": 1, "args": {"lr": 0.5}}
    # Another layout than saved: the whole tensor in one piece.
    template = {
        "w": ShardedTensor.from_rank_offsets("layer.w", torch.zeros(4, 3)),
        "rng": ShardedObject("rng", None, (1,), (0,)),
    }
    out = sharded.load(template, tmp_path)
    assert torch.equal(out["w"], w) and out["rng"] == {"seed": 1}
    meta = sharded.load_tensors_metadata(tmp_path)
    assert set(meta) == {"layer.w"}
    assert meta["layer.w"].global_shape == (4, 3) and meta["layer.w"].dtype == torch.float32


def test_dcp_load_strategy_refuses_a_newer_format_and_names_missing_common_state(tmp_path):
    sd, _ = _sharded(2)
    DcpSaveShardedStrategy(sync_files=False).save(sd, tmp_path)
    with pytest.raises(CorruptCheckpointError, match="common.rckc is missing"):
        DcpLoadCommonStrategy().load(tmp_path)
    manifest = json.loads((tmp_path / "resilient_ckpt.json").read_text())
    manifest["version"] = 9
    (tmp_path / "resilient_ckpt.json").write_text(json.dumps(manifest))
    with pytest.raises(ForeignCheckpointError, match="the checkpoint has version 9"):
        DcpLoadShardedStrategy().load(_sharded(0)[0], tmp_path)
    with pytest.raises(ValidationError, match="no load_sharded strategy for format version 9"):
        verify_checkpoint_and_load_strategy(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorruptCheckpointError, match="is not a checkpoint directory"):
        read_checkpoint_format(tmp_path / "empty")


def test_memory_strategies_save_and_restore_through_the_manager(tmp_path):
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    mgr = CheckpointManager("strat", str(tmp_path / "shm"), replication_factor=1)
    try:
        sd, w = _sharded(3)
        sd["step"] = 3
        save = get_default_strategy(StrategyAction.SAVE_SHARDED, "memory", 1, manager=mgr)
        save.save(sd, tmp_path / "iter_0000003")
        load = get_default_strategy(StrategyAction.LOAD_SHARDED, "memory", 1, manager=mgr)
        out = load.load(_sharded(0)[0], "latest")
        assert torch.equal(out["layer"]["w0"], w[:2]) and torch.equal(out["layer"]["w1"], w[2:])
        assert out["rng"] == {"seed": 3} and out["step"] == 3
        with pytest.raises(CheckpointingException, match="newest complete iteration is 3, not 5"):
            load.load(_sharded(0)[0], 5)
        meta = load.load_tensors_metadata(3)
        assert meta["layer.w"].global_shape == (4, 3)
        with pytest.raises(ValidationError, match="needs the iteration in checkpoint_dir"):
            save.save(sd, tmp_path / "somewhere")
    finally:
        mgr.close()


def test_strategy_interfaces_are_abstract():
    with pytest.raises(TypeError):
        LoadShardedStrategy()  # type: ignore[abstract]
