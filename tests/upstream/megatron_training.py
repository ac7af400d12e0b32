# Copyright (c) 2025 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# Ported to CPU/gloo from Megatron-LM core_v0.16.1 (BSD-3-Clause, see Megatron-LM's LICENSE):
# the parts of megatron/training/{checkpointing.py, async_utils.py, training.py, utils.py} and
# tests/unit_tests/dist_checkpointing/utils.py that the local-checkpointing unit tests
# (test_local.py, test_replication.py) run. The megatron-core wheel does not ship
# megatron.training, so the ported tests call these instead.
#
# What the port keeps and what it changes:
# - save_checkpoint / load_checkpoint: the non-persistent *local* checkpoint path only, step by
#   step as upstream (generate_state_dict -> MCoreTensorAwareStateDict.from_state_dict over the
#   data-parallel group -> checkpointing_context['local_checkpoint_manager'].save(...,
#   is_async=args.async_save) -> finalize fns -> the async queue; on load find_latest() -> load()
#   twice (rank0 pass for the common part, then the sharded pass) -> to_state_dict -> model and
#   optimizer load_state_dict). Global/legacy/DCP/FSDP formats, ModelOpt, one-logger, wandb,
#   fault-tolerance hooks and the rerun state machine (None unless a rerun is in progress) are
#   left out.
# - get_args / parse_args: an argparse.Namespace with Megatron's defaults for the arguments these
#   paths read (the full parser lives in megatron.training.arguments, not shipped).
# - CPU: no CUDA RNG tracker (model_parallel_cuda_manual_seed -> torch.manual_seed; the rng state
#   has no 'cuda_rng_state' / tracker states), no model.cuda(), no CUDA stream around DDP;
#   Megatron-core's DDP and DistributedOptimizer are built under :class:`MegatronOnCpu` (CUDA
#   placement -> CPU, and ``Tensor.type()`` reports ``torch.cuda.*Tensor`` so the optimizer
#   accepts CPU parameters), as is the optimizer's 'fully_reshardable' sharded state dict;
#   without Apex/Transformer Engine the optimizer is torch's AdamW, which needs a number for
#   ``lr`` (0.0) and keeps ``step`` per parameter state;
# - GPT model of 2 layers instead of 8 (NUM_LAYERS): every tensor is a gloo message here.

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import types
from enum import Enum, auto
from functools import partial
from typing import Any, Callable, Tuple, Union
from unittest import mock

import numpy as np
import torch

from resilient_ckpt.bench.baseline import _CudaAsCpu

# ---- CPU --------------------------------------------------------------------------------------


