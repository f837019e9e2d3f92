"""Everything `pretrain_hdp.py` checks before any process group exists (light imports only).

`validate_args(args, world_size)` runs on every rank right after parsing, before torch or
Megatron-Core is imported, and raises `ValueError` naming the flag and the bad value:

- numbers: every float finite, counts and divisors positive, rates in their ranges;
- the parallel layout and batch shape against the pool;
- paths: folders to write (`--save`, `--tensorboard-dir`, `--data-cache-path`) are folders
  that exist or can be created, files to read (`--tokenizer-model`, a device-profile JSON,
  the `--data-path` files) are readable, `--hdp-metrics-file` can be appended to;
- the resume (`megatron_hdp.megatron.resume_checks`): the checkpoint's optimizer layout,
  learning-rate schedule and iteration, and that `--save` belongs to this run.

`check_resume_matches(meta, ...)` makes the checks that need the opened datasets (data set-up
and model shape against the checkpoint); it still runs before any process group.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import math
import os
import re
import zipfile
from pathlib import Path

from megatron_hdp.checkpoint_digests import digest_problems, read_digests
from megatron_hdp.checkpoint_files import (
    DIST_METADATA,
    TRACKER,
    iteration_dir,
    latest_iteration,
    read_meta,
)
from megatron_hdp.checkpoint_shards import INDEX, index_problem, short_shards
from megatron_hdp.data.batch_ramp import BatchRamp, ramp_problems
from megatron_hdp.data.sampler import parse_split
from megatron_hdp.data.service.address import (
    address_origin,
    check_ray_address,
    resolve_ray_address,
)
from megatron_hdp.data.spec import load_spec
from megatron_hdp.distributed.layout import layout_problems
from megatron_hdp.errors import one_message
from megatron_hdp.megatron.arguments import (
    build_parser,
    capacity_of,
    counts_samples,
    parse_data_path,
    schedule_steps,
    uses_static_mesh,
)
from megatron_hdp.megatron.mla_args import args_problems
from megatron_hdp.megatron.resume_checks import (
    NothingToTrain,
    check_overwrite,
    check_save_folder,
    check_schedule,
)
from megatron_hdp.offload.host_budget import (
    available_memory_bytes,
    budget_problem,
    local_processes,
)
from megatron_hdp.scheduler.cost import PROFILES, DeviceProfile
from megatron_hdp.scheduler.windows import window_problems

__all__ = [
    "NothingToTrain",
    "check_resume_matches",
    "flag_notes",
    "validate_args",
    "validate_layout",
]

#: Flags whose value must be > 0 (counts, sizes, divisors, intervals).
POSITIVE = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "seq_length",
    "max_position_embeddings",
    "rotary_base",
    "kv_channels",
    "rotary_percent",
    "init_method_std",
    "make_vocab_size_divisible_by",
    "train_iters",
    "train_samples",
    "lr_decay_samples",
    "lr",
    "lr_decay_iters",
    "adam_eps",
    "global_batch_size",
    "context_parallel_size",
    "hdp_capacity",
    "hdp_global_batch_tokens",
    "log_interval",
    "eval_interval",
    "save_interval",
    "exit_interval",
    "distributed_timeout_minutes",
    "vocab_size",
    "ddp_bucket_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
)

#: Flags whose value must be >= 0.
NON_NEGATIVE = (
    "min_lr",
    "weight_decay",
    "clip_grad",
    "lr_warmup_iters",
    "lr_warmup_samples",
    "eval_iters",
    "seed",
    "hdp_skip_nonfinite_steps",
    "hdp_stall_report_seconds",
    "hdp_prefetch_depth",
    "hdp_timeline_interval",
    "moe_aux_loss_coeff",
)

#: MoE flags that do nothing without --num-experts, with their defaults.
MOE_ONLY = {
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": None,
    "moe_aux_loss_coeff": 0.0,
    "moe_token_dispatcher_type": "allgather",
}

#: Bytes each parameter needs at the least while training: its weight and its gradient in
#: 16-bit precision (Megatron adds fp32 main weights and Adam's two moments on top).
MIN_BYTES_PER_PARAM = 4

#: Batches the prefetch thread may prepare ahead (each holds its plan and tokens in memory;
#: the Ray planner keeps twice as many).
MAX_PREFETCH_DEPTH = 64

#: Seeds torch's generators take (Megatron adds small per-rank offsets).
MAX_SEED = 2**63 - 2**20

#: Flags whose value must lie in [0, 1).
UNIT_INTERVAL = ("adam_beta1", "adam_beta2", "hidden_dropout", "attention_dropout")


@functools.cache
def _flag_names() -> dict[str, str]:
    return {
        action.dest: action.option_strings[0]
        for action in build_parser()._actions
        if action.option_strings
    }


def flag(dest: str) -> str:
    """The command-line spelling of an argument (`lr_decay_iters` -> `--lr-decay-iters`)."""
    return _flag_names().get(dest, "--" + dest.replace("_", "-"))


def _check_numbers(args: argparse.Namespace) -> None:
    for dest, value in vars(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{flag(dest)} {value}: must be a finite number")
    for dest in POSITIVE:
        value = getattr(args, dest, None)
        if value is not None and not value > 0:
            raise ValueError(f"{flag(dest)} must be > 0, got {value}")
    for dest in NON_NEGATIVE:
        value = getattr(args, dest, None)
        if value is not None and value < 0:
            raise ValueError(f"{flag(dest)} must be >= 0, got {value}")
    for dest in UNIT_INTERVAL:
        value = getattr(args, dest)
        if not 0 <= value < 1:
            raise ValueError(f"{flag(dest)} must lie in [0, 1), got {value}")
    if args.hdp_host_memory_gb is not None and not args.hdp_host_memory_gb > 0:
        raise ValueError(
            f"--hdp-host-memory-gb {args.hdp_host_memory_gb}: no room for offloaded activations"
        )
    if args.hdp_prefetch_depth > MAX_PREFETCH_DEPTH:
        raise ValueError(
            f"--hdp-prefetch-depth {args.hdp_prefetch_depth}: at most {MAX_PREFETCH_DEPTH} "
            "batches ahead (each is held in memory until its step)"
        )
    if args.seed > MAX_SEED:
        raise ValueError(f"--seed {args.seed}: must be below 2**63 (torch's generators)")
    try:
        datetime.timedelta(minutes=args.distributed_timeout_minutes)
    except OverflowError:
        raise ValueError(
            f"--distributed-timeout-minutes {args.distributed_timeout_minutes:g}: too long for "
            "a timeout (at most about 1e12 minutes)"
        ) from None
    timeout_s = args.distributed_timeout_minutes * 60
    if args.hdp_stall_report_seconds is not None and args.hdp_stall_report_seconds >= timeout_s:
        raise ValueError(
            f"--hdp-stall-report-seconds {args.hdp_stall_report_seconds} must be below the "
            f"collective timeout ({timeout_s:g} s from --distributed-timeout-minutes), or the "
            "report comes after the job has failed"
        )
    problems = window_problems(
        args.window_size,
        args.window_attn_skip_freq,
        num_layers=args.num_layers,
    )
    if problems:
        raise ValueError("; ".join(problems))
    timeline_interval = getattr(args, "hdp_timeline_interval", None)
    if timeline_interval and args.hdp_metrics_file is None:
        raise ValueError(
            f"--hdp-timeline-interval {timeline_interval} needs --hdp-metrics-file: the "
            "timelines are written next to it"
        )


_LAYOUT_FIELDS = re.compile(
    r"\b(num_experts|moe_router_topk|expert_model_parallel_size|tensor_model_parallel_size"
    r"|pipeline_model_parallel_size|num_layers|moe_token_dispatcher_type|disable_bias_linear)\b"
)


def _memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _params_per_rank(args: argparse.Namespace) -> tuple[int, int]:
    """Parameters on the busiest rank: (per transformer layer, embedding and output layer).

    A lower bound (no norms or biases; the vocabulary at its smallest padding): enough to
    refuse a model that cannot fit.
    """
    h, tp = args.hidden_size, args.tensor_model_parallel_size
    ffn = args.ffn_hidden_size or 2 * h  # Megatron's default is 4 h, or about 8 h / 3
    gates = 2 if args.swiglu else 1
    layer = 4 * h * h // tp
    if args.num_experts is None:
        layer += (gates + 1) * h * ffn // tp
    else:
        expert_ffn = ffn if args.moe_ffn_hidden_size is None else args.moe_ffn_hidden_size
        ep = args.expert_model_parallel_size
        layer += args.num_experts * h  # the router is on every rank
        layer += (args.num_experts // ep) * (gates + 1) * h * expert_ffn // (tp // ep)
    vocab = args.make_vocab_size_divisible_by * tp
    if args.vocab_size is not None:
        vocab = max(vocab, args.vocab_size)
    embedding = vocab // tp * h
    if args.position_embedding_type == "learned_absolute":
        embedding += (args.max_position_embeddings or args.seq_length) * h
    return layer, embedding


def _check_model_fits(args: argparse.Namespace) -> None:
    """ValueError when the weights and gradients alone exceed this machine's memory.

    Catches a mistyped size (`--num-experts 100000000`) in a second instead of a failed
    allocation after start-up; the real peak is several times this bound. The model is
    built in host memory before it moves to a GPU, so the bound holds there too. The
    ranks that share this machine are torchrun's `LOCAL_WORLD_SIZE` (1 when not set).
    """
    memory = _memory_bytes()
    if memory is None:
        return
    layer, embedding = _params_per_rank(args)
    layers = args.num_layers // args.pipeline_model_parallel_size
    need = (layer * layers + embedding) * MIN_BYTES_PER_PARAM
    local_ranks = local_processes()
    if need * local_ranks <= memory:
        return
    sizes = ["num_layers", "hidden_size", "ffn_hidden_size", "num_experts", "moe_ffn_hidden_size"]
    sizes += ["make_vocab_size_divisible_by", "vocab_size"]
    if args.position_embedding_type == "learned_absolute":
        sizes.append("max_position_embeddings")
    named = ", ".join(
        f"{flag(dest)} {getattr(args, dest)}" for dest in sizes if getattr(args, dest) is not None
    )
    raise ValueError(
        f"the model ({named}) holds at least {need / 2**30:.1f} GiB of weights and gradients "
        f"per rank, more than this machine's {memory / 2**30:.1f} GiB of memory shared by "
        f"{local_ranks} ranks"
    )


def _check_offload_memory(args: argparse.Namespace) -> None:
    """ValueError when this machine's offload pools would not fit its available memory.

    Every device (the pool is allocated on CPU runs too); the processes of this machine are
    torchrun's `LOCAL_WORLD_SIZE` (`scripts/run_cpu.sh` and the SLURM script set it for
    `--hdp-validate-only`). Without `--hdp-host-memory-gb` the default share fits by
    construction.
    """
    if not args.hdp_offload or args.hdp_host_memory_gb is None:
        return
    problem = budget_problem(
        args.hdp_host_memory_gb, local=local_processes(), available=available_memory_bytes()
    )
    if problem is not None:
        raise ValueError(problem)


def _check_experts(args: argparse.Namespace, world_size: int) -> None:
    """The layout owner's MoE rules, reported with flag names."""
    if args.num_experts is None:
        for dest, default in MOE_ONLY.items():
            if getattr(args, dest) != default:
                raise ValueError(
                    f"{flag(dest)} {getattr(args, dest)} needs --num-experts (it applies to MoE "
                    "layers only; this model has a dense MLP)"
                )
    problems = layout_problems(
        world_size=world_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        num_layers=args.num_layers,
        expert_model_parallel_size=args.expert_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        num_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        add_bias_linear=not args.disable_bias_linear,
    )
    if problems:
        raise ValueError(_LAYOUT_FIELDS.sub(lambda m: flag(m.group(1)), problems[0]))
    expert_ffn = args.moe_ffn_hidden_size
    etp = args.tensor_model_parallel_size // args.expert_model_parallel_size
    if args.num_experts is not None and expert_ffn is not None and expert_ffn % etp:
        raise ValueError(
            f"--moe-ffn-hidden-size {expert_ffn} is not divisible by the {etp} TP ranks each "
            "expert is split over (--tensor-model-parallel-size / --expert-model-parallel-size)"
        )


