"""The C++ balance core (`megatron_hdp._planner`) against the Python reference and invariants.

The reference `balance.balance_core` is the specification: the C++ core must return the
same placements, the same floats bit for bit and the same global order. The invariants are
checked independently of both implementations.
"""

import gc
import math
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hdp import _planner
from megatron_hdp.scheduler import plan_step
from megatron_hdp.scheduler.balance import Placement, plan_from_placements
from megatron_hdp.scheduler.cost import CPU, H100, CostModel, ModelShape, lower_bound
from megatron_hdp.scheduler.placement import plan_balanced, simple_cost
from megatron_hdp.scheduler.planner import default_core, reference_core
from tests.plan_checks import run_to_completion
from tests.property import examples

cpp_core = _planner.balance_core
cpp_arrays = _planner.balance_core_arrays
PRIMES = (2, 3, 5, 7, 11, 13, 31, 61)
MODEL = CostModel(ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4), CPU)


def exact(placements):
    """Placements as comparable values that tell every float bit (and -0.0 from 0.0)."""
    return [(p.start.hex(), p.cost.hex(), p.ring, p.seq_indices) for p in placements]


def placements_from_arrays(arrays):
    """balance_core_arrays' flat arrays as Placement objects, checking their layout."""
    starts, costs, ring_offsets, ring_ranks, seq_offsets, seq_indices = arrays
    m = len(starts)
    assert starts.dtype == costs.dtype == np.float64
    for a in (ring_offsets, ring_ranks, seq_offsets, seq_indices):
        assert a.dtype == np.int64 and a.ndim == 1
    assert len(costs) == m and len(ring_offsets) == len(seq_offsets) == m + 1
    assert ring_offsets[0] == seq_offsets[0] == 0
    assert ring_offsets[-1] == len(ring_ranks) and seq_offsets[-1] == len(seq_indices)
    return [
        Placement(
            float(starts[p]),
            float(costs[p]),
            tuple(int(r) for r in ring_ranks[ring_offsets[p] : ring_offsets[p + 1]]),
            tuple(int(i) for i in seq_indices[seq_offsets[p] : seq_offsets[p + 1]]),
        )
        for p in range(m)
    ]


def as_arrays(lengths, ring_sizes, local, ring):
    """The inputs as numpy arrays of assorted dtypes and layouts (values unchanged)."""
    strided = np.zeros(2 * len(local))
    strided[::2] = local
    return (
        np.asarray(lengths, dtype=np.int64),
        np.asarray(ring_sizes, dtype=np.int32),
        strided[::2],  # not contiguous
        np.asarray(ring, dtype=np.float64),
    )


@st.composite
def problems(draw, max_size=60):
    pool_size = draw(st.one_of(st.integers(1, 64), st.sampled_from(PRIMES)))
    # Small capacities index rooms directly; large ones (next to few items) use the set.
    capacity = draw(
        st.one_of(
            st.integers(1, 512),
            st.sampled_from([1, 2, 8, 64]),
            st.sampled_from([4096, 5000, 8192, 10**6]),
        )
    )
    top = pool_size * capacity
    mix = draw(st.sampled_from(["heavy_tail", "ties", "all_short", "all_long", "mixed", "zeros"]))
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
    elif mix == "zeros":  # empty sequences, which fit anywhere
        element = st.sampled_from([0, 0, 0, 1, capacity, top])
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
    """The reference's and the C++ core's plans; the C++ plan also from numpy inputs and
    as arrays, which must be the same."""
    lengths, ring_sizes, local, ring, pool_size, capacity, delta = problem
    kwargs = dict(pool_size=pool_size, capacity=capacity, delta=delta)
    ref = reference_core(lengths, ring_sizes, local, ring, **kwargs)
    got = cpp_core(lengths, ring_sizes, local, ring, **kwargs)
    arrays = as_arrays(lengths, ring_sizes, local, ring)
    assert exact(cpp_core(*arrays, **kwargs)) == exact(got)
    assert exact(placements_from_arrays(cpp_arrays(*arrays, **kwargs))) == exact(got)
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


@pytest.mark.property
@given(problems())
@settings(max_examples=examples(250), deadline=None)
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


