"""The C++ balance core (`megatron_hdp._planner`) against the Python reference and invariants.

The reference `balance.balance_core` is the specification: the C++ core must return the
same placements, the same floats bit for bit and the same global order. The invariants are
checked independently of both implementations.
"""

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hdp import _planner
from megatron_hdp.scheduler import StepPlan, plan_step
from megatron_hdp.scheduler.balance import Placement, plan_from_placements
from megatron_hdp.scheduler.cost import CPU, CostModel, ModelShape, lower_bound
from megatron_hdp.scheduler.placement import plan_balanced, simple_cost
from megatron_hdp.scheduler.planner import default_core, reference_core

cpp_core = _planner.balance_core
PRIMES = (2, 3, 5, 7, 11, 13, 31, 61)
MODEL = CostModel(ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4), CPU)


def exact(placements):
    """Placements as comparable values that tell every float bit (and -0.0 from 0.0)."""
    return [(p.start.hex(), p.cost.hex(), p.ring, p.seq_indices) for p in placements]


def run_to_completion(plan: StepPlan) -> bool:
    """Simulate blocking execution: a micro-batch runs once every ring member is at it."""
    queues = [list(plan.for_rank(r)) for r in range(plan.pool_size)]
    while any(queues):
        progressed = False
        for mb in plan.micro_batches:
            if all(queues[r] and queues[r][0] is mb for r in mb.ring):
                for r in mb.ring:
                    queues[r].pop(0)
                progressed = True
        if not progressed:
            return False
    return True


