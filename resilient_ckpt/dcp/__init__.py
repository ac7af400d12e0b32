"""Layer 8 — PyTorch DCP on top of the manager: ``MemoryStorageWriter`` and
``MemoryStorageReader`` let ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` use the in-memory
store (replication, checksums, agreement, persistent fallback) unchanged except for the
``storage_writer`` / ``storage_reader`` they pass. Imports manager and the layers below.

Modules: ``checkpoint_id`` (the iteration a checkpoint_id names), ``metadata_codec`` (DCP
Metadata without pickle), ``payload`` (DCP items <-> the manager's sharded state dict),
``gate`` (async_save's staging wait), ``backing`` (the manager behind both), ``writer``,
``reader``. Importing this package imports torch.distributed.checkpoint: nothing below it
imports this package, so a trainer that does not use DCP never pays for it.
"""

from __future__ import annotations

from .checkpoint_id import iteration_from_checkpoint_id
from .metadata_codec import decode_metadata, encode_metadata
from .reader import MemoryStorageReader
from .writer import MemoryStorageWriter, async_save

__all__ = [
    "MemoryStorageReader",
    "MemoryStorageWriter",
    "async_save",
    "decode_metadata",
    "encode_metadata",
    "iteration_from_checkpoint_id",
]
