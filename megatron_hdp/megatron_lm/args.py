"""`--hdp` and the `--hdp-*` flags inside Megatron-LM's own parser, and their checks.

`add_args(parser)` is what Megatron-LM's `extra_args_provider` adds: `--hdp` (off by default:
without it the job is stock Megatron-LM) and the `--hdp-*` flags of `pretrain_hdp.py`.
`check_args(args)` runs before Megatron-LM's `validate_args` and `finish_args(args)` after it,
both before any process group exists; they do nothing without `--hdp`. A flag that HDP under
Megatron-LM's `pretrain()` cannot honour is refused by name (`ValueError`), never ignored.

Imports neither torch nor Megatron at module level.
"""

from __future__ import annotations

import argparse
import logging
import math
import os

from megatron_hdp.data.sampler import parse_split
from megatron_hdp.errors import one_message
from megatron_hdp.megatron.arguments import add_hdp_args
from megatron_hdp.megatron_lm.moe import moe_refusals
from megatron_hdp.scheduler.windows import window_problems

logger = logging.getLogger(__name__)

#: `--hdp-*` flags of `pretrain_hdp.py` that Megatron-LM's loop does not run, with the reason
#: and what to use instead. Refused when given a value other than their default.
REFUSED_HDP_FLAGS = {
    "hdp_static_baseline": (
        "--hdp-static-baseline",
        "Megatron-LM's own DP x CP training is the static baseline: run without --hdp",
    ),
    "hdp_offload": (
        "--hdp-offload",
        "activation offloading runs in pretrain_hdp.py only (the drop-in schedule does not "
        "install the offload manager)",
    ),
    "hdp_host_memory_gb": ("--hdp-host-memory-gb", "it sizes --hdp-offload, see there"),
    "hdp_load_if_exists": (
        "--hdp-load-if-exists",
        "Megatron-LM's --load already starts fresh when the folder holds no checkpoint",
    ),
    "hdp_metrics_file": (
        "--hdp-metrics-file",
        "Megatron-LM logs the steps itself (--log-interval, --tensorboard-dir, --wandb-project)",
    ),
    "hdp_timeline_interval": (
        "--hdp-timeline-interval",
        "timelines are recorded by pretrain_hdp.py's loop only",
    ),
    "hdp_validate_only": (
        "--hdp-validate-only",
        "Megatron-LM validates its arguments at start-up itself",
    ),
    "hdp_skip_nonfinite_steps": (
        "--hdp-skip-nonfinite-steps",
        "Megatron-LM handles non-finite steps itself (--check-for-nan-in-loss-and-grad, "
        "--rerun-mode)",
    ),
    "hdp_overwrite_checkpoints": (
        "--hdp-overwrite-checkpoints",
        "Megatron-LM manages its --save folder itself",
    ),
    "hdp_stall_report_seconds": (
        "--hdp-stall-report-seconds",
        "the stall watchdog runs in pretrain_hdp.py's loop only",
    ),
    "hdp_data_service": (
        "--hdp-data-service",
        "the Ray data service runs in pretrain_hdp.py only; every rank reads its own tokens here",
    ),
    "hdp_ray_address": ("--hdp-ray-address", "see --hdp-data-service"),
}

