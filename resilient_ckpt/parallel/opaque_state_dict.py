"""Tensor-aware state dicts we cannot take apart, stored whole with ``torch.save``.

nvidia-resiliency-ext's ``LocalCheckpointManager`` accepts any ``TensorAwareStateDict`` and
pickles it whole (``torch.save``; ``torch.load(weights_only=False)`` on load). Ours stores
Megatron-core's ``MCoreTensorAwareStateDict`` (and our own) pickle-free; any other subclass
— user-defined ones need not even implement ``pop_tensors`` — can only be stored the
reference's way, so it is serialised into one byte tensor that goes through the store,
checksums and replication like any other, and that needs the ``allow_pickle=True`` opt-in
(unpickling runs code: only for data this job wrote itself).
"""

from __future__ import annotations

import io
from typing import Any, List

import torch

from ..errors import CodecError
from ..model import codec

_MARK = "resilient_ckpt/opaque-tasd"


class OpaqueStateDict:
    """The save-side view of a foreign TASD: one uint8 tensor (its ``torch.save`` bytes)."""

    def __init__(self, obj: Any, allow_pickle: bool):
        type_name = f"{type(obj).__module__}.{type(obj).__qualname__}"
        if not allow_pickle:
            raise CodecError(
                f"{type_name} is a TensorAwareStateDict other than Megatron-core's "
                "MCoreTensorAwareStateDict: it can only be stored pickled (torch.save), as "
                "nvidia-resiliency-ext does. Pass allow_pickle=True to the manager to store it "
                "that way (local data only: unpickling runs code), or hand save() a "
                "Megatron-core MCoreTensorAwareStateDict / a sharded state dict"
            )
        # As the reference does before torch.save: tensors go to host memory in place.
        obj.copy_tensors_to_cpu(non_blocking=False)
        buf = io.BytesIO()
        torch.save(obj, buf)
        self.type_name = type_name
        self._blob = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
        self._popped = False

    @property
    def tensors(self) -> List[torch.Tensor]:
        return [self._blob]

    def pop_tensors(self) -> List[torch.Tensor]:
        self._popped = True
        return [self._blob]

    def insert_tensors(self, tensors) -> None:
        (self._blob,) = list(tensors)
        self._popped = False

    def to_bytes(self, allow_pickle: bool = False) -> bytes:
        return codec.encode({_MARK: self.type_name})


def is_opaque(meta: bytes) -> bool:
    """Whether a checkpoint's ``meta`` describes an :class:`OpaqueStateDict`. The mark is the
    first key of the body, so other metas (large: every tensor's metadata) are told apart
    without decoding them."""
    if _MARK.encode() not in bytes(meta[:96]):
        return False
    try:
        d = codec.decode(meta)
    except CodecError:
        return False
    return isinstance(d, dict) and _MARK in d


def load_opaque(blob: torch.Tensor, allow_pickle: bool) -> Any:
    """The stored TASD, unpickled, with its tensors moved back to their devices (as the
    reference's ``_load_fn`` does)."""
    if not allow_pickle:
        raise CodecError(
            "this checkpoint holds a pickled TensorAwareStateDict (saved with allow_pickle=True); "
            "loading it runs code: pass allow_pickle=True to the manager if this job wrote it"
        )
    obj = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=False)  # nosec: opted in
    obj.restore_tensor_device(non_blocking=False)
    return obj