class MegatronOnCpu(_CudaAsCpu):
    """The benchmark's CUDA->CPU torch function mode, plus ``Tensor.type()`` naming CUDA types
    (Megatron-core's DistributedOptimizer only accepts ``torch.cuda.*Tensor`` parameters)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) == "type" and len(args) == 1 and not kwargs:
            out = func(*args)
            return out.replace("torch.", "torch.cuda.", 1) if isinstance(out, str) else out
        return super().__torch_function__(func, types, args, kwargs)


def _cpu_if_gathering(optim_sd_kwargs):
    """The optimizer's 'fully_reshardable' state gathers through CUDA buffers: CPU there. (Not
    around every optimizer call: a torch function mode costs ~20 us per tensor op.)"""
    metadata = (optim_sd_kwargs or {}).get("metadata") or {}
    if metadata.get("distrib_optim_sharding_type") == "fully_reshardable":
        return MegatronOnCpu()
    return contextlib.nullcontext()


# ---- megatron/training/global_vars.py, arguments.py ------------------------------------------

_GLOBAL_ARGS = None


def get_args():
    return _GLOBAL_ARGS


def parse_args(ignore_unknown_args=True):
    """Megatron's defaults for the arguments read by the ported code, in an
    ``argparse.Namespace`` as Megatron-LM's parse_args returns."""
    return argparse.Namespace(
        async_save=False,
        auto_detect_ckpt_format=False,
        bf16=False,
        check_for_large_grads=False,
        ckpt_assume_constant_structure=False,
        ckpt_format="torch_dist",
        ckpt_fully_parallel_load=False,
        ckpt_fully_parallel_save=True,
        ckpt_step=None,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        data_parallel_random_init=False,
        ddp_average_in_collective=False,
        ddp_bucket_size=None,
        ddp_num_buckets=None,
        ddp_pad_buckets_for_high_nccl_busbw=False,
        ddp_reduce_scatter_with_fp32_accumulation=False,
        dist_ckpt_optim_fully_reshardable=False,
        distrib_optim_fully_reshardable_mem_efficient=False,
        exit_on_missing_checkpoint=False,
        finetune=False,
        fp16=False,
        load=None,
        load_main_params_from_ckpt=False,
        log_progress=False,
        no_load_optim=False,
        no_load_rng=False,
        no_save_optim=False,
        no_save_rng=False,
        non_persistent_ckpt_type=None,
        non_persistent_global_ckpt_dir=None,
        non_persistent_local_ckpt_algo="fully_parallel",
        phase_transition_iterations=None,
        pretrained_checkpoint=None,
        save=None,
        skipped_train_samples=0,
        use_dist_ckpt=True,
        use_distributed_optimizer=False,
        use_megatron_fsdp=False,
        use_torch_fsdp2=False,
        vocab_file=None,
    )


def update_num_microbatches(consumed_samples, verbose=False):
    """Patched out by the tests, as upstream patches megatron.training's."""
    raise NotImplementedError("patched by the tests")


# ---- megatron/training/utils.py ---------------------------------------------------------------


def print_rank_0(message):
    if torch.distributed.is_initialized():
        if torch.distributed.get_rank() == 0:
            print(message, flush=True)
    else:
        print(message, flush=True)


def is_last_rank():
    return torch.distributed.get_rank() == (torch.distributed.get_world_size() - 1)


def unwrap_model(model, module_instances=None):
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.transformer.module import Float16Module

    module_instances = module_instances or (DDP, Float16Module)
    return_list = True
    if not isinstance(model, list):
        model = [model]
        return_list = False
    unwrapped_model = []
    for model_module in model:
        while isinstance(model_module, module_instances):
            model_module = model_module.module
        unwrapped_model.append(model_module)
    if not return_list:
        return unwrapped_model[0]
    return unwrapped_model


# ---- megatron/training/async_utils.py ---------------------------------------------------------

_async_calls_queue = None


def _queue():
    global _async_calls_queue
    if _async_calls_queue is None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        _async_calls_queue = AsyncCallsQueue()
    return _async_calls_queue


def reset_async_queue():
    """Between cases (the pool's teardown): a fresh queue, as a fresh process would have."""
    global _async_calls_queue
    if _async_calls_queue is not None:
        try:
            _async_calls_queue.close(abort=True)
        except Exception:
            pass
    _async_calls_queue = None


def schedule_async_save(async_request):
    _queue().schedule_async_request(async_request)


def maybe_finalize_async_save(blocking: bool = False, terminate=False):
    args = get_args()
    if not args.async_save:
        return

    if blocking and not is_empty_async_queue():
        print_rank_0("Unfinalized async checkpoint saves. Finalizing them synchronously now.")

    _queue().maybe_finalize_async_calls(blocking, no_dist=False)

    if terminate:
        _queue().close()


def is_empty_async_queue() -> bool:
    return _queue().get_num_unfinalized_calls() == 0


# ---- megatron/training/training.py: get_model (one model chunk, no vpp) ----------------------