#: Megatron-LM arguments (dest, value test, message) that HDP cannot run with.
_REFUSED_MEGATRON = (
    (
        "decoder_first_pipeline_num_layers",
        lambda v: v is not None,
        "--decoder-first-pipeline-num-layers: HDP splits the layers evenly over the stages",
    ),
    (
        "decoder_last_pipeline_num_layers",
        lambda v: v is not None,
        "--decoder-last-pipeline-num-layers: HDP splits the layers evenly over the stages",
    ),
    (
        "pipeline_model_parallel_layout",
        lambda v: v is not None,
        "--pipeline-model-parallel-layout: HDP splits the layers evenly over the stages",
    ),
    ("sft", bool, "--sft: HDP trains on pretraining documents"),
    ("fim_data", bool, "--fim-data: HDP reads documents as they are"),
    ("train_data_path", lambda v: v is not None, "--train-data-path: give --data-path and --split"),
    ("valid_data_path", lambda v: v is not None, "--valid-data-path: give --data-path and --split"),
    ("test_data_path", lambda v: v is not None, "--test-data-path: give --data-path and --split"),
    ("data_args_path", lambda v: v is not None, "--data-args-path: give --data-path"),
    (
        "per_split_data_args_path",
        lambda v: v is not None,
        "--per-split-data-args-path: give --data-path and --split",
    ),
    ("use_legacy_models", bool, "--use-legacy-models: HDP runs Megatron-Core's GPTModel"),
    ("spec", lambda v: v is not None, "--spec: HDP sets the layer spec (HDP core attention)"),
    ("yaml_cfg", lambda v: v is not None, "--yaml-cfg: give the flags on the command line"),
    (
        "mtp_use_repeated_layer",
        bool,
        "--mtp-use-repeated-layer: HDP builds one MTP layer per depth (not tested shared)",
    ),
    (
        "experimental_attention_variant",
        lambda v: v is not None,
        "--experimental-attention-variant: HDP replaces the core attention",
    ),
    (
        "heterogeneous_layers_config_path",
        lambda v: v is not None,
        "--heterogeneous-layers-config-path: not supported with HDP",
    ),
    ("use_rope_scaling", bool, "--use-rope-scaling: HDP applies plain RoPE"),
    (
        "cache_mla_latents",
        bool,
        "--cache-mla-latents: it caches MLA's latents for flash-decode inference, and "
        "Megatron-Core's MultiLatentAttention refuses it in training at the first forward",
    ),
    (
        "rotary_seq_len_interpolation_factor",
        lambda v: v is not None,
        "--rotary-seq-len-interpolation-factor: HDP applies RoPE at the original positions",
    ),
    ("hybrid_context_parallel", bool, "--hybrid-context-parallel: HDP replaces it"),
    (
        "inprocess_restart",
        bool,
        "--inprocess-restart: HDP's schedule keeps the process groups of the first start",
    ),
    (
        "export_kd_teacher_load",
        lambda v: v is not None,
        "--export-kd-teacher-load: ModelOpt distillation builds ModelOpt's models (HDP builds "
        "Megatron-LM's GPT model)",
    ),
)

#: Megatron-LM paths that run on GPUs only, by the flags that choose them: (name, whether
#: the launch chose it, what it is). Refused on CPU; on CUDA see `GPU_REFUSED` and
#: `unverified_on_gpu`.
GPU_ONLY = (
    (
        "--transformer-impl transformer_engine",
        lambda a: getattr(a, "transformer_impl", None) == "transformer_engine",
        "Transformer Engine layers (Megatron-LM's default; on CPU pass --transformer-impl local)",
    ),
    (
        "--fp8-format",
        lambda a: getattr(a, "fp8", None) is not None,
        "FP8 layers (Transformer Engine), with --fp8-recipe, --fp8-param-gather and the other "
        "--fp8-* flags",
    ),
    ("--fp4-format", lambda a: getattr(a, "fp4", None) is not None, "FP4 layers"),
    (
        "--tp-comm-overlap",
        lambda a: bool(getattr(a, "tp_comm_overlap", False)),
        "Transformer Engine's tensor-parallel communication overlap (userbuffers)",
    ),
    (
        "--recompute-modules layernorm / moe_act",
        lambda a: (
            getattr(a, "recompute_granularity", None) == "selective"
            and bool({"layernorm", "moe_act"} & set(getattr(a, "recompute_modules", None) or []))
        ),
        "Megatron-Core's CheckpointWithoutOutput, which reads Transformer Engine's FP8 state "
        "(drop layernorm and moe_act from --recompute-modules)",
    ),
    (
        "--use-megatron-fsdp",
        lambda a: bool(getattr(a, "use_megatron_fsdp", False)),
        "Megatron-FSDP (with --data-parallel-sharding-strategy)",
    ),
)

#: Of those, the ones HDP cannot run on CUDA either, and why.
GPU_REFUSED = {
    "--tp-comm-overlap": "Transformer Engine's userbuffers are allocated once for --seq-length x "
    "--micro-batch-size / CP tokens per micro-batch, and an HDP micro-batch holds a different "
    "number of tokens every time (packed documents, ring shards); drop it",
    "--fp4-format": "HDP pads micro-batches to FP8's multiple of tokens only (not FP4's); drop it",
}


