"""Interleaved 1F1B (virtual pipeline stages): order, padding, execution, PP-Balance.

Checked against the textbook step of equal micro-batches, `M t + (d - 1) t / v`
(Narayanan et al. 2021, sec. 2.2), against Megatron's own count checks (restated from its
`forward_backward_pipelining_with_interleaving`) and against a brute-force event simulator
(`tests.plan_checks.brute_force_interleaved`). `tests/megatron/test_interleaved_order.py`
holds the order to Megatron-Core's own schedule table.
"""

import numpy as np
import pytest

from megatron_hdp.scheduler import plan_step
from megatron_hdp.scheduler.interleaved import (
    count_problem,
    execute_interleaved,
    interleaved_order,
    padded_count,
    simulate_plan_interleaved,
)
from megatron_hdp.scheduler.pipeline_timeline import plan_lists
from megatron_hdp.scheduler.plan import lockstep_problems
from tests.plan_checks import brute_force_interleaved, megatron_interleaved_order


@pytest.mark.parametrize(("d", "v", "m"), [(2, 2, 4), (2, 2, 6), (4, 2, 8), (4, 3, 12), (3, 4, 9)])
def test_equal_micro_batches_take_the_textbook_interleaved_step(d, v, m):
    t = 1.5  # forward + backward per stage of one micro-batch
    fwd = np.full((m, v * d), t / 3 / v)
    ex = execute_interleaved([list(range(m))], fwd, 2 * fwd, num_stages=d, chunks=v)
    assert ex.completed
    assert ex.step_time == pytest.approx(m * t + (d - 1) * t / v)
    assert ex.busy == pytest.approx(np.full((1, d), m * t))


def _megatron_accepts(m, d, n):
    """Megatron's checks, as its interleaved schedule raises them."""
    return not (n > m or n < d) and not (0 < m % n < d)


@pytest.mark.parametrize("d", [2, 3, 4])
@pytest.mark.parametrize("n_extra", [0, 1, 3])
def test_padding_is_the_least_count_megatron_accepts(d, n_extra):
    n = d + n_extra
    assert padded_count(0, d, n) == 0
    for m in range(1, 30):
        want = next(k for k in range(m, 10 * m + n) if _megatron_accepts(k, d, n))
        assert padded_count(m, d, n) == want, m
        assert (count_problem(m, d, n) is None) == _megatron_accepts(m, d, n)


def test_order_refuses_a_count_megatron_refuses():
    with pytest.raises(ValueError, match="last group of 1"):
        interleaved_order(5, 0, 2, 2)
    with pytest.raises(ValueError, match="group size 3 is smaller than the 4"):
        padded_count(5, 4, 3)


@pytest.mark.parametrize(("d", "v", "n"), [(2, 2, 2), (4, 2, 4), (3, 3, 4), (2, 4, 3)])
def test_order_matches_the_written_out_schedule(d, v, n):
    for m in range(n, 3 * n + 2):
        if count_problem(m, d, n) is not None:
            continue
        for s in range(d):
            got = interleaved_order(m, s, d, v, n)
            want = megatron_interleaved_order(m, s, d, v, n)
            assert [(u, c, "FB"[k]) for u, c, k in got] == want
            every = [(u, c, k) for u in range(m) for c in range(v) for k in (0, 1)]
            assert sorted(got) == every


def _padded_lists(plan, d, n):
    lists = [list(x) for x in plan_lists(plan)]
    extra = plan.num_micro_batches
    for a in lists:
        pad = padded_count(len(a), d, n) - len(a)
        a.extend(range(extra, extra + pad))
        extra += pad
    return lists, extra


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("d", "v"), [(2, 2), (3, 2), (2, 3)])
def test_pp_balance_plans_run_interleaved_as_the_brute_force_simulator(seed, d, v):
    rng = np.random.default_rng([47, 5, seed, d, v])
    pool, capacity = int(rng.integers(2, 6)), 64
    lengths = [int(x) for x in rng.integers(1, capacity * pool, size=int(rng.integers(2, 12)))]
    plan = plan_step(
        lengths, pool_size=pool, capacity=capacity, pipeline_stages=d, virtual_stages=v
    )
    assert lockstep_problems(plan) == []
    costs = rng.uniform(0.5, 2.0, plan.num_micro_batches)
    ex = simulate_plan_interleaved(plan, d, v, costs=costs)
    assert ex.completed, ex.stuck
    lists, total = _padded_lists(plan, d, d)
    done, finish = brute_force_interleaved(
        lists, list(costs) + [0.0] * (total - len(costs)), d, v, d
    )
    assert done
    assert ex.finish == pytest.approx(finish)


def test_pp_balance_prices_the_interleaved_fill():
    """Equal one-pack sequences: 1F1B and interleaved plans agree with their own steps."""
    lengths, pool, capacity, d = [64] * 16, 2, 64, 4
    for v in (1, 2, 4):
        plan = plan_step(
            lengths, pool_size=pool, capacity=capacity, pipeline_stages=d, virtual_stages=v
        )
        assert sorted(plan.num_micro_batches_per_rank()) == [8, 8]
        if v > 1:
            t = plan.micro_batches[0].predicted_cost / d
            step = simulate_plan_interleaved(plan, d, v, forward_share=1 / 3).step_time
            assert step == pytest.approx(8 * t + (d - 1) * t / v)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_virtual_stages_are_refused_by_value(bad):
    with pytest.raises(ValueError, match=f"virtual_stages must be an integer >= 1, got {bad!r}"):
        plan_step([10, 20], pool_size=2, capacity=16, pipeline_stages=2, virtual_stages=bad)
