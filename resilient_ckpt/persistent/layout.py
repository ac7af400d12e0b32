"""What resilient_ckpt puts into a DCP directory: file names, the manifest, internal entries.

A checkpoint directory is a standard DCP directory (``.metadata`` + ``__<rank>_<n>.distcp``)
plus a manifest (``resilient_ckpt.json``: format, backend, version, session, iteration, world
size) and, for checkpoints flushed from the store, one internal entry per rank holding that
rank's hollow state dict (``__resilient_ckpt__/hollow/rank_<r>``). The persistent tier names
its checkpoints ``iter_<N>`` (Megatron's naming) and writes them as ``.iter_<N>.partial``
until they are complete.

Pure names and values only: reading and writing files lives in :mod:`.storage`.
"""

from __future__ import annotations

import os
import re
import socket
import time
from typing import Any, Dict, Optional, Tuple, Union

import torch

BACKEND = "dcp"
#: Version of what resilient_ckpt puts into a DCP directory (manifest, internal entries).
DCP_FORMAT_VERSION = 1
FORMAT_NAME = "resilient_ckpt/dcp"
MANIFEST_NAME = "resilient_ckpt.json"
METADATA_NAME = ".metadata"
#: Entries resilient_ckpt adds for its own use (never part of the user's state dict).
INTERNAL_PREFIX = "__resilient_ckpt__/"
#: Problems (keys, chunks) listed in one error message; the rest are counted.
MAX_REPORTED = 20

#: A position in a nested state dict: dict keys (str) and list indices (int).
StatePath = Tuple[Union[str, int], ...]

ITER_DIR = re.compile(r"^iter_(\d+)$")
PARTIAL_DIR = re.compile(r"^\.iter_(\d+)\.partial$")


def hollow_fqn(rank: int) -> str:
    """The entry holding rank ``rank``'s hollow state dict (structure + common state)."""
    return f"{INTERNAL_PREFIX}hollow/rank_{rank:06d}"


def is_internal(fqn: str) -> bool:
    return fqn.startswith(INTERNAL_PREFIX)


def iteration_dir_name(iteration: int) -> str:
    """``iter_0000100``: Megatron's naming (7 digits, more when needed)."""
    return f"iter_{iteration:07d}"


def partial_dir_name(iteration: int) -> str:
    return f".{iteration_dir_name(iteration)}.partial"


class RawBytes:
    """A value already encoded (stored as is, e.g. a hollow state dict's codec bytes)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = bytes(data)


def writer_id() -> str:
    """``host:pid`` of the process writing a checkpoint (recorded in manifests)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def new_manifest(
    source: str, *, session: Optional[str], iteration: Optional[int], world_size: int, **extra: Any
) -> Dict[str, Any]:
    """A manifest for a checkpoint written by ``source`` ("flush", "export", "strategy");
    ``extra`` adds keys (``group_size``, ``writer``) or overrides them. The writer adds the
    entry count and tensor bytes when it finishes."""
    manifest: Dict[str, Any] = {
        "format": FORMAT_NAME,
        "backend": BACKEND,
        "version": DCP_FORMAT_VERSION,
        "session": session,
        "iteration": iteration,
        "world_size": world_size,
        "created": time.time(),
        "torch": torch.__version__,
        "source": source,
    }
    manifest.update(extra)
    return manifest
