"""Placement policies: invariants on random inputs, deadlock freedom, bad input."""

import itertools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hdp.scheduler import StepPlan, plan_step
from megatron_hdp.scheduler.balance import best_fit_decreasing
from megatron_hdp.sharding import rank_token_counts
from tests.plan_checks import run_to_completion
from tests.property import examples


@st.composite
def batches(draw):
    pool_size = draw(st.integers(min_value=1, max_value=13))
    capacity = draw(st.integers(min_value=1, max_value=64))
    lengths = draw(
        st.lists(st.integers(min_value=1, max_value=pool_size * capacity), min_size=1, max_size=40)
    )
    return lengths, pool_size, capacity


@pytest.mark.property
@given(batches())
@settings(max_examples=examples(300), deadline=None)
def test_greedy_plan_invariants(batch):
    lengths, pool_size, capacity = batch
    plan = plan_step(lengths, pool_size=pool_size, capacity=capacity, policy="greedy")
    plan.validate(pool_size=pool_size)
    placed = sorted(i for mb in plan.micro_batches for i in mb.seq_indices)
    assert placed == list(range(len(lengths)))
    for mb in plan.micro_batches:
        seq_lengths = [lengths[i] for i in mb.seq_indices]
        if mb.cp_size > 1:
            (only,) = seq_lengths
            assert mb.cp_size == math.ceil(only / capacity)  # exactly the ranks it needs
        else:
            assert sum(seq_lengths) <= capacity
        assert max(rank_token_counts(seq_lengths, mb.cp_size)) <= capacity
        assert len(set(mb.ring)) == mb.cp_size and all(0 <= r < pool_size for r in mb.ring)
    assert run_to_completion(plan)
    assert plan == plan_step(lengths, pool_size=pool_size, capacity=capacity, policy="greedy")


