"""PP-Balance and the static mesh on pipelines: lock-step, valid, deadlock-free, and fast.

Checked independently of the planner: lock step by `plan.lockstep_problems`, tokens per
member by `sharding.rank_token_counts`, execution by a brute-force event simulator
(`tests.plan_checks`), step times by `pipeline_timeline` and by hand formulas.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hdp.scheduler import plan_step
from megatron_hdp.scheduler.cost import H100, CostModel
from megatron_hdp.scheduler.pipeline_timeline import simulate_plan
from megatron_hdp.scheduler.placement import plan_balanced, plan_static
from megatron_hdp.scheduler.plan import lockstep_problems
from megatron_hdp.scheduler.pp_balance import (
    forward_shares,
    micro_batch_costs,
    pipeline_execution,
    pipeline_lower_bound,
    plan_pp_balanced,
)
from megatron_hdp.sharding import rank_token_counts
from megatron_hdp.sim.distributions import GENERATORS
from megatron_hdp.sim.models import MODELS
from tests.plan_checks import brute_force_pipelines, run_to_completion
from tests.property import examples


def check_pipeline_plan(plan, lengths, capacity, stages, *, brute=True):
    """Every invariant of a plan for pipelines, checked without the planner's code."""
    plan.validate()
    assert lockstep_problems(plan) == []
    placed = sorted(i for mb in plan.micro_batches for i in mb.seq_indices)
    assert placed == list(range(len(lengths)))
    for mb in plan.micro_batches:
        seqs = [lengths[i] for i in mb.seq_indices]
        counts = rank_token_counts(seqs, mb.cp_size)
        assert min(counts) >= 1 and max(counts) <= capacity
        if mb.cp_size > 1 and len(seqs) == 1:
            assert mb.cp_size >= math.ceil(seqs[0] / capacity)  # at least its minimal ring
    lists = [plan.for_rank(r) for r in range(plan.pool_size)]
    for lst in lists:
        assert [mb.order for mb in lst] == sorted(mb.order for mb in lst)
    assert run_to_completion(plan)
    ex = simulate_plan(plan, stages)
    assert ex.completed, ex.stuck
    if brute:
        done, finish = brute_force_pipelines(plan, stages)
        assert done and np.allclose(ex.finish, finish)
    return ex


@st.composite
def batches(draw):
    pool = draw(st.integers(1, 12))
    capacity = draw(st.integers(2, 64))
    stages = draw(st.integers(2, 6))
    lengths = draw(st.lists(st.integers(1, pool * capacity), min_size=1, max_size=40))
    return lengths, pool, capacity, stages


@pytest.mark.property
@given(batches())
@settings(max_examples=examples(200), deadline=None)
def test_pp_balance_and_static_plans_are_lockstep_and_run(batch):
    lengths, pool, capacity, stages = batch
    plans = {}
    for policy in ("balanced", "static"):
        try:
            plans[policy] = plan_step(
                lengths, pool_size=pool, capacity=capacity, policy=policy, pipeline_stages=stages
            )
        except ValueError as err:
            assert "token" in str(err) or "no CP size" in str(err)
    if "static" in plans:
        # PP-Balance never refuses a batch the static mesh can plan.
        assert "balanced" in plans
    for policy, plan in plans.items():
        ex = check_pipeline_plan(plan, lengths, capacity, stages)
        starts = [mb.predicted_start for mb in plan.micro_batches]
        assert np.allclose(starts, ex.forward_start)
        assert plan == plan_step(
            lengths, pool_size=pool, capacity=capacity, policy=policy, pipeline_stages=stages
        )
    if "balanced" in plans:
        bound = pipeline_lower_bound(
            lengths, pool_size=pool, capacity=capacity, pipeline_stages=stages
        )["bound"]
        assert simulate_plan(plans["balanced"], stages).step_time >= bound * (1 - 1e-9)


