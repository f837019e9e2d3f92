"""What the cost model predicts for one step's plan, and which static mesh to compare (pure).

The training job records these per step in the metrics file, for its own plan and for the
plan the static `DP x CP` mesh would run on the same batch, so the end-of-run summary can
compare like with like: predicted against predicted.
"""

from __future__ import annotations

import math

import numpy as np

from megatron_hdp.scheduler.pipeline_timeline import simulate_plan
from megatron_hdp.scheduler.plan import StepPlan
from megatron_hdp.sim.timeline import timeline


def predicted_step_seconds(plan: StepPlan, pipeline_stages: int = 1) -> float:
    """When the last rank of `plan` finishes its micro-batches, by the cost model.

    Every rank runs its micro-batches in plan order with their `predicted_cost`; a ring
    starts when all its members are free (`sim.timeline`); with pipelines, Megatron's 1F1B
    on every pipeline (`pipeline_timeline.simulate_plan`). The gradient sync and the update
    are not included (they are the same for any plan of the same batch).
    """
    if pipeline_stages > 1:
        return simulate_plan(plan, pipeline_stages).step_time
    return timeline(plan).step_time


def static_mesh_cp(seq_length: int, capacity: int, pool_size: int, context_parallel: int) -> int:
    """The CP size of the static mesh that trains `seq_length`-token sequences on this pool.

    `context_parallel` (`--context-parallel-size`) if its context `CP x capacity` holds
    `seq_length`, else the smallest CP that divides the pool and does, i.e. at least
    `ceil(seq_length / capacity)`. ValueError if no CP of the pool does.
    """
    if context_parallel * capacity >= seq_length and pool_size % context_parallel == 0:
        return context_parallel
    for cp in range(max(1, math.ceil(seq_length / capacity)), pool_size + 1):
        if pool_size % cp == 0:
            return cp
    raise ValueError(
        f"no CP size dividing the pool of {pool_size} ranks gives a context of {seq_length} "
        f"tokens with capacity {capacity}"
    )


def ring_attention_bytes(
    plan: StepPlan,
    *,
    num_layers: int,
    kv_dim: int,
    kv_element_bytes: int,
    grad_element_bytes: int,
) -> int:
    """Bytes the ring attention of `plan` sends, summed over every rank (all layers).

    What `attention.ring` sends per layer on a ring whose `n` members hold tokens (a
    member without tokens skips the micro-batch) and `T` tokens in all: forward, `n - 1`
    K/V messages per member; backward, `n - 1` K/V messages and `n` dK/dV messages per
    member. Each member's K/V message at a step carries another member's tokens, so over
    the ring the K/V messages carry `2 (n - 1) T` tokens and the dK/dV messages `n T`, each
    token `2 kv_dim` values (K and V) of `kv_element_bytes` (the model's dtype) or
    `grad_element_bytes` (the accumulation dtype, float32 for 16-bit models). Local
    micro-batches send nothing. With tensor parallelism each TP rank sends its heads'
    share, so the job's total is this.
    """
    widths = plan.ring_sizes()
    rings = np.nonzero(widths > 1)[0]
    if len(rings) == 0:
        return 0
    # Every micro-batch holds >= 1 sequence, so reduceat over all of them is well formed.
    tokens = np.add.reduceat(plan.lengths[plan.seq_ids], plan.seq_offsets[:-1])[rings]
    # Zigzag sharding hands tokens out round-robin over the members (`sharding.chunk_sizes`
    # carries the remainder's offset from document to document), so min(k, T) of the k
    # members hold tokens.
    members = np.minimum(widths[rings], tokens)
    total = 0  # Python ints: exact at any size
    for n, t in zip(members.tolist(), tokens.tolist(), strict=True):
        if n >= 2:
            total += t * 2 * kv_dim * (2 * (n - 1) * kv_element_bytes + n * grad_element_bytes)
    return int(num_layers * total)
