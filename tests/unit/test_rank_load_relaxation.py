"""The planner benchmark's rank-load relaxation bound (`scripts/bench/rank_load_relaxation.py`).

Checked against a brute force over widths and orders of list schedules (every such
schedule is a plan): the bound never exceeds the best one, is at least the fluid bound it
starts from, and on tiny batches closes the fluid bound's gap, so that the planner's plan
there is shown optimal.
"""

import importlib.util
from pathlib import Path

import pytest

from megatron_hdp.scheduler.placement import plan_balanced
from megatron_hdp.scheduler.ring_sizing import step_lower_bound
from megatron_hdp.sim.distributions import BENCH_MIXES, first_sequences
from tests.unit.test_ring_sizing import (
    CONFLICTS,
    MODEL,
    TINY,
    C,
    brute_force_best_schedule,
    costs_of,
    makespan,
)

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "rank_load_relaxation.py"
_SPEC = importlib.util.spec_from_file_location("rank_load_relaxation", _PATH)
relaxation = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(relaxation)


def tiny(mix, pool, seed):
    return [int(x) for x in first_sequences(BENCH_MIXES[mix], [pool, seed, 11], 5, pool * C)]


CASES = [(pool, tiny(mix, pool, seed)) for mix, pool, seed in TINY] + CONFLICTS


@pytest.mark.parametrize("pool, seqlens", CASES)
def test_the_relaxation_is_a_bound_between_the_fluid_one_and_the_best_schedule(pool, seqlens):
    fluid = step_lower_bound(costs_of(seqlens, pool)).value
    best = brute_force_best_schedule(seqlens, pool, wider=3)
    got = relaxation.rank_load_bound(
        seqlens, pool, MODEL, C, lower=fluid, upper=best, time_limit=30
    )
    assert got["optimal"]
    assert fluid <= got["value"] <= best * (1 + 1e-9)


@pytest.mark.parametrize("mix, pool, seed", TINY)
def test_on_tiny_batches_the_relaxation_shows_the_plan_optimal(mix, pool, seed):
    seqlens = tiny(mix, pool, seed)
    fluid = step_lower_bound(costs_of(seqlens, pool)).value
    plan = makespan(plan_balanced(seqlens, pool_size=pool, capacity=C, cost_model=MODEL))
    got = relaxation.rank_load_bound(
        seqlens, pool, MODEL, C, lower=fluid, upper=plan, time_limit=30
    )
    assert fluid < 0.95 * plan  # the fluid bound alone leaves a gap of 5-13%
    assert got["value"] >= plan * (1 - 2e-5)  # the bound is shaded by 1e-5 (SAFETY)
