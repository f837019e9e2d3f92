"""Mixture-of-experts flags of Megatron-LM under `--hdp`: what runs, what is refused (host layer).

Megatron-LM's MoE flags keep their meaning with `--hdp`, with three HDP rules that make every
layout give the loss and gradients of single-process training (`megatron.moe`):

- the load-balancing loss (`--moe-router-load-balancing-type aux_loss`) is computed per
  sequence and weighted by its share of the global batch's tokens, the z-loss
  (`--moe-z-loss-coeff`) is the mean over the global batch's tokens (Megatron takes both per
  micro-batch, and HDP's micro-batches differ per layout);
- the expert-bias counts (`--moe-router-enable-expert-bias`) leave HDP's pad tokens out;
- experts are parallel inside one replica (`--expert-model-parallel-size` x
  `--expert-tensor-parallel-size` = `--tensor-model-parallel-size`), or across replicas
  with TP 1 and expert TP 1: replicas run different numbers of micro-batches, and rings at
  different positions, so the drop-in's schedule pads each EP group's micro-batches to lock
  step for the dispatcher's all-to-all (`megatron.ep_lockstep`).

`moe_refusals(args)` names every MoE flag of a launch that cannot be made exact (or is not
wired), with the reason; `args.check_args` adds them to the launch's one message. Imports
neither torch nor Megatron.
"""

from __future__ import annotations

import argparse

#: Load-balancing types that run: HDP's per-sequence aux losses (`aux_loss`, and Megatron's
#: `seq_aux_loss` with each document a sequence), or none.
BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")

#: (dest, refused(value), why): MoE flags HDP cannot make exact or has not wired, refused
#: when set. Dests missing from a Megatron-LM release are skipped.
_REFUSED = (
    (
        "moe_grouped_gemm",
        bool,
        "--moe-grouped-gemm: HDP runs Megatron's SequentialMLP experts, initialised by global "
        "expert index so that every --expert-model-parallel-size gives the same model; "
        "GroupedMLP / TEGroupedMLP (grouped_gemm or Transformer Engine, GPU-only) are not "
        "wired with --hdp: drop the flag",
    ),
    (
        "moe_expert_capacity_factor",
        lambda v: v is not None,
        "--moe-expert-capacity-factor: Megatron drops the tokens over an expert's capacity per "
        "micro-batch, and HDP's micro-batches differ per layout (the dropped tokens would too)",
    ),
    (
        "moe_expert_rank_capacity_factor",
        lambda v: v is not None,
        "--moe-expert-rank-capacity-factor: capacity is per micro-batch, whose tokens differ "
        "per HDP layout",
    ),
    (
        "moe_pad_expert_input_to_capacity",
        bool,
        "--moe-pad-expert-input-to-capacity: needs --moe-expert-capacity-factor (refused)",
    ),
    (
        "moe_token_dispatcher_type",
        lambda v: v not in (None, "allgather", "alltoall"),
        "--moe-token-dispatcher-type flex: DeepEP / HybridEP dispatch is GPU-only and not wired "
        "with --hdp; use alltoall or allgather",
    ),
    (
        "moe_enable_deepep",
        bool,
        "--moe-enable-deepep: DeepEP (flex dispatch) is not wired with --hdp",
    ),
    (
        "overlap_moe_expert_parallel_comm",
        bool,
        "--overlap-moe-expert-parallel-comm: Megatron's combined 1F1B schedule is replaced by "
        "HDP's schedule",
    ),
    (
        "moe_input_jitter_eps",
        lambda v: v is not None,
        "--moe-input-jitter-eps: the jitter is drawn per micro-batch shape, which differs per "
        "HDP layout",
    ),
    (
        "moe_router_force_biased",
        lambda v: v is not None,
        "--moe-router-force-biased: random routing for benchmarks, drawn per micro-batch",
    ),
    ("moe_use_upcycling", bool, "--moe-use-upcycling: not supported with --hdp"),
    ("moe_latent_size", lambda v: v is not None, "--moe-latent-size: not supported with --hdp yet"),
    (
        "moe_enable_routing_replay",
        bool,
        "--moe-enable-routing-replay: not supported with --hdp",
    ),
)