def get_model(model_provider_func, wrap_with_ddp=True):
    from megatron.core import mpu, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module
    from megatron.core.utils import get_model_config

    args = get_args()
    pre_process = mpu.is_pipeline_first_stage()
    post_process = mpu.is_pipeline_last_stage()
    model = [model_provider_func(pre_process=pre_process, post_process=post_process)]
    for model_module in model:
        for param in model_module.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    # CPU: no model_module.cuda(...)
    if args.fp16 or args.bf16:
        config = get_model_config(model[0])
        model = [Float16Module(config, model_module) for model_module in model]
    if wrap_with_ddp:
        config = get_model_config(model[0])
        kwargs = {}
        for f in dataclasses.fields(DistributedDataParallelConfig):
            if hasattr(args, f.name):
                kwargs[f.name] = getattr(args, f.name)
        kwargs["grad_reduce_in_fp32"] = args.accumulate_allreduce_grads_in_fp32
        kwargs["check_for_nan_in_grad"] = args.check_for_nan_in_loss_and_grad
        kwargs["check_for_large_grads"] = args.check_for_large_grads
        kwargs["bucket_size"] = args.ddp_bucket_size
        kwargs["average_in_collective"] = args.ddp_average_in_collective
        ddp_config = DistributedDataParallelConfig(**kwargs)
        if not ddp_config.overlap_grad_reduce:
            ddp_config.bucket_size = None
        with MegatronOnCpu():  # CPU: no side CUDA stream
            model = [
                DDP(config=config, ddp_config=ddp_config, module=model_chunk, disable_bucketing=(i > 0))
                for i, model_chunk in enumerate(model)
            ]
        if not args.data_parallel_random_init:
            for model_module in model:
                model_module.broadcast_params()
    return model


# ---- tests/unit_tests/dist_checkpointing/utils.py ---------------------------------------------

NUM_LAYERS = 2  # upstream 8: every tensor is a gloo message; 2 CPU cores here
HIDDEN_SIZE = 16
NUM_ATTENTION_HEADS = 8


def initialize_gpt_model(pre_process=True, post_process=True, seed=0, use_glu=True, **config_kwargs):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config_kwargs.pop("pg_collection", None)
    config_kwargs.pop("config", None)

    torch.manual_seed(seed)
    # CPU: model_parallel_cuda_manual_seed(seed) needs the CUDA RNG

    default_config_kwargs = dict(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN_SIZE,
        num_attention_heads=NUM_ATTENTION_HEADS,
        use_cpu_initialization=True,
        bf16=True,
    )
    default_config_kwargs.update(**config_kwargs)
    transformer_config = TransformerConfig(**default_config_kwargs, gated_linear_unit=use_glu)
    model = GPTModel(
        config=transformer_config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=128,
        max_sequence_length=4,
        pre_process=pre_process,
        post_process=post_process,
    )

    with torch.no_grad():
        for p in model.parameters():
            p.random_()
    return model


def init_basic_mock_args(args, tp, pp, bf16=True):
    args.data_parallel_random_init = False
    args.virtual_pipeline_model_parallel_size = None
    args.fp16 = False
    args.bf16 = bf16
    args.accumulate_allreduce_grads_in_fp32 = False
    args.overlap_grad_reduce = False
    args.overlap_param_gather_with_optimizer_step = False
    args.fp8_param_gather = False
    args.use_distributed_optimizer = True
    args.ddp_bucket_size = None
    args.check_for_nan_in_loss_and_grad = False
    args.ddp_average_in_collective = False
    args.tensor_model_parallel_size = tp
    args.pipeline_model_parallel_size = pp
    args.enable_ft_package = False
    args.use_torch_fsdp2 = False
    args.init_model_with_meta_device = False
    return args


