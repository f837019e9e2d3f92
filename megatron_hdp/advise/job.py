"""The user's job as the simulator sees it: model, layout, capacity and memory (pure).

`parse_job(argv, gpus)` runs `pretrain_hdp.py`'s own parser and validation
(`megatron.arguments.build_parser`, `megatron.validation.validate_args`) on the job's
Megatron flags for a world of `gpus` ranks, after setting aside the flags that only matter
to a running job (checkpoints, logs, the Ray data service, the job's own cost-model
profile); `Job` then holds what the simulator needs.

Memory (per GPU, bf16 mixed precision, stated estimates):
- weights, gradients and optimizer state: `total_params / (TP x PP)` parameters at
  2 (bf16 weights) + 4 (fp32 main gradients) + 12 (fp32 master weights and two Adam
  moments) bytes, the 12 divided over the pool with `--use-distributed-optimizer`
  (ZeRO-1), plus `RESERVE_BYTES` for workspace and communication buffers: the rule of
  `sim.models.memory_capacity`;
- activations: per token and layer `34 h / TP` bytes with sequence parallelism (or TP 1),
  `(10 + 24 / TP) h` without (Korthikanti et al. 2022, "Reducing Activation Recomputation
  in Large Transformer Models", Table 2, with flash attention: no `5 a s / h` term), for
  the layers of one pipeline stage.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from megatron_hdp.megatron.arguments import (
    build_parser,
    capacity_of,
    megatron_ffn_hidden_size,
    padded_vocab_size,
    parse_data_path,
    uses_static_mesh,
)
from megatron_hdp.megatron.mla_args import mla_shape_fields
from megatron_hdp.scheduler.cost import ModelShape
from megatron_hdp.scheduler.windows import check_window, windowed_layers
from megatron_hdp.sim.models import SimModel
from megatron_hdp.sim.simulate import static_cp

#: Device bytes kept for workspace and NCCL buffers (`sim.models.memory_capacity`'s).
RESERVE_BYTES = 8e9

#: Flags of a running job that change nothing in a prediction: set aside, and listed in
#: the report (`Job.ignored`). Name -> the value that switches them off.
RUNTIME_ONLY = {
    "save": None,
    "load": None,
    "hdp_load_if_exists": None,
    "tensorboard_dir": None,
    "hdp_metrics_file": None,
    "hdp_timeline_interval": None,
    "hdp_data_service": "local",
    "hdp_ray_address": None,
    "hdp_device_profile": None,
    "hdp_overwrite_checkpoints": False,
    "hdp_check_plans": False,
    "hdp_validate_only": False,
}


@dataclass(frozen=True)
class Job:
    """What the advisor simulates: one model replica layout on `gpus` GPUs."""

    args: argparse.Namespace = field(repr=False)
    model: SimModel
    gpus: int
    pool_size: int
    capacity: int
    capacity_source: str
    context: int
    static_cp: int
    tokens_per_batch: int | None
    units_per_batch: int | None
    ignored: tuple[str, ...] = ()

    @property
    def your_system(self) -> str:
        """The simulated system the job's flags would run."""
        a = self.args
        if uses_static_mesh(a):
            return "static"
        if a.hdp_offload:
            return "hdp_offload_balance"
        return "hdp_greedy" if a.hdp_placement == "greedy" else "hdp_balance"

    def summary(self) -> dict:
        """JSON-ready description of the job."""
        m, a = self.model, self.args
        return {
            "gpus": self.gpus,
            "tp": m.tp,
            "pp": m.pp,
            "ep": a.expert_model_parallel_size,
            "pool_size": self.pool_size,
            "gpus_per_replica": m.gpus_per_rank,
            "num_layers": m.shape.num_layers,
            "hidden_size": m.shape.hidden_size,
            "num_attention_heads": m.shape.num_attention_heads,
            "num_query_groups": m.shape.num_query_groups,
            "ffn_hidden_size": m.shape.ffn_hidden_size,
            "vocab_size": m.shape.vocab_size,
            "num_experts": m.shape.num_experts,
            "moe_router_topk": m.shape.moe_router_topk if m.shape.num_experts else None,
            "total_params": m.total_params,
            "active_params": m.active_params,
            "capacity": self.capacity,
            "capacity_source": self.capacity_source,
            "context": self.context,
            "static_cp": self.static_cp,
            "tokens_per_batch": self.tokens_per_batch,
            "units_per_batch": self.units_per_batch,
            "your_system": self.your_system,
            "use_distributed_optimizer": a.use_distributed_optimizer,
            "sequence_parallel": a.sequence_parallel,
            "ignored_flags": list(self.ignored),
        }