def test_impossible_batches_are_refused_by_both_policies():
    # 81 tokens fill all 9 x 9 slots of the one ring every pipeline joins; the 1-token
    # sequence would need a position of its own on all nine, with one token between them.
    for policy in ("balanced", "static"):
        with pytest.raises(ValueError, match="token"):
            plan_step([81, 1], pool_size=9, capacity=9, policy=policy, pipeline_stages=4)


def test_equal_packs_spread_evenly_by_hand():
    # 8 sequences of C tokens on 4 pipelines of 4 stages, simple costs: each costs
    # C + C^2 / (2C) = 1.5 C, per stage t = 1.5 C / 4; two each: (2 + 4 - 1) t.
    c = 64
    plan = plan_step([c] * 8, pool_size=4, capacity=c, policy="balanced", pipeline_stages=4)
    assert plan.num_micro_batches_per_rank() == [2, 2, 2, 2]
    ex = check_pipeline_plan(plan, [c] * 8, c, 4)
    assert ex.step_time == pytest.approx(5 * 1.5 * c / 4)


def test_a_ring_over_the_pool_runs_first_on_every_pipeline():
    # One 32-token sequence needs the whole pool of 4 at C = 8; four 8-token sequences
    # follow, one per pipeline: every list is [ring, pack].
    lengths = [32, 8, 8, 8, 8]
    plan = plan_step(lengths, pool_size=4, capacity=8, policy="balanced", pipeline_stages=2)
    for r in range(4):
        lst = plan.for_rank(r)
        assert [mb.cp_size for mb in lst] == [4, 1]
    # Simple costs: ring 32 + 32^2/16 = 96 per 4 members = 24, pack 8 + 4 = 12. Stage
    # times t = 12 and 6, forward a third: F_R 4, B_R 8, F_P 2, B_P 4. Stage 0 runs
    # F_R F_P B_R B_P, stage 1 F_R B_R F_P B_P: s0 F_R [0,4] F_P [4,6]; s1 F_R [4,8]
    # B_R [8,16] F_P [16,18] B_P [18,22]; s0 B_R [16,24] B_P [24,28].
    ex = check_pipeline_plan(plan, lengths, 8, 2)
    assert ex.step_time == pytest.approx(28.0)


def test_plan_step_refusals_and_pipeline_stages_one():
    lengths = [40, 5, 7, 30]
    with pytest.raises(ValueError, match="offloading is not planned with pipeline"):
        plan_step(
            lengths,
            pool_size=4,
            capacity=16,
            policy="balanced",
            offload=True,
            cost_model=CostModel(MODELS["llama-7b"].shape, H100),
            pipeline_stages=2,
        )
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="pipeline_stages must be an integer >= 1"):
            plan_step(lengths, pool_size=4, capacity=16, pipeline_stages=bad)
    for policy in ("greedy", "balanced", "static"):
        assert plan_step(lengths, pool_size=4, capacity=16, policy=policy) == plan_step(
            lengths, pool_size=4, capacity=16, policy=policy, pipeline_stages=1
        )


def test_offload_ratios_stay_on_their_rings():
    # PP-Balance itself takes ring sizes and ratios (the simulator's composition).
    lengths = [100, 60, 5, 6, 7]
    sizes = [4, 3, 1, 1, 1]  # smaller than ceil(s / 16) = 7 and 4: they offload
    ratios = [0.5, 0.4, 0.0, 0.0, 0.0]
    plan = plan_pp_balanced(
        lengths,
        pool_size=8,
        capacity=16,
        pipeline_stages=2,
        ring_sizes=sizes,
        offload_ratios=ratios,
        num_layers=8,
    )
    plan.validate()
    assert lockstep_problems(plan) == []
    by_seq = {mb.seq_indices[0]: mb for mb in plan.micro_batches if mb.cp_size > 1}
    assert by_seq[0].offload_ratio == 0.5 and by_seq[1].offload_ratio == 0.4
    assert by_seq[0].cp_size >= 4 and by_seq[1].cp_size >= 3


