"""Selective offloading's capacity rule against an independent, exact search over ring sizes.

The rule (`offload_rule`) is a closed form; here Eq. 3 is read as a search over `D` in
`2..ceil(s / C)`, each member holding its real (zigzag) `ceil(s / D)` tokens, with every bound
checked directly, and the returned ratio checked in exact rational arithmetic. The property
tests run derandomized in the suite; `scripts/property_tests.sh` runs them long and random.
"""

import dataclasses
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hdp.scheduler import plan_step
from megatron_hdp.scheduler.cost import H100, CostModel, ModelShape
from megatron_hdp.scheduler.offload_rule import offload_rule
from tests.property import examples

SLACK = 1e-12  # bounds tied within this (relative) may go either way: floats decide them


def shape(layers):
    return ModelShape(
        num_layers=layers,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=11008,
        vocab_size=32000,
    )


def per_token_bytes(model):
    """Saved activation bytes per token per layer: 34 h at 16 bits."""
    return Fraction(34 * model.model.hidden_size * model.device.bytes_per_element, 2)


def copy_bound(s, model):
    """r_max: the share of a layer's activations whose D2H copy hides under its forward."""
    d, layers = model.device, model.model.num_layers
    # One layer's forward: its share of the GEMMs plus its causal attention (2 s^2 h FLOPs).
    linear = 6 * model.model.params_per_token * s / d.linear_flops / 3 / layers
    forward = linear + 2 * s * s * model.model.hidden_size / d.attention_flops
    return forward * d.host_bandwidth / (float(per_token_bytes(model)) * s)