def total_params(shape: ModelShape, *, tied_embeddings: bool) -> float:
    """Every weight (all experts, the router, embeddings; norms and biases left out)."""
    h = shape.hidden_size
    attention = h * (h + 2 * shape.kv_dim) + h * h
    if shape.multi_latent_attention:
        attention = shape.attention_params
    per_mlp = 3 if shape.swiglu else 2
    ffn = shape.ffn_hidden_size or 4 * h
    if shape.num_experts is None:
        mlp = per_mlp * h * ffn
    else:
        expert_ffn = shape.moe_ffn_hidden_size or ffn
        mlp = h * shape.num_experts + shape.num_experts * per_mlp * h * expert_ffn
    embeddings = h * shape.vocab_size * (1 if tied_embeddings else 2)
    return float(shape.num_layers * (attention + mlp) + embeddings)


def state_bytes_per_gpu(job: Job) -> float:
    """Weights, gradients, optimizer state and the reserve on one GPU (module docstring)."""
    optimizer = 12.0 / job.pool_size if job.args.use_distributed_optimizer else 12.0
    return (6.0 + optimizer) * job.model.total_params / job.model.gpus_per_rank + RESERVE_BYTES


def activation_bytes_per_token(job: Job) -> float:
    """Activation bytes one GPU keeps per token of its micro-batch (one pipeline stage)."""
    tp, h = job.model.tp, job.model.shape.hidden_size
    per_layer = 34.0 * h / tp if (tp == 1 or job.args.sequence_parallel) else (10 + 24 / tp) * h
    return job.model.layers_per_stage * per_layer


def memory_capacity(job: Job, hbm_bytes: float) -> int:
    """Tokens per HDP rank whose activations fit beside the state (0 if none fit)."""
    free = hbm_bytes - state_bytes_per_gpu(job)
    return max(0, int(free / activation_bytes_per_token(job)))


def model_shape(args: argparse.Namespace, vocab_size: int) -> ModelShape:
    """The cost model's shape of the job's model (vocabulary padded as Megatron pads it)."""
    return ModelShape(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=getattr(args, "kv_channels", None),
        ffn_hidden_size=megatron_ffn_hidden_size(args),
        vocab_size=padded_vocab_size(
            vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
        ),
        swiglu=args.swiglu,
        num_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        window=check_window(getattr(args, "window_size", None)),
        windowed_layers=sum(
            windowed_layers(
                args.num_layers,
                getattr(args, "window_size", None),
                getattr(args, "window_attn_skip_freq", None),
            )
        ),
        **mla_shape_fields(args),
    )


def tokenizer_vocab_size(args: argparse.Namespace) -> int:
    """The tokenizer's vocabulary before padding, as the job computes it."""
    if args.tokenizer_type == "NullTokenizer":
        return int(args.vocab_size) + 1  # Megatron's NullTokenizer puts EOD at vocab_size
    from megatron_hdp.data.tokenizers import build_tokenizer

    return build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model).vocab_size


def job_parser() -> argparse.ArgumentParser:
    """`pretrain_hdp.py`'s parser, printing one line (no usage) on a bad flag."""
    parser = build_parser()
    parser.prog = "python -m megatron_hdp.advise"
    parser.print_usage = lambda file=None: None  # the error line names the flag
    return parser


def with_defaults(argv: Sequence[str], steps: int) -> list[str]:
    """The job's flags plus what the advisor does not need but the parser requires."""
    argv = list(argv)
    given = {a.split("=", 1)[0] for a in argv}
    if "--train-iters" not in given:
        argv += ["--train-iters", str(steps)]
    if "--lr" not in given:
        argv += ["--lr", "1e-4"]
    return argv