# ------------------------------------------------------------- heavy-tailed batches

MODEL = MODELS["mixtral-8x7b"]
C = 8192


def _cells():
    for mix in ("github_like", "byted_like"):
        for pool in (16, 64):
            for stages in (2, 4, 8):
                yield mix, pool, stages


@pytest.fixture(scope="module")
def cost_model():
    return CostModel(MODEL.shape, H100.replica(MODEL.tp))


@pytest.mark.parametrize("mix, pool, stages", list(_cells()))
def test_pp_balance_beats_dp_balance_blind_and_static_on_heavy_tails(mix, pool, stages, cost_model):
    rng = np.random.default_rng([7, pool, stages])
    lengths = GENERATORS[mix](rng, 8 * pool * C, min(pool * C, 2 * 1024 * 1024))
    plan = plan_step(
        lengths,
        pool_size=pool,
        capacity=C,
        policy="balanced",
        cost_model=cost_model,
        pipeline_stages=stages,
    )
    ex = check_pipeline_plan(plan, lengths, C, stages, brute=False)
    # predicted_cost is the cost model's time; the execution with the cost model's
    # forward shares is the plan's predicted step.
    assert np.allclose(
        [mb.predicted_cost for mb in plan.micro_batches], micro_batch_costs(plan, cost_model)
    )
    ours, schedule = pipeline_execution(plan, stages, cost_model=cost_model)
    assert schedule == "1f1b"
    assert np.allclose(ours.forward_start, [mb.predicted_start for mb in plan.micro_batches])
    static = plan_step(
        lengths,
        pool_size=pool,
        capacity=C,
        policy="static",
        cost_model=cost_model,
        pipeline_stages=stages,
    )
    check_pipeline_plan(static, lengths, C, stages, brute=False)
    static_ex, _ = pipeline_execution(static, stages, cost_model=cost_model)
    # DP-Balance as the paper has it (minimal rings), blind to the pipeline; PP-Balance
    # does not size rings either.
    blind = plan_balanced(
        lengths, pool_size=pool, capacity=C, cost_model=cost_model, size_rings=False
    )
    blind_ex, _ = pipeline_execution(blind, stages, cost_model=cost_model)  # flush if it deadlocks
    bound = pipeline_lower_bound(
        lengths, pool_size=pool, capacity=C, pipeline_stages=stages, cost_model=cost_model
    )["bound"]
    assert bound <= ours.step_time * (1 + 1e-9)
    assert bound <= blind_ex.step_time * (1 + 1e-9)
    assert ours.step_time < blind_ex.step_time
    assert ours.step_time < static_ex.step_time
    assert ex.completed and forward_shares(plan, cost_model).max() <= 1 / 3 + 1e-12


def test_the_static_plan_gives_every_member_a_token_only_when_asked():
    # cp 4 at C = 8 (context 32): best fit makes [29, 2] and [2]; the 2-token pack leaves
    # two members empty. With a token per member a 2 moves over: [29] and [2, 2].
    lengths = [29, 2, 2]
    plain = plan_static(lengths, pool_size=4, capacity=8)
    assert any(
        min(rank_token_counts([lengths[i] for i in mb.seq_indices], mb.cp_size)) == 0
        for mb in plain.micro_batches
    )
    piped = plan_static(lengths, pool_size=4, capacity=8, token_per_member=True)
    piped.validate()
    assert sorted(sorted(lengths[i] for i in mb.seq_indices) for mb in piped.micro_batches) == [
        [2, 2],
        [29],
    ]
    with pytest.raises(ValueError, match="cannot give every one of the 4 CP members"):
        plan_static([30, 3], pool_size=4, capacity=8, token_per_member=True)
    assert all(
        min(rank_token_counts([lengths[i] for i in mb.seq_indices], mb.cp_size)) >= 1
        for mb in piped.micro_batches
    )
