"""Sliding-window pricing (`scheduler.windows`, `CostModel`) against formulas and Megatron-Core."""

import dataclasses

import numpy as np
import pytest
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_hdp.scheduler.cost import H100, CostModel, ModelShape
from megatron_hdp.scheduler.placement import plan_step
from megatron_hdp.scheduler.windows import attention_pairs, parse_skip_freq, windowed_layers

SHAPE = ModelShape(
    num_layers=4, hidden_size=4096, num_attention_heads=32, num_query_groups=8, vocab_size=32000
)


@pytest.mark.parametrize("freq", [None, 1, 2, 3, 4, [1, 0, 0, 1, 1, 1, 0, 1]])
def test_windowed_layers_follow_megatron_core(freq):
    mine = windowed_layers(8, (128, 0), freq)
    theirs = tuple(is_layer_window_attention((128, 0), freq, n) for n in range(1, 9))
    assert mine == theirs
    assert windowed_layers(8, None, freq) == (False,) * 8


def test_skip_freq_parsing_as_megatron_lm():
    assert parse_skip_freq("4") == 4
    assert parse_skip_freq("([1]*3+[0])*2") == [1, 1, 1, 0, 1, 1, 1, 0]
    with pytest.raises(ValueError, match="invalid pattern"):
        parse_skip_freq("[__import__('os')]")


@pytest.mark.parametrize("s", [1, 5, 64, 1000])
@pytest.mark.parametrize("w", [0, 3, 63, 5000])
def test_window_pairs_within_one_pair_per_token_of_the_exact_count(s, w):
    exact = sum(min(i, w) + 1 for i in range(s))
    assert abs(float(attention_pairs(s, w)) - exact) <= s
    assert float(attention_pairs(s, None)) == s * s / 2


def test_long_windowed_sequence_costs_less_attention_and_ring():
    """128k tokens on a ring of 8, window 4096 on 3 of 4 layers (skip freq 4), against the
    hand formulas: pairs s W - W^2/2, ring rows per hop min(s/k, 2W); latency 0 and infinite
    attention speed leave the ring's bytes exposed: per layer (k-1) + 2(k-1) + 1 transfers."""
    s, k, w = 131072, 8, 4096
    device = dataclasses.replace(H100, p2p_latency=0.0)
    full = CostModel(SHAPE, device)
    windowed = CostModel(dataclasses.replace(SHAPE, window=w, windowed_layers=3), device)
    per_pair = 3.5 * 4 * 32 * 128 / device.attention_flops
    width = w + 1
    assert windowed.attention_time(s) == pytest.approx(
        per_pair * (1 * s * s / 2 + 3 * (s * width - width * width / 2))
    )
    assert windowed.attention_time(s) < 0.3 * full.attention_time(s)  # 1 full layer of 4

    fast = dataclasses.replace(device, attention_flops=1e40)
    rows_full, rows_window = s / k, min(s / k, 2 * width)
    transfer = 2 * 8 * 128 * fast.bytes_per_element / fast.p2p_bandwidth
    hops = (k - 1) + 2 * (k - 1) + 1
    want = hops * transfer * (1 * rows_full + 3 * rows_window)
    got = CostModel(dataclasses.replace(SHAPE, window=w, windowed_layers=3), fast)
    assert got.exposed_ring_time(s, k) == pytest.approx(want)
    assert CostModel(SHAPE, fast).exposed_ring_time(s, k) == pytest.approx(
        hops * transfer * 4 * rows_full
    )
    # A pack of one sequence: micro_batch_time is compute / k plus the same ring time.
    compute = (got.linear_time(s) + got.attention_time(s)) / k
    assert got.micro_batch_time([s], k) == pytest.approx(compute + want)


def test_plans_price_a_windowed_long_sequence_lower():
    lengths = [131072] + [4096] * 16
    full = CostModel(SHAPE, H100)
    windowed = CostModel(dataclasses.replace(SHAPE, window=4096, windowed_layers=3), H100)
    plans = {
        name: plan_step(lengths, pool_size=16, capacity=32768, cost_model=model)
        for name, model in (("full", full), ("window", windowed))
    }
    finish = {
        name: float(max(plan.predicted_start + plan.predicted_cost)) for name, plan in plans.items()
    }
    assert finish["window"] < 0.7 * finish["full"], finish
    # Where no document exceeds the window, the window changes nothing.
    short = [2048] * 8
    assert windowed.micro_batch_time(short, 1) == pytest.approx(full.micro_batch_time(short, 1))


def test_the_planners_array_costs_equal_the_cost_model_with_windows():
    """`greedy.micro_batch_costs` prices groups as arrays; with windows, as `micro_batch_time`."""
    from megatron_hdp.scheduler.greedy import micro_batch_costs

    model = CostModel(dataclasses.replace(SHAPE, window=1023, windowed_layers=2), H100)
    lengths = np.array([65536, 700, 3000, 120, 40000, 9000])
    ids = np.array([0, 1, 2, 3, 4, 5])
    offsets = np.array([0, 1, 4, 5, 6])  # a ring, a pack of three, two rings
    ks = np.array([4, 1, 2, 1])
    got = micro_batch_costs(model.planner_cost, lengths, offsets, ids, ks, 16384)
    groups = [[65536], [700, 3000, 120], [40000], [9000]]
    want = [model.micro_batch_time(g, int(k)) for g, k in zip(groups, ks, strict=True)]
    assert got.tolist() == pytest.approx(want, rel=1e-12)
