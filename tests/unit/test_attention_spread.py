"""Spreading attention over ranks (`scheduler/attention_spread.py`, ring sizing's last pass).

The C++ pass against its Python specification (identical results), the result against an
independent re-timing and the invariants it must keep, a hand-computed instance, and the
planner on the benchmark's Pareto-like batch of 8 ranks against its own plan without the
pass.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hdp import _planner
from megatron_hdp.scheduler import attention_spread, ring_sizing
from megatron_hdp.scheduler.attention_spread import (
    item_attention,
    spread_attention_reference,
)
from megatron_hdp.scheduler.placement import plan_balanced
from megatron_hdp.scheduler.ring_sizing import TIME_CEILING, RingCosts, step_lower_bound
from megatron_hdp.sim.distributions import BENCH_MIXES
from tests.unit.test_ring_sizing import MODEL, C, makespan

native = _planner.spread_attention


def simulate(costs, ring_offsets, ring_ranks, pool):
    """Independent re-timing: each rank's queue in the global order, a ring starts when its
    members are all at its turn (event by event, not the pass's loop)."""
    items = [
        (list(ring_ranks[ring_offsets[p] : ring_offsets[p + 1]]), costs[p])
        for p in range(len(costs))
    ]
    queues = {r: [p for p, (ring, _) in enumerate(items) if r in ring] for r in range(pool)}
    free = dict.fromkeys(range(pool), 0.0)
    starts = [None] * len(items)
    pending = set(range(len(items)))
    while pending:
        ready = [p for p in pending if all(queues[r][0] == p for r in items[p][0])]
        assert ready, "the order deadlocks"
        p = min(ready)
        starts[p] = max(free[r] for r in items[p][0])
        for r in items[p][0]:
            free[r] = starts[p] + items[p][1]
            queues[r].pop(0)
        pending.remove(p)
    return np.asarray(starts)


def loads(weights, ring_offsets, ring_ranks, pool):
    out = np.zeros(pool)
    for p in range(len(weights)):
        ring = ring_ranks[ring_offsets[p] : ring_offsets[p + 1]]
        out[ring] += weights[p] / len(ring)
    return out


@st.composite
def plans(draw):
    pool = draw(st.integers(1, 7))
    n = draw(st.integers(0, 14))
    costs, weights, offsets, ranks = [], [], [0], []
    for _ in range(n):
        width = draw(st.integers(1, pool))
        ranks += sorted(draw(st.permutations(range(pool)))[:width])
        offsets.append(len(ranks))
        costs.append(draw(st.floats(0.0, 4.0)))
        weights.append(draw(st.floats(0.0, 9.0)))
    starts = simulate(costs, offsets, ranks, pool) if n else np.zeros(0)
    end = float(np.max(starts + np.asarray(costs))) if n else 0.0
    slack = draw(st.sampled_from([0.0, 0.05, 0.3, 1.0]))
    budget = draw(st.sampled_from([0, 50, 500, 10**6]))
    return costs, offsets, ranks, weights, pool, end * (1 + slack), budget


@pytest.mark.property
@given(plans())
@settings(max_examples=300, deadline=None)
def test_cpp_pass_equals_reference_and_keeps_the_invariants(plan):
    costs, offsets, ranks, weights, pool, limit, budget = plan
    kwargs = dict(pool_size=pool, limit=limit, budget=budget)
    starts, new_ranks, work = native(costs, offsets, ranks, weights, **kwargs)
    ref = spread_attention_reference(costs, offsets, ranks, weights, **kwargs)
    assert np.array_equal(starts, ref[0]) and np.array_equal(new_ranks, ref[1])
    n = len(costs)
    assert work == ref[2] and work <= budget + n * pool * (n + 1)  # one round may pass it
    for p in range(len(costs)):  # widths kept, rings ascending and distinct
        ring = list(new_ranks[offsets[p] : offsets[p + 1]])
        assert ring == sorted(set(ring)) and len(ring) == offsets[p + 1] - offsets[p]
    if costs:
        assert np.allclose(starts, simulate(costs, offsets, list(new_ranks), pool), atol=1e-12)
        assert float(np.max(starts + np.asarray(costs))) <= limit
        before = loads(weights, offsets, ranks, pool)
        after = loads(weights, offsets, new_ranks, pool)
        assert after.max() <= before.max() * (1 + 1e-12)
        assert np.isclose(after.sum(), before.sum())


def test_a_ring_member_moves_to_the_idle_rank():
    # Rank 0 holds a ring of two with rank 1 (weight 8: 4 each) and a pack (weight 2);
    # rank 2 holds a pack (weight 1). Loads 6 / 4 / 1, mean 11/3. Moving the ring's member
    # on rank 0 to rank 2 gives 2 / 4 / 5; trading it for rank 2's pack gives 3 / 4 / 4,
    # the better move (peak 4), and the ring then starts at 0 on ranks 1 and 2.
    costs = [1.0, 1.0, 1.0]
    offsets = [0, 2, 3, 4]
    ranks = [0, 1, 0, 2]
    weights = [8.0, 2.0, 1.0]
    kwargs = dict(pool_size=3, limit=2.0, budget=10**6)
    starts, new_ranks, _ = native(costs, offsets, ranks, weights, **kwargs)
    assert list(new_ranks) == [1, 2, 0, 0]
    assert list(starts) == [0.0, 0.0, 1.0]
    assert loads(weights, offsets, new_ranks, 3).tolist() == [3.0, 4.0, 4.0]


def test_no_move_passes_the_limit():
    # The same plan ends at 2.0 (the pack on rank 0 waits for the ring), and so does every
    # plan a move makes: with the limit at 1.5 none is taken and the input comes back.
    costs, offsets, ranks, weights = [1.0, 1.0, 1.0], [0, 2, 3, 4], [0, 1, 0, 2], [8.0, 2.0, 1.0]
    kwargs = dict(pool_size=3, limit=1.5, budget=10**6)
    starts, new_ranks, work = native(costs, offsets, ranks, weights, **kwargs)
    assert list(new_ranks) == ranks and list(starts) == [0.0, 1.0, 0.0]
    assert work > 0  # moves were tried


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(ranks=[0, 3, 0, 2]), "rank 3 outside the pool"),
        (dict(ranks=[0, 0, 0, 2]), "rank 0 outside the pool or twice"),
        (dict(offsets=[0, 2, 2, 4]), "empty ring"),
        (dict(weights=[8.0, -1.0, 1.0]), "weight of item 1"),
        (dict(costs=[1.0, float("nan"), 1.0]), "cost of item 1"),
        (dict(limit=float("nan")), "limit is NaN"),
        (dict(budget=-1), "budget must be >= 0"),
        (dict(weights=[8.0, 2.0]), "differ in length"),
    ],
)
def test_bad_input_is_refused_alike(change, message):
    args = dict(
        costs=[1.0, 1.0, 1.0], offsets=[0, 2, 3, 4], ranks=[0, 1, 0, 2], weights=[8.0, 2.0, 1.0]
    )
    args.update({k: v for k, v in change.items() if k in args})
    kwargs = dict(pool_size=3, limit=change.get("limit", 2.0), budget=change.get("budget", 100))
    for run in (native, spread_attention_reference):
        with pytest.raises(ValueError, match=message):
            run(args["costs"], args["offsets"], args["ranks"], args["weights"], **kwargs)


