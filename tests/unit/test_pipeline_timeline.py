"""1F1B timelines and the pipeline execution simulator, against hand-derived references.

References here are independent of `pipeline_timeline`: Megatron's op order written out
from its schedule's three loops, step times derived by hand (comments show the arithmetic),
and a brute-force event simulator that runs ops one at a time from each queue's head.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hdp.scheduler import plan_step
from megatron_hdp.scheduler.pipeline_timeline import (
    execute,
    pipeline_timeline,
    simulate_plan,
    stage_order,
    stage_times,
)
from megatron_hdp.scheduler.plan import MicroBatch, lockstep_problems, plan_from_rank_lists
from tests.plan_checks import brute_force_pipelines as _brute_force
from tests.plan_checks import megatron_order, run_to_completion
from tests.property import examples


@pytest.mark.parametrize("m, stages", [(1, 1), (1, 4), (3, 4), (8, 4), (2, 8), (12, 3)])
def test_stage_order_is_megatron_s(m, stages):
    for s in range(stages):
        got = [(p, "B" if b else "F") for p, b in stage_order(m, s, stages)]
        assert got == megatron_order(m, s, stages)
    # By hand: stage 0 of 4 with 3 micro-batches warms up with all three forwards.
    if (m, stages) == (3, 4):
        assert stage_order(3, 0, 4) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


@pytest.mark.parametrize("m", [1, 2, 3, 8, 20])
@pytest.mark.parametrize("stages", [1, 2, 4, 8])
def test_uniform_micro_batches_take_m_plus_d_minus_one_slots(m, stages):
    # Equal micro-batches: the last stage starts after d - 1 forwards, then runs m (F, B)
    # pairs without waiting, and the last backward crosses d - 1 stages back:
    # (d - 1) f + m (f + b) + (d - 1) b = (m + d - 1)(f + b).
    f, b = 1.5, 3.0
    ex = pipeline_timeline([f] * m, [b] * m, stages)
    assert ex.completed
    assert ex.step_time == pytest.approx((m + stages - 1) * (f + b))
    assert np.allclose(ex.busy, m * (f + b))
    assert np.allclose(ex.idle, (stages - 1) * (f + b))
    assert ex.bubble_share == pytest.approx((stages - 1) / (m + stages - 1))


def test_two_unequal_micro_batches_on_two_stages_by_hand():
    # Stage 0 runs F0 F1 B0 B1, stage 1 runs F0 B0 F1 B1; f = (1, 3), b = (2, 6).
    # s0: F0 [0,1], F1 [1,4]; s1: F0 [1,2], B0 [2,4], F1 [4,7], B1 [7,13];
    # s0: B0 [4,6] (after s1's B0 at 4), B1 [13,19].
    ex = pipeline_timeline([1.0, 3.0], [2.0, 6.0], 2)
    assert ex.step_time == pytest.approx(19.0)
    assert np.allclose(ex.busy, [[12.0, 12.0]])
    assert ex.forward_start.tolist() == [0.0, 1.0]
    assert ex.backward_end.tolist() == [6.0, 19.0]


def test_a_ring_waits_for_its_slowest_member_on_every_stage():
    # Two pipelines of 2 stages: P0 runs [L0, R], P1 runs [L1, R]; R is a ring.
    # f/b: L0 1/2, L1 2/4, R 1/2. s0: F_L0 [0,1] (P0), F_L1 [0,2] (P1), F_R [2,3] on both;
    # s1: P0 F_L0 [1,2] B_L0 [2,4]; P1 F_L1 [2,4] B_L1 [4,8]; F_R [8,9], B_R [9,11] on both;
    # s0: P0 B_L0 [4,6], P1 B_L1 [8,12]; B_R [12,14] on both. Both finish at 14.
    # Busy per stage: P0 (1 + 2) + (1 + 2) = 6, P1 (2 + 4) + (1 + 2) = 9.
    f = np.array([[1.0, 1.0], [2.0, 2.0], [1.0, 1.0]])
    ex = execute([[0, 2], [1, 2]], f, 2 * f)
    assert ex.completed
    assert ex.finish.tolist() == [14.0, 14.0]
    assert ex.forward_start.tolist() == [0.0, 0.0, 2.0]
    assert np.allclose(ex.busy, [[6.0, 6.0], [9.0, 9.0]])
    assert ex.backward_end.tolist() == [6.0, 12.0, 14.0]


def _order_consistent_plan_that_deadlocks():
    # Pool 2, C = 8: X and Y are rings over both ranks, Z is local on rank 0. Global order
    # X < Z < Y, so rank 0 runs [X, Z, Y] and rank 1 runs [X, Y]: fine without pipelines.
    return plan_from_rank_lists(
        [16, 4, 16],
        2,
        8,
        "manual",
        [
            MicroBatch(order=0, ring=(0, 1), seq_indices=(0,), predicted_cost=3.0),
            MicroBatch(order=1, ring=(0,), seq_indices=(1,), predicted_cost=3.0),
            MicroBatch(order=2, ring=(0, 1), seq_indices=(2,), predicted_cost=3.0),
        ],
    )


def test_a_plan_that_is_not_lockstep_deadlocks_on_pipelines():
    plan = _order_consistent_plan_that_deadlocks()
    plan.validate()
    assert run_to_completion(plan)  # one-stage ranks: no deadlock
    assert lockstep_problems(plan)
    # Two stages. Rank 0 (3 micro-batches) stage 0 runs F_X F_Z B_X F_Y ...: B_X before
    # F_Y. Rank 1 (2 micro-batches) stage 0 runs F_X F_Y B_X B_Y: F_Y before B_X. Each
    # waits for the other at its ring op: a cycle.
    ex = simulate_plan(plan, 2)
    assert not ex.completed and ex.step_time == float("inf")
    assert any("pipeline 0 stage 0: waits at op 2, B of micro-batch 0" in s for s in ex.stuck)
    assert any("pipeline 1 stage 0: waits at op 1, F of micro-batch 2" in s for s in ex.stuck)
    assert not _brute_force(plan, 2)[0]
    # One stage, or a flush around every ring: it runs.
    assert simulate_plan(plan, 1).completed
    assert simulate_plan(plan, 2, schedule="flush").completed


def test_the_greedy_placement_deadlocks_pipelines_which_is_why_it_is_refused():
    plan = plan_step([46, 58, 88], pool_size=6, capacity=16, policy="greedy")
    assert run_to_completion(plan)
    assert not simulate_plan(plan, 4).completed
    assert not _brute_force(plan, 4)[0]
    assert simulate_plan(plan, 4, schedule="flush").completed
    with pytest.raises(ValueError, match="'greedy' placement policy is not lock-step"):
        plan_step([46, 58, 88], pool_size=6, capacity=16, policy="greedy", pipeline_stages=4)


def test_stage_times_split_uniformly():
    f, b = stage_times([6.0, 12.0], 3, [1 / 3, 0.25])
    assert np.allclose(f, [[2 / 3] * 3, [1.0] * 3])
    assert np.allclose(b, [[4 / 3] * 3, [3.0] * 3])


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        execute([[0]], np.ones((1, 2)), np.ones((1, 2)), schedule="gpipe")
    with pytest.raises(ValueError, match="lists a micro-batch twice"):
        execute([[0, 0]], np.ones((1, 2)), np.ones((1, 2)))
    with pytest.raises(ValueError, match="stage 4 of 4 stages"):
        stage_order(2, 4, 4)


@st.composite
def random_plans(draw):
    """Plans from the planners (lock-step or not) plus costs, for the simulator."""
    pool = draw(st.integers(1, 5))
    capacity = draw(st.integers(2, 16))
    lengths = draw(st.lists(st.integers(1, pool * capacity), min_size=1, max_size=10))
    stages = draw(st.integers(1, 4))
    policy = draw(st.sampled_from(["greedy", "balanced", "static"]))
    plan = plan_step(lengths, pool_size=pool, capacity=capacity, policy=policy)
    costs = [draw(st.floats(0.5, 20.0)) for _ in plan.micro_batches]
    return plan, stages, costs


@pytest.mark.property
@given(random_plans())
@settings(max_examples=examples(150), deadline=None)
def test_execution_matches_a_brute_force_event_simulation(case):
    plan, stages, costs = case
    ex = simulate_plan(plan, stages, costs=costs)
    completed, finish = _brute_force(plan, stages, costs)
    assert ex.completed == completed
    if completed:
        assert np.allclose(ex.finish, finish)
        busy = np.zeros(plan.pool_size)
        for u, mb in enumerate(plan.micro_batches):
            for r in mb.ring:
                busy[r] += costs[u] / stages
        assert np.allclose(ex.busy, busy[:, None])


@pytest.mark.property
@given(
    st.integers(1, 8),
    st.lists(st.floats(0.01, 100.0), min_size=1, max_size=24),
    st.floats(0.05, 0.95),
)
@settings(max_examples=examples(300), deadline=None)
def test_heaviest_first_lists_stay_within_the_planner_estimate(stages, taus, share):
    # PP-Balance's estimate sum(t) + (d - 1) max(t) for a non-increasing list with one
    # forward share; and no list beats sum(t) + (d - 1)(f_first + b_last).
    t = np.sort(np.asarray(taus))[::-1]
    ex = pipeline_timeline(t * share, t * (1 - share), stages)
    assert ex.step_time <= (t.sum() + (stages - 1) * t.max()) * (1 + 1e-9)
    floor = t.sum() + (stages - 1) * (t[0] * share + t[-1] * (1 - share))
    assert ex.step_time >= floor * (1 - 1e-9)
