# Copyright (c) 2023, NVIDIA CORPORATION. All rights reserved.
#
# Ported to CPU/gloo from Megatron-LM core_v0.16.1
# tests/unit_tests/dist_checkpointing/test_strict.py, class TestStrictLocal (BSD-3-Clause, see
# Megatron-LM's LICENSE). What changed:
# - each test body runs on the 2 gloo ranks of the shared pool (upstream: 8 GPUs, NCCL) and is
#   parametrized over ``impl``: the MCoreTensorAwareStateDict under test is Megatron-core's
#   (reference) or ours, built from the same Megatron-core ShardedTensor / ShardedObject state
#   dict and given Megatron-core's StrictHandling values; ``caplog`` is the pool's per-rank log
#   capture;
# - Utils.initialize_model_parallel(8, 1) ("doesn't matter for this test") becomes (2, 1);
# - test_passthrough_errors: upstream expects the reference's AssertionError (its atomic load
#   asserts on requested keys the checkpoint lacks). Ours deliberately drops unexpected keys (or
#   raises a CheckpointingException on every rank), it never asserts or hangs; the ours branch
#   pins that behaviour, see docs/upstream-tests.md.

import logging
import typing

import pytest
import torch

from upstream.support import IMPLS, Utils, tasd_cls

pytestmark = pytest.mark.multiprocess


def _mcore():
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.validation import StrictHandling

    return ShardedTensor, ShardedObject, StrictHandling, CheckpointingException


def _strict(name):
    """A Megatron-core StrictHandling member by name (parametrize ids stay importable without
    importing Megatron-core in the test process)."""
    return getattr(_mcore()[2], name)


STRICT = [
    "ASSUME_OK_UNEXPECTED",
    "LOG_UNEXPECTED",
    "LOG_ALL",
    "RAISE_UNEXPECTED",
    "RAISE_ALL",
    "RETURN_UNEXPECTED",
    "RETURN_ALL",
    "IGNORE_ALL",
]  # list(StrictHandling), in Megatron-core's order
PASSTHROUGH = [
    "ASSUME_OK_UNEXPECTED",
    "LOG_UNEXPECTED",
    "LOG_ALL",
    "RETURN_UNEXPECTED",
    "RETURN_ALL",
    "IGNORE_ALL",
]


