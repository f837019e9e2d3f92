"""Fixed planner inputs whose plans are pinned by hash (`test_plan_columns.py`).

The hashes in `plan_regression_hashes.json` were written by the planner as it was before
plans became columnar (revision 5f24fb3), with this file run as a script from a checkout
of that revision:

    PYTHONPATH=<old checkout> python tests/unit/plan_regression_cases.py --write FILE

An intended change of the planner's decisions changes them; rewrite the file from the
revision that makes the change, and say so in its commit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

HASHES = Path(__file__).with_name("plan_regression_hashes.json")


def cases():
    """(name, lengths, plan_step keyword arguments) of every pinned plan."""
    from megatron_hdp.scheduler.cost import H100, CostModel
    from megatron_hdp.sim.distributions import BENCH_MIXES, first_sequences
    from megatron_hdp.sim.models import MODELS

    cost_model = CostModel(MODELS["llama-7b"].shape, H100)
    capacity = 8192
    for mix, gen in sorted(BENCH_MIXES.items()):
        for pool in (8, 16, 64, 509):
            rng = np.random.default_rng([7, pool, len(mix)])
            max_len = min(pool * capacity, 2 << 20)
            for size, lengths in (
                ("large", gen(rng, 4 * pool * capacity, max_len)),
                ("small", first_sequences(gen, rng, max(2, round(1.5 * pool)), max_len)),
            ):
                lengths = [int(s) for s in lengths]
                base = dict(pool_size=pool, capacity=capacity)
                yield (
                    f"{mix}-{size}-{pool}-balanced",
                    lengths,
                    dict(base, policy="balanced", cost_model=cost_model),
                )
                if pool <= 64:
                    yield (
                        f"{mix}-{size}-{pool}-balanced-simple",
                        lengths,
                        dict(base, policy="balanced"),
                    )
                    yield (
                        f"{mix}-{size}-{pool}-greedy",
                        lengths,
                        dict(base, policy="greedy", cost_model=cost_model),
                    )
                    yield (
                        f"{mix}-{size}-{pool}-static",
                        lengths,
                        dict(base, policy="static", cost_model=cost_model),
                    )
                    yield (
                        f"{mix}-{size}-{pool}-offload",
                        lengths,
                        dict(base, policy="balanced", cost_model=cost_model, offload=True),
                    )
                if pool <= 16 and size == "large":
                    for policy in ("balanced", "static"):
                        yield (
                            f"{mix}-{size}-{pool}-pp2-{policy}",
                            lengths,
                            dict(base, policy=policy, cost_model=cost_model, pipeline_stages=2),
                        )


def plan_hash(plan) -> str:
    """sha256 of the plan's canonical JSON (`StepPlan.to_json`)."""
    return hashlib.sha256(plan.to_json().encode()).hexdigest()


def compute() -> dict:
    """Every case's plan hash, or the error it raised (`error: Type: message`)."""
    from megatron_hdp.scheduler import plan_step

    out = {}
    for name, lengths, kwargs in cases():
        try:
            out[name] = plan_hash(plan_step(lengths, **kwargs))
        except ValueError as err:
            out[name] = f"error: {type(err).__name__}: {err}"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="write the pinned plan hashes")
    p.add_argument("--write", type=Path, required=True)
    args = p.parse_args(argv)
    args.write.write_text(json.dumps(compute(), indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