def init_checkpointing_mock_args(args, ckpt_dir, fully_parallel=False):
    args.non_persistent_global_ckpt_dir = None
    args.non_persistent_ckpt_type = None
    args.save = ckpt_dir
    args.load = ckpt_dir
    args.pretrained_checkpoint = None
    args.ckpt_fully_parallel_save = fully_parallel
    args.ckpt_fully_parallel_load = fully_parallel
    args.async_save = False
    args.use_dist_ckpt = True
    args.ckpt_format = "torch_dist"
    args.no_save_optim = False
    args.no_save_rng = False
    args.ckpt_assume_constant_structure = False
    args.log_progress = False
    args.auto_detect_ckpt_format = False
    args.exit_on_missing_checkpoint = False
    args.finetune = False
    args.consumed_train_samples = 0
    args.skipped_train_samples = 0
    args.consumed_valid_samples = 0
    args.no_load_optim = False
    args.no_load_rng = False
    args.dist_ckpt_strictness = "assume_ok_unexpected"
    args.add_position_embedding = True
    args.vocab_file = False
    args.num_layers = NUM_LAYERS
    args.hidden_size = HIDDEN_SIZE
    args.num_attention_heads = NUM_ATTENTION_HEADS
    args.ckpt_step = None
    args.use_megatron_fsdp = False
    args.dist_ckpt_optim_fully_reshardable = False
    args.distrib_optim_fully_reshardable_mem_efficient = False
    args.phase_transition_iterations = None


def setup_model_and_optimizer(seed, tp, pp, initialize_fn=initialize_gpt_model, bf16=True, dist_opt=True):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    mock_args = parse_args(ignore_unknown_args=True)
    with mock.patch(f"{__name__}.get_args", new=lambda: mock_args):
        init_basic_mock_args(mock_args, tp, pp, bf16=bf16)
        model = get_model(
            partial(
                initialize_fn,
                seed=seed,
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                pipeline_dtype=torch.bfloat16,
                bf16=bf16,
            )
        )

    config = OptimizerConfig(
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float,
        use_distributed_optimizer=dist_opt,
        optimizer="adam",
        lr=0.0,  # CPU: torch's AdamW (no Apex/TE fused Adam) needs a number
    )
    with MegatronOnCpu():
        optimizer = get_megatron_optimizer(config, model)

        torch.manual_seed(seed + 1)
        # CPU: model_parallel_cuda_manual_seed(seed + 1) needs the CUDA RNG

        for group in optimizer.optimizer.param_groups:
            for p in group["params"]:
                if len(optimizer.optimizer.state[p]) == 0:
                    optimizer.optimizer.state[p]["exp_avg"] = torch.rand_like(p.data)
                    optimizer.optimizer.state[p]["exp_avg_sq"] = torch.rand_like(p.data)
                    optimizer.optimizer.state[p]["step"] = torch.tensor(0.0)  # torch AdamW's

        optimizer.reload_model_params()

    return unwrap_model(model), optimizer


def find_matching_values(
    x: Union[dict, list], predicate: Callable[[Any], bool]
) -> Tuple[Union[dict, list], Union[dict, list]]:
    """Return matching values in a single list

    Args:
        x (Union[dict, list]) : state dict to process. Top-level argument must be a dict or list
        predicate (object -> bool): determines matching values
    """

    matching_vals = []
    if hasattr(x, "values") and callable(x.values):
        values = x.values()
    elif isinstance(x, list):
        values = x
    else:
        raise ValueError(f"Unexpected top-level object type: {type(x)}")
    for v in values:
        if isinstance(v, (list, dict)):
            matching_vals += find_matching_values(v, predicate)
        elif predicate(v):
            matching_vals.append(v)
    return matching_vals


# ---- megatron/training/checkpointing.py (the local-checkpoint path) --------------------------

_CHECKPOINT_VERSION = None


def set_checkpoint_version(value):
    global _CHECKPOINT_VERSION
    _CHECKPOINT_VERSION = value


def get_checkpoint_version():
    return _CHECKPOINT_VERSION


def check_checkpoint_args(checkpoint_args):
    """Ensure fixed arguments for a model are the same for the input
    arguments and the one retrieved from checkpoint."""
    args = get_args()

    def _compare(arg_name, old_arg_name=None, default=None):
        ckpt_arg_name = old_arg_name if old_arg_name is not None else arg_name
        if default is not None:
            checkpoint_value = getattr(checkpoint_args, ckpt_arg_name, default)
        else:
            checkpoint_value = getattr(checkpoint_args, ckpt_arg_name)
        args_value = getattr(args, arg_name)
        error_message = "{} value from checkpoint ({}) is not equal to the input argument value ({}).".format(
            arg_name, checkpoint_value, args_value
        )
        assert checkpoint_value == args_value, error_message

    _compare("num_layers")
    _compare("hidden_size")
    _compare("num_attention_heads")
    _compare("add_position_embedding", default=True)
    if args.data_parallel_random_init:
        _compare("data_parallel_random_init")