def parse_job(
    argv: Sequence[str],
    *,
    gpus: int,
    steps: int,
    capacity: str,
    hbm_bytes: float,
    own_data: bool = True,
) -> Job:
    """Parse and validate the job's flags for `gpus` GPUs; ValueError naming the bad value.

    `own_data`: the batches come from the job's data flags, which are then checked as
    `pretrain_hdp.py` checks them; else (a lengths file, a mix) only the numbers, the
    layout and the tokenizer (for the vocabulary size) are.

    `capacity`: "job" (the job's own: `--hdp-capacity`, else seq-length / CP) or "memory"
    (the most tokens per rank the GPU's `hbm_bytes` hold, `memory_capacity`).
    Exits (status 2, one line) on a flag the parser refuses.
    """
    from megatron_hdp.megatron.validation import validate_args, validate_layout

    if gpus < 1:
        raise ValueError(f"--gpus {gpus}: need at least one GPU")
    args = job_parser().parse_args(with_defaults(argv, steps))
    ignored = []
    for dest, off in RUNTIME_ONLY.items():
        if getattr(args, dest) != off:
            ignored.append(f"--{dest.replace('_', '-')}")
            setattr(args, dest, off)
    if own_data:
        validate_args(args, gpus, here=False)
    else:
        validate_layout(args, gpus, here=False)
        if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        if args.tokenizer_type == "HuggingFaceTokenizer" and not args.tokenizer_model:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    shape = model_shape(args, tokenizer_vocab_size(args))
    params = total_params(shape, tied_embeddings=not args.untie_embeddings_and_output_weights)
    model = SimModel(
        name="your model",
        shape=shape,
        total_params=params,
        tp=tp,
        pp=pp,
        gpus=gpus,
        experts=args.num_experts or 1,
        top_k=args.moe_router_topk if args.num_experts else 1,
    )
    pool = gpus // (tp * pp)
    # As the job reads it (megatron.config.global_batch_tokens): --global-batch-size B is
    # B x --seq-length tokens; a --rampup-batch-size ends there, which is what is advised.
    tokens, units = args.hdp_global_batch_tokens, None
    if args.global_batch_size is not None:
        tokens = args.global_batch_size * args.seq_length
    if tokens is None:  # the job's default: one --seq-length per data-parallel rank
        tokens = (pool // args.context_parallel_size) * args.seq_length
    job = Job(
        args=args,
        model=model,
        gpus=gpus,
        pool_size=pool,
        capacity=capacity_of(args),
        capacity_source="--hdp-capacity"
        if args.hdp_capacity is not None
        else "ceil(--seq-length / --context-parallel-size)",
        context=args.seq_length,
        static_cp=0,
        tokens_per_batch=tokens,
        units_per_batch=units,
        ignored=tuple(ignored),
    )
    if capacity == "memory":
        cap = memory_capacity(job, hbm_bytes)
        if cap < 1:
            raise ValueError(
                f"--capacity memory: the model's weights and optimizer state "
                f"({state_bytes_per_gpu(job) / 1e9:.1f} GB per GPU with the reserve) leave no "
                f"room for activations in {hbm_bytes / 1e9:.0f} GB"
            )
        job = replace(job, capacity=cap, capacity_source="memory estimate")
    elif capacity != "job":
        raise ValueError(f"--capacity {capacity}: choose 'job' or 'memory'")
    if job.capacity * pool < args.seq_length:
        raise ValueError(
            f"capacity {job.capacity} x {pool} replicas = {job.capacity * pool} tokens cannot "
            f"hold --seq-length {args.seq_length}"
        )
    return replace(job, static_cp=static_cp(args.seq_length, pool, job.capacity))


def data_source(args: argparse.Namespace) -> str:
    """How the job names its data: 'data-path', 'data-spec' or 'default corpus'."""
    if args.hdp_data_spec:
        return "data-spec"
    return "data-path" if parse_data_path(args.data_path) else "default corpus"