class TestStrictLocal:
    """Upstream's class, run inside a rank (``impl``: whose MCoreTensorAwareStateDict)."""

    __test__ = False  # pytest: the test functions below drive it

    def __init__(self, impl):
        self.impl = impl
        self.MCoreTensorAwareStateDict = tasd_cls(impl)

    def setup_method(self, method):
        Utils.initialize_model_parallel(2, 1)  # doesn't matter for this test

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def _get_base_state_dict(self):
        ShardedTensor, ShardedObject, _, _ = _mcore()
        return {
            "TenA": ShardedTensor.from_rank_offsets("TenA", torch.arange(2), replica_id=Utils.rank),
            "TenB": ShardedTensor.from_rank_offsets(
                "TenB", torch.arange(3), (0, Utils.rank, Utils.world_size), replica_id=0
            ),
            "TenC": ShardedTensor.from_rank_offsets(
                "TenC", torch.arange(3), replica_id=Utils.world_size - Utils.rank - 1
            ),
            "ObjA": ShardedObject("ObjA", list(range(10)), (1,), (0,), replica_id=Utils.rank),
            "ObjB": ShardedObject(
                "ObjB", {Utils.rank + 7}, (1, Utils.world_size), (0, Utils.rank), replica_id=0
            ),
            "Nested": {
                "TenE": ShardedTensor.from_rank_offsets(
                    "Nested.TenE", torch.arange(3), replica_id=Utils.world_size - Utils.rank - 1
                ),
                "ObjE": ShardedObject("Nested.ObjE", list(range(10)), (1,), (0,), replica_id=Utils.rank),
                "TenF": ShardedTensor.from_rank_offsets(
                    "Nested.TenF", torch.arange(3), replica_id=Utils.rank
                ),
                "ObjF": ShardedObject("Nested.ObjF", list(range(10)), (1,), (0,), replica_id=Utils.rank),
            },
            "NestedEmpty": {},
        }

    def _get_extra_state_dict(self):
        ShardedTensor, ShardedObject, _, _ = _mcore()
        return {
            "UnexpectedTenD": ShardedTensor.from_rank_offsets(
                "UnexpectedTenD", torch.arange(3), replica_id=Utils.rank
            ),
            "UnexpectedObjD": ShardedObject("UnexpectedObjD", None, (1,), (0,), replica_id=Utils.rank),
            "UnexpectedNested": {
                "UnexpectedTenF": ShardedTensor.from_rank_offsets(
                    "UnexpectedNested.UnexpectedTenF", torch.arange(3), replica_id=Utils.rank
                ),
                "UnexpectedObjF": ShardedObject(
                    "UnexpectedNested.UnexpectedObjF", None, (1,), (0,), replica_id=Utils.rank
                ),
            },
            "Nested": {
                "UnexpectedTenG": ShardedTensor.from_rank_offsets(
                    "Nested.UnexpectedTenG", torch.arange(3), replica_id=Utils.rank
                ),
                "UnexpectedObjG": ShardedObject(
                    "Nested.UnexpectedObjG", None, (1,), (0,), replica_id=Utils.rank
                ),
            },
            "NestedEmpty": {
                "UnexpectedTenH": ShardedTensor.from_rank_offsets(
                    "NestedEmpty.UnexpectedTenH", torch.arange(3), replica_id=Utils.rank
                ),
                "UnexpectedObjH": ShardedObject(
                    "NestedEmpty.UnexpectedObjH", None, (1,), (0,), replica_id=Utils.rank
                ),
            },
        }

    def _tasd_to_state_dict(self, *, algo, strict, validate_access_integrity, missing, unexpected):
        from megatron.core.dist_checkpointing.dict_utils import merge

        sharded_state_dict = self._get_base_state_dict()
        if missing:
            del sharded_state_dict["TenA"]
            del sharded_state_dict["ObjB"]
            del sharded_state_dict["Nested"]["TenE"]
            del sharded_state_dict["Nested"]["ObjF"]
            del sharded_state_dict["NestedEmpty"]
        if unexpected:
            # Note: merge is in-place
            sharded_state_dict = merge(sharded_state_dict, self._get_extra_state_dict())
        tasd, _ = self.MCoreTensorAwareStateDict.from_state_dict(self._get_base_state_dict(), algo)
        tasd = typing.cast(self.MCoreTensorAwareStateDict, tasd)
        return tasd.to_state_dict(
            sharded_state_dict=sharded_state_dict,
            validate_access_integrity=validate_access_integrity,
            strict=strict,
            algo=algo,
            return_mismatch_keys=True,
        )

    @property
    def _missing_keys(self):
        return {"TenA", "ObjB", "Nested.TenE", "Nested.ObjF"}

    @property
    def _unexpected_keys(self):
        return {
            "UnexpectedTenD",
            "UnexpectedObjD",
            "UnexpectedNested.UnexpectedTenF",
            "UnexpectedNested.UnexpectedObjF",
            "NestedEmpty.UnexpectedTenH",
            "NestedEmpty.UnexpectedObjH",
        }

    def _check_log_message(self, text, should_contain_missing, should_contain_unexpected):
        if not should_contain_missing and not should_contain_unexpected:
            assert text == ""
            return
        if should_contain_missing:
            assert "Missing keys" in text
            for key in self._missing_keys:
                assert key in text
        else:
            assert "Missing keys" not in text
            for key in self._missing_keys:
                assert key not in text
        if should_contain_unexpected:
            assert "Unexpected keys" in text
            for key in self._unexpected_keys:
                assert key in text
        else:
            assert "Unexpected keys" not in text
            for key in self._unexpected_keys:
                assert key not in text

    def _check_log_message_for_strict_handling(self, text, strict, missing, unexpected):
        StrictHandling = _mcore()[2]
        should_contain_unexpected = (
            strict in {StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL}
        ) and unexpected
        should_contain_missing = (strict in {StrictHandling.LOG_ALL}) and missing
        return self._check_log_message(text, should_contain_missing, should_contain_unexpected)

    def _check_return_values(
        self, missing_keys, unexpected_keys, should_contain_missing, should_contain_unexpected
    ):
        if should_contain_missing:
            assert set(missing_keys) == self._missing_keys
        else:
            assert set(missing_keys) == set()
        if should_contain_unexpected:
            assert set(unexpected_keys) == self._unexpected_keys
        else:
            assert set(unexpected_keys) == set()

    def _check_return_values_for_strict_handling(
        self, strict, missing_keys, unexpected_keys, missing, unexpected
    ):
        StrictHandling = _mcore()[2]
        should_contain_missing = (strict in {StrictHandling.RETURN_ALL, StrictHandling.LOG_ALL}) and missing
        should_contain_unexpected = (
            strict
            in {
                StrictHandling.RETURN_ALL,
                StrictHandling.RETURN_UNEXPECTED,
                StrictHandling.LOG_UNEXPECTED,
                StrictHandling.LOG_ALL,
            }
        ) and unexpected
        self._check_return_values(
            missing_keys, unexpected_keys, should_contain_missing, should_contain_unexpected
        )

    def test_everything_ok(self, caplog, algo, validate_integrity, strict):
        with caplog.at_level(logging.WARNING):
            state_dict, missing_keys, unexpected_keys = self._tasd_to_state_dict(
                algo=algo,
                strict=strict,
                validate_access_integrity=validate_integrity,
                missing=False,
                unexpected=False,
            )
            assert state_dict.keys() == self._get_base_state_dict().keys()
            assert set(missing_keys) == set()
            assert set(unexpected_keys) == set()
        assert caplog.text == ""

    def test_passthrough(self, caplog, algo, validate_integrity, missing, unexpected, strict):
        # Scenario: strictness check is supposed to pass the errors through, the underlying
        # algorithm is able to handle it.
        with caplog.at_level(logging.WARNING):
            _, missing_keys, unexpected_keys = self._tasd_to_state_dict(
                algo=algo,
                strict=strict,
                validate_access_integrity=validate_integrity,
                missing=missing,
                unexpected=unexpected,
            )
        self._check_log_message_for_strict_handling(caplog.text, strict, missing, unexpected)
        self._check_return_values_for_strict_handling(
            strict, missing_keys, unexpected_keys, missing, unexpected
        )

    def test_passthrough_errors(self, caplog, algo, validate_integrity, missing, unexpected, strict):
        # Scenario: strictness check is supposed to pass the errors through,
        # but they result in an error in the underlying algorithm as it's unable to handle it.
        with caplog.at_level(logging.WARNING):
            if self.impl == "reference":
                with pytest.raises(AssertionError):
                    self._tasd_to_state_dict(
                        algo=algo,
                        strict=strict,
                        validate_access_integrity=validate_integrity,
                        missing=missing,
                        unexpected=unexpected,
                    )
            else:
                self._passthrough_errors_ours(caplog, algo, validate_integrity, missing, unexpected, strict)
                return
            # TODO: check exc_info
        self._check_log_message_for_strict_handling(caplog.text, strict, missing, unexpected)

    def _passthrough_errors_ours(self, caplog, algo, validate_integrity, missing, unexpected, strict):
        """Ours (deliberately): the unexpected keys - requested, absent from the checkpoint - are
        dropped from the loaded state dict and reported, logged and returned as the flag says
        (ASSUME_OK_UNEXPECTED: one CheckpointingException naming them, on every rank); nothing
        asserts. All eight requested-but-absent keys count: upstream's ``_unexpected_keys``
        leaves out the two merged into 'Nested' (never compared exactly on a passing path)."""
        from resilient_ckpt.errors import CheckpointingException as OurCheckpointingException

        StrictHandling = _mcore()[2]
        all_unexpected = self._unexpected_keys | {"Nested.UnexpectedTenG", "Nested.UnexpectedObjG"}
        kwargs = dict(
            algo=algo,
            strict=strict,
            validate_access_integrity=validate_integrity,
            missing=missing,
            unexpected=unexpected,
        )
        if strict == StrictHandling.ASSUME_OK_UNEXPECTED:
            with pytest.raises(OurCheckpointingException) as exc_info:
                self._tasd_to_state_dict(**kwargs)
            for key in all_unexpected:
                assert key in str(exc_info.value)
            return
        with caplog.at_level(logging.WARNING):
            state_dict, missing_keys, unexpected_keys = self._tasd_to_state_dict(**kwargs)
        should_contain_missing = (strict in {StrictHandling.RETURN_ALL, StrictHandling.LOG_ALL}) and missing
        should_contain_unexpected = strict in {
            StrictHandling.RETURN_ALL,
            StrictHandling.RETURN_UNEXPECTED,
            StrictHandling.LOG_UNEXPECTED,
            StrictHandling.LOG_ALL,
        }
        assert set(missing_keys) == (self._missing_keys if should_contain_missing else set())
        assert set(unexpected_keys) == (all_unexpected if should_contain_unexpected else set())
        flat = set(_flat_keys(state_dict))
        assert not flat & {k.replace(".", "/") for k in all_unexpected}, flat
        logged = strict in {StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL}
        assert ("Unexpected keys" in caplog.text) == logged
        for key in all_unexpected:
            assert (key in caplog.text) == logged

    def test_raise_unexpected(self, validate_integrity, algo, missing):
        _, _, StrictHandling, CheckpointingException = _mcore()
        with pytest.raises(CheckpointingException) as exc_info:
            self._tasd_to_state_dict(
                algo=algo,
                strict=StrictHandling.RAISE_UNEXPECTED,
                validate_access_integrity=validate_integrity,
                missing=missing,
                unexpected=True,
            )
        self._check_log_message(
            str(exc_info.value), should_contain_missing=False, should_contain_unexpected=True
        )

    def test_raise_all(self, validate_integrity, algo, missing, unexpected):
        _, _, StrictHandling, CheckpointingException = _mcore()
        with pytest.raises(CheckpointingException) as exc_info:
            self._tasd_to_state_dict(
                algo=algo,
                strict=StrictHandling.RAISE_ALL,
                validate_access_integrity=validate_integrity,
                missing=missing,
                unexpected=unexpected,
            )
        self._check_log_message(
            str(exc_info.value),
            should_contain_missing=missing,
            should_contain_unexpected=unexpected,
        )


