"""Selective offloading's capacity rule against an independent brute-force reading of Eq. 3."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hdp.scheduler import plan_step
from megatron_hdp.scheduler.cost import H100, CostModel, ModelShape
from megatron_hdp.scheduler.offload_rule import offload_rule


def shape(layers):
    return ModelShape(
        num_layers=layers,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=11008,
        vocab_size=32000,
    )


def brute_force(s, capacity, model, budget):
    """Eq. 3 by search: the ratio from its three bounds, then the fewest ranks that fit."""
    layers, d = model.model.num_layers, model.device
    base = max(1, math.ceil(s / capacity))
    if s <= capacity or layers <= 2:
        return base, 0.0
    per_token = 34 * model.model.hidden_size * d.bytes_per_element / 2  # bytes / token / layer
    act, act_c = per_token * s, per_token * capacity
    # One layer's forward: its share of the GEMMs plus its causal attention (2 s^2 h FLOPs).
    linear = 6 * model.model.params_per_token * s / d.linear_flops / 3 / layers
    forward = linear + 2 * s * s * model.model.hidden_size / d.attention_flops
    r = min(1.0, forward * d.host_bandwidth / act)
    for trial in np.linspace(1.0, 0.0, 100001):  # largest ratio whose bytes fit the budget
        ranks = (2 + (1 - trial) * (layers - 2)) * act / (layers * act_c)
        if trial * (layers - 2) * act / ranks <= budget * (1 + 1e-9):
            r = min(r, trial)
            break
    if r < min(1.0, layers * act_c / ((layers - 2) * act)) - 1e-4:
        return base, 0.0
    resident = (2 + (1 - r) * (layers - 2)) / layers
    ranks = next(  # a member holds up to ceil(s / ranks) tokens
        (d for d in range(2, base + 1) if resident * math.ceil(s / d) <= capacity * (1 + 1e-12)),
        base,
    )
    if ranks == base:
        return base, 0.0  # no rank saved: nothing to offload
    # The least ratio that still fits `ranks` (searched, not solved).
    for trial in np.linspace(0.0, r, 20001):
        if (2 + (1 - trial) * (layers - 2)) / layers * math.ceil(s / ranks) <= capacity:
            return ranks, float(trial)
    return ranks, r


@given(
    st.integers(min_value=1, max_value=4_000_000),
    st.sampled_from([1024, 8192, 32768]),
    st.sampled_from([2, 3, 8, 32, 80]),
    st.sampled_from([5e9, 25e9, 50e9, 400e9]),
    st.sampled_from([1e9, 64e9, 1e12]),
)
@settings(max_examples=300, deadline=None)
def test_rule_matches_brute_force(s, capacity, layers, bandwidth, budget):
    model = CostModel(shape(layers), dataclasses.replace(H100, host_bandwidth=bandwidth))
    (ranks,), (ratio,) = offload_rule([s], capacity, model, host_budget_bytes=budget)
    want_ranks, want_ratio = brute_force(s, capacity, model, budget)
    assert ranks == want_ranks
    assert ratio == pytest.approx(want_ratio, abs=2e-4)
    assert ranks <= max(1, math.ceil(s / capacity))
    if s > capacity:
        assert ranks >= 2
        assert ratio * (layers - 2) * 34 * 4096 * s / ranks <= budget * (1 + 1e-9)


def test_edge_cases():
    model = CostModel(shape(32), H100)
    ranks, ratios = offload_rule([100, 8192, 8193, 1 << 20], 8192, model)
    assert list(ranks[:2]) == [1, 1] and list(ratios[:2]) == [0.0, 0.0]  # packs never offload
    assert ranks[2] == 2  # just above C: a ring of 2 stays a ring
    assert ranks[3] < 128 and ratios[3] > 0  # a long sequence needs fewer ranks
    slow = CostModel(shape(32), dataclasses.replace(H100, host_bandwidth=1e6))
    ranks, ratios = offload_rule([1 << 20], 8192, slow)
    assert (ranks[0], ratios[0]) == (128, 0.0)  # copies cannot hide: no offloading
    two_layers = CostModel(shape(2), H100)
    assert offload_rule([1 << 20], 8192, two_layers)[1][0] == 0.0
    with pytest.raises(ValueError, match="host memory budget is 0"):
        offload_rule([1 << 20], 8192, model, host_budget_bytes=0)


def test_planner_gives_long_sequences_the_rule_s_ranks():
    """With plenty of other work, the ring-time limit does not bind: exactly Eq. 3's ranks."""
    model = CostModel(shape(32), H100)
    lengths = [300000, 500000, 70000, 9000] + [8192] * 9000
    ranks, ratios = offload_rule(lengths, 8192, model)
    plan = plan_step(
        lengths, pool_size=64, capacity=8192, policy="balanced", cost_model=model, offload=True
    )
    plan.validate(pool_size=64)
    for mb in plan.micro_batches:
        if mb.cp_size > 1:
            (i,) = mb.seq_indices
            assert mb.cp_size == ranks[i] and mb.offload_ratio == pytest.approx(ratios[i])
        else:
            assert mb.offload_ratio == 0.0
    plain = plan_step(lengths, pool_size=64, capacity=8192, policy="balanced", cost_model=model)
    assert sum(mb.cp_size for mb in plan.micro_batches) < sum(
        mb.cp_size for mb in plain.micro_batches
    )
    with pytest.raises(ValueError, match="offloading is planned by the balanced policy"):
        plan_step(lengths, pool_size=64, capacity=8192, policy="greedy", offload=True)


@given(st.integers(min_value=20000, max_value=3_000_000), st.floats(min_value=0.5, max_value=500))
@settings(max_examples=100, deadline=None)
def test_ring_time_limit_adds_ranks_and_lowers_the_ratio(s, limit):
    model, capacity = CostModel(shape(32), H100), 8192
    (free_ranks,), (free_ratio,) = offload_rule([s], capacity, model)
    (ranks,), (ratio,) = offload_rule([s], capacity, model, max_ring_time=limit)
    base = math.ceil(s / capacity)
    assert free_ranks <= ranks <= base and ratio <= free_ratio + 1e-12
    # The fewest ranks (from Eq. 3's count up) that finish within the limit, or all of them.
    want = next((d for d in range(free_ranks, base + 1) if model.time(s, d) <= limit), base)
    assert ranks == max(free_ranks, want)
    resident = (2 + (1 - ratio) * 30) / 32 * math.ceil(s / ranks)
    assert resident <= capacity * (1 + 1e-9)  # the activations still fit
    if ranks == base:
        assert ratio == 0.0


def test_predicted_activation_bytes_by_hand():
    from megatron_hdp.scheduler.plan import MicroBatch, plan_from_rank_lists
    from megatron_hdp.scheduler.stats import predicted_activation_bytes

    plan = plan_from_rank_lists(
        [10, 3, 40],
        3,
        16,
        "manual",
        [
            MicroBatch(order=0, ring=(0,), seq_indices=(0, 1)),
            MicroBatch(order=1, ring=(1, 2), seq_indices=(2,), offload_ratio=0.5),
        ],
        num_layers=10,
    )
    # 40 tokens on 2 ranks: 20 each, resident share (2 + 0.5 * 8) / 10 = 0.6.
    assert predicted_activation_bytes(plan, 100.0) == [1300.0, 1200.0, 1200.0]