@pytest.mark.parametrize("mix, pool_size", [("heavy_tail", 1024), ("many_short", 512)])
def test_cpp_core_equals_reference_at_scale(mix, pool_size):
    # Realistic batches: capacity 8192, 8 micro-batches of tokens per rank, an H100 cost
    # model; thousands of packs and rings, gaps and ranks that free up together.
    capacity, rng = 8192, np.random.default_rng(pool_size)
    total = 8 * pool_size * capacity
    n = total // (3000 if mix == "heavy_tail" else 1500)
    short = rng.lognormal(6.5, 1.0, n)
    long = np.minimum(rng.pareto(1.1, n) * capacity, min(pool_size * capacity, 2**21))
    lengths = np.where(rng.random(n) < 0.8, short, long).astype(np.int64) + 1
    model = CostModel(
        ModelShape(
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_query_groups=8,
            ffn_hidden_size=11008,
            vocab_size=32000,
        ),
        H100,
    )
    k, local, ring = model.cost_arrays(lengths.tolist(), capacity)
    inputs = (lengths.tolist(), k.tolist(), local.tolist(), ring.tolist())
    for delta in (0.0, float(np.median(local))):
        kwargs = dict(pool_size=pool_size, capacity=capacity, delta=delta)
        ref = exact(reference_core(*inputs, **kwargs))
        assert exact(cpp_core(*inputs, **kwargs)) == ref
        assert exact(cpp_core(lengths, k, local, ring, **kwargs)) == ref
        assert exact(placements_from_arrays(cpp_arrays(lengths, k, local, ring, **kwargs))) == ref


@pytest.mark.parametrize("delta", [-1.0, -0.5])
def test_negative_delta_keeps_empty_gaps_like_the_reference(delta):
    # delta < 0 remembers gaps of length 0 (and zero-cost packs fill them); odd, but the
    # contract is the reference's.
    lengths = [3, 8, 3, 3, 0, 0, 4, 12, 1]
    ring_sizes = [1, 2, 1, 1, 1, 1, 1, 3, 1]
    local = [3.0, 0.0, 2.0, 1.0, 0.0, -0.0, 2.0, 0.0, 1.0]
    ring = [0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    for pool_size in (3, 4, 5):
        problem = (lengths, ring_sizes, local, ring, pool_size, 4, delta)
        ref, got = plan_both(problem)
        assert exact(got) == exact(ref)


def test_numpy_inputs_of_any_integer_and_real_dtype():
    lengths = [3, 9, 2, 0, 17, 4]
    ring_sizes = [1, 3, 1, 1, 5, 1]
    local = [1.5, 5.0, 1.0, 0.25, 2.0, 3.0]
    ring = [0.0, 2.5, 0.0, 0.0, 4.0, 0.0]
    kwargs = dict(pool_size=5, capacity=4, delta=0.0)
    expected = exact(reference_core(lengths, ring_sizes, local, ring, **kwargs))
    for int_dtype in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, np.uint64):
        for real_dtype in (np.int64, np.float32, np.float64):
            got = cpp_core(
                np.asarray(lengths, dtype=int_dtype),
                np.asarray(ring_sizes, dtype=int_dtype),
                np.asarray(local, dtype=real_dtype) if real_dtype != np.int64 else local,
                np.asarray(ring, dtype=real_dtype) if real_dtype != np.int64 else ring,
                **kwargs,
            )
            assert exact(got) == expected
    # Tuples, ranges, numpy scalars in lists and ints for costs are read as before.
    got = cpp_core(
        tuple(lengths),
        [np.int64(k) for k in ring_sizes],
        [np.float64(c) for c in local],
        [int(c * 4) / 4 for c in ring],
        **kwargs,
    )
    assert exact(got) == expected
    assert exact(cpp_core(range(3), [1, 1, 1], [1, 2, 3], [0, 0, 0], pool_size=2, capacity=4)) == (
        exact(reference_core([0, 1, 2], [1, 1, 1], [1, 2, 3], [0, 0, 0], pool_size=2, capacity=4))
    )
    empty = np.array([])  # float64, but empty
    assert cpp_core(empty, empty, empty, empty, pool_size=2, capacity=4) == []
    starts, *_ = cpp_arrays(empty, empty, empty, empty, pool_size=2, capacity=4)
    assert starts.shape == (0,)


@pytest.mark.parametrize(
    "lengths, ring_sizes, message",
    [
        (np.array([1.0, 2.0]), [1, 1], "lengths must have an integer dtype"),
        ([1.5, 2], [1, 1], "lengths must be a sequence of ints"),
        ([1, 2], np.array([True, True]), "ring_sizes must have an integer dtype"),
        (np.ones((2, 1), dtype=np.int64), [1, 1], "lengths must be one-dimensional"),
        ("ab", [1, 1], "lengths must be a sequence of ints"),
    ],
)
def test_wrong_input_types_raise_type_error(lengths, ring_sizes, message):
    for core in (cpp_core, cpp_arrays):
        with pytest.raises(TypeError, match=message):
            core(lengths, ring_sizes, [1.0, 1.0], [0.0, 0.0], pool_size=2, capacity=4)
    with pytest.raises(TypeError, match="local_cost must have a real dtype"):
        cpp_core([1], [1], np.array(["x"]), [0.0], pool_size=2, capacity=4)


