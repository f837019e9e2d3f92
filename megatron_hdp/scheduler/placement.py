"""Placement policies: turn the lengths of a global batch into a `StepPlan` (pure Python).

Two policies live here:
- `"greedy"` (HDP): a sequence of at most `capacity` tokens goes whole to one rank, packed
  best-fit with other short ones; a longer sequence gets a ring of `ceil(s / capacity)`
  ranks (any integer, any ranks). Rings are placed first, longest first, on the least
  loaded ranks; packs follow, heaviest first, each on the least loaded rank.
- `"static"` (the baseline mesh): `pool_size = dp * cp`; sequences are packed best-fit up
  to the context `cp * capacity`, and every pack is sharded over one fixed, contiguous CP
  group; packs go round robin over the DP groups, as Megatron's static mesh does.

- `"balanced"` (HDP): ByteScale's balance scheduler (`balance.py`): the same rings and
  packs, placed by predicted cost so that all ranks reach the gradient sync together.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

import numpy as np

from megatron_hdp.scheduler.balance import best_fit_decreasing, plan_from_placements
from megatron_hdp.scheduler.offload_rule import planned_offload
from megatron_hdp.scheduler.plan import MicroBatch, StepPlan, plan_from_rank_lists, validate_inputs

POLICIES = ("greedy", "balanced", "static")

#: Cost of one micro-batch for one ring member: f(lengths, cp_size, capacity) -> float.
CostFn = Callable[[Sequence[int], int, int], float]


def simple_cost(lengths: Sequence[int], cp_size: int, capacity: int) -> float:
    """Per-member cost: linear work plus causal attention, in units of one token's linear work.

    The attention term `s^2 / (2 * capacity)` makes a full-capacity sequence cost 1.5x its
    tokens. A stand-in until the calibrated cost model arrives; only relative values matter.
    """
    return sum(s + s * s / (2.0 * capacity) for s in lengths) / cp_size


def plan_greedy(
    seqlens: Sequence[int],
    *,
    pool_size: int,
    capacity: int,
    cost: CostFn = simple_cost,
    ring_sizes: Sequence[int] | None = None,
    offload_ratios: Sequence[float] | None = None,
    num_layers: int = 0,
    policy: str = "greedy",
) -> StepPlan:
    """HDP placement: rings of `ceil(s / capacity)` ranks for long sequences, packs for short.

    Rings go first, longest first, each on the `k` least-loaded ranks (ties: lower rank);
    packs (best-fit decreasing) follow, heaviest first, each on the least-loaded rank.
    `ring_sizes` overrides the rank count of every sequence (1 = packed), e.g. with the
    offload rule's counts and `offload_ratios`; `num_layers` then goes into the plan for its
    memory check. `policy` names the result.
    """
    validate_inputs(seqlens, pool_size, capacity)
    if ring_sizes is None:
        ring_sizes = [math.ceil(s / capacity) for s in seqlens]
    loads = [(0.0, r) for r in range(pool_size)]  # heap of (load, rank)
    micro_batches: list[MicroBatch] = []
    long_ids = sorted(
        (i for i in range(len(seqlens)) if ring_sizes[i] > 1), key=lambda i: (-seqlens[i], i)
    )
    for i in long_ids:
        k = int(ring_sizes[i])
        members = [heapq.heappop(loads) for _ in range(k)]
        c = cost([seqlens[i]], k, capacity)
        for load, r in members:
            heapq.heappush(loads, (load + c, r))
        micro_batches.append(
            MicroBatch(
                order=len(micro_batches),
                ring=tuple(sorted(r for _, r in members)),
                seq_indices=(i,),
                predicted_cost=c,
                offload_ratio=0.0 if offload_ratios is None else float(offload_ratios[i]),
            )
        )
    short = [i for i in range(len(seqlens)) if ring_sizes[i] <= 1]
    packs = best_fit_decreasing(seqlens, short, capacity)
    costed = [(cost([seqlens[i] for i in p], 1, capacity), n, p) for n, p in enumerate(packs)]
    for c, _, pack in sorted(costed, key=lambda x: (-x[0], x[1])):
        load, rank = heapq.heappop(loads)
        heapq.heappush(loads, (load + c, rank))
        micro_batches.append(
            MicroBatch(
                order=len(micro_batches), ring=(rank,), seq_indices=tuple(pack), predicted_cost=c
            )
        )
    return plan_from_rank_lists(
        seqlens, pool_size, capacity, policy, micro_batches, num_layers=num_layers
    )


def static_cp_size(seqlens: Sequence[int], pool_size: int, capacity: int) -> int:
    """Smallest CP size that divides the pool and whose context holds the longest sequence."""
    longest = max(seqlens)
    for cp in range(1, pool_size + 1):
        if pool_size % cp == 0 and cp * capacity >= longest:
            return cp
    raise ValueError(
        f"no CP size dividing the pool of {pool_size} ranks gives a context of at least "
        f"{longest} tokens with capacity {capacity}"
    )


def plan_static(
    seqlens: Sequence[int],
    *,
    pool_size: int,
    capacity: int,
    cp_size: int | None = None,
    cost: CostFn = simple_cost,
) -> StepPlan:
    """The static DP x CP mesh: pack to the context `cp * capacity`, shard every pack over CP."""
    validate_inputs(seqlens, pool_size, capacity)
    if cp_size is None:
        cp_size = static_cp_size(seqlens, pool_size, capacity)
    if cp_size < 1 or pool_size % cp_size != 0:
        raise ValueError(f"cp_size {cp_size} does not divide the pool of {pool_size} ranks")
    context = cp_size * capacity
    longest = max(range(len(seqlens)), key=lambda i: seqlens[i])
    if seqlens[longest] > context:
        raise ValueError(
            f"sequence {longest} has {seqlens[longest]} tokens, more than the static context "
            f"cp_size {cp_size} x capacity {capacity} = {context}"
        )
    dp_size = pool_size // cp_size
    packs = best_fit_decreasing(seqlens, range(len(seqlens)), context)
    micro_batches = []
    for n, pack in enumerate(packs):
        group = n % dp_size
        ring = tuple(range(group * cp_size, (group + 1) * cp_size))
        c = cost([seqlens[i] for i in pack], cp_size, capacity)
        micro_batches.append(
            MicroBatch(order=n, ring=ring, seq_indices=tuple(pack), predicted_cost=c)
        )
    return plan_from_rank_lists(seqlens, pool_size, capacity, "static", micro_batches)


def plan_balanced(
    seqlens: Sequence[int],
    *,
    pool_size: int,
    capacity: int,
    cost_model=None,
    delta: float = 0.0,
    core=None,
    offload: bool = False,
) -> StepPlan:
    """HDP with the balance scheduler; costs from `cost_model` (a `cost.CostModel`).

    Without a cost model the costs are `simple_cost`'s. `core` is the placement core with
    `balance.balance_core`'s signature (the C++ core by default). With `offload`, long
    sequences get the smaller rings and offload ratios of `offload_rule` (needs a cost
    model); the plan then records the model's layer count for its memory check.
    """
    validate_inputs(seqlens, pool_size, capacity)
    ratios = None
    if offload:
        if cost_model is None:
            raise ValueError("offloading needs a cost model (bandwidths and activation sizes)")
        ring_sizes, ratios = planned_offload(
            seqlens, pool_size=pool_size, capacity=capacity, cost_model=cost_model
        )
        ring_sizes, local, ring = cost_model.cost_arrays(seqlens, capacity, ring_sizes=ring_sizes)
    elif cost_model is not None:
        ring_sizes, local, ring = cost_model.cost_arrays(seqlens, capacity)
    else:
        ring_sizes = [max(1, math.ceil(s / capacity)) for s in seqlens]
        local = [simple_cost([s], 1, capacity) for s in seqlens]
        ring = [
            simple_cost([s], k, capacity) if k > 1 else 0.0
            for s, k in zip(seqlens, ring_sizes, strict=True)
        ]
    if core is None:
        from megatron_hdp.scheduler.planner import default_core

        core = default_core()
    placements = core(
        np.asarray(seqlens, dtype=np.int64),
        ring_sizes,
        local,
        ring,
        pool_size=pool_size,
        capacity=capacity,
        delta=delta,
    )
    return plan_from_placements(
        placements,
        seqlens,
        pool_size=pool_size,
        capacity=capacity,
        policy="balanced",
        offload_ratios=ratios,
        num_layers=cost_model.model.num_layers if offload else 0,
    )


def plan_step(
    seqlens: Sequence[int],
    *,
    pool_size: int,
    capacity: int,
    policy: str = "greedy",
    cp_size: int | None = None,
    cost_model=None,
    offload: bool = False,
) -> StepPlan:
    """Plan one step with the named policy (`"greedy"`, `"balanced"` or the `"static"` mesh).

    Deterministic: equal inputs give equal plans on every rank. Raises ValueError for bad
    input before anything else happens. The policies' invariants are held by property
    tests, not re-checked here (`StepPlan.validate()` does that, at O(plan) Python cost).
    `cp_size` applies to the static policy only; `cost_model` (a `cost.CostModel`) prices
    micro-batches for the balanced policy and fills every policy's `predicted_cost`;
    `offload` applies the selective-offloading capacity rule (balanced policy only).
    """
    if offload and policy != "balanced":
        raise ValueError(f"offloading is planned by the balanced policy, not {policy!r}")
    if policy != "static" and cp_size is not None:
        raise ValueError(f"cp_size {cp_size} applies to the static policy only, not {policy!r}")
    cost = cost_model.planner_cost if cost_model is not None else simple_cost
    if policy == "greedy":
        plan = plan_greedy(seqlens, pool_size=pool_size, capacity=capacity, cost=cost)
    elif policy == "balanced":
        plan = plan_balanced(
            seqlens, pool_size=pool_size, capacity=capacity, cost_model=cost_model, offload=offload
        )
    elif policy == "static":
        plan = plan_static(
            seqlens, pool_size=pool_size, capacity=capacity, cp_size=cp_size, cost=cost
        )
    else:
        raise ValueError(f"unknown placement policy {policy!r}; choose one of {POLICIES}")
    return plan