def gpu_problems(args: argparse.Namespace, cuda: bool) -> list[str]:
    """The GPU-only paths this launch chose that cannot run here, one phrase each."""
    problems = []
    for flag, chosen, what in GPU_ONLY:
        if not chosen(args):
            continue
        if not cuda:
            problems.append(
                f"{flag}: {what} runs on CUDA GPUs only, and this machine has none (stock "
                "Megatron-LM cannot run it on CPU either)"
            )
        elif flag in GPU_REFUSED:
            problems.append(f"{flag}: {GPU_REFUSED[flag]}")
    return problems


def unverified_on_gpu(args: argparse.Namespace) -> list[str]:
    """A note for each GPU-only path of this (CUDA) launch that is accepted but unverified.

    No GPU run of this project's tests has checked these paths yet; rank 0 logs the notes.
    """
    return [
        f"{flag} with --hdp is accepted but unverified on GPU: this project's tests run it "
        "on CPU fakes only (see docs/megatron-lm.md, 'GPU-only flags')"
        for flag, chosen, _ in GPU_ONLY
        if chosen(args) and flag not in GPU_REFUSED
    ]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


#: `--tokenizer-type` values HDP's data layer cannot read with, and why (refused at start-up).
#: Every other type Megatron-LM builds is read through the tokenizer object Megatron-LM built
#: (`data.MegatronLMTokenizer`: its `tokenize`, `eod` and `vocab_size`).
REFUSED_TOKENIZERS = {
    "MultimodalTokenizer": "a multimodal prompt tokenizer; HDP trains a text GPT on documents",
    "NullMultimodalTokenizer": "a multimodal tokenizer; HDP trains a text GPT on documents",
    "SFTTokenizer": "a chat-prompt tokenizer for --sft; HDP trains on pretraining documents",
}
POSITION_EMBEDDINGS = ("rope", "learned_absolute")


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's `extra_args_provider`: add `--hdp` (default off) and the `--hdp-*` flags."""
    add_hdp_args(parser)
    parser.set_defaults(hdp=False)
    for action in parser._actions:  # noqa: SLF001 - argparse has no public lookup
        if action.dest == "hdp":
            action.help = (
                "train with Hybrid Data Parallelism through Megatron-LM's pretrain(); "
                "without it (or with --no-hdp) the job is stock Megatron-LM"
            )
    group = parser.add_argument_group("hybrid data parallelism: data")
    group.add_argument(
        "--hdp-data-spec",
        default=None,
        metavar="FILE",
        help="a declarative data spec (JSON or YAML) instead of --data-path (see the README's "
        "'Data spec')",
    )
    group.add_argument(
        "--hdp-data-service", default="local", help="refused here (pretrain_hdp.py only)"
    )
    group.add_argument("--hdp-ray-address", default=None, help="refused here")
    return parser


