"""Whole-`plan_step` time with the columnar plan, against the goals of 100 ms at 16,384 ranks
and 5 ms at 512 (balanced policy, LLaMA-7B-like cost model, C++ core).

For each length mix and pool size, one `large` batch of the planner benchmark
(`bench_planner.batch`: `8 * N * C` tokens, about 8 micro-batches of capacity per rank) is
planned `--repeats` times on one core; the JSON records the median of:

- `plan_step`: the whole call as the trainer makes it (lengths as a Python list of ints in,
  validation, cost arrays, bound, ring sizing with the C++ core, the columnar plan);
- `for_rank`: one rank's `MicroBatch` views (median over 64 ranks spread over the pool);
- `all_micro_batches`: every `MicroBatch` object of the plan (what building the plan cost
  before it was columnar, for comparison) and `digest` / `to_json`.

Run from the repository root:

    python scripts/bench/bench_plan_step.py                     # about a minute
    python scripts/bench/bench_plan_step.py --pools 512 --repeats 3
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one core: set before numpy loads its pools

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_planner import CAPACITY, MODEL, batch, timed  # noqa: E402

from megatron_hdp.provenance import environment, git_revision  # noqa: E402
from megatron_hdp.scheduler import plan_step  # noqa: E402
from megatron_hdp.scheduler.cost import H100, CostModel  # noqa: E402
from megatron_hdp.sim.distributions import BENCH_MIXES  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
#: The issue's goals for the whole `plan_step`, seconds by pool size.
GOALS_S = {512: 0.005, 16384: 0.100}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixes", nargs="+", default=list(BENCH_MIXES), choices=list(BENCH_MIXES))
    p.add_argument("--pools", nargs="+", type=int, default=sorted(GOALS_S))
    p.add_argument("--repeats", type=int, default=7, help="runs per measurement (median)")
    p.add_argument("--seed", type=int, default=0, help="batch seed (as bench_planner's)")
    p.add_argument(
        "--out", type=Path, default=REPO / "results" / "plan_step_bench.json", help="JSON path"
    )
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    bad = [n for n in args.pools if n < 1]
    if bad:
        p.error(f"--pools must be >= 1, got {bad}")
    return args


def run_case(mix: str, pool: int, args, cost_model) -> dict:
    lengths, _ = batch(mix, pool, "large", args.seed)
    lengths = [int(s) for s in lengths]

    def plan():
        return plan_step(
            lengths, pool_size=pool, capacity=CAPACITY, policy="balanced", cost_model=cost_model
        )

    whole, result = timed(plan, args.repeats)
    ranks = np.unique(np.linspace(0, pool - 1, 64).astype(int)).tolist()
    per_rank = []
    for r in ranks:
        t0 = time.perf_counter()
        result.for_rank(r)
        per_rank.append(time.perf_counter() - t0)
    objects, _ = timed(lambda: plan().micro_batches, 1)
    digest, _ = timed(result.digest, args.repeats)
    to_json, _ = timed(result.to_json, 1)
    counts = result.num_micro_batches_per_rank()
    goal = GOALS_S.get(pool)
    return {
        "mix": mix,
        "pool": pool,
        "num_sequences": len(lengths),
        "num_micro_batches": result.num_micro_batches,
        "micro_batches_per_rank_mean": sum(counts) / pool,
        "micro_batches_per_rank_max": max(counts),
        "plan_step_s": whole,
        "for_rank_s_median": statistics.median(per_rank),
        "for_rank_s_max": max(per_rank),
        "plan_step_and_all_micro_batch_objects_s": objects["median_s"],
        "digest_s": digest["median_s"],
        "to_json_s": to_json["median_s"],
        "goal_s": goal,
        "goal_met": None if goal is None else whole["median_s"] < goal,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    cost_model = CostModel(MODEL, H100)
    results = []
    for pool in args.pools:
        for mix in args.mixes:
            case = run_case(mix, pool, args, cost_model)
            results.append(case)
            print(
                f"{mix:12s} N={pool:6d} seqs={case['num_sequences']:7d} "
                f"mb/rank={case['micro_batches_per_rank_mean']:.1f} "
                f"plan_step {case['plan_step_s']['median_s'] * 1e3:7.1f} ms "
                f"(goal {case['goal_s'] * 1e3 if case['goal_s'] else float('nan'):.0f} ms) "
                f"for_rank {case['for_rank_s_median'] * 1e6:.0f} us",
                flush=True,
            )
    report = {
        "benchmark": "plan_step_bench",
        "config": {
            "capacity": CAPACITY,
            "model": asdict(MODEL),
            "batch": "bench_planner large: 8 * N * C tokens",
            "repeats": args.repeats,
            "seed": args.seed,
            "goals_s": GOALS_S,
        },
        "versions": environment(),
        "git_revision": git_revision(REPO),
        "results": results,
        "all_goals_met": all(c["goal_met"] is not False for c in results),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
