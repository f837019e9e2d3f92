"""Summary statistics of a `StepPlan`, for logs and benchmarks (pure)."""

from __future__ import annotations

from megatron_hdp.scheduler.offload_rule import resident_fraction
from megatron_hdp.scheduler.plan import StepPlan
from megatron_hdp.sharding import rank_token_counts


def plan_statistics(plan: StepPlan) -> dict:
    """Ranks per sequence, micro-batches per rank and the predicted imbalance of a plan.

    Keys: `num_sequences`, `num_tokens`, `max_ranks_per_sequence`,
    `mean_ranks_per_sequence`, `token_weighted_ranks_per_sequence`,
    `micro_batches_per_rank_min` / `_max`, and `predicted_imbalance` (the most loaded
    rank's predicted cost over the mean; 1.0 is perfect balance).
    """
    ring_of = {}
    for mb in plan.micro_batches:
        for i in mb.seq_indices:
            ring_of[i] = mb.cp_size
    sizes = [ring_of[i] for i in range(len(plan.seqlens))]
    tokens = plan.total_tokens()
    loads = [0.0] * plan.pool_size
    for mb in plan.micro_batches:
        for r in mb.ring:
            loads[r] += mb.predicted_cost
    mean_load = sum(loads) / plan.pool_size
    counts = plan.num_micro_batches_per_rank()
    return {
        "num_sequences": len(plan.seqlens),
        "num_tokens": tokens,
        "max_ranks_per_sequence": max(sizes),
        "mean_ranks_per_sequence": sum(sizes) / len(sizes),
        "token_weighted_ranks_per_sequence": sum(
            s * n for s, n in zip(sizes, plan.seqlens, strict=True)
        )
        / tokens,
        "micro_batches_per_rank_min": min(counts),
        "micro_batches_per_rank_max": max(counts),
        "predicted_imbalance": max(loads) / mean_load if mean_load > 0 else 1.0,
    }


def predicted_activation_bytes(plan: StepPlan, bytes_per_token: float) -> list[float]:
    """Each rank's predicted peak of resident saved-activation bytes.

    A rank runs its micro-batches one after another, so its peak is the largest of them:
    the tokens it holds times `bytes_per_token` (all layers, e.g.
    `CostModel.activation_bytes_per_token()`), times the resident share left by the
    micro-batch's offload ratio (`(2 + (1 - r)(l - 2)) / l`).
    """
    peaks = [0.0] * plan.pool_size
    for mb in plan.micro_batches:
        counts = rank_token_counts([plan.seqlens[i] for i in mb.seq_indices], mb.cp_size)
        share = 1.0
        if mb.offload_ratio > 0:
            share = float(resident_fraction(mb.offload_ratio, plan.num_layers))
        for position, rank in enumerate(mb.ring):
            peaks[rank] = max(peaks[rank], counts[position] * bytes_per_token * share)
    return peaks