def _flat_keys(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat_keys(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}"


def _run(ctx, impl, method, **params):
    """One upstream test method on this rank, with setup_method/teardown_method around it."""
    test = TestStrictLocal(impl)
    if "strict" in params:
        params["strict"] = _strict(params["strict"])
    test.setup_method(None)
    try:
        fn = getattr(test, method)
        if "caplog" in fn.__code__.co_varnames[: fn.__code__.co_argcount]:
            params["caplog"] = ctx.caplog
        fn(**params)
    finally:
        test.teardown_method(None)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("algo", ["fully_parallel", "atomic"])
@pytest.mark.parametrize("validate_integrity", [True, False])
@pytest.mark.parametrize("strict", STRICT)
def test_everything_ok(pool, impl, algo, validate_integrity, strict):
    pool.run(
        _run, impl, "test_everything_ok", algo=algo, validate_integrity=validate_integrity, strict=strict
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("algo", ["atomic"])
@pytest.mark.parametrize("validate_integrity", [True, False])
@pytest.mark.parametrize(["missing", "unexpected"], [(True, False)])
@pytest.mark.parametrize("strict", PASSTHROUGH)
def test_passthrough(pool, impl, algo, validate_integrity, missing, unexpected, strict):
    pool.run(
        _run,
        impl,
        "test_passthrough",
        algo=algo,
        validate_integrity=validate_integrity,
        missing=missing,
        unexpected=unexpected,
        strict=strict,
    )


# NOTE: Fully parallel results in a hard-to-catch error:
#       The exchange algorithm is unaware of the missing tensors and will still expect the shards
#       to be received - which will cause the process to hang indefinitely.
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("algo", ["atomic"])
@pytest.mark.parametrize("validate_integrity", [True, False])
@pytest.mark.parametrize(["missing", "unexpected"], [(False, True), (True, True)])
@pytest.mark.parametrize("strict", PASSTHROUGH)
def test_passthrough_errors(pool, impl, algo, validate_integrity, missing, unexpected, strict):
    pool.run(
        _run,
        impl,
        "test_passthrough_errors",
        algo=algo,
        validate_integrity=validate_integrity,
        missing=missing,
        unexpected=unexpected,
        strict=strict,
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("algo", ["fully_parallel", "atomic"])
@pytest.mark.parametrize("validate_integrity", [True, False])
@pytest.mark.parametrize("missing", [True, False])
def test_raise_unexpected(pool, impl, validate_integrity, algo, missing):
    pool.run(
        _run, impl, "test_raise_unexpected", validate_integrity=validate_integrity, algo=algo, missing=missing
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("algo", ["fully_parallel", "atomic"])
@pytest.mark.parametrize("validate_integrity", [True, False])
@pytest.mark.parametrize(["missing", "unexpected"], [(True, False), (False, True), (True, True)])
def test_raise_all(pool, impl, validate_integrity, algo, missing, unexpected):
    pool.run(
        _run,
        impl,
        "test_raise_all",
        validate_integrity=validate_integrity,
        algo=algo,
        missing=missing,
        unexpected=unexpected,
    )