def _check_pipeline(args: argparse.Namespace) -> None:
    """What pipeline parallelism does not combine with (yet), by flag."""
    from megatron_hdp.megatron.arguments import model_chunks

    model_chunks(args)  # --num-layers-per-virtual-pipeline-stage: ValueError by value
    pp = args.pipeline_model_parallel_size
    if pp == 1:
        return
    if args.hdp_offload:
        raise ValueError(
            f"--hdp-offload with --pipeline-model-parallel-size {pp} is not supported yet "
            "(offloading runs each micro-batch's forward and backward back to back)"
        )
    if not uses_static_mesh(args) and args.hdp_placement == "greedy":
        raise ValueError(
            f"--hdp-placement greedy with --pipeline-model-parallel-size {pp}: only the "
            "balanced placement (PP-Balance) and the static mesh plan pipelines in lock step"
        )


def _check_layout(args: argparse.Namespace, world_size: int, *, here: bool = True) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % tp:
        raise ValueError(
            f"--tensor-model-parallel-size {tp} does not divide the {world_size} ranks (each HDP "
            "replica is a group of TP ranks)"
        )
    if world_size % (tp * pp):
        raise ValueError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} = "
            f"{tp * pp} does not divide the {world_size} ranks (each HDP replica is a pipeline "
            "of PP stages of TP ranks)"
        )
    if args.num_attention_heads % tp:
        raise ValueError(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    if groups % tp and tp % groups:
        raise ValueError(
            f"--num-query-groups {groups} and --tensor-model-parallel-size {tp}: one must divide "
            "the other"
        )
    pool_size = world_size // (tp * pp)
    if args.ffn_hidden_size is not None and args.ffn_hidden_size % tp:
        raise ValueError(
            f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if args.sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    _check_experts(args, world_size)
    _check_pipeline(args)
    if here:
        _check_model_fits(args)
        _check_offload_memory(args)
    if args.micro_batch_size != 1:
        raise ValueError(
            f"--micro-batch-size {args.micro_batch_size}: HDP packs micro-batches itself; use 1"
        )
    max_pos = args.max_position_embeddings or args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.seq_length > max_pos:
        raise ValueError(
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings {max_pos}"
        )
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise ValueError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads} (give --kv-channels for another head size)"
        )
    head_dim = args.kv_channels or args.hidden_size // args.num_attention_heads
    if not 0 < args.rotary_percent <= 1:
        raise ValueError(f"--rotary-percent must lie in (0, 1], got {args.rotary_percent}")
    rotary = int(head_dim * args.rotary_percent)
    if args.position_embedding_type == "rope" and (rotary < 2 or rotary % 2):
        raise ValueError(
            f"--rotary-percent {args.rotary_percent} of head dim {head_dim} rotates {rotary} "
            "channels: RoPE needs an even number >= 2"
        )
    mla = args_problems(args)  # --multi-latent-attention's shape and RoPE, all of them
    if mla:
        raise ValueError("; ".join(mla))
    if args.group_query_attention and args.num_attention_heads % args.num_query_groups:
        raise ValueError(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--num-query-groups {args.num_query_groups}"
        )
    if pool_size % args.context_parallel_size:
        raise ValueError(
            f"--context-parallel-size {args.context_parallel_size} does not divide the pool of "
            f"{pool_size} replicas ({world_size} ranks / (TP {tp} x PP {pp}))"
        )
    capacity = capacity_of(args)
    if uses_static_mesh(args):
        context = capacity * args.context_parallel_size
        if context < args.seq_length:
            raise ValueError(
                f"static mesh: --context-parallel-size {args.context_parallel_size} x capacity "
                f"{capacity} = {context} tokens cannot hold --seq-length {args.seq_length}"
            )
    elif capacity * pool_size < args.seq_length:
        raise ValueError(
            f"capacity {capacity} x {pool_size} replicas = {capacity * pool_size} tokens is too "
            f"small for --seq-length {args.seq_length}: raise --hdp-capacity"
        )
    if args.hdp_offload and (uses_static_mesh(args) or args.hdp_placement != "balanced"):
        raise ValueError(
            "--hdp-offload needs the balanced HDP placement (--hdp-placement balanced)"
        )


