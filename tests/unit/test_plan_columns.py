"""The columnar `StepPlan`: the same plans as before, micro-batches as views, fast checks.

References: the plan hashes written by the planner before it was columnar
(`plan_regression_cases.py`), and plans built the old way from `Placement` and
`MicroBatch` objects.
"""

import json
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hdp import _planner
from megatron_hdp.scheduler import plan_step
from megatron_hdp.scheduler.balance import plan_from_placements
from megatron_hdp.scheduler.plan import MicroBatch, StepPlan, plan_from_rank_lists
from tests.plan_checks import run_to_completion
from tests.property import examples
from tests.unit.plan_regression_cases import HASHES, compute


@pytest.mark.skipif(
    sys.version_info[:2] != (3, 11),
    reason="pinned on Python 3.11: stdlib_like draws from the interpreter's own stdlib docs, and "
    "3.12's sum() of floats rounds differently (CI's Python 3.11 lane checks these plans)",
)
def test_plans_are_the_ones_the_object_planner_made():
    pinned = json.loads(HASHES.read_text())
    now = compute()
    assert sorted(now) == sorted(pinned)
    changed = [name for name in pinned if now[name] != pinned[name]]
    assert not changed, f"{len(changed)} of {len(pinned)} plans changed, first {changed[:5]}"


def _object_plan(placements, lengths, pool):
    """The plan as `plan_from_placements` built it before: one MicroBatch per placement."""
    mbs = [
        MicroBatch(
            order=n,
            ring=p.ring,
            seq_indices=p.seq_indices,
            predicted_cost=p.cost,
            predicted_start=p.start,
        )
        for n, p in enumerate(placements)
    ]
    return plan_from_rank_lists(lengths, pool, 64, "balanced", mbs)


@pytest.mark.property
@given(
    st.lists(st.integers(min_value=1, max_value=400), min_size=1, max_size=40),
    st.integers(min_value=1, max_value=9),
)
@settings(max_examples=examples(60), deadline=None)
def test_columns_from_the_core_equal_the_object_built_plan(lengths, pool):
    lengths = [min(s, pool * 64) for s in lengths]
    k = [max(1, -(-s // 64)) for s in lengths]
    local = [s * (1 + s / 64) for s in lengths]
    ring = [s * (1 + s / 64) / kk if kk > 1 else 0.0 for s, kk in zip(lengths, k)]
    args = (lengths, k, local, ring)
    objects = _planner.balance_core(*args, pool_size=pool, capacity=64)
    columns = plan_from_placements(
        _planner.balance_core_arrays(*args, pool_size=pool, capacity=64),
        lengths,
        pool_size=pool,
        capacity=64,
        policy="balanced",
    )
    old = _object_plan(objects, lengths, pool)
    assert columns == old
    assert columns.to_dict() == old.to_dict()
    assert columns.digest() == old.digest()
    assert columns.micro_batches == old.micro_batches
    for r in range(pool):
        assert columns.for_rank(r) == old.for_rank(r)
    assert columns.num_micro_batches_per_rank() == old.num_micro_batches_per_rank()
    assert run_to_completion(columns)


def test_for_rank_makes_only_its_own_micro_batches():
    lengths = [int(s) for s in np.random.default_rng(3).integers(1, 3000, 2000)]
    plan = plan_step(lengths, pool_size=64, capacity=1024, policy="balanced")
    seen = set()
    for r in range(64):
        mine = plan.for_rank(r)
        assert all(r in mb.ring for mb in mine)
        assert [mb.order for mb in mine] == sorted(mb.order for mb in mine)
        seen.update(mb.order for mb in mine)
    assert plan._micro_batches is None  # no rank needed every micro-batch's object
    assert seen == {mb.order for mb in plan.micro_batches}
    assert sorted(i for mb in plan.micro_batches for i in mb.seq_indices) == list(range(2000))


@pytest.mark.parametrize("pool", [7, 65536, 70_001])
def test_for_rank_lists_each_rank_s_micro_batches_in_order_at_any_pool_size(pool):
    # Per-rank lists are sorted by rank with 16-bit keys up to 65,536 ranks, by full
    # integers beyond: either way, each rank's micro-batches in plan order.
    rng = np.random.default_rng(pool)
    m = 300
    rings = [
        sorted(rng.choice(pool, size=int(rng.integers(1, 6)), replace=False)) for _ in range(m)
    ]
    rings[0] = [0, pool - 1]
    plan = StepPlan(
        pool_size=pool,
        capacity=8,
        seqlens=[3] * m,
        policy="x",
        order=np.arange(m),
        ring_offsets=np.cumsum([0] + [len(r) for r in rings]),
        ring_ranks=np.concatenate(rings),
        seq_offsets=np.arange(m + 1),
        seq_ids=np.arange(m),
    )
    for rank in {0, pool - 1, *rings[1], *rings[-1]}:
        expected = [n for n, ring in enumerate(rings) if rank in ring]
        assert [mb.order for mb in plan.for_rank(int(rank))] == expected


def test_exact_int_array_reads_only_exact_ints():
    assert _planner.exact_int_array([3, 0, -2, 2**62]).tolist() == [3, 0, -2, 2**62]
    assert _planner.exact_int_array((5,)).dtype == np.int64
    assert _planner.exact_int_array([]).tolist() == []
    # Anything else goes back to the element-by-element path, which names it.
    for other in ([1, True], [1, np.int64(2)], [1, 2.0], [1, 2**63], np.arange(3), range(3)):
        assert _planner.exact_int_array(other) is None


def test_round_trip_digest_and_read_only_columns():
    plan = plan_step([900, 40, 3000, 7, 512, 2048], pool_size=4, capacity=1024, policy="balanced")
    again = StepPlan.from_dict(json.loads(plan.to_json()))
    assert again == plan and again.digest() == plan.digest()
    moved = plan.replace(predicted_start=plan.predicted_start + 1.0)
    assert moved != plan and moved.digest() != plan.digest()
    assert moved.for_rank(0)[0].predicted_start == plan.for_rank(0)[0].predicted_start + 1.0
    assert plan.replace(policy="other").digest() != plan.digest()
    with pytest.raises(ValueError, match="read-only"):
        plan.ring_ranks[0] = 3
    with pytest.raises(TypeError, match="no attribute"):
        plan.replace(micro_batches=())


def test_inconsistent_columns_are_refused():
    with pytest.raises(ValueError, match="ring_offsets must hold 2 entries from 0 to 1"):
        StepPlan(
            pool_size=2,
            capacity=8,
            seqlens=[3],
            policy="x",
            order=[0],
            ring_offsets=[0, 2],
            ring_ranks=[0],
            seq_offsets=[0, 1],
            seq_ids=[0],
        )


@pytest.mark.parametrize(
    "lengths, message",
    [
        (np.array([5, 7, 0, -1]), "sequence 2 is empty"),
        (np.array([5, 49, 60], dtype=np.int32), "sequence 1 has 49 tokens"),
        ([5, True, 3], "the length of sequence 1 must be an integer, got True"),
        ([5, 3.0], "the length of sequence 1 must be an integer, got 3.0"),
        ([4, np.int64(2**40)], "sequence 1 has 1099511627776 tokens"),
        ([4, 2**70], "sequence 1 has 1180591620717411303424 tokens"),
    ],
)
def test_bad_lengths_are_named_by_their_first_index(lengths, message):
    with pytest.raises(ValueError, match=message):
        plan_step(lengths, pool_size=3, capacity=16, policy="balanced")
