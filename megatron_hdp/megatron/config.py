"""Flags -> typed configurations of the training job (host layer).

`pretrain_hdp.py`'s parsed arguments become the frozen configs the library takes: the
model shape (`GPTConfig`), the optimizer and schedule (`OptimConfig`), the data set-up
(`DataConfig`) and the cost model's device profile. Nothing here reads the environment or
talks to other ranks.
"""

from __future__ import annotations

import argparse

import torch

from megatron_hdp.data.batch_ramp import BatchRamp, parse_step_schedule
from megatron_hdp.data.sampler import parse_split
from megatron_hdp.data.spec import load_spec
from megatron_hdp.data.training_data import DataConfig
from megatron_hdp.megatron.arguments import (
    counts_samples,
    megatron_ffn_hidden_size,
    model_chunks,
    padded_vocab_size,
    parse_data_path,
    schedule_steps,
)
from megatron_hdp.megatron.engine import OptimConfig
from megatron_hdp.megatron.mla_args import mla_fields
from megatron_hdp.megatron.model import GPTConfig
from megatron_hdp.scheduler.cost import PROFILES, DeviceProfile


def device_profile(spec: str | None) -> DeviceProfile:
    """A named profile, a calibrated profile JSON, or the default for this machine."""
    if spec is None:
        spec = "h100" if torch.cuda.is_available() else "cpu"
    if spec in PROFILES:
        return PROFILES[spec]
    return DeviceProfile.from_json(spec)


def model_config(args: argparse.Namespace, vocab_size: int) -> GPTConfig:
    """The model shape from Megatron-named arguments."""
    return GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        ffn_hidden_size=megatron_ffn_hidden_size(args),
        vocab_size=padded_vocab_size(
            vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
        ),
        max_position_embeddings=args.max_position_embeddings or args.seq_length,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        rotary_interleaved=args.rotary_interleaved,
        kv_channels=args.kv_channels,
        qk_layernorm=args.qk_layernorm,
        softmax_type=args.softmax_type,
        normalization=args.normalization,
        swiglu=args.swiglu,
        add_bias_linear=not args.disable_bias_linear,
        init_method_std=args.init_method_std,
        tie_embeddings=not args.untie_embeddings_and_output_weights,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        params_dtype="bfloat16" if args.bf16 else "float16" if args.fp16 else "float32",
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=model_chunks(args),
        sequence_parallel=args.sequence_parallel,
        num_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        expert_model_parallel_size=args.expert_model_parallel_size,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        mtp_num_layers=args.mtp_num_layers,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        window_size=args.window_size,
        window_attn_skip_freq=_skip_freq(args.window_attn_skip_freq),
        **mla_fields(args),
    )


def _skip_freq(value):
    """A list pattern as a tuple (GPTConfig is frozen); ints and None as they are."""
    return tuple(value) if isinstance(value, list) else value


def optim_config(args: argparse.Namespace, *, override_scheduler: bool = False) -> OptimConfig:
    """Optimizer and LR schedule from Megatron-named arguments."""
    return OptimConfig(
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_grad_reduce=args.overlap_grad_reduce,
        grad_reduce_in_fp32=not args.grad_reduce_in_bf16,
        fp16=args.fp16,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        ddp_bucket_size=args.ddp_bucket_size,
        lr_warmup_iters=schedule_steps(args)[0],
        lr_decay_iters=schedule_steps(args)[1],
        schedule_in_samples=counts_samples(args),
        lr_decay_style=args.lr_decay_style,
        override_scheduler=override_scheduler or args.override_opt_param_scheduler,
        use_checkpoint_scheduler=args.use_checkpoint_opt_param_scheduler,
    )


def data_config(args: argparse.Namespace, world_size: int) -> DataConfig:
    """Data set-up from Megatron-named arguments (`pretrain_hdp.py`)."""
    pool_size = world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    tokens, ramp = global_batch_tokens(args, pool_size)
    return batch_data_config(args, tokens_per_batch=tokens, ramp=ramp)


def batch_ramp(args: argparse.Namespace) -> BatchRamp | None:
    """The batch size per step in samples of `--seq-length` tokens (None: a token budget).

    `--global-batch-size` (with `--rampup-batch-size`), or megatron-core 0.19's
    `--step-batch-size-schedule`.
    """
    schedule = getattr(args, "step_batch_size_schedule", None)
    if schedule is not None:  # megatron-core 0.19 (the drop-in): it replaces the batch size
        steps = parse_step_schedule(schedule, int(args.seq_length))
        return BatchRamp(steps[-1][1], int(args.seq_length), schedule=steps)
    if args.global_batch_size is None or args.hdp_global_batch_tokens is not None:
        return None
    rampup = getattr(args, "rampup_batch_size", None)
    return BatchRamp(
        int(args.global_batch_size),
        int(args.seq_length),
        None if rampup is None else tuple(int(x) for x in rampup),
    )


def global_batch_tokens(args: argparse.Namespace, pool_size: int) -> tuple[int, BatchRamp | None]:
    """The token budget of a step after any ramp, and the ramp (None: the same every step).

    As Megatron-LM counts them: `--global-batch-size B` is B samples of `--seq-length`
    tokens per step (ramped by `--rampup-batch-size`); `--hdp-global-batch-tokens` is the
    budget itself; neither: one `--seq-length` sample per data-parallel rank
    (Megatron-LM's default, micro-batch 1 x pool / CP). Both entry points read it here.
    """
    ramp = batch_ramp(args)
    if ramp is not None:
        return ramp.global_batch_size * ramp.seq_length, ramp
    if args.hdp_global_batch_tokens is not None:
        return int(args.hdp_global_batch_tokens), None
    return (pool_size // args.context_parallel_size) * args.seq_length, None


def batch_flag(args: argparse.Namespace) -> str | None:
    """The global-batch flag as the user gave it, for messages (None: the token flag)."""
    if args.global_batch_size is not None and args.hdp_global_batch_tokens is None:
        return (
            f"--global-batch-size {args.global_batch_size} (x --seq-length {args.seq_length} "
            "tokens)"
        )
    return None


def batch_data_config(
    args: argparse.Namespace,
    *,
    tokens_per_batch: int | None,
    units_per_batch: int | None = None,
    ramp: BatchRamp | None = None,
) -> DataConfig:
    """Data set-up from Megatron-named arguments, with the global batch already decided."""
    return DataConfig(
        blend=parse_data_path(args.data_path),
        split=parse_split(args.split),
        seq_length=args.seq_length,
        seed=args.seed,
        tokens_per_batch=tokens_per_batch,
        units_per_batch=units_per_batch,
        ramp=ramp,
        batch_flag=batch_flag(args),
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        cache_dir=args.data_cache_path,
        spec=load_spec(args.hdp_data_spec) if args.hdp_data_spec else None,
    )