def _check_data_spec(args: argparse.Namespace) -> None:
    """The data spec parses, names readable sources, and its schedule covers training."""
    if args.hdp_data_spec is None:
        return
    if args.data_path is not None:
        raise ValueError("give --hdp-data-spec or --data-path, not both (the spec names sources)")
    spec = load_spec(args.hdp_data_spec)
    if args.train_iters is not None:
        spec.check_covers(args.train_iters)
    for source in spec.sources:
        where = f"--hdp-data-spec source {source.name!r}:"
        if source.kind == "indexed":
            for suffix in (".idx", ".bin"):
                check_readable_file(where, source.path + suffix)
        for path in source.jsonl:
            check_readable_file(where, path)
        vocab = source.synthetic_params.get("vocab")
        if vocab is not None and args.tokenizer_type == "ByteLevel" and vocab > 257:
            raise ValueError(
                f"{where} synthetic vocab {vocab} holds ids that the ByteLevel tokenizer's "
                "vocabulary (257) does not"
            )
        if source.tokenize == "on_read":  # its lengths index is cached there
            check_writable_folder("--data-cache-path", args.data_cache_path or str(Path.home()))
        if source.kind == "builtin":
            check_writable_folder("--data-cache-path", args.data_cache_path or str(Path.home()))
            if args.tokenizer_type != "ByteLevel":
                raise ValueError(
                    f"{where} the embedded corpus is byte-level; --tokenizer-type "
                    f"{args.tokenizer_type} cannot read it"
                )


