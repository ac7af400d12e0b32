"""One rank's stored checkpoint as a DCP state dict, zero-copy (what a flush or an export
writes).

:class:`StoreSnapshot` maps the store segment read-only and makes every saved tensor a view of
the mapping whose storage is exactly the tensor's bytes, so DCP's writer neither clones it nor
copies it to a device: the bytes go from the mapping to the file once. After writing, the
mapped bytes are checked against the store's checksums (a segment retired and reused by a
newer save mid-write fails instead of writing mixed data).
"""

from __future__ import annotations

import mmap
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import CorruptCheckpointError
from ..memory import checksum
from ..memory.layout import CheckpointId
from ..memory.store import CheckpointStore
from ..model.nested import map_leaves, merge
from ..parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict
from .layout import RawBytes, hollow_fqn


class StoreSnapshot:
    """One stored checkpoint (``owner``'s, iteration ``iteration``) as a state dict whose
    tensors are views of a read-only mapping of the store segment.

    ``state_dict()`` holds the common state, the sharded state (tensors this owner saved; the
    others as metadata only) and the hollow bytes under :func:`~.layout.hollow_fqn`. ``verify()``
    checks the mapped bytes against the header's checksums (call it after writing them).
    """

    def __init__(self, store: CheckpointStore, iteration: int, owner: int):
        self.iteration = iteration
        self.owner = owner
        self._mmap: Optional[mmap.mmap] = None
        self._views: List[Tuple[torch.Tensor, Optional[int], int]] = []
        cid = CheckpointId(int(iteration), int(owner), store.session)
        reader = store.open(cid)
        self.header = header = reader.header
        self.path = reader.path
        try:
            tasd = MCoreTensorAwareStateDict.from_bytes(header.meta)
        except Exception as e:
            raise CorruptCheckpointError(
                f"{store.header_path(cid)}: the stored state dict does not decode ({e})"
            ) from e
        metas = tasd.tensor_metadata
        if len(metas) != len(header.tensors):
            raise CorruptCheckpointError(
                f"{store.header_path(cid)}: {len(header.tensors)} tensors in the layout, "
                f"{len(metas)} saved shards in the state dict"
            )
        if header.data_nbytes:
            with open(reader.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), header.data_nbytes, prot=mmap.PROT_READ)
        for i, (st, lay) in enumerate(zip(metas, header.tensors)):
            if lay.torch_dtype != st.dtype or tuple(lay.shape) != tuple(st.local_shape):
                raise CorruptCheckpointError(
                    f"{store.header_path(cid)}: tensor {i} ({st.key!r}) is {lay.dtype} "
                    f"{list(lay.shape)} in the layout but {st.dtype} {list(st.local_shape)} in "
                    "the state dict"
                )
            if lay.offset + lay.nbytes > header.data_nbytes:
                raise CorruptCheckpointError(f"{store.header_path(cid)}: tensor {i} lies outside the segment")
            st.data = self._view(lay)
            self._views.append((st.data, lay.checksum, i))
        self._tasd = tasd

    def _view(self, lay) -> torch.Tensor:
        if lay.nbytes == 0:
            return torch.empty(lay.shape, dtype=lay.torch_dtype)
        # A view whose storage is exactly the tensor's bytes: DCP's writer then saves it
        # without cloning, and torch.save writes only these bytes.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only mapping: we only read
            flat = torch.frombuffer(self._mmap, dtype=torch.uint8, offset=lay.offset, count=lay.nbytes)
        return flat.view(lay.torch_dtype).view(lay.shape)

    @property
    def tensor_bytes(self) -> int:
        return sum(lay.nbytes for lay in self.header.tensors)

    def state_dict(self) -> Dict[str, Any]:
        common = map_leaves(lambda v: v, self._tasd.common)
        sd = merge(common, self._tasd.sharded_state_dict)
        if not isinstance(sd, dict):
            raise CorruptCheckpointError("the stored state dict is not a dict at its top level")
        sd[hollow_fqn(self.owner)] = RawBytes(self.header.meta)
        return sd

    def verify(self) -> None:
        """Raise if the mapped bytes no longer match the stored checksums."""
        for t, ck, i in self._views:
            if ck is None or t.numel() == 0:
                continue
            if checksum.digest(checksum.byte_view(t)) != ck:
                raise CorruptCheckpointError(
                    f"{self.path}: tensor {i} of iteration {self.iteration} (owner {self.owner}) "
                    "changed while it was being written to the persistent tier (the store retired "
                    "and reused the segment); this flush is abandoned, the previous durable "
                    "checkpoint stays"
                )

    def close(self) -> None:
        self._views = []
        self._tasd = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a view is still referenced somewhere; the mapping goes when it does
            self._mmap = None

    def __enter__(self) -> "StoreSnapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