def get_rng_state(ckpt_format: str, tp_group, pp_group):
    """Collect rng state across data parallel ranks (CPU: no CUDA generator, no tracker)."""
    from megatron.core import mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.utils import get_pg_rank, get_pg_size

    args = get_args()
    rng_state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
    }
    rng_state_list = None
    if args.data_parallel_random_init and mpu.get_data_parallel_world_size() > 1:
        rng_state_list = [None for i in range(mpu.get_data_parallel_world_size())]
        torch.distributed.all_gather_object(rng_state_list, rng_state, group=mpu.get_data_parallel_group())
    else:
        rng_state_list = [rng_state]

    if ckpt_format == "torch_dist":
        pp_rank = get_pg_rank(pp_group)
        pp_size = get_pg_size(pp_group)
        tp_rank = get_pg_rank(tp_group)
        tp_size = get_pg_size(tp_group)
        rng_state_list = ShardedObject(
            "rng_state",
            rng_state_list,
            (pp_size, tp_size),
            (pp_rank, tp_rank),
            replica_id=mpu.get_data_parallel_rank(with_context_parallel=True),
        )
    return rng_state_list


class CheckpointType(Enum):
    LEGACY = auto()
    LOCAL = auto()
    GLOBAL = auto()
    TORCH_DCP = auto()
    FSDP_DTENSOR = auto()


def _build_sharded_state_dict_metadata(args, dp_cp_group=None) -> dict:
    from megatron.core import mpu

    metadata = {}
    if args.use_distributed_optimizer and args.ckpt_format != "fsdp_dtensor":
        if args.dist_ckpt_optim_fully_reshardable:
            metadata["distrib_optim_sharding_type"] = "fully_reshardable"
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = (
                args.distrib_optim_fully_reshardable_mem_efficient
            )
        else:
            metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    metadata["singleton_local_shards"] = False
    metadata["chained_optim_avoid_prefix"] = True
    if dp_cp_group is None:
        dp_cp_group = mpu.get_data_parallel_group(with_context_parallel=True)
    metadata["dp_cp_group"] = dp_cp_group
    return metadata