def _check_data_service(args: argparse.Namespace) -> None:
    """With --hdp-data-service ray: Ray is installed and the cluster's address answers."""
    if args.hdp_data_service != "ray":
        if args.hdp_ray_address is not None:
            raise ValueError("--hdp-ray-address needs --hdp-data-service ray")
        return
    if importlib.util.find_spec("ray") is None:
        raise ValueError(
            "--hdp-data-service ray needs Ray: pip install 'megatron-hdp[ray]' (Ray >= 2.40)"
        )
    check_ray_address(
        resolve_ray_address(args.hdp_ray_address), origin=address_origin(args.hdp_ray_address)
    )


def check_mtp(args: argparse.Namespace) -> None:
    """--mtp-num-layers: at least 1, and nothing it does not combine with (yet)."""
    depth = getattr(args, "mtp_num_layers", None)
    if depth is None:
        return
    if depth < 1:
        raise ValueError(f"--mtp-num-layers must be >= 1, got {depth}")
    if args.pipeline_model_parallel_size > 1:
        raise ValueError(
            f"--mtp-num-layers {depth} with --pipeline-model-parallel-size "
            f"{args.pipeline_model_parallel_size}: multi-token prediction runs with one "
            "pipeline stage only"
        )
    if getattr(args, "hdp_data_service", "none") == "ray":
        raise ValueError(
            f"--mtp-num-layers {depth} with --hdp-data-service ray: each rank reads the tokens "
            "after its chunks, which the Ray data service does not fetch"
        )


def _check_training(args: argparse.Namespace) -> None:
    parse_split(args.split)
    parse_data_path(args.data_path)
    _check_data_spec(args)
    _check_data_service(args)
    if args.data_path is not None and len(args.data_path) == 0:
        raise ValueError("--data-path needs at least one dataset prefix (omit it for the default)")
    if args.tokenizer_type == "HuggingFaceTokenizer" and not args.tokenizer_model:
        raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model")
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.tokenizer_type != "NullTokenizer" and args.vocab_size is not None:
        raise ValueError(
            f"--vocab-size {args.vocab_size} only applies to NullTokenizer; "
            f"{args.tokenizer_type} defines its own vocabulary"
        )
    if args.data_path is None and args.hdp_data_spec is None and args.tokenizer_type != "ByteLevel":
        raise ValueError(
            f"the embedded default corpus is byte-level; --tokenizer-type {args.tokenizer_type} "
            "needs --data-path"
        )
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    if args.lr_decay_iters is not None and args.lr_decay_iters <= args.lr_warmup_iters:
        raise ValueError(
            f"--lr-decay-iters {args.lr_decay_iters} must exceed --lr-warmup-iters "
            f"{args.lr_warmup_iters}"
        )
    if (
        args.train_iters is not None
        and args.lr_decay_iters is None
        and args.lr_warmup_iters >= args.train_iters
    ):
        raise ValueError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be below --train-iters "
            f"{args.train_iters} (the decay ends at --train-iters unless --lr-decay-iters)"
        )
    if args.save_interval is not None and args.save is None:
        raise ValueError("--save-interval needs --save")
    _check_checkpoint_flags(args)
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ValueError(
            "give --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler, not both"
        )
    if args.hdp_skip_nonfinite_steps and not args.check_for_nan_in_loss_and_grad:
        raise ValueError(
            "--hdp-skip-nonfinite-steps needs --check-for-nan-in-loss-and-grad (the default)"
        )
    _check_grad_sync(args)
    _check_fp16(args)


def _check_checkpoint_flags(args: argparse.Namespace) -> None:
    """The checkpoint-format flags (Megatron-LM's names)."""
    if args.ckpt_format == "torch":
        raise ValueError(
            "--ckpt-format torch: the per-rank torch.save format is no longer written; "
            "checkpoints are written in torch_dist (Megatron's distributed format), and "
            "folders in the torch format are still read by --load (found by their files)"
        )
    if args.async_save and args.save is None:
        raise ValueError("--async-save needs --save")
    if args.dist_ckpt_optim_fully_reshardable and not args.use_distributed_optimizer:
        raise ValueError(
            "--dist-ckpt-optim-fully-reshardable needs --use-distributed-optimizer (it sets "
            "how the distributed optimizer's state is saved)"
        )
    if args.finetune and args.load is None and args.hdp_load_if_exists is None:
        raise ValueError("--finetune needs --load (the checkpoint whose weights to start from)")


def _check_fp16(args: argparse.Namespace) -> None:
    """--fp16 and its loss-scale flags (Megatron-LM's names and rules)."""
    if args.fp16 and args.bf16:
        raise ValueError("give --fp16 or --bf16, not both")
    if args.fp16 and args.num_experts is not None:
        raise ValueError(
            "--fp16 with --num-experts: the load-balancing loss is not loss-scaled yet; use --bf16"
        )
    if args.fp16 and args.hdp_skip_nonfinite_steps:
        raise ValueError(
            "--hdp-skip-nonfinite-steps with --fp16: the loss scaler skips the steps whose "
            "gradients overflow itself (and lowers the scale); drop the flag"
        )
    if args.loss_scale is not None and not args.loss_scale > 0:
        raise ValueError(f"--loss-scale must be > 0, got {args.loss_scale}")
    if not 0 < args.min_loss_scale <= args.initial_loss_scale:
        raise ValueError(
            f"--min-loss-scale {args.min_loss_scale} must lie in (0, --initial-loss-scale "
            f"{args.initial_loss_scale}]"
        )
    if not args.loss_scale_window > 0 or args.hysteresis < 1:
        raise ValueError(
            f"--loss-scale-window {args.loss_scale_window} must be > 0 and --hysteresis "
            f"{args.hysteresis} >= 1"
        )


