"""Layer 6 — the persistent tier over torch.distributed.checkpoint. Imports model, parallel,
memory, replication.

Modules, bottom to top (each imports only those before it):

- ``layout``: what we put into a DCP directory (file names, manifest, internal entries);
- ``checks``: validation of save plans, metadata and data files;
- ``flatten``: a (sharded) state dict as DCP entries, shared by save and load;
- ``save_planner`` / ``load_planner``: our DCP planners;
- ``storage``: reader and writer (safe metadata, checked files, manifest);
- ``local_load``: loading in one process (``load_local``, ``load_metadata_only``);
- ``two_stage``: the two-stage data-parallel load;
- ``snapshot``: a stored checkpoint as a zero-copy DCP state dict;
- ``interface``: ``PersistentTierProtocol``, what the manager uses of a tier;
- ``tier``: ``PersistentTier`` (flush, restore) and ``restore_latest``;
- ``export``: a node's store to a DCP directory without torch.distributed;
- ``strategies``: Megatron-style save/load strategies and their registry.

The names below are importable from this package; they load on first use, so importing one
light module (``layout``) does not pull in DCP and the tier.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, List

_EXPORTS: Dict[str, str] = {
    # layout
    "BACKEND": "layout",
    "DCP_FORMAT_VERSION": "layout",
    "FORMAT_NAME": "layout",
    "INTERNAL_PREFIX": "layout",
    "MANIFEST_NAME": "layout",
    "METADATA_NAME": "layout",
    "RawBytes": "layout",
    "hollow_fqn": "layout",
    "is_internal": "layout",
    "iteration_dir_name": "layout",
    # checks
    "check_data_files": "checks",
    "chunk_problems": "checks",
    "validate_global_plan": "checks",
    "validate_metadata": "checks",
    # flatten
    "flatten_for_save": "flatten",
    # planners
    "LocalPlanData": "save_planner",
    "ResilientSavePlanner": "save_planner",
    "SavePlannerStats": "save_planner",
    "build_global_save_plan": "save_planner",
    "plan_signature": "save_planner",
    "MetadataStateDictLoadPlanner": "load_planner",
    "PassiveLoadPlanner": "load_planner",
    "ResilientLoadPlanner": "load_planner",
    "decode_value": "load_planner",
    # storage and local loads
    "CountingStorageReader": "storage",
    "ResilientFileSystemWriter": "storage",
    "SafeFileSystemReader": "storage",
    "read_manifest": "storage",
    "read_metadata_file": "storage",
    "stored_lengths": "storage",
    "load_local": "local_load",
    "load_metadata_only": "local_load",
    "read_values": "local_load",
    "tensors_metadata": "local_load",
    # two-stage load, snapshot
    "DEFAULT_READ_AHEAD_BYTES": "two_stage",
    "TwoStageStats": "two_stage",
    "two_stage_load": "two_stage",
    "StoreSnapshot": "snapshot",
    # the tier
    "DurableCheckpoint": "interface",
    "FlushHandle": "interface",
    "FlushResult": "interface",
    "LoadReport": "interface",
    "PersistentTierProtocol": "interface",
    "PersistentTier": "tier",
    "Restored": "tier",
    "restore_latest": "tier",
    "ExportResult": "export",
    "export_store_iteration": "export",
    # strategies
    "DcpLoadCommonStrategy": "strategies",
    "DcpLoadShardedStrategy": "strategies",
    "DcpSaveCommonStrategy": "strategies",
    "DcpSaveShardedStrategy": "strategies",
    "LoadCommonStrategy": "strategies",
    "LoadShardedStrategy": "strategies",
    "MemoryLoadShardedStrategy": "strategies",
    "MemorySaveShardedStrategy": "strategies",
    "SaveCommonStrategy": "strategies",
    "SaveShardedStrategy": "strategies",
    "StrategyAction": "strategies",
    "TwoStageDcpLoadShardedStrategy": "strategies",
    "get_default_strategy": "strategies",
    "read_checkpoint_format": "strategies",
    "register_default_strategy": "strategies",
    "verify_checkpoint_and_load_strategy": "strategies",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # DCP and the tier load on first use (as the top-level package does for its heavy names).
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_EXPORTS))