def test_item_attention_sums_squares_per_item():
    assert item_attention([3, 4, 10], [0, 2, 3], [0, 1, 2]).tolist() == [25.0, 100.0]


def test_the_spreading_pass_evens_attention_on_the_benchmarks_pareto_batch(monkeypatch):
    # The planner benchmark's Pareto-like batch on 8 ranks: without the spreading pass the
    # plan's busiest rank holds 1.10 of the mean attention (Megatron-Core's scheduler: 1.04).
    pool = 8
    rng = np.random.default_rng([2025, pool, list(BENCH_MIXES).index("pareto_like"), 0])
    seqlens = BENCH_MIXES["pareto_like"](rng, 8 * pool * C, pool * C)
    k = np.maximum(1, np.ceil(np.asarray(seqlens) / C)).astype(np.int64)
    bound = step_lower_bound(RingCosts(seqlens, MODEL, pool, k)).value
    mean = float(np.sum(np.asarray(seqlens, dtype=np.float64) ** 2)) / pool

    def peak(plan):
        load = np.zeros(pool)
        for mb in plan.micro_batches:
            load[list(mb.ring)] += sum(seqlens[i] ** 2 for i in mb.seq_indices) / len(mb.ring)
        return load.max() / mean

    plan = plan_balanced(seqlens, pool_size=pool, capacity=C, cost_model=MODEL)
    plan.validate()
    assert makespan(plan) <= (1 + TIME_CEILING) * bound
    assert peak(plan) <= 1 + ring_sizing.SPREAD_ACCEPT
    monkeypatch.setattr(attention_spread, "SPREAD_BUDGET", 0)
    before = plan_balanced(seqlens, pool_size=pool, capacity=C, cost_model=MODEL)
    assert peak(before) > 1.05