def _check_grad_sync(args: argparse.Namespace) -> None:
    """The gradient-sync flags, by Megatron-LM's rules (bf16 reduces in fp32 by default)."""
    if args.grad_reduce_in_bf16 and not args.bf16:
        raise ValueError(
            "--grad-reduce-in-bf16 needs --bf16 (float32 parameters have float32 gradients)"
        )
    if args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32:
        raise ValueError(
            "give --accumulate-allreduce-grads-in-fp32 or --grad-reduce-in-bf16, not both"
        )
    if args.ddp_bucket_size is not None and not args.overlap_grad_reduce:
        raise ValueError(
            f"--ddp-bucket-size {args.ddp_bucket_size} needs --overlap-grad-reduce (without "
            "it the gradients are reduced in one bucket after the backward)"
        )


def flag_notes(args: argparse.Namespace) -> list[str]:
    """Lines to log at start-up about accepted flags that change nothing in this run."""
    notes = []
    if args.accumulate_allreduce_grads_in_fp32:
        notes.append(
            "--accumulate-allreduce-grads-in-fp32: gradients accumulate and reduce in float32 "
            + (
                "already (Megatron-LM's rule for --bf16 without --grad-reduce-in-bf16)"
                if args.bf16
                else "already (float32 parameters)"
            )
        )
    return notes


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_folder(name: str, value: str | None) -> None:
    """ValueError unless `value` is a folder this process may write, or one it can create."""
    if value is None:
        return
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name} {value}: is a file, not a folder")
    existing = _nearest_existing(path)
    if not existing.is_dir():
        raise ValueError(f"{name} {value}: {existing} is a file, so the folder cannot be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {value}: {existing} is not writable")


def check_readable_file(name: str, value: str | None) -> None:
    """ValueError unless `value` names a regular file this process may read."""
    if value is None:
        return
    path = Path(value)
    if not path.exists():
        raise ValueError(f"{name} {value}: no such file")
    if not path.is_file():
        raise ValueError(f"{name} {value}: not a regular file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{name} {value}: not readable")


def _check_paths(args: argparse.Namespace) -> None:
    check_writable_folder("--save", args.save)
    check_writable_folder("--tensorboard-dir", args.tensorboard_dir)
    if args.data_path is None and args.hdp_data_spec is None:
        check_writable_folder("--data-cache-path", args.data_cache_path or str(Path.home()))
    if args.hdp_metrics_file is not None:
        metrics = Path(args.hdp_metrics_file)
        if metrics.exists():
            if not metrics.is_file():
                raise ValueError(f"--hdp-metrics-file {metrics}: not a regular file")
            if not os.access(metrics, os.W_OK):
                raise ValueError(f"--hdp-metrics-file {metrics}: not writable")
        else:
            check_writable_folder("--hdp-metrics-file's folder", str(metrics.parent))
    if args.tokenizer_type == "HuggingFaceTokenizer":
        check_readable_file("--tokenizer-model", args.tokenizer_model)
    for _, prefix in parse_data_path(args.data_path):
        for suffix in (".idx", ".bin"):
            check_readable_file("--data-path", prefix + suffix)
    profile = args.hdp_device_profile
    if profile is not None and profile not in PROFILES:
        if not Path(profile).is_file():
            raise ValueError(
                f"--hdp-device-profile {profile}: neither a profile name "
                f"({', '.join(sorted(PROFILES))}) nor a JSON file"
            )
        try:
            DeviceProfile.from_json(profile)
        except (OSError, ValueError, TypeError) as err:
            raise ValueError(
                f"--hdp-device-profile {profile}: not a device profile JSON ({err})"
            ) from None
    for name, value in (("--load", args.load), ("--hdp-load-if-exists", args.hdp_load_if_exists)):
        if value is not None and Path(value).exists() and not Path(value).is_dir():
            raise ValueError(f"{name} {value}: is a file, not a checkpoint folder")


def _digest_share() -> tuple[int, int]:
    """(rank, ranks) that share out the content check: the job's, under torchrun.

    `--hdp-validate-only` and other single processes (no `LOCAL_RANK`) check every file.
    """
    if "LOCAL_RANK" not in os.environ:
        return 0, 1
    try:
        return int(os.environ.get("RANK", "0")), max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 0, 1


def _check_files_complete(load: str, meta: dict | None = None) -> None:
    """ValueError naming a file of the latest checkpoint that is damaged, missing or foreign.

    A checkpoint with digests (`checkpoint_digests`) is checked file by file against them:
    presence, size and content (the job's ranks share the reading out). One written before
    digests existed, or by stock Megatron-LM, gets the structural checks: torch.save's zip
    archives have their central directory, a distributed folder has its `metadata.json`
    (readable) and its index `.metadata` (readable), and every shard holds what the index
    says.
    """
    latest = latest_iteration(load)
    folder = iteration_dir(load, latest)
    where = folder.relative_to(load)
    advice = f"resume from an earlier checkpoint by pointing the tracker {TRACKER} at it"

    def refuse(what: str) -> None:
        raise ValueError(f"--load {load}: {where}/{what}; {advice}")

    try:
        record = read_digests(folder)
    except ValueError as err:
        refuse(str(err))
    if record is not None:
        rank, ranks = _digest_share()
        run_id = (meta or {}).get("run_id")
        problems = digest_problems(
            folder, record, run_id=run_id, iteration=latest, rank=rank, world=ranks
        )
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            refuse(problems[0] + more)
        return
    distributed = (folder / DIST_METADATA).exists()
    if not distributed and ((folder / INDEX).exists() or any(folder.glob("*.distcp"))):
        refuse(
            f"{DIST_METADATA} is missing from a folder of distributed-checkpoint shards (copied "
            "or written only in part)"
        )
    if distributed:
        try:
            json.loads((folder / DIST_METADATA).read_text())
        except (OSError, ValueError) as err:
            refuse(f"{DIST_METADATA} is damaged ({type(err).__name__})")
        problem = index_problem(folder)
        if problem is not None:
            refuse(problem)
    for path in sorted(folder.glob("*.pt")):
        if not zipfile.is_zipfile(path):
            refuse(f"{path.name} is not a complete torch file (truncated or damaged)")
    for name, needed, have in short_shards(folder):
        found = "is missing" if have is None else f"holds {have:,} bytes"
        refuse(f"{name} {found}, its index {INDEX} says {needed:,} (truncated)")


