"""Summary statistics of a `StepPlan`, for logs and benchmarks (pure)."""

from __future__ import annotations

import numpy as np

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
    widths = plan.ring_sizes()
    counts = np.diff(plan.seq_offsets)
    sizes = np.zeros(len(plan.lengths), dtype=np.int64)
    sizes[plan.seq_ids] = np.repeat(widths, counts)
    tokens = plan.total_tokens()
    member_cost = np.repeat(plan.predicted_cost, widths)
    loads = np.bincount(plan.ring_ranks, weights=member_cost, minlength=plan.pool_size)
    mean_load = float(loads.sum()) / plan.pool_size
    per_rank = plan.num_micro_batches_per_rank()
    return {
        "num_sequences": len(plan.lengths),
        "num_tokens": tokens,
        "max_ranks_per_sequence": int(sizes.max()),
        "mean_ranks_per_sequence": float(sizes.mean()),
        "token_weighted_ranks_per_sequence": float((sizes * plan.lengths).sum()) / tokens,
        "micro_batches_per_rank_min": min(per_rank),
        "micro_batches_per_rank_max": max(per_rank),
        "predicted_imbalance": float(loads.max()) / mean_load if mean_load > 0 else 1.0,
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