@st.composite
def problems(draw, max_size=60):
    pool_size = draw(st.one_of(st.integers(1, 64), st.sampled_from(PRIMES)))
    capacity = draw(st.one_of(st.integers(1, 512), st.sampled_from([1, 2, 8, 64])))
    top = pool_size * capacity
    mix = draw(st.sampled_from(["heavy_tail", "ties", "all_short", "all_long", "mixed"]))
    if mix == "all_long" and pool_size == 1:
        mix = "all_short"
    if mix == "heavy_tail":
        short = st.integers(1, max(1, capacity // 8))
        element = st.one_of(short, short, short, short, st.integers(1, top))
    elif mix == "ties":
        element = st.sampled_from(sorted({1, max(1, capacity // 2), capacity, top}))
    elif mix == "all_short":
        element = st.integers(1, capacity)
    elif mix == "all_long":
        element = st.integers(capacity + 1, top)
    else:
        element = st.integers(1, top)
    lengths = draw(st.lists(element, min_size=0, max_size=max_size))

    # Ring sizes: the minimal count, or offloading's smaller rings (any k >= 2 for a long
    # sequence; a short one may also run on a ring).
    offload = draw(st.booleans()) and pool_size > 1
    ring_sizes = []
    for s in lengths:
        k = max(1, math.ceil(s / capacity))
        if offload:
            k = (
                draw(st.integers(2, pool_size))
                if s > capacity
                else draw(st.sampled_from([1, 1, 1, draw(st.integers(1, pool_size))]))
            )
        ring_sizes.append(k)

    costs = draw(st.sampled_from(["simple", "model", "equal", "ints", "floats"]))
    if costs == "simple":
        local = [simple_cost([s], 1, capacity) for s in lengths]
        ring = [simple_cost([s], k, capacity) for s, k in zip(lengths, ring_sizes)]
    elif costs == "model":
        local = [float(MODEL.time(float(s), 1)) for s in lengths]
        ring = [float(MODEL.time(float(s), k)) for s, k in zip(lengths, ring_sizes)]
    elif costs == "equal":
        local = [1.0] * len(lengths)
        ring = [1.0] * len(lengths)
    elif costs == "ints":
        local = [float(draw(st.integers(1, 4))) for _ in lengths]
        ring = [float(draw(st.integers(1, 4))) for _ in lengths]
    else:
        cost = st.floats(1e-3, 100.0, allow_nan=False, allow_infinity=False)
        local = [draw(cost) for _ in lengths]
        ring = [draw(cost) for _ in lengths]
    ring = [r if k > 1 else draw(st.sampled_from([0.0, r])) for r, k in zip(ring, ring_sizes)]

    typical = sum(local) / len(local) if local else 1.0
    delta = draw(
        st.one_of(
            st.sampled_from([0.0, 0.05, 0.5, 2.0]).map(lambda f: f * typical),
            st.sampled_from([0.0, 1.0, 2.0]),  # exact ties with integer costs
        )
    )
    return lengths, ring_sizes, local, ring, pool_size, capacity, delta


def plan_both(problem):
    lengths, ring_sizes, local, ring, pool_size, capacity, delta = problem
    kwargs = dict(pool_size=pool_size, capacity=capacity, delta=delta)
    ref = reference_core(lengths, ring_sizes, local, ring, **kwargs)
    got = cpp_core(lengths, ring_sizes, local, ring, **kwargs)
    return ref, got


def check_invariants(placements, problem):
    lengths, ring_sizes, local, ring, pool_size, capacity, _ = problem
    placed = sorted(i for p in placements for i in p.seq_indices)
    assert placed == list(range(len(lengths)))  # every sequence exactly once
    by_rank = [[] for _ in range(pool_size)]
    for p in placements:
        assert all(0 <= r < pool_size for r in p.ring)
        assert list(p.ring) == sorted(set(p.ring))  # distinct ranks, ascending
        if len(p.ring) == 1 and all(ring_sizes[i] == 1 for i in p.seq_indices):
            # A pack: only ring-size-1 sequences, at most `capacity` tokens, local costs.
            assert sum(lengths[i] for i in p.seq_indices) <= capacity
            assert math.isclose(p.cost, math.fsum(local[i] for i in p.seq_indices))
        else:
            (i,) = p.seq_indices  # a ring item holds its one sequence on exactly k ranks
            assert ring_sizes[i] > 1 and len(p.ring) == ring_sizes[i]
            assert p.cost == ring[i]
        for r in p.ring:  # one start shared by all members
            by_rank[r].append((p.start, p.cost))
    for intervals in by_rank:
        # In the returned (global) order each rank's starts increase, and its intervals
        # [start, start + cost) do not overlap (up to the rounding of start + cost).
        assert intervals == sorted(intervals, key=lambda x: x[0])
        for (s0, c0), (s1, _) in zip(intervals, intervals[1:]):
            end = s0 + c0
            assert s1 >= end - 1e-9 * max(1.0, abs(end))
    if lengths:
        makespan = max(p.start + p.cost for p in placements)
        bound = lower_bound(ring_sizes, local, ring, pool_size)
        assert makespan >= bound * (1 - 1e-9)
    plan = plan_from_placements(
        placements, lengths, pool_size=pool_size, capacity=capacity, policy="balanced"
    )
    assert run_to_completion(plan)  # deadlock freedom under blocking execution


@given(problems())
@settings(max_examples=250, deadline=None)
def test_cpp_core_equals_reference_and_keeps_the_invariants(problem):
    ref, got = plan_both(problem)
    assert got == ref
    assert exact(got) == exact(ref)
    for p in got:
        assert type(p) is Placement
        assert type(p.start) is float and type(p.cost) is float
        assert type(p.ring) is tuple and all(type(r) is int for r in p.ring)
        assert type(p.seq_indices) is tuple and all(type(i) is int for i in p.seq_indices)
    check_invariants(got, problem)


@pytest.mark.parametrize("seed, pool_size, capacity", [(0, 61, 4096), (1, 64, 1000), (2, 7, 9)])
def test_cpp_core_equals_reference_on_larger_batches(seed, pool_size, capacity):
    rng = np.random.default_rng(seed)
    n = 3000
    lengths = np.minimum(rng.pareto(1.2, n) * capacity / 4 + 1, pool_size * capacity)
    lengths = lengths.astype(np.int64).tolist()
    k, local, ring = MODEL.cost_arrays(lengths, capacity)
    for delta in (0.0, float(np.median(local))):
        problem = (lengths, k.tolist(), local.tolist(), ring.tolist(), pool_size, capacity, delta)
        ref, got = plan_both(problem)
        assert exact(got) == exact(ref)
    # numpy arrays are accepted as well
    got_np = cpp_core(lengths, k, local, ring, pool_size=pool_size, capacity=capacity)
    ref_np = reference_core(lengths, k, local, ring, pool_size=pool_size, capacity=capacity)
    assert got_np == ref_np


def test_keywords_defaults_and_empty_batch():
    args = dict(lengths=[3, 9, 2], ring_sizes=[1, 2, 1], local_cost=[1.0, 5.0, 1.0])
    args["ring_cost"] = [0.0, 2.5, 0.0]
    got = cpp_core(**args, pool_size=2, capacity=4)
    assert got == reference_core(**args, pool_size=2, capacity=4, delta=0.0)
    assert got[0] == Placement(start=0.0, cost=2.5, ring=(0, 1), seq_indices=(1,))
    with pytest.raises(TypeError):
        cpp_core([1], [1], [1.0], [0.0], 1, 4)  # pool_size and capacity are keyword-only
    assert cpp_core([], [], [], [], pool_size=3, capacity=4) == []


@pytest.mark.parametrize(
    "delta, expected",
    [
        (0.0, [(0.0, (0,), (0,)), (0.0, (1,), (2,)), (2.0, (1,), (3,)), (3.0, (0, 1), (1,))]),
        (1.0, [(0.0, (0,), (0,)), (0.0, (1,), (2,)), (3.0, (0, 1), (1,)), (5.0, (0,), (3,))]),
        (3.0, [(0.0, (0,), (0,)), (3.0, (0, 1), (1,)), (5.0, (0,), (2,)), (5.0, (1,), (3,))]),
    ],
)
def test_gap_backfill_by_hand(delta, expected):
    # Rank 0 runs a 3.0 pack; the ring of ranks 0-1 then waits for it, so rank 1 idles
    # [0, 3). The 2.0 pack back-fills that gap unless it is within delta; the 1.0 pack
    # takes the rest [2, 3) unless that is within delta.
    lengths, ring_sizes = [3, 8, 3, 3], [1, 2, 1, 1]
    local, ring = [3.0, 0.0, 2.0, 1.0], [0.0, 2.0, 0.0, 0.0]
    kwargs = dict(pool_size=2, capacity=4, delta=delta)
    got = cpp_core(lengths, ring_sizes, local, ring, **kwargs)
    assert exact(got) == exact(reference_core(lengths, ring_sizes, local, ring, **kwargs))
    assert [(p.start, p.ring, p.seq_indices) for p in got] == expected


@pytest.mark.parametrize(
    "lengths, ring_sizes, local, ring, pool_size, capacity, message",
    [
        ([1, 2], [1], [1.0, 1.0], [0.0, 0.0], 2, 4, "equal lengths, got 2, 1, 2, 2"),
        ([1], [0], [1.0], [0.0], 2, 4, "sequence 0 has ring size 0, outside \\[1, pool_size=2\\]"),
        ([9], [3], [1.0], [1.0], 2, 4, "ring size 3, outside"),
        ([1, 5], [1, 1], [1.0, 1.0], [0.0, 0.0], 2, 4, "sequence 1 has ring size 1 but 5 tokens"),
        ([1], [1], [1.0], [0.0], 2, 0, "capacity .* must be > 0, got 0"),
        ([1], [1], [1.0], [0.0], 0, 4, "pool_size must be >= 1, got 0"),
        ([-1], [1], [1.0], [0.0], 2, 4, "negative length"),
        ([1], [1], [math.nan], [0.0], 2, 4, "non-finite local_cost"),
        ([9], [3], [1.0], [math.inf], 3, 4, "non-finite ring_cost"),
    ],
)
def test_bad_input_raises_value_error(
    lengths, ring_sizes, local, ring, pool_size, capacity, message
):
    with pytest.raises(ValueError, match=message):
        cpp_core(lengths, ring_sizes, local, ring, pool_size=pool_size, capacity=capacity)


def test_concurrent_calls_from_threads_agree():
    problem = ([5, 40, 17, 3, 3, 16] * 50, None, None, None, 5, 16, 0.0)
    lengths = problem[0]
    k = [max(1, math.ceil(s / 16)) for s in lengths]
    local = [simple_cost([s], 1, 16) for s in lengths]
    ring = [simple_cost([s], kk, 16) for s, kk in zip(lengths, k)]
    expected = reference_core(lengths, k, local, ring, pool_size=5, capacity=16)
    barrier = threading.Barrier(2)

    def run(_):
        barrier.wait()
        return cpp_core(lengths, k, local, ring, pool_size=5, capacity=16)

    with ThreadPoolExecutor(2) as pool:
        assert all(out == expected for out in pool.map(run, range(2)))


def test_default_core_is_the_extension_and_balanced_policy_plans_with_it():
    assert default_core() is cpp_core
    lengths, pool_size, capacity = [5, 40, 17, 3, 3, 16, 64, 1], 7, 16
    for cost_model in (None, MODEL):
        plan = plan_step(
            lengths,
            pool_size=pool_size,
            capacity=capacity,
            policy="balanced",
            cost_model=cost_model,
        )
        assert plan.policy == "balanced"
        plan.validate(pool_size=pool_size)
        assert run_to_completion(plan)
        expected = plan_balanced(
            lengths,
            pool_size=pool_size,
            capacity=capacity,
            cost_model=cost_model,
            core=reference_core,
        )
        assert plan == expected