def _check_optimizer_resume(args: argparse.Namespace, meta: dict, world_size: int) -> None:
    """ValueError if the checkpoint's optimizer state cannot be loaded at this layout.

    Megatron's distributed format reshards the model and a non-distributed optimizer over
    TP, PP and pool size, the distributed optimizer's `dp_reshardable` state over the pool
    size only; the per-rank torch format reshards nothing.
    """
    saved = meta.get("distributed_optimizer")
    if saved is None:
        return  # a checkpoint of Megatron-LM's own: its args are checked at load
    if saved != args.use_distributed_optimizer:
        raise ValueError(
            f"--load {args.load}: written with use_distributed_optimizer={saved}; resume with "
            "the same setting (or --finetune for its weights alone)"
        )
    layout = (
        meta.get("tensor_model_parallel_size", 1),
        meta.get("pipeline_model_parallel_size", 1),
    )
    mine = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    if meta.get("format") != "torch_dist":
        if saved and meta["world_size"] != world_size:
            raise ValueError(
                f"--load {args.load}: written by {meta['world_size']} ranks with the "
                f"distributed optimizer in the per-rank torch format, which does not "
                f"reshard; resume it on {meta['world_size']} ranks, not {world_size}"
            )
        if layout != mine:
            raise ValueError(
                f"--load {args.load}: written at TP x PP {layout[0]} x {layout[1]} in the "
                f"per-rank torch format, which does not reshard; this job has {mine[0]} x "
                f"{mine[1]} (resume at the old layout once: its next save is in torch_dist)"
            )
        return
    sharding = meta.get("distrib_optim_sharding_type")
    if saved and layout != mine and sharding == "dp_reshardable":
        raise ValueError(
            f"--load {args.load}: the distributed optimizer's state was saved dp_reshardable, "
            f"which loads at another pool size but not at another TP x PP ({layout[0]} x "
            f"{layout[1]} -> {mine[0]} x {mine[1]}); save it with "
            "--dist-ckpt-optim-fully-reshardable, or give --finetune for the weights alone"
        )


def _check_resume(args: argparse.Namespace, world_size: int) -> dict | None:
    """The `--load` checkpoint's meta (None for a fresh start), after checking it fits."""
    if args.load is not None and args.hdp_load_if_exists is not None:
        raise ValueError("give --load or --hdp-load-if-exists, not both")
    check_overwrite(args)
    if args.hdp_load_if_exists is not None and (Path(args.hdp_load_if_exists) / TRACKER).exists():
        args.load = args.hdp_load_if_exists
    meta = None
    if args.load is not None:
        try:
            meta = read_meta(args.load)
        except ValueError as err:
            raise ValueError(f"--load {args.load}: {err}") from None
        _check_files_complete(args.load, meta)
        if not args.finetune:
            _check_optimizer_resume(args, meta, world_size)
            check_schedule(args, meta, flag)
    check_save_folder(args, meta)
    return meta


def validate_layout(args: argparse.Namespace, world_size: int, *, here: bool = True) -> None:
    """The number and layout checks of `validate_args` alone (no data, paths or resume).

    For tools that take the job's model and layout flags but not its data (the advisor
    with a lengths file). `here=False`: the job runs elsewhere (a cluster the advisor
    predicts), so this machine's memory is not checked. Raises ValueError naming the flag
    and the value.
    """
    _check_numbers(args)
    _check_layout(args, world_size, here=here)


def validate_args(args: argparse.Namespace, world_size: int, *, here: bool = True) -> dict | None:
    """Check the arguments against each other, the pool, the file system and `--load`.

    Reads only small files (the checkpoint's `meta.json`, a device profile). Sets
    `args.load` when `--hdp-load-if-exists` finds a checkpoint, and `args.train_iters` from
    `--train-samples` (`_check_batch`). `here=False`: the job runs on other machines (the
    advisor), so this machine's memory is not checked. Every group of checks runs and their
    problems come together in one message (`errors.one_message`); the resume is checked
    once the flags themselves hold.

    Returns:
        The meta of the checkpoint to resume, or None for a fresh start.

    Raises:
        ValueError: Naming each flag and value at fault.
        NothingToTrain: The checkpoint to resume is already at (or past) `--train-iters`.
    """
    problems = []
    for check in (
        _check_numbers,
        lambda a: _check_batch(a, world_size),
        lambda a: _check_layout(a, world_size, here=here),
        _check_training,
        check_mtp,
        _check_paths,
    ):
        try:
            check(args)
        except ValueError as err:
            problems.append(str(err))
        except (ArithmeticError, TypeError):
            if not problems:
                raise
            # a consequence of a value already refused (a zero divisor, a missing count)
    if problems:
        raise ValueError(one_message(problems))
    return _check_resume(args, world_size)