def generate_state_dict(
    args,
    model,
    optimizer,
    opt_param_scheduler,
    rng_state,
    iteration=None,
    optim_sd_kwargs=None,
    model_sd_kwargs=None,
    rerun_state=None,
):
    """Generate a state dict from given model, optimizer, scheduler, rng state and others."""
    from megatron.core import mpu

    state_dict = {}
    state_dict["args"] = args
    state_dict["checkpoint_version"] = 3.0
    if iteration is not None:
        state_dict["iteration"] = iteration

    for i in range(len(model)):
        key = "model"
        if len(model) > 1:
            key = f"model{i}"
        assert args.ckpt_format == "torch_dist"
        model_sd = model[i].sharded_state_dict(
            **(
                model_sd_kwargs
                or {"metadata": {"dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}}
            )
        )
        state_dict[key] = model_sd

    if not args.no_save_optim:
        if optimizer is not None and not optimizer.is_stub_optimizer:
            with _cpu_if_gathering(optim_sd_kwargs):
                optimizer_sd = optimizer.sharded_state_dict(
                    state_dict,
                    **(
                        optim_sd_kwargs
                        or {
                            "metadata": {
                                "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)
                            }
                        }
                    ),
                )
            state_dict["optimizer"] = optimizer_sd
        if opt_param_scheduler is not None:
            state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()

    if rerun_state:
        state_dict["rerun_state_machine"] = rerun_state

    if not args.no_save_rng and rng_state:
        state_dict["rng_state"] = rng_state

    return state_dict


def save_checkpoint(
    iteration,
    model,
    optimizer,
    opt_param_scheduler,
    num_floating_point_operations_so_far,
    checkpointing_context=None,
    non_persistent_ckpt=False,
    dp_cp_group=None,
):
    """Save a model and optimizer checkpoint: the non-persistent local path."""
    from megatron.core import mpu
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    args = get_args()

    if args.async_save and not is_empty_async_queue():
        print_rank_0(
            "WARNING: Starting a checkpoint save before previous has finished. "
            "Consider increasing the checkpoint interval."
        )

    model = unwrap_model(model)

    assert non_persistent_ckpt and args.non_persistent_ckpt_type == "local", "ported: the local path only"
    ckpt_type = CheckpointType.LOCAL
    save_dir = checkpointing_context["local_checkpoint_manager"].local_ckpt_dir
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {save_dir} in torch format")

    tp_group = mpu.get_tensor_model_parallel_group()
    pp_group = mpu.get_pipeline_model_parallel_group()
    rng_state = get_rng_state(args.ckpt_format, tp_group, pp_group)

    sharded_sd_metadata = _build_sharded_state_dict_metadata(args, dp_cp_group=dp_cp_group)
    state_dict = generate_state_dict(
        args,
        model,
        optimizer,
        opt_param_scheduler,
        rng_state,
        iteration=iteration,
        optim_sd_kwargs=dict(metadata=sharded_sd_metadata),
        model_sd_kwargs=dict(metadata=sharded_sd_metadata),
    )
    state_dict["num_floating_point_operations_so_far"] = num_floating_point_operations_so_far

    if (sharded_sd_metadata or {}).get("distrib_optim_sharding_type") in [
        "fully_reshardable",
        "dp_zero_gather_scatter",
    ]:
        raise RuntimeError(
            "Local checkpointing does not support optimizer sharding type "
            f"'{sharded_sd_metadata['distrib_optim_sharding_type']}'."
        )
    algo = args.non_persistent_local_ckpt_algo
    cached_metadata = None
    if args.ckpt_assume_constant_structure and "local_checkpoint_cache" in checkpointing_context:
        cached_metadata = checkpointing_context["local_checkpoint_cache"]
    state_dict_for_save, cacheable_metadata = MCoreTensorAwareStateDict.from_state_dict(
        state_dict,
        algo=algo,
        cached_metadata=cached_metadata,
        parallelization_group=mpu.get_data_parallel_group(with_context_parallel=True),
    )
    async_save_request = checkpointing_context["local_checkpoint_manager"].save(
        state_dict_for_save, iteration, is_async=bool(args.async_save)
    )
    checkpointing_context["local_checkpoint_cache"] = cacheable_metadata

    if torch.distributed.get_rank() == 0:

        def iter_finalize_fn():
            print_rank_0(f"  successfully saved local checkpoint from iteration {iteration:7d}")

        if args.async_save:
            assert async_save_request is not None
            async_save_request.add_finalize_fn(iter_finalize_fn)
        else:
            iter_finalize_fn()

    if is_last_rank():

        def onelogger_finalize_fn():  # on_save_checkpoint_success: no one-logger here
            pass

        if args.async_save:
            assert async_save_request is not None
            async_save_request.add_finalize_fn(onelogger_finalize_fn)
        else:
            onelogger_finalize_fn()

    if args.async_save:
        schedule_async_save(async_save_request)
        print_rank_0(f"  scheduled an async checkpoint save at iteration {iteration:7d} to {save_dir}")

    torch.distributed.barrier()
    del ckpt_type


def _get_non_persistent_iteration(non_persistent_global_dir, args, checkpointing_context=None):
    if args.non_persistent_ckpt_type is None:
        return -1
    elif args.non_persistent_ckpt_type == "local":
        return checkpointing_context["local_checkpoint_manager"].find_latest()
    raise NotImplementedError("ported: the local path only")


def _load_non_persistent_base_checkpoint(
    non_persistent_global_dir,
    args,
    rank0,
    sharded_state_dict,
    non_persistent_iteration,
    checkpointing_context=None,
):
    from megatron.core import mpu

    assert args.non_persistent_ckpt_type == "local", "ported: the local path only"
    intermediate_state_dict, checkpoint_name = checkpointing_context["local_checkpoint_manager"].load()
    state_dict = intermediate_state_dict.to_state_dict(
        sharded_state_dict,
        algo=args.non_persistent_local_ckpt_algo,
        parallelization_group=mpu.get_data_parallel_group(with_context_parallel=True),
    )
    return state_dict, checkpoint_name, False, CheckpointType.LOCAL


def _load_base_checkpoint(load_dir, args, rank0=False, sharded_state_dict=None, checkpointing_context=None):
    non_persistent_global_dir = args.non_persistent_global_ckpt_dir
    non_persistent_iteration = _get_non_persistent_iteration(
        non_persistent_global_dir, args, checkpointing_context
    )
    iteration = -1
    assert load_dir is None, "ported: no persistent checkpoints"
    if non_persistent_iteration != -1:  # there is a non-persistent checkpoint
        if non_persistent_iteration >= iteration:
            return _load_non_persistent_base_checkpoint(
                non_persistent_global_dir,
                args,
                rank0,
                sharded_state_dict,
                non_persistent_iteration,
                checkpointing_context,
            )
    if iteration == -1:
        if not rank0:
            print_rank_0("WARNING: could not find the metadata file because load directory is not defined")
            print_rank_0("    will not load any checkpoints and will start from random")
        return None, "", False, None


def _load_sharded_state_dict(args, model, optimizer, opt_param_scheduler, state_dict, release):
    """load_checkpoint's torch_dist branch: the sharded state dict to load into, and whether
    the rng state is ignored (the (TP, PP) sizes changed)."""
    from megatron.core import mpu
    from megatron.core.optimizer import DistributedOptimizer

    ignore_rng_state = False
    ckpt_args = types.SimpleNamespace()
    if state_dict is not None and "args" in state_dict:
        ckpt_args = state_dict.get("args")
    ckpt_tp_pp = (
        getattr(ckpt_args, "tensor_model_parallel_size", 1),
        getattr(ckpt_args, "pipeline_model_parallel_size", 1),
    )
    run_tp_pp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    mismatch_msg = "(TP, PP) mismatch after resume ({} vs {} from checkpoint)".format(run_tp_pp, ckpt_tp_pp)

    if (
        ckpt_tp_pp == run_tp_pp
        and not release
        and not args.finetune
        and not args.no_load_rng
        and not getattr(ckpt_args, "no_save_rng", False)
    ):
        tp_group = mpu.get_tensor_model_parallel_group()
        pp_group = mpu.get_pipeline_model_parallel_group()
        gen_sd_rng_state = get_rng_state(args.ckpt_format, tp_group, pp_group)
    else:
        ignore_rng_state = True
        gen_sd_rng_state = None

    sharded_sd_metadata = _build_sharded_state_dict_metadata(args)

    if (
        not release
        and not args.finetune
        and not args.no_load_optim
        and not getattr(ckpt_args, "no_save_optim", False)
    ):
        gen_sd_optim = optimizer
        gen_sd_opt_param_scheduler = opt_param_scheduler
        if args.use_distributed_optimizer:
            if (
                ckpt_tp_pp != run_tp_pp
                and sharded_sd_metadata["distrib_optim_sharding_type"]
                not in DistributedOptimizer.checkpoint_fully_reshardable_formats
            ):
                raise RuntimeError(f"{mismatch_msg}: not supported for DistributedOptimizer")
    else:
        gen_sd_optim = None
        gen_sd_opt_param_scheduler = None

    sharded_sd_metadata["dp_cp_group"] = mpu.get_data_parallel_group(with_context_parallel=True)
    optim_sd_kwargs = dict(metadata=sharded_sd_metadata, is_loading=True)
    model_sd_kwargs = dict(metadata=sharded_sd_metadata)
    sharded_state_dict = generate_state_dict(
        args,
        model,
        gen_sd_optim,
        gen_sd_opt_param_scheduler,
        gen_sd_rng_state,
        optim_sd_kwargs=optim_sd_kwargs,
        model_sd_kwargs=model_sd_kwargs,
    )
    return sharded_state_dict, ignore_rng_state


def _restore_rng_state(args, state_dict):
    """rng states (CPU: no CUDA generator and no tracker states to restore)."""
    from megatron.core import mpu

    if "rng_state" in state_dict:
        rng_state = state_dict["rng_state"]
        if args.data_parallel_random_init:
            rng_state = rng_state[mpu.get_data_parallel_rank()]
        else:
            rng_state = rng_state[0]
        random.setstate(rng_state["random_rng_state"])
        np.random.set_state(rng_state["np_rng_state"])
        torch.set_rng_state(rng_state["torch_rng_state"])


def load_checkpoint(
    ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True, checkpointing_context=None
):
    """Load a model checkpoint and return the iteration (the local path)."""
    args = get_args()
    load_dir = getattr(args, load_arg)
    model = unwrap_model(ddp_model)

    ckpt_format = args.ckpt_format
    state_dict, checkpoint_name, release, ckpt_type = _load_base_checkpoint(
        load_dir, args, rank0=True, checkpointing_context=checkpointing_context
    )
    ckpt_format = None
    if ckpt_type in [CheckpointType.LOCAL, CheckpointType.GLOBAL]:
        ckpt_format = "torch_dist"

    load_kwargs = {}
    ignore_rng_state = False
    if ckpt_format == "torch_dist":
        load_kwargs["sharded_state_dict"], ignore_rng_state = _load_sharded_state_dict(
            args, model, optimizer, opt_param_scheduler, state_dict, release
        )

    state_dict, checkpoint_name, release, ckpt_type = _load_base_checkpoint(
        load_dir, args, rank0=False, checkpointing_context=checkpointing_context, **load_kwargs
    )

    # Checkpoint not loaded.
    if state_dict is None:
        # Iteration and num_floating_point_operations_so_far default to 0.
        return 0, 0

    set_checkpoint_version(state_dict.get("checkpoint_version", 0))
    iteration = state_dict["iteration"]
    num_floating_point_operations_so_far = state_dict.get("num_floating_point_operations_so_far", 0)

    if "args" in state_dict and not args.finetune:
        checkpoint_args = state_dict["args"]
        check_checkpoint_args(checkpoint_args)
        args.consumed_train_samples = getattr(checkpoint_args, "consumed_train_samples", 0)
        args.skipped_train_samples = getattr(checkpoint_args, "skipped_train_samples", 0)
        update_num_microbatches(consumed_samples=args.consumed_train_samples, verbose=True)
        args.consumed_valid_samples = getattr(checkpoint_args, "consumed_valid_samples", 0)
    else:
        print_rank_0("could not find arguments in the checkpoint ...")

    # Model.
    ddp_model[0].load_state_dict(state_dict["model"], strict=strict)

    # Optimizer.
    if not release and not args.finetune and not args.no_load_optim:
        if optimizer is not None and not optimizer.is_stub_optimizer:
            optimizer.load_state_dict(state_dict["optimizer"])
        if opt_param_scheduler is not None:
            opt_param_scheduler.load_state_dict(state_dict["opt_param_scheduler"])
    else:
        if (args.fp16 or args.bf16) and optimizer is not None:
            with MegatronOnCpu():
                optimizer.reload_model_params()

    if not release and not args.finetune and not args.no_load_rng and not ignore_rng_state:
        _restore_rng_state(args, state_dict)

    torch.distributed.barrier()
    print_rank_0(f"  successfully loaded checkpoint at iteration {iteration}")
    return iteration, num_floating_point_operations_so_far