def test_placements_are_plain_placement_objects_and_gc_state_is_kept():
    lengths, ring_sizes = [3, 9, 2, 3000], [1, 3, 1, 2]
    local, ring = [1.0, 5.0, 1.0, 1.0], [0.0, 2.5, 0.0, 7.0]
    kwargs = dict(pool_size=500, capacity=4)
    ref = reference_core(lengths, ring_sizes, local, ring, **kwargs)
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            got = cpp_core(lengths, ring_sizes, local, ring, **kwargs)
            assert gc.isenabled() is enabled
        finally:
            gc.enable()
        assert got == ref
        for p, q in zip(got, ref):
            assert type(p) is Placement and vars(p) == vars(q)
            assert list(vars(p)) == ["start", "cost", "ring", "seq_indices"]
            assert hash(p) == hash(q) and repr(p) == repr(q)
            with pytest.raises(AttributeError):
                p.start = 1.0  # still frozen


def test_placements_are_made_by_the_class_when_it_is_no_longer_a_plain_dataclass():
    # A fresh interpreter whose Placement.__init__ is wrapped before the first plan: the
    # extension must then call the class for every placement.
    code = textwrap.dedent(
        """
        import megatron_hdp.scheduler.balance as balance
        calls = []
        generated = balance.Placement.__init__
        def counting_init(self, *args):
            calls.append(args)
            generated(self, *args)
        balance.Placement.__init__ = counting_init
        from megatron_hdp import _planner
        lengths, ring_sizes = [3, 9, 2, 3000], [1, 3, 1, 2]
        local, ring = [1.0, 5.0, 1.0, 1.0], [0.0, 2.5, 0.0, 7.0]
        got = _planner.balance_core(lengths, ring_sizes, local, ring, pool_size=5, capacity=4)
        ref = balance.balance_core(lengths, ring_sizes, local, ring, pool_size=5, capacity=4)
        assert got == ref, (got, ref)
        assert len(calls) == 2 * len(ref), len(calls)
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_keywords_defaults_and_empty_batch():
    args = dict(lengths=[3, 9, 2], ring_sizes=[1, 2, 1], local_cost=[1.0, 5.0, 1.0])
    args["ring_cost"] = [0.0, 2.5, 0.0]
    got = cpp_core(**args, pool_size=2, capacity=4)
    assert got == reference_core(**args, pool_size=2, capacity=4, delta=0.0)
    assert got[0] == Placement(start=0.0, cost=2.5, ring=(0, 1), seq_indices=(1,))
    with pytest.raises(TypeError):
        cpp_core([1], [1], [1.0], [0.0], 1, 4)  # pool_size and capacity are keyword-only
    with pytest.raises(TypeError):
        cpp_arrays([1], [1], [1.0], [0.0], 1, 4)
    assert cpp_core([], [], [], [], pool_size=3, capacity=4) == []
    arrays = cpp_arrays(**args, pool_size=2, capacity=4)
    assert placements_from_arrays(arrays) == got


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
    "delta, expected",
    [
        # Ring D would take ranks 3 (free at 12) and 0 (free at 14); ranks 4 and 5 idle
        # [0, 12) waiting for ring C, so D runs there from 0, and pack E takes what is
        # left at 8.
        (
            0.0,
            [
                (0.0, (0, 1), (1,)),
                (0.0, (2, 3), (0,)),
                (0.0, (4, 5), (3,)),
                (8.0, (4,), (4,)),
                (12.0, (2, 4, 5), (2,)),
            ],
        ),
        # D's wait of 2 is within delta: it runs at 14 after all; E back-fills rank 4.
        (
            5.0,
            [
                (0.0, (0, 1), (1,)),
                (0.0, (2, 3), (0,)),
                (0.0, (4,), (4,)),
                (12.0, (2, 4, 5), (2,)),
                (14.0, (0, 3), (3,)),
            ],
        ),
    ],
)
def test_ring_backfills_idle_gaps_by_hand(delta, expected):
    # Rings B (14 s) and A (12 s) take ranks 0-3 at 0, longest first; ring C (3 ranks,
    # 10 s) then waits for rank 2 on ranks 4 and 5. Ring D (2 ranks, 8 s) fits in their
    # wait (rule 8).
    lengths, ring_sizes = [8, 8, 8, 8, 3], [2, 2, 3, 2, 1]
    local, ring = [0.0, 0.0, 0.0, 0.0, 3.0], [12.0, 14.0, 10.0, 8.0, 0.0]
    kwargs = dict(pool_size=6, capacity=4, delta=delta)
    got = cpp_core(lengths, ring_sizes, local, ring, **kwargs)
    assert exact(got) == exact(reference_core(lengths, ring_sizes, local, ring, **kwargs))
    assert [(p.start, p.ring, p.seq_indices) for p in got] == expected
    # Every rank runs its micro-batches one after another, without overlap.
    busy = {}
    for p in got:
        for r in p.ring:
            busy.setdefault(r, []).append((p.start, p.start + p.cost))
    for spans in busy.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


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
    for core in (cpp_core, cpp_arrays):
        with pytest.raises(ValueError, match=message):
            core(lengths, ring_sizes, local, ring, pool_size=pool_size, capacity=capacity)


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