def _check_batch(args: argparse.Namespace, world_size: int) -> None:
    """The global batch and the run length, in Megatron-LM's samples of --seq-length tokens.

    Resolves `--train-samples` into `args.train_iters` (Megatron-LM's `update_train_iters`,
    ramp included) and, where a sample count is needed and --global-batch-size is not
    given, Megatron-LM's default (one sample per data-parallel rank).
    """
    if (args.train_iters is None) == (args.train_samples is None):
        raise ValueError("give --train-iters or --train-samples (one of them)")
    if args.train_iters is not None and (args.lr_decay_samples or args.lr_warmup_samples):
        raise ValueError(
            "--lr-decay-samples / --lr-warmup-samples go with --train-samples; with "
            "--train-iters give --lr-decay-iters / --lr-warmup-iters (Megatron-LM's rule)"
        )
    if args.train_samples is not None and (args.lr_decay_iters or args.lr_warmup_iters):
        raise ValueError(
            "--lr-decay-iters / --lr-warmup-iters go with --train-iters; with --train-samples "
            "give --lr-decay-samples / --lr-warmup-samples (Megatron-LM's rule)"
        )
    if args.hdp_global_batch_tokens is not None:
        if args.global_batch_size is not None:
            raise ValueError("give --global-batch-size or --hdp-global-batch-tokens, not both")
        if counts_samples(args):
            raise ValueError(
                "--train-samples, --lr-*-samples and --rampup-batch-size count samples of "
                "--seq-length tokens: give --global-batch-size (samples per step), not "
                "--hdp-global-batch-tokens"
            )
        if args.hdp_global_batch_tokens < args.seq_length:
            raise ValueError(
                f"--hdp-global-batch-tokens {args.hdp_global_batch_tokens} is smaller than one "
                f"sequence (--seq-length {args.seq_length})"
            )
        return
    if args.rampup_batch_size is not None and args.train_samples is None:
        raise ValueError(
            "--rampup-batch-size needs --train-samples, not --train-iters (Megatron-LM's rule: "
            "no batch-size ramp-up for iteration-based training)"
        )
    if args.rampup_batch_size is not None and args.global_batch_size is None:
        raise ValueError("--rampup-batch-size needs --global-batch-size (the size after the ramp)")
    if counts_samples(args) and args.global_batch_size is None:
        replicas = world_size // (
            args.tensor_model_parallel_size * args.pipeline_model_parallel_size
        )
        args.global_batch_size = max(1, replicas // args.context_parallel_size)
    if args.global_batch_size is None:
        return
    problems = ramp_problems(args.global_batch_size, args.rampup_batch_size)
    if problems:
        raise ValueError(problems[0])
    if args.train_samples is not None:
        ramp = BatchRamp(args.global_batch_size, args.seq_length, args.rampup_batch_size)
        args.train_iters = ramp.train_iters(args.train_samples)
        if args.train_iters < 1:
            raise ValueError(
                f"--train-samples {args.train_samples}: less than one step of "
                f"--global-batch-size {args.global_batch_size}"
            )
    warmup, decay = schedule_steps(args)
    if args.train_samples is not None and decay <= warmup:
        raise ValueError(
            f"--lr-decay-samples {decay} (default --train-samples) must exceed "
            f"--lr-warmup-samples {warmup}"
        )


#: What checkpoints written before a model field existed had (they were dense and TP 1).
MODEL_FIELDS_BEFORE_THEY_EXISTED = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "num_experts": None,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": None,
    "expert_model_parallel_size": 1,
    "rotary_percent": 1.0,
    "rotary_interleaved": False,
    "kv_channels": None,
    "qk_layernorm": False,
    "softmax_type": "vanilla",
    "virtual_pipeline_model_parallel_size": None,
    "mtp_num_layers": None,
    "mtp_loss_scaling_factor": 0.1,
    "window_size": None,
    "window_attn_skip_freq": None,
}
#: Model settings that change no parameter, so a resume may change them.
MAY_CHANGE_ON_RESUME = (
    "sequence_parallel",
    "moe_aux_loss_coeff",
    "moe_token_dispatcher_type",
    "mtp_loss_scaling_factor",
)
#: The layout, which a checkpoint in Megatron's distributed format reshards on load.
RESHARDED_ON_LOAD = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size",
)


def _shares(saved: list[float], now: list[float], streams: list[str]) -> str:
    """`'web' 25% -> 50%` for each stream whose blend share changed."""
    return ", ".join(
        f"{name!r} {100 * a:.6g}% -> {100 * b:.6g}%"
        for name, a, b in zip(streams, saved, now, strict=True)
        if a != b
    )


def _blend_change(key: str, saved, now, streams: list[str] | None) -> str | None:
    """The blend change by stream name (None when the set-ups are not comparable)."""
    if streams is None or saved is None or now is None:
        return None
    if key == "weights" and len(saved) == len(now) == len(streams):
        return f"the blend's token shares changed: {_shares(saved, now, streams)}"
    if key != "schedule" or len(saved) != len(now):
        return None
    ends = ([until for until, _ in saved], [until for until, _ in now])
    if ends[0] != ends[1]:
        return f"the schedule's phases end at steps {ends[0]}, now {ends[1]}"
    if any(len(a) != len(streams) or len(b) != len(streams) for (_, a), (_, b) in zip(saved, now)):
        return None
    return "; ".join(
        f"the phase up to step {until}: {_shares(a, b, streams)}"
        for (until, a), (_, b) in zip(saved, now, strict=True)
        if a != b
    )


#: Model fields whose flag has another name or default (the rest: `flag(field)`).
_MODEL_FLAGS = {
    "max_position_embeddings": "--max-position-embeddings (default: --seq-length)",
    "add_bias_linear": "--disable-bias-linear (off: biases)",
    "tie_embeddings": "--untie-embeddings-and-output-weights (off: tied)",
    "vocab_size": "the padded vocabulary (--tokenizer-type, --vocab-size, "
    "--make-vocab-size-divisible-by)",
}


def _model_flag(field: str) -> str:
    return _MODEL_FLAGS.get(field) or flag(field)


