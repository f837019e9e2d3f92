"""The planner benchmark's rank-load relaxation bound (`scripts/bench/rank_load_relaxation.py`).

Checked against a brute force over widths and orders of list schedules (every such
schedule is a plan): the solver's bound never exceeds the best one, at any time scale,
and on tiny batches it closes the fluid bound's gap, so that the planner's plan there is
shown optimal.
"""

import pytest

from megatron_hdp.scheduler.placement import plan_balanced
from megatron_hdp.scheduler.ring_sizing import step_lower_bound
from megatron_hdp.sim.distributions import BENCH_MIXES, first_sequences
from tests.unit.scripts_loader import load_script
from tests.unit.test_ring_sizing import (
    CONFLICTS,
    MODEL,
    TINY,
    C,
    brute_force_best_schedule,
    costs_of,
    makespan,
)

relaxation = load_script("scripts/bench/rank_load_relaxation.py", "rank_load_relaxation")


def tiny(mix, pool, seed):
    return [int(x) for x in first_sequences(BENCH_MIXES[mix], [pool, seed, 11], 5, pool * C)]


CASES = [(pool, tiny(mix, pool, seed)) for mix, pool, seed in TINY] + CONFLICTS


@pytest.mark.parametrize("pool, seqlens", CASES)
def test_the_relaxation_never_exceeds_the_best_schedule(pool, seqlens):
    # The solver's own bound, not clipped to `lower` or `upper`: with no lower bound given
    # and every width a plan within `best` could use, it must not exceed that plan.
    best = brute_force_best_schedule(seqlens, pool, wider=3)
    got = relaxation.rank_load_bound(seqlens, pool, MODEL, C, lower=0.0, upper=best, time_limit=30)
    assert got["optimal"]
    assert 0.5 * best < got["dual"] <= best * (1 + 1e-9)


@pytest.mark.parametrize("scale", [1e-5, 1.0, 1e3])
def test_the_relaxation_holds_at_any_time_scale(scale):
    # The solver's tolerances are absolute: times of microseconds or hours must give the
    # same bound relative to the step.
    class Scaled:
        def cost_arrays(self, *args):
            return MODEL.cost_arrays(*args)

        def time(self, s, k):
            return scale * MODEL.time(s, k)

    pool, seqlens = CASES[0]
    best = brute_force_best_schedule(seqlens, pool, wider=3)
    got = relaxation.rank_load_bound(
        seqlens, pool, Scaled(), C, lower=0.0, upper=scale * best, time_limit=30
    )
    assert got["dual"] / (scale * best) == pytest.approx(1.0, abs=1e-6)


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