@pytest.mark.property
@given(batches())
@settings(max_examples=examples(200), deadline=None)
def test_static_plan_uses_fixed_contiguous_groups(batch):
    lengths, pool_size, capacity = batch
    cp_options = [
        cp
        for cp in range(1, pool_size + 1)
        if pool_size % cp == 0 and cp * capacity >= max(lengths)
    ]
    if not cp_options:
        with pytest.raises(ValueError, match="no CP size"):
            plan_step(lengths, pool_size=pool_size, capacity=capacity, policy="static")
        return
    plan = plan_step(lengths, pool_size=pool_size, capacity=capacity, policy="static")
    plan.validate(pool_size=pool_size)
    cp = cp_options[0]
    groups = {tuple(range(g * cp, (g + 1) * cp)) for g in range(pool_size // cp)}
    for mb in plan.micro_batches:
        assert mb.ring in groups
        assert sum(lengths[i] for i in mb.seq_indices) <= cp * capacity
    assert run_to_completion(plan)


def test_round_trip_through_json():
    plan = plan_step([5, 40, 17, 3, 3, 16], pool_size=5, capacity=16, policy="greedy")
    again = StepPlan.from_dict(json.loads(plan.to_json()))
    assert again == plan and again.digest() == plan.digest()


def test_ring_sizes_are_not_powers_of_two_and_may_be_any_ranks():
    plan = plan_step([33, 40, 2, 2], pool_size=7, capacity=8, policy="greedy")
    sizes = sorted(mb.cp_size for mb in plan.micro_batches if mb.cp_size > 1)
    assert sizes == [5, 5]
    assert plan.validate(pool_size=7) is None


def _optimal_bins(sizes, bin_size):
    for n in range(1, len(sizes) + 1):
        for assignment in itertools.product(range(n), repeat=len(sizes)):
            loads = [0] * n
            for s, b in zip(sizes, assignment):
                loads[b] += s
            if max(loads) <= bin_size:
                return n
    raise AssertionError


@pytest.mark.property
@given(st.lists(st.integers(min_value=1, max_value=10), min_size=1, max_size=7))
@settings(max_examples=examples(80), deadline=None)
def test_best_fit_is_within_its_bound_of_optimal(sizes):
    bins = best_fit_decreasing(sizes, range(len(sizes)), 10)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= 10 for b in bins)
    # Best-fit decreasing uses at most 11/9 OPT + 6/9 bins (Dosa 2007).
    assert len(bins) <= 11 / 9 * _optimal_bins(sizes, 10) + 6 / 9


@pytest.mark.parametrize(
    "lengths, pool_size, capacity, message",
    [
        ([5, 49], 3, 16, "sequence 1 has 49 tokens"),
        ([5, 0, 3], 3, 16, "sequence 1 is empty"),
        ([5], 3, 0, "capacity .* must be > 0, got 0"),
        ([5], 3, -4, "got -4"),
        ([5], 0, 16, "pool_size must be an integer >= 1, got 0"),
        ([], 3, 16, "holds no sequence"),
    ],
)
def test_bad_input_names_the_value(lengths, pool_size, capacity, message):
    for policy in ("greedy", "static"):
        with pytest.raises(ValueError, match=message):
            plan_step(lengths, pool_size=pool_size, capacity=capacity, policy=policy)


def test_plan_for_another_pool_is_refused():
    plan = plan_step([5, 20], pool_size=3, capacity=16, policy="greedy")
    with pytest.raises(ValueError, match="plan is for a pool of 3 ranks, but this pool has 4"):
        plan.validate(pool_size=4)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown placement policy 'wavefront'"):
        plan_step([5], pool_size=1, capacity=8, policy="wavefront")


def test_plan_statistics_by_hand():
    from megatron_hdp.scheduler.stats import plan_statistics

    plan = plan_step(
        [40, 4, 4], pool_size=4, capacity=10, policy="greedy"
    )  # ring of 4, then two packs
    stats = plan_statistics(plan)
    assert stats["max_ranks_per_sequence"] == 4
    assert stats["mean_ranks_per_sequence"] == (4 + 1 + 1) / 3
    assert stats["token_weighted_ranks_per_sequence"] == (40 * 4 + 4 + 4) / 48
    assert (stats["micro_batches_per_rank_min"], stats["micro_batches_per_rank_max"]) == (1, 2)
    loads = [0.0] * 4
    for mb in plan.micro_batches:
        for r in mb.ring:
            loads[r] += mb.predicted_cost
    assert stats["predicted_imbalance"] == max(loads) / (sum(loads) / 4)


def test_numpy_lengths_are_accepted_and_cp_size_needs_the_static_policy():
    import numpy as np

    plan = plan_step(
        list(np.array([5, 20, 3])), pool_size=np.int64(3), capacity=16, policy="greedy"
    )
    assert plan.seqlens == (5, 20, 3)
    with pytest.raises(ValueError, match="cp_size 2 applies to the static policy only"):
        plan_step([5], pool_size=2, capacity=8, cp_size=2)


def test_a_deserialised_plan_is_checked_like_planner_input():
    data = plan_step([5, 20], pool_size=3, capacity=16, policy="greedy").to_dict()
    data["capacity"] = 0
    with pytest.raises(ValueError, match="must be > 0, got 0"):
        StepPlan.from_dict(data).validate()


def test_the_readmes_call_is_the_balanced_policy_on_the_cpp_core(monkeypatch):
    """`plan_step(seqlens, pool_size=N, capacity=C)` as README.md shows it, at 16,384 ranks:
    the balanced policy (the one pretrain_hdp.py runs), placed by the C++ core, equal to an
    explicit `policy="balanced"` call."""
    import numpy as np

    from megatron_hdp import _planner

    calls = []
    real = _planner.balance_core_arrays

    def spy(*args, **kwargs):
        calls.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(_planner, "balance_core_arrays", spy)
    pool, capacity = 16384, 8192
    rng = np.random.default_rng(0)
    lengths = np.minimum(pool * capacity, 1 + rng.lognormal(7.5, 1.7, size=60000)).astype(int)
    plan = plan_step(lengths.tolist(), pool_size=pool, capacity=capacity)
    assert plan.policy == "balanced" and calls == [len(lengths)]
    assert plan == plan_step(lengths.tolist(), pool_size=pool, capacity=capacity, policy="balanced")
    greedy = plan_step(lengths.tolist(), pool_size=pool, capacity=capacity, policy="greedy")
    assert greedy.policy == "greedy" and greedy != plan