def megatron_lm_model(load: str) -> dict | None:
    """The model shape of the latest checkpoint Megatron-LM wrote in `load`, by our fields.

    From the `args` it stores (Megatron-LM's names); None if it stores none. Reads the
    checkpoint's common part only (no tensors); local.
    """
    from megatron_hdp.megatron.dist_checkpoint import read_common

    ckpt = read_common(iteration_dir(load, latest_iteration(load))).get("args")
    if ckpt is None:
        return None
    heads = ckpt.num_attention_heads
    return {
        "num_layers": ckpt.num_layers,
        "hidden_size": ckpt.hidden_size,
        "num_attention_heads": heads,
        "num_query_groups": ckpt.num_query_groups if ckpt.group_query_attention else None,
        "ffn_hidden_size": ckpt.ffn_hidden_size,
        "vocab_size": ckpt.padded_vocab_size,
        "swiglu": bool(ckpt.swiglu),
        "add_bias_linear": bool(ckpt.add_bias_linear),
        "tie_embeddings": not ckpt.untie_embeddings_and_output_weights,
        "num_experts": getattr(ckpt, "num_experts", None),
        "softmax_type": getattr(ckpt, "softmax_type", "vanilla"),
    }


def _check_same_data(
    load: str, saved: dict, prefixes: list[str], fingerprints: list[str] | None
) -> None:
    """ValueError if this run's datasets are not the checkpoint's.

    By content where the checkpoint has fingerprints (at any path), else by path as given.
    """
    saved_prints = saved.get("fingerprints")
    if saved_prints is None or fingerprints is None:
        if saved["prefixes"] != prefixes:
            raise ValueError(
                f"--load {load}: the checkpoint was trained on {saved['prefixes']}, this "
                f"run reads {prefixes}"
            )
        return
    if len(saved_prints) != len(fingerprints):
        raise ValueError(
            f"--load {load}: the checkpoint was trained on {len(saved_prints)} datasets "
            f"({saved['prefixes']}), this run reads {len(fingerprints)} ({prefixes})"
        )
    for then, now, print_then, print_now in zip(
        saved["prefixes"], prefixes, saved_prints, fingerprints, strict=True
    ):
        if print_then == print_now:
            continue  # the same content, wherever it lives now
        where = f"{now} is not" if then == now else f"{now} is not the checkpoint's {then}"
        raise ValueError(
            f"--load {load}: the dataset {where}: its content differs from what the checkpoint "
            f"was trained on (fingerprint {print_now}, the checkpoint's {print_then}; "
            "rewritten or re-preprocessed?)"
        )


def check_resume_matches(
    meta: dict,
    *,
    load: str,
    model: dict,
    data_setup: dict,
    prefixes: list[str],
    streams: list[str] | None = None,
    finetune: bool = False,
    fingerprints: list[str] | None = None,
) -> None:
    """ValueError naming what differs between this run and the checkpoint it resumes.

    Args:
        meta: The checkpoint's `meta.json`.
        load: The checkpoint folder (for the message).
        model: This run's model configuration (`dataclasses.asdict(GPTConfig)`).
        data_setup: This run's training sampler set-up (`TokenBudgetSampler.setup()`).
        prefixes: This run's dataset prefixes.
        streams: This run's sampler streams (names a changed blend by source and bucket).
        finetune: `--finetune` (the weights alone): the data may differ.
        fingerprints: This run's datasets' content fingerprints (`data.fingerprint`), in
            the order of `prefixes`: where the checkpoint has them too, the same content
            at another path is the same data, and other content at the same path is not.
    """
    saved_model = meta.get("model")
    if saved_model is None and meta.get("megatron_lm"):
        saved_model = megatron_lm_model(load)
        model = {k: v for k, v in model.items() if k in (saved_model or {})}
    if saved_model is not None:
        saved_model = {**MODEL_FIELDS_BEFORE_THEY_EXISTED, **saved_model}
        model = json.loads(json.dumps(model))  # as meta.json holds it: tuples are lists
        may_change = MAY_CHANGE_ON_RESUME
        if meta.get("format") == "torch_dist":
            may_change += RESHARDED_ON_LOAD
        model = {k: v for k, v in model.items() if k not in may_change}
        changed = [key for key in model if saved_model.get(key) != model[key]]
        if changed:
            detail = ", ".join(
                f"{_model_flag(k)}: {saved_model.get(k)!r} -> {model[k]!r}" for k in changed
            )
            raise ValueError(f"--load {load}: the model differs from the checkpoint's ({detail})")
    saved_data = None if finetune else meta.get("data")
    if saved_data is not None:
        _check_same_data(load, saved_data, prefixes, fingerprints)
        saved_streams = len(saved_data["setup"].get("units", []))
        if streams is not None and saved_streams != len(data_setup.get("units", [])):
            raise ValueError(
                f"--load {load}: the checkpoint's data had {saved_streams} streams, this run "
                f"has {len(streams)} ({', '.join(streams)}): sources or length buckets of "
                "--hdp-data-spec were added or removed"
            )
        for key in sorted(set(data_setup) | set(saved_data["setup"])):
            if saved_data["setup"].get(key) != data_setup.get(key):
                blend = _blend_change(
                    key, saved_data["setup"].get(key), data_setup.get(key), streams
                )
                if blend:
                    raise ValueError(
                        f"--load {load}: {blend} (--hdp-data-spec or --data-path weights); a "
                        "resumed run must keep the checkpoint's blend, or start afresh elsewhere"
                    )
                raise ValueError(
                    f"--load {load}: the data set-up differs from the checkpoint's: {key} was "
                    f"{saved_data['setup'].get(key)!r}, now {data_setup.get(key)!r} (changed "
                    "--seed, --data-path, --hdp-data-spec (its length buckets?), --split, "
                    "--seq-length or the global batch size?)"
                )