def _types(value) -> list[str]:
    """`--moe-router-load-balancing-type` as a list (Megatron takes one type or several)."""
    return [value] if isinstance(value, str) else list(value or [])


def aux_loss_coeff(args: argparse.Namespace) -> float:
    """The coefficient of the `aux_loss` balancing type (0 without it), as Megatron pairs them."""
    types, coeffs = _types(args.moe_router_load_balancing_type), args.moe_aux_loss_coeff
    if "aux_loss" not in types:
        return 0.0
    if isinstance(coeffs, (list, tuple)):
        return float(coeffs[types.index("aux_loss")]) if len(coeffs) == len(types) else 0.0
    return float(coeffs)


def moe_fields(args: argparse.Namespace) -> dict:
    """GPTConfig's MoE fields from Megatron-LM's arguments (none for a dense model)."""
    if getattr(args, "num_experts", None) is None:
        return {}
    return {
        "num_experts": args.num_experts,
        "moe_router_topk": args.moe_router_topk,
        "moe_ffn_hidden_size": args.moe_ffn_hidden_size,
        "moe_aux_loss_coeff": aux_loss_coeff(args),
        "expert_model_parallel_size": args.expert_model_parallel_size,
        "experts_across_replicas": (
            args.tensor_model_parallel_size == 1 and args.expert_model_parallel_size > 1
        ),
        "moe_token_dispatcher_type": args.moe_token_dispatcher_type,
    }


def moe_layer_pattern(args: argparse.Namespace) -> list[int]:
    """1 for each layer with experts, 0 for a dense one (`--moe-layer-freq`, Megatron's way)."""
    freq = getattr(args, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(args.num_layers)]
    pattern = [int(v) for v in freq]
    if len(pattern) != args.num_layers:
        raise ValueError(
            f"--moe-layer-freq has {len(pattern)} entries for --num-layers {args.num_layers}"
        )
    return pattern


def moe_refusals(args: argparse.Namespace) -> list[str]:
    """Every MoE flag of this `--hdp` launch HDP cannot run exactly, one phrase each.

    Runs before Megatron-LM's `validate_args` (its defaults, e.g. the expert TP size, are not
    filled in yet). Nothing without `--num-experts`.
    """
    if getattr(args, "num_experts", None) is None:
        return []
    problems = [
        message
        for dest, refused, message in _REFUSED
        if dest in args and refused(getattr(args, dest))
    ]
    types = _types(args.moe_router_load_balancing_type)
    others = [t for t in types if t not in BALANCING_TYPES]
    if others:
        problems.append(
            f"--moe-router-load-balancing-type {' '.join(others)}: HDP computes the aux loss "
            "per sequence over the global batch ('aux_loss', 'seq_aux_loss'; 'none' for "
            "none); Megatron's other types depend on which sequences share a micro-batch, "
            "which differs per HDP layout"
        )
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp  # Megatron-LM's default: TP
    dispatcher = getattr(args, "moe_token_dispatcher_type", None) or "allgather"
    if tp == 1 and ep > 1 and dispatcher == "allgather":
        problems.append(
            f"--moe-token-dispatcher-type allgather with --expert-model-parallel-size {ep} "
            "across replicas: its all-gather needs equally many tokens on every EP rank, and "
            "HDP's micro-batches differ per rank; give --moe-token-dispatcher-type alltoall"
        )
    if ep * etp != tp and not (tp == 1 and etp == 1):
        problems.append(
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} must "
            f"equal --tensor-model-parallel-size {tp} with --hdp (experts inside one "
            "replica), or TP and expert TP must be 1 (experts across replicas: each EP group "
            "pads its micro-batches to lock step, `megatron.ep_lockstep`); an expert grid "
            "spanning TP ranks and replicas at once is not built"
            + (f"; give --expert-tensor-parallel-size {tp // ep}" if tp % ep == 0 else "")
        )
    return problems
