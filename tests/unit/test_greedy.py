"""The array-form greedy placement gives exactly the plans of the first, per-object one.

`reference_plan_greedy` and `reference_best_fit_decreasing` below are the implementations
`plan_step(policy="greedy")` ran before (placement.py and balance.py at 7d40960), kept as
the specification; the new `scheduler.greedy` must equal them column for column (costs
bit for bit) on random batches, with both known cost functions and an unknown one.
"""

import bisect
import heapq
import math

import numpy as np
import pytest

from megatron_hdp.scheduler import plan_step
from megatron_hdp.scheduler.cost import CPU, H100, CostModel, ModelShape
from megatron_hdp.scheduler.greedy import best_fit_decreasing, plan_greedy
from megatron_hdp.scheduler.plan import MicroBatch, plan_from_rank_lists, validate_inputs
from megatron_hdp.scheduler.static_mesh import simple_cost

LLAMA7B = ModelShape(num_layers=32, hidden_size=4096, num_attention_heads=32, vocab_size=32000)


def reference_best_fit_decreasing(lengths, indices, capacity):
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    bins, rooms = [], []
    for i in order:
        size = lengths[i]
        pos = bisect.bisect_left(rooms, (size, -1))
        if pos == len(rooms):
            bins.append([i])
            bisect.insort(rooms, (capacity - size, len(bins) - 1))
        else:
            room, b = rooms.pop(pos)
            bins[b].append(i)
            bisect.insort(rooms, (room - size, b))
    return bins


def reference_plan_greedy(
    seqlens, *, pool_size, capacity, cost=simple_cost, ring_sizes=None, offload_ratios=None,
    num_layers=0, policy="greedy",
):  # fmt: skip
    validate_inputs(seqlens, pool_size, capacity)
    if ring_sizes is None:
        ring_sizes = [math.ceil(s / capacity) for s in seqlens]
    loads = [(0.0, r) for r in range(pool_size)]
    micro_batches = []
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
    packs = reference_best_fit_decreasing(seqlens, short, capacity)
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


def random_batch(rng):
    pool = int(rng.integers(1, 40))
    capacity = int(rng.choice([1, 7, 64, 1000, 8192]))
    n = int(rng.integers(1, 400))
    if rng.random() < 0.5:  # many short ones, lots of equal lengths and ties
        lengths = rng.integers(1, max(2, capacity // 3), size=n)
    else:  # a heavy tail up to the pool's limit
        lengths = np.minimum(pool * capacity, 1 + rng.pareto(1.2, size=n) * capacity / 4)
    return [int(s) for s in lengths], pool, capacity


def costs():
    h100 = CostModel(LLAMA7B, H100)
    return {
        "simple": simple_cost,
        "h100": h100.planner_cost,
        "cpu": CostModel(LLAMA7B, CPU).planner_cost,
        "other": lambda lengths, k, capacity: (max(lengths) + 0.5 * len(lengths)) / k,
    }


@pytest.mark.parametrize("name", ["simple", "h100", "cpu", "other"])
def test_greedy_equals_the_old_greedy_on_random_batches(name):
    cost = costs()[name]
    rng = np.random.default_rng(45)
    for _ in range(60):
        lengths, pool, capacity = random_batch(rng)
        new = plan_greedy(lengths, pool_size=pool, capacity=capacity, cost=cost)
        old = reference_plan_greedy(lengths, pool_size=pool, capacity=capacity, cost=cost)
        assert new == old, (lengths, pool, capacity)
        new.validate(pool_size=pool)


def test_greedy_with_given_ring_sizes_and_offload_ratios_equals_the_old():
    """As the simulator calls it (`sim.simulate`): ring sizes and ratios given."""
    model = CostModel(LLAMA7B, H100)
    rng = np.random.default_rng(8)
    for _ in range(40):
        lengths, pool, capacity = random_batch(rng)
        minimal = [math.ceil(s / capacity) for s in lengths]
        ring_sizes = [min(pool, k + int(rng.integers(0, 3))) if k > 1 else k for k in minimal]
        ratios = rng.random(len(lengths)).tolist()
        kw = dict(pool_size=pool, capacity=capacity, cost=model.planner_cost)
        kw.update(ring_sizes=ring_sizes, offload_ratios=ratios, num_layers=32, policy="x")
        assert plan_greedy(lengths, **kw) == reference_plan_greedy(lengths, **kw)


def test_plan_step_greedy_equals_the_old_greedy_on_a_large_batch():
    """A 4,096-rank batch with thousands of bins (the old packing's quadratic case)."""
    rng = np.random.default_rng(3)
    pool, capacity = 4096, 8192
    lengths = [int(s) for s in np.minimum(pool * capacity, rng.lognormal(7.5, 1.6, 30000) + 1)]
    for cost_model in (None, CostModel(LLAMA7B, H100)):
        cost = simple_cost if cost_model is None else cost_model.planner_cost
        new = plan_step(
            lengths, pool_size=pool, capacity=capacity, policy="greedy", cost_model=cost_model
        )
        old = reference_plan_greedy(lengths, pool_size=pool, capacity=capacity, cost=cost)
        assert new == old


def test_best_fit_decreasing_equals_the_old_packing():
    rng = np.random.default_rng(11)
    for _ in range(200):
        capacity = int(rng.integers(1, 3000))
        lengths = rng.integers(1, capacity + 1, size=int(rng.integers(0, 3000))).tolist()
        indices = [i for i in range(len(lengths)) if rng.random() < 0.9]
        got = best_fit_decreasing(lengths, indices, capacity)
        assert got == reference_best_fit_decreasing(lengths, indices, capacity)
