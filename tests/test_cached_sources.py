"""Cached saves of the same tensor objects (issue 41): what is kept from one save to the next —
the walk's layers, the shard comparison, staging's integer views of the sources — never makes a
save store anything but what the tensors hold at that save.

A training loop saves the same tensors again and again, changed in place, wrapped in fresh
ShardedTensors (Megatron's ``sharded_state_dict()``) or in the very same ones (``TrainState``).
Specified here: every save restores to exactly the values it was taken at and takes the cached
path; a ``.data`` swap (same object, new storage), a wrapper changed in place, or a key added to
a layer is noticed and saved as it is.
"""

from __future__ import annotations

import pytest
import torch

from resilient_ckpt.bits import bits
from resilient_ckpt.manager.checkpoint_manager import CheckpointManager
from resilient_ckpt.memory.layout import CheckpointId
from resilient_ckpt.model.mapping import ShardedTensor


def _manager(root):
    return CheckpointManager("sources", store_root=str(root), replication_factor=1, keep_last=10)


def _tensors():
    g = torch.Generator().manual_seed(0)
    layer = {f"w{i}": torch.nn.Parameter(torch.randn(3, 4, generator=g)) for i in range(6)}
    return layer, [torch.arange(5, dtype=torch.int64), torch.randn(2, generator=g).to(torch.bfloat16)]


def _wrap(layer, extra, *, key_prefix="m"):
    return {
        "model": {k: ShardedTensor.from_rank_offsets(f"{key_prefix}.{k}", t) for k, t in layer.items()},
        "extra": [ShardedTensor.from_rank_offsets(f"x{i}", t) for i, t in enumerate(extra)],
        "step": 0,
    }


def _stored(m, it) -> list:
    """The bytes of each tensor the checkpoint of ``it`` holds, in its header's order."""
    cid = CheckpointId(it, 0, "sources")
    header, raw = m.store.read_header(cid), m.store.data_path(cid).read_bytes()
    return [raw[lay.offset : lay.offset + lay.nbytes] for lay in header.tensors if lay.nbytes]


def _bytes(values) -> list:
    layer, extra = values
    return [bits(t.detach()).numpy().tobytes() for t in [*layer.values(), *extra]]


@pytest.mark.parametrize("wrappers", ["fresh", "reused"])
def test_the_same_tensors_saved_again_store_their_values_at_each_save(tmp_root, wrappers):
    layer, extra = _tensors()
    snapshots, flags = {}, []
    sd = _wrap(layer, extra)
    with _manager(tmp_root) as m:
        for it in range(1, 5):
            with torch.no_grad():
                for t in layer.values():
                    t.mul_(2.0).add_(it)  # the optimizer's in-place update
                extra[0].add_(it)
            if wrappers == "fresh":
                sd = _wrap(layer, extra)
            sd["step"] = it
            h = m.save_local(sd, it, is_async=False)
            flags.append(h.metrics.structure_cached)
            snapshots[it] = ({k: t.detach().clone() for k, t in layer.items()}, [t.clone() for t in extra])
        assert flags == [False, True, True, True]
        for it, values in snapshots.items():
            assert _stored(m, it) == _bytes(values), it


def test_a_data_swap_between_saves_is_saved_from_the_new_storage(tmp_root):
    layer, extra = _tensors()
    with _manager(tmp_root) as m:
        m.save_local(_wrap(layer, extra), 1, is_async=False)
        m.save_local(_wrap(layer, extra), 2, is_async=False)  # the sources' views are now kept
        layer["w3"].data = torch.full((3, 4), 7.0)  # same Parameter object, new storage
        h = m.save_local(_wrap(layer, extra), 3, is_async=False)
        assert h.metrics.structure_cached  # the structure is the same: only the source moved
        assert _stored(m, 3) == _bytes((layer, extra)) and layer["w3"].detach().eq(7.0).all()


@pytest.mark.parametrize("change", ["shape", "key", "added key"])
def test_a_change_to_reused_wrappers_or_their_layer_is_noticed(tmp_root, change):
    layer, extra = _tensors()
    sd = _wrap(layer, extra)
    with _manager(tmp_root) as m:
        m.save_local(sd, 1, is_async=False)
        assert m.save_local(sd, 2, is_async=False).metrics.structure_cached
        if change == "shape":
            w2 = sd["model"]["w2"]
            w2.data, w2.local_shape, w2.global_shape = torch.ones(6, 4), (6, 4), (6, 4)
        elif change == "key":
            sd["model"]["w2"].key = "renamed"
        else:
            sd["model"]["w9"] = ShardedTensor.from_rank_offsets("m.w9", torch.ones(2))
        h = m.save_local(sd, 3, is_async=False)
        assert not h.metrics.structure_cached
        stored = _stored(m, 3)
    assert len(stored) == len(layer) + len(extra) + (1 if change == "added key" else 0)
    if change == "shape":
        assert bits(torch.ones(6, 4)).numpy().tobytes() in stored


def test_neither_a_closed_manager_nor_new_tensors_keep_a_callers_tensors_alive(tmp_root):
    """What a cached save keeps of the tensors (their integer views: their storage, GPU memory
    too) is kept only while the same tensors come back, and never by a closed manager."""
    import gc
    import weakref

    layer, extra = _tensors()
    with _manager(tmp_root) as m:
        for it in (1, 2, 3):  # the same tensors three times: their views are kept
            m.save_local(_wrap(layer, extra), it, is_async=False)
        new_layer, new_extra = _tensors()
        gone = weakref.ref(new_layer["w0"])
        m.save_local(_wrap(new_layer, new_extra), 4, is_async=False)  # seen once: nothing kept
        del new_layer, new_extra
        gc.collect()
        assert gone() is None
        watched = weakref.ref(layer["w1"])
        m.save_local(_wrap(layer, extra), 5, is_async=False)
        m.save_local(_wrap(layer, extra), 6, is_async=False)  # back twice: kept again
    del layer, extra
    gc.collect()
    assert watched() is None