def _hdp_flags() -> dict[str, tuple[str, object]]:
    """Each flag `add_args` adds: its dest -> (its name, its default)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_args(parser)
    return {a.dest: (a.option_strings[0], a.default) for a in parser._actions}  # noqa: SLF001


def check_args(args: argparse.Namespace) -> None:
    """Before Megatron-LM's `validate_args`: refuse what HDP cannot run, set what it implies.

    Without `--hdp` it only refuses `--hdp-*` flags (they would do nothing).

    With `--hdp` this sets `--dataloader-type external` and `--calculate-per-token-loss`
    (HDP's data iterator and per-token loss) and `--micro-batch-size 1` (HDP packs its own
    micro-batches, so Megatron-LM's sample counter only needs the batch sizes divisible by
    its data-parallel size). Raises one ValueError naming every refused flag of the launch
    (`one_message`), so a recipe is fixed in one round.
    """
    flags = _hdp_flags()
    if not getattr(args, "hdp", False):
        problems = [
            f"{flag} has no effect without --hdp"
            for dest, (flag, default) in flags.items()
            if dest != "hdp" and getattr(args, dest, default) != default
        ]
        if problems:
            raise ValueError(one_message(problems))
        return
    if getattr(args, "rampup_batch_size", None) is not None and not megatron_ramps():
        if int(os.environ.get("RANK", "0") or 0) == 0:
            logger.warning(
                "--rampup-batch-size %s: this Megatron-LM (megatron-core %s) ignores it "
                "(deprecated for --step-batch-size-schedule); as without --hdp every step "
                "trains --global-batch-size",
                " ".join(map(str, args.rampup_batch_size)),
                _core_version(),
            )
        args.rampup_batch_size = None
    cuda = _cuda()
    problems = _refusals(args, flags) + gpu_problems(args, cuda)
    if problems:
        raise ValueError(one_message(problems))
    if int(os.environ.get("RANK", "0") or 0) == 0:
        for note in replaced_by_plan(args) + (unverified_on_gpu(args) if cuda else []):
            logger.warning("%s", note)
    args.micro_batch_size = 1
    args.dataloader_type = "external"
    args.calculate_per_token_loss = True


def megatron_ramps() -> bool:
    """Whether this megatron-core ramps the batch size by `--rampup-batch-size`.

    0.16 does; 0.19 dropped its calculator for `--step-batch-size-schedule` and ignores the
    flag.
    """
    from megatron.core import num_microbatches_calculator

    return hasattr(num_microbatches_calculator, "RampupBatchsizeNumMicroBatchesCalculator")


def _core_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def replaced_by_plan(args: argparse.Namespace) -> list[str]:
    """The flags of an `--hdp` launch that HDP's plan replaces, one note each (rank 0 logs).

    Not refused: the job runs the same model and data; these only chose how Megatron-LM
    would have split and batched it, which HDP's planner decides per step instead.
    """
    notes = []
    if args.micro_batch_size not in (None, 1):
        notes.append(
            f"--micro-batch-size {args.micro_batch_size} has no effect with --hdp: HDP packs "
            "micro-batches up to --hdp-capacity tokens per rank (a step trains "
            "--global-batch-size x --seq-length tokens)"
        )
    cp_comm = getattr(args, "cp_comm_type", None) or ["p2p"]
    if any(kind != "p2p" for kind in cp_comm):
        notes.append(
            f"--cp-comm-type {' '.join(cp_comm)} has no effect with --hdp: a long sequence's "
            "ring is HDP's point-to-point zigzag ring over the ranks the planner gives it"
        )
    if getattr(args, "hierarchical_context_parallel_sizes", None):
        sizes = " ".join(str(n) for n in args.hierarchical_context_parallel_sizes)
        notes.append(
            f"--hierarchical-context-parallel-sizes {sizes} has no effect with --hdp: "
            "--context-parallel-size is folded into the pool and rings are sized per sequence"
        )
    backend = getattr(args, "attention_backend", None)
    name = getattr(backend, "name", backend)
    if name not in (None, "auto"):
        notes.append(
            f"--attention-backend {name} has no effect with --hdp: HDP's attention runs the "
            "kernel of --hdp-attention-backend (checked at start-up for this device)"
        )
    return notes


def _refusals(args: argparse.Namespace, flags: dict) -> list[str]:
    """Every flag of this `--hdp` launch that HDP cannot run, one phrase each."""
    problems = []
    for dest, (flag, reason) in REFUSED_HDP_FLAGS.items():
        if getattr(args, dest, flags[dest][1]) != flags[dest][1]:
            problems.append(f"{flag} is not supported with Megatron-LM's pretrain(): {reason}")
    for dest, refused, message in _REFUSED_MEGATRON:
        if dest in args and refused(getattr(args, dest)):
            problems.append(f"{message} (with --hdp)")
    problems += [f"{message} (with --hdp)" for message in moe_refusals(args)]
    if getattr(args, "mtp_num_layers", None) and args.pipeline_model_parallel_size > 1:
        problems.append(
            f"--mtp-num-layers {args.mtp_num_layers} with --pipeline-model-parallel-size "
            f"{args.pipeline_model_parallel_size}: HDP runs multi-token prediction with one "
            "pipeline stage only (with --hdp)"
        )
    problems += [
        f"{message} (with --hdp)"
        for message in window_problems(
            getattr(args, "window_size", None),
            getattr(args, "window_attn_skip_freq", None),
            num_layers=args.num_layers,
        )
    ]
    if getattr(args, "dataloader_type", None) not in (None, "external"):
        problems.append(
            f"--dataloader-type {args.dataloader_type}: --hdp brings its own data iterator "
            "(Megatron-LM's 'external' type); drop the flag"
        )
    if args.position_embedding_type not in POSITION_EMBEDDINGS:
        problems.append(
            f"--position-embedding-type {args.position_embedding_type}: HDP supports "
            f"{' and '.join(POSITION_EMBEDDINGS)}"
        )
    if args.normalization not in ("LayerNorm", "RMSNorm"):
        problems.append(f"--normalization {args.normalization}: HDP supports LayerNorm, RMSNorm")
    if args.tokenizer_type in REFUSED_TOKENIZERS:
        problems.append(
            f"--tokenizer-type {args.tokenizer_type}: {REFUSED_TOKENIZERS[args.tokenizer_type]}"
        )
    model = getattr(args, "tokenizer_model", None)
    if args.tokenizer_type == "HuggingFaceTokenizer" and model and os.path.isfile(model):
        problems.append(
            f"--tokenizer-model {model}: Megatron-LM's HuggingFaceTokenizer "
            "(transformers.AutoTokenizer.from_pretrained) takes the folder that holds "
            f"tokenizer.json ({os.path.dirname(model) or '.'}) or a hub id, not the file"
        )
    if args.hdp_data_spec is not None and args.data_path:
        problems.append("--hdp-data-spec and --data-path: give one of them")
    problems += _batch_problems(args)
    if args.hdp_data_spec is not None and getattr(args, "mock_data", False):
        problems.append("--hdp-data-spec and --mock-data: give one of them")
    if args.hdp_capacity is not None and args.hdp_capacity <= 0:
        problems.append(f"--hdp-capacity must be positive, got {args.hdp_capacity}")
    if args.hdp_prefetch_depth < 0:
        problems.append(f"--hdp-prefetch-depth must be >= 0, got {args.hdp_prefetch_depth}")
    return problems


def _batch_problems(args: argparse.Namespace) -> list[str]:
    """The global batch flags: one way to give it, and Megatron-LM's sample-counter rules.

    Megatron-LM counts each step's samples as data-parallel size x micro-batch (1 with
    --hdp) x micro-batches and asserts that this is the batch size of the step, so
    `--global-batch-size` and the ramp's start and increment must be multiples of its
    data-parallel size, world / (TP x PP x CP) (HDP itself would not need it).
    """
    from megatron_hdp.data.batch_ramp import ramp_problems

    rampup = getattr(args, "rampup_batch_size", None)
    schedule = getattr(args, "step_batch_size_schedule", None)
    if args.hdp_global_batch_tokens is not None:
        if args.global_batch_size is not None or rampup is not None or schedule is not None:
            return [
                "--hdp-global-batch-tokens and --global-batch-size / --rampup-batch-size / "
                "--step-batch-size-schedule: give one of them (a token budget, or samples of "
                "--seq-length tokens per step)"
            ]
        counted = [
            "--" + dest.replace("_", "-")
            for dest in ("train_samples", "lr_decay_samples", "lr_warmup_samples")
            if getattr(args, dest, None)
        ]
        if counted:
            return [
                f"{' and '.join(counted)} with --hdp-global-batch-tokens: Megatron-LM would "
                "count samples HDP does not train (a token budget is no number of samples); "
                "give --global-batch-size (samples of --seq-length tokens per step)"
            ]
        return []
    if schedule is not None:  # megatron-core 0.19; Megatron-LM refuses it with the others
        return _schedule_problems(args, schedule)
    if args.global_batch_size is None:
        if rampup is not None:
            return ["--rampup-batch-size needs --global-batch-size (the size after the ramp)"]
        return []
    problems = ramp_problems(args.global_batch_size, rampup)
    if rampup is not None and not getattr(args, "train_samples", None):
        problems.append(
            "--rampup-batch-size needs --train-samples, not --train-iters (Megatron-LM asserts "
            "no batch-size ramp-up for iteration-based training)"
        )
    world = int(getattr(args, "world_size", None) or os.environ.get("WORLD_SIZE", "1"))
    model = (
        args.tensor_model_parallel_size
        * args.pipeline_model_parallel_size
        * args.context_parallel_size
    )
    data_parallel = max(1, world // model)
    sizes = {"--global-batch-size": args.global_batch_size}
    if rampup is not None and not problems:
        sizes["the --rampup-batch-size start"] = int(rampup[0])
        sizes["the --rampup-batch-size increment"] = int(rampup[1])
    for name, size in sizes.items():
        if size % data_parallel:
            problems.append(
                f"{name} {size} is not a multiple of Megatron-LM's data-parallel size "
                f"{data_parallel} (world {world} / (TP x PP x CP)), which its sample counter "
                "asserts"
            )
    return problems


def _data_parallel(args: argparse.Namespace) -> tuple[int, int]:
    """(world size, Megatron-LM's data-parallel size world / (TP x PP x CP))."""
    world = int(getattr(args, "world_size", None) or os.environ.get("WORLD_SIZE", "1"))
    model = (
        args.tensor_model_parallel_size
        * args.pipeline_model_parallel_size
        * args.context_parallel_size
    )
    return world, max(1, world // model)


def _schedule_problems(args: argparse.Namespace, schedule: str) -> list[str]:
    """What is wrong with `--step-batch-size-schedule`, one sentence each.

    Parsed as megatron-core 0.19 reads it; its sizes must be multiples of Megatron-LM's
    data-parallel size (its sample counter asserts the size of every step it reaches).
    """
    from megatron_hdp.data.batch_ramp import parse_step_schedule

    try:
        steps = parse_step_schedule(schedule, int(args.seq_length))
    except ValueError as err:
        return [str(err)]
    world, data_parallel = _data_parallel(args)
    return [
        f"--step-batch-size-schedule: batch size {size} (from {threshold} samples) is not a "
        f"multiple of Megatron-LM's data-parallel size {data_parallel} (world {world} / "
        "(TP x PP x CP)), which its sample counter asserts"
        for threshold, size in steps
        if size % data_parallel
    ]


def pool_size(args: argparse.Namespace) -> int:
    """Ranks in the HDP pool: Megatron-LM's data-parallel x context-parallel ranks."""
    return args.world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)


def capacity(args: argparse.Namespace) -> int:
    """Tokens per rank per micro-batch: --hdp-capacity, else ceil(seq-length / CP)."""
    if args.hdp_capacity is not None:
        return args.hdp_capacity
    return math.ceil(args.seq_length / args.context_parallel_size)


def global_batch(args: argparse.Namespace):
    """(token budget after any ramp, `BatchRamp` or None) of a step.

    As pretrain_hdp.py reads the same flags (`megatron.config.global_batch_tokens`):
    `--global-batch-size B` is B
    samples of `--seq-length` tokens (Megatron-LM's default B: one per data-parallel rank),
    ramped by `--rampup-batch-size`; `--hdp-global-batch-tokens` the budget itself.
    """
    from megatron_hdp.megatron.config import global_batch_tokens

    return global_batch_tokens(args, pool_size(args))


def finish_args(args: argparse.Namespace) -> None:
    """After Megatron-LM's `validate_args`: check the model shape and the attention kernel.

    Resolves `--hdp-attention-backend` to the kernel for this device; with `--save`, turns
    on Megatron-LM's data-loader checkpoint (`dataloader_save`) so that checkpoints carry
    the data position. Raises ValueError naming the problem.
    """
    if not getattr(args, "hdp", False):
        return
    import torch

    from megatron_hdp.attention.kernels.device import DeviceFacts
    from megatron_hdp.attention.kernels.registry import resolve_kernel
    from megatron_hdp.megatron_lm.model import gpt_config

    if getattr(args, "split", None) is not None:
        parse_split(args.split)  # as Megatron-Core reads it; the data reader reads it so too
    tokens, _ = global_batch(args)
    if tokens < args.seq_length:
        raise ValueError(
            f"--hdp-global-batch-tokens {tokens} is smaller than one sequence "
            f"(--seq-length {args.seq_length})"
        )
    size = capacity(args)
    if args.seq_length > pool_size(args) * size:
        raise ValueError(
            f"--seq-length {args.seq_length} does not fit the pool: {pool_size(args)} ranks x "
            f"capacity {size} tokens"
        )
    cfg = gpt_config(args, vocab_size=args.tensor_model_parallel_size)  # raises on a bad shape
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.hdp_attention_backend = resolve_kernel(
        args.hdp_attention_backend,
        DeviceFacts.of(device),
        dtype=cfg.dtype,
        head_dim=cfg.head_dim,
        window=cfg.window_size is not None,
        head_dim_v=cfg.head_dim_v,  # MLA: v's head dim differs from q's and k's
    )
    from megatron_hdp.megatron_lm.switch import startup_problems

    problems = startup_problems(args)  # a --load checkpoint of another model shape
    if problems:
        raise ValueError(one_message(problems))
    if args.save:
        args.dataloader_save = args.save