def brute_force(s, capacity, model, budget, slack=0.0):
    """Eq. 3 by search: the fewest ranks whose members fit, and the least ratio that does it.

    A ring of `D` ranks gives a member `t = ceil(s / D)` tokens; the least ratio that keeps
    its resident activations within `C` solves `(2 + (1 - r)(l - 2)) t <= l C`, and `D` is
    admissible when that ratio also hides the copy (`<= r_max`) and the member's offloaded
    bytes fit the host budget. Offloading is used only where the largest admissible ratio
    (its host-budget cap found by bisection) reaches `r_min`. `slack` loosens (> 0) or
    tightens (< 0) every bound by that relative amount. Returns `(ranks, exact ratio)`.
    """
    layers = model.model.num_layers
    base = max(1, math.ceil(s / capacity))
    if s <= capacity or layers <= 2:
        return base, Fraction(0)
    per_token = float(per_token_bytes(model))
    r_max = min(1.0, copy_bound(s, model) * (1 + slack))
    budget = budget * (1 + slack)

    def offloaded_when_full(r):  # a member's offloaded bytes when its resident share is C
        return r * (layers - 2) * per_token * layers * capacity / (2 + (1 - r) * (layers - 2))

    low, high = 0.0, 1.0  # the largest ratio a full member can offload within the budget
    if offloaded_when_full(1.0) <= budget:
        low = 1.0
    while high - low > 1e-15:
        mid = (low + high) / 2
        low, high = (mid, high) if offloaded_when_full(mid) <= budget else (low, mid)
    r_min = min(1.0, layers * capacity / ((layers - 2) * s))
    if min(r_max, low) < r_min * (1 - slack):
        return base, Fraction(0)
    ranks = np.arange(2, base)
    tokens = -(-s // ranks)
    least = layers * (tokens - capacity) / ((layers - 2) * tokens)
    offloaded = least * (layers - 2) * per_token * tokens
    fits = (least <= r_max) & (offloaded <= budget)
    if not fits.any():
        return base, Fraction(0)  # no rank saved: nothing to offload
    d = int(ranks[np.argmax(fits)])
    return d, least_fitting(s, d, capacity, layers)


def least_fitting(s, ranks, capacity, layers):
    """The exact least ratio whose resident share fits a member's ceil(s / ranks) tokens."""
    t = -(-s // ranks)
    return max(Fraction(0), Fraction(layers * (t - capacity), (layers - 2) * t))


def assert_invariants(s, capacity, model, budget, ranks, ratio):
    """What the rule promises every ring member, in exact arithmetic on the returned floats."""
    layers = model.model.num_layers
    base = max(1, math.ceil(s / capacity))
    r = Fraction(float(ratio))
    assert 1 <= ranks <= base and 0 <= r <= 1
    if s <= capacity:
        assert (ranks, r) == (1, 0)  # packs never offload
        return
    assert ranks >= 2  # a ring stays a ring
    if ranks == base or layers <= 2:
        assert r == 0  # no rank saved, or nothing to offload: no offloading
    tokens = -(-s // ranks)  # a member's real (zigzag) share, not s / ranks
    assert (2 + (1 - r) * (layers - 2)) * tokens <= layers * capacity  # resident <= C
    assert r * (layers - 2) * per_token_bytes(model) * tokens <= Fraction(budget)  # host
    assert r <= Fraction(copy_bound(s, model)) * (1 + Fraction(SLACK))  # the copy hides


def check_against_brute_force(s, capacity, layers, bandwidth, budget):
    model = CostModel(shape(layers), dataclasses.replace(H100, host_bandwidth=bandwidth))
    (ranks,), (ratio,) = offload_rule([s], capacity, model, host_budget_bytes=budget)
    ranks = int(ranks)
    assert_invariants(s, capacity, model, budget, ranks, ratio)
    loose = brute_force(s, capacity, model, budget, slack=SLACK)
    tight = brute_force(s, capacity, model, budget, slack=-SLACK)
    assert loose[0] <= ranks <= tight[0]  # equal unless a bound is tied within SLACK
    if ranks < max(1, math.ceil(s / capacity)):
        # The least ratio for the member's tokens, rounded up by at most an ulp or two.
        least = least_fitting(s, ranks, capacity, layers)
        assert 0 <= Fraction(float(ratio)) - least <= Fraction(1, 10**15)
    else:
        assert ratio == 0.0
    return ranks, ratio


configs = (
    st.sampled_from([1024, 8192, 32768]),
    st.sampled_from([2, 3, 8, 32, 80]),
    st.sampled_from([5e9, 25e9, 50e9, 400e9]),
    st.sampled_from([1e9, 64e9, 1e12]),
)


@pytest.mark.property
@given(st.integers(min_value=1, max_value=4_000_000), *configs)
@settings(max_examples=examples(300), deadline=None)
def test_rule_matches_brute_force(s, capacity, layers, bandwidth, budget):
    check_against_brute_force(s, capacity, layers, bandwidth, budget)


def most_tokens(s, capacity, model, budget):
    """The most tokens one member may hold at `s`'s bounds (searched over token counts)."""
    layers, per_token = model.model.num_layers, float(per_token_bytes(model))
    tokens = np.arange(capacity + 1, layers * capacity // 2 + 2)
    least = layers * (tokens - capacity) / ((layers - 2) * tokens)
    fits = (least <= min(1.0, copy_bound(s, model))) & (
        least * (layers - 2) * per_token * tokens <= budget
    )
    return int(tokens[fits][-1]) if fits.any() else capacity


@pytest.mark.property
@given(
    st.integers(min_value=1, max_value=4_000_000),
    *configs[:1],
    st.sampled_from([3, 8, 32, 80]),
    *configs[2:],
    st.integers(min_value=-1, max_value=1),
    st.integers(min_value=-1, max_value=1),
)
@settings(max_examples=examples(200), deadline=None)
def test_rule_at_ring_size_steps(s, capacity, layers, bandwidth, budget, step, offset):
    """Where the ranks change: `s` a token off a multiple of the most tokens a member holds."""
    model = CostModel(shape(layers), dataclasses.replace(H100, host_bandwidth=bandwidth))
    most = most_tokens(s, capacity, model, budget)
    ranks = max(2, math.ceil(s / most) + step)
    edge = ranks * most + offset
    if capacity < edge <= 4_000_000:
        check_against_brute_force(edge, capacity, layers, bandwidth, budget)


def test_issue_example_gets_130_ranks():
    """Found by the property test: s = 1,999,921, C = 1,024, 32 layers, 5 GB/s, 64 GB.

    The old brute force searched the ratio on a 1e-5 grid, floored the host cap
    r_host = 0.99567209 to 0.99567 and wanted 131 ranks; exactly, 130 fit. A member then
    holds ceil(s / 130) = 15,385 tokens, the least ratio is 32 (15385 - 1024) / (30 * 15385)
    = 0.99567111 <= r_host, and it offloads its activations beyond C's worth:
    32 layers * 34 h bytes * 14,361 tokens = 63.999 GB <= 64 GB. On 129 ranks (15,504
    tokens) it would offload 64.53 GB.
    """
    s, capacity, budget = 1_999_921, 1024, 64e9
    ranks, ratio = check_against_brute_force(s, capacity, 32, 5e9, budget)
    assert ranks == 130
    assert Fraction(float(ratio)) >= Fraction(32 * (15385 - 1024), 30 * 15385)
    assert ratio == pytest.approx(0.9956711082222944, abs=1e-15)
    per_member = 32 * 34 * 4096  # bytes a member offloads per token over C at the least ratio
    assert per_member * (15385 - 1024) <= budget < per_member * (15504 - 1024)


@pytest.mark.parametrize(
    "s, capacity, layers, bandwidth, budget, want",
    [
        # r_max >= 1: offloading everything but the two resident layers is allowed exactly,
        # a member holds l C / 2 = 12,288 tokens.
        (2_690_958, 8192, 3, 25e9, 1e12, (219, 1.0)),
        # r_max is exactly 4/51, the least ratio on 68 ranks: no float is both >= the least
        # ratio and <= r_max, so the rule takes one rank more (the old rule's ratio was
        # 2^-50 tokens short of fitting).
        (73_984, 1024, 8, 5e9, 1e9, (69, None)),
        # r_max is exactly 604/645, the least ratio on 357 ranks: the rule's ratio, rounded
        # up, passes the float r_max, so again one rank more (the old rule's ratio was one
        # ulp above the exact r_max).
        (1_228_032, 1024, 8, 5e9, 64e9, (358, None)),
        # A member's ceil(s / D) tokens, not s / D: 15,385 tokens per member fit 130 ranks,
        # one token more does not.
        (130 * 15385, 1024, 32, 5e9, 64e9, (130, None)),
        (130 * 15385 + 1, 1024, 32, 5e9, 64e9, (131, None)),
    ],
)
def test_edges_found_by_search(s, capacity, layers, bandwidth, budget, want):
    ranks, ratio = check_against_brute_force(s, capacity, layers, bandwidth, budget)
    assert ranks == want[0]
    if want[1] is not None:
        assert ratio == want[1]


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


def test_planner_offloads_within_the_rule_and_never_plans_slower():
    """Where the planner offloads, each ring has at least Eq. 3's ranks and the least ratio
    that fits its placed width; the chosen plan is never predicted slower than the plan
    without offloading (offloading is a choice, `offload_choice`)."""
    from megatron_hdp.scheduler.offload_choice import predicted_step
    from megatron_hdp.scheduler.offload_rule import least_ratio

    slow_net = CostModel(shape(32), dataclasses.replace(H100, p2p_bandwidth=12.5e9))
    for model in (CostModel(shape(32), H100), slow_net):
        lengths = [1 << 21] * 4 + [300000, 70000, 9000] + [8192] * 200
        ranks, _ = offload_rule(lengths, 8192, model)
        plan = plan_step(
            lengths, pool_size=512, capacity=8192, policy="balanced", cost_model=model, offload=True
        )
        plan.validate(pool_size=512)
        for mb in plan.micro_batches:
            if mb.offload_ratio > 0:
                (i,) = mb.seq_indices
                assert ranks[i] <= mb.cp_size < math.ceil(lengths[i] / 8192)
                tokens = -(-lengths[i] // mb.cp_size)
                assert mb.offload_ratio == least_ratio(tokens, 8192, 32)
        plain = plan_step(
            lengths, pool_size=512, capacity=8192, policy="balanced", cost_model=model
        )
        assert predicted_step(plan) <= predicted_step(plain)
    assert plan.offload_decision.offloaded > 0  # the slow network's plan offloads
    with pytest.raises(ValueError, match="offloading is planned by the balanced policy"):
        plan_step(lengths, pool_size=64, capacity=8192, policy="greedy", offload=True)


@pytest.mark.property
@given(st.integers(min_value=20000, max_value=3_000_000), st.floats(min_value=0.5, max_value=500))
@settings(max_examples=examples(100), deadline=None)
def test_ring_time_limit_adds_ranks_and_lowers_the_ratio(s, limit):
    model, capacity = CostModel(shape(32), H100), 8192
    (free_ranks,), (free_ratio,) = offload_rule([s], capacity, model)
    (ranks,), (ratio,) = offload_rule([s], capacity, model, max_ring_time=limit)
    base = math.ceil(s / capacity)
    assert free_ranks <= ranks <= base and ratio <= free_ratio + 1e-12
    # The fewest ranks (from Eq. 3's count up) that finish within the limit, or all of them.
    want = next((d for d in range(free_ranks, base + 1) if model.time(s, d) <= limit), base)
    assert ranks == max(free_ranks, want)
    assert_invariants(s, capacity, model, H100.host_memory_bytes, ranks, ratio)  # still fit
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
