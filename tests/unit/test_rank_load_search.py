"""The planner benchmark's rank-load search bound (`scripts/bench/rank_load_search.py`).

Checked against an exhaustive rank-load optimum (every width and every member set of every
sequence, ranks sorted to merge states that differ only by rank names) and against the
brute force over list schedules, which are plans: the bound is valid (never above either),
exact where the search decides every step, and never claims more when its budget runs out.
"""

import itertools

import numpy as np
import pytest

from megatron_hdp.scheduler.placement import plan_balanced
from megatron_hdp.scheduler.ring_sizing import step_lower_bound
from tests.unit.scripts_loader import load_script
from tests.unit.test_rank_load_relaxation import CASES
from tests.unit.test_ring_sizing import (
    MODEL,
    C,
    brute_force_best_schedule,
    costs_of,
    makespan,
)

search = load_script("scripts/bench/rank_load_search.py", "rank_load_search")


def exhaustive_rank_load(seqlens, pool, model=MODEL, upper=np.inf):
    """The least max rank load over every width and member set (states above `upper`
    dropped: they cannot be the least when a plan of step `upper` exists)."""
    states = {(0.0,) * pool}
    for s in seqlens:
        k_min = max(1, -(-s // C))
        nxt = set()
        for k in range(k_min, max(k_min, min(pool, s)) + 1):
            t = float(model.time(float(s), k))
            for loads in states:
                for members in itertools.combinations(range(pool), k):
                    new = list(loads)
                    for r in members:
                        new[r] += t
                    if max(new) <= upper:
                        nxt.add(tuple(sorted(new)))
        states = nxt
    return min(max(loads) for loads in states)


def random_batch(seed, pool, count):
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(200, min(3, pool) * C, size=count)]


RANDOM = [
    (pool, random_batch(seed, pool, count))
    for seed, pool, count in [
        (0, 2, 5),
        (1, 3, 5),
        (2, 3, 6),
        (3, 4, 5),
        (4, 4, 6),
        (5, 4, 4),
        (6, 5, 4),
    ]
]


@pytest.mark.parametrize("pool, seqlens", RANDOM)
def test_the_search_finds_the_exhaustive_rank_load_optimum(pool, seqlens):
    best = exhaustive_rank_load(seqlens, pool)
    got = search.rank_load_search_bound(seqlens, pool, MODEL, C, lower=0.0, upper=2.0 * best)
    assert got["undecided"] == 0
    assert best * (1 - 2 * search.TOLERANCE) <= got["value"] <= best


@pytest.mark.parametrize("pool, seqlens", CASES)
def test_the_search_never_exceeds_the_best_schedule(pool, seqlens):
    best = brute_force_best_schedule(seqlens, pool, wider=3)
    optimum = exhaustive_rank_load(seqlens, pool, upper=best * (1 + 1e-12))
    got = search.rank_load_search_bound(seqlens, pool, MODEL, C, lower=0.0, upper=best)
    assert got["value"] <= optimum <= best * (1 + 1e-12)
    assert got["value"] >= optimum * (1 - 2 * search.TOLERANCE)


@pytest.mark.parametrize("scale", [1e-5, 1e3])
def test_the_search_holds_at_any_time_scale(scale):
    class Scaled:
        def cost_arrays(self, *args):
            return MODEL.cost_arrays(*args)

        def time(self, s, k):
            return scale * MODEL.time(s, k)

    pool, seqlens = RANDOM[3]
    best = exhaustive_rank_load(seqlens, pool)
    got = search.rank_load_search_bound(
        seqlens, pool, Scaled(), C, lower=0.0, upper=2.0 * scale * best
    )
    assert got["value"] / (scale * best) == pytest.approx(1.0, abs=2 * search.TOLERANCE)


def test_an_exhausted_budget_proves_nothing():
    pool, seqlens = RANDOM[4]
    best = exhaustive_rank_load(seqlens, pool)
    lower = 0.5 * best
    got = search.rank_load_search_bound(
        seqlens, pool, MODEL, C, lower=lower, upper=2.0 * best, node_budget=1
    )
    assert got["undecided"] > 0 and got["value"] <= best
    # Whatever it proves, it proves with one node per decision: only a width or work
    # argument, never a placement it did not finish.
    full = search.rank_load_search_bound(seqlens, pool, MODEL, C, lower=lower, upper=2.0 * best)
    assert got["value"] <= full["value"]


def test_on_the_benchmark_s_pareto_like_16_rank_batch_the_search_lifts_the_fluid_bound():
    # The planner benchmark's small Pareto-like batch on 16 ranks (seed 2025): 24
    # sequences, all shorter than C. HiGHS reached 1.018 of the fluid bound in 300 s.
    seqlens = [2036, 1330, 1093, 1074, 1022, 733, 694, 672, 613, 573, 545, 491]
    seqlens += [439, 417, 405, 371, 351, 350, 349, 330, 325, 295, 282, 263]
    fluid = step_lower_bound(costs_of(seqlens, 16)).value
    plan = makespan(plan_balanced(seqlens, pool_size=16, capacity=C, cost_model=MODEL))
    got = search.rank_load_search_bound(seqlens, 16, MODEL, C, lower=fluid, upper=plan)
    assert got["proven"] and got["value"] >= 1.025 * fluid
    assert plan <= 1.03 * got["value"] and plan > 1.05 * fluid


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lower": 2.0, "upper": 1.0}, "lower=2.0, upper=1.0"),
        ({"lower": -1.0, "upper": 1.0}, "lower=-1.0"),
        ({"lower": 0.0, "upper": float("nan")}, "upper=nan"),
        ({"lower": 0.0, "upper": 1.0, "node_budget": 0}, "node_budget must be"),
        ({"lower": 0.0, "upper": 1.0, "node_budget": 2.5}, "got 2.5"),
    ],
)
def test_bad_input_is_refused_with_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        search.rank_load_search_bound([1000, 2000], 2, MODEL, C, **kwargs)


def test_an_empty_batch_is_refused():
    with pytest.raises(ValueError, match="empty batch"):
        search.rank_load_search_bound([], 2, MODEL, C, lower=0.0, upper=1.0)
