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

With `--policies` it instead times, per pool (default 1,024, 16,384 and 65,536 ranks) and
mix, the README's call `plan_step(seqlens, pool_size=N, capacity=C)` (the default policy,
no cost model), the same with `policy="balanced"` and the cost model, and the greedy
baseline without and with the cost model, into `results/plan_step_policies.json`.

Run from the repository root:

    python scripts/bench/bench_plan_step.py                     # about a minute
    python scripts/bench/bench_plan_step.py --pools 512 --repeats 3
    python scripts/bench/bench_plan_step.py --policies --mixes byted_like --repeats 3
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one core: set before numpy loads its pools

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
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
#: Pools of `--policies` (the README's call against the greedy baseline).
POLICY_POOLS = (1024, 16384, 65536)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixes", nargs="+", default=list(BENCH_MIXES), choices=list(BENCH_MIXES))
    p.add_argument("--pools", nargs="+", type=int, default=None)
    p.add_argument("--repeats", type=int, default=7, help="runs per measurement (median)")
    p.add_argument("--seed", type=int, default=0, help="batch seed (as bench_planner's)")
    p.add_argument(
        "--policies",
        action="store_true",
        help="time the default policy against greedy (pools default to POLICY_POOLS)",
    )
    p.add_argument("--out", type=Path, default=None, help="JSON path")
    args = p.parse_args(argv)
    if args.pools is None:
        args.pools = list(POLICY_POOLS) if args.policies else sorted(GOALS_S)
    if args.out is None:
        name = "plan_step_policies.json" if args.policies else "plan_step_bench.json"
        args.out = REPO / "results" / name
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


def run_policies(mix: str, pool: int, args, cost_model) -> dict:
    """Median times of the default call, balanced with the cost model, and greedy."""
    lengths, _ = batch(mix, pool, "large", args.seed)
    lengths = [int(s) for s in lengths]
    kw = dict(pool_size=pool, capacity=CAPACITY)
    calls = {
        "default_s": lambda: plan_step(lengths, **kw),
        "balanced_cost_model_s": lambda: plan_step(
            lengths, policy="balanced", cost_model=cost_model, **kw
        ),
        "greedy_s": lambda: plan_step(lengths, policy="greedy", **kw),
        "greedy_cost_model_s": lambda: plan_step(
            lengths, policy="greedy", cost_model=cost_model, **kw
        ),
    }
    case = {"mix": mix, "pool": pool, "num_sequences": len(lengths)}
    for name, call in calls.items():
        case[name], plan = timed(call, args.repeats)
        case[name.replace("_s", "_policy")] = plan.policy
    for base in ("default", "balanced_cost_model"):
        case[f"greedy_over_{base}"] = case["greedy_s"]["median_s"] / case[f"{base}_s"]["median_s"]
    case["greedy_cost_model_over_balanced_cost_model"] = (
        case["greedy_cost_model_s"]["median_s"] / case["balanced_cost_model_s"]["median_s"]
    )
    return case


def main_policies(args) -> int:
    """`--policies`: the README's call (default policy) against the greedy baseline."""
    cost_model = CostModel(MODEL, H100)
    results = []
    for pool in args.pools:
        for mix in args.mixes:
            case = run_policies(mix, pool, args, cost_model)
            results.append(case)
            print(
                f"{mix:12s} N={pool:6d} seqs={case['num_sequences']:7d} "
                + " ".join(
                    f"{k[:-2]} {case[k]['median_s'] * 1e3:.1f} ms"
                    for k in (
                        "default_s",
                        "balanced_cost_model_s",
                        "greedy_s",
                        "greedy_cost_model_s",
                    )
                ),
                flush=True,
            )
    report = {
        "benchmark": "plan_step_policies",
        "config": {
            "capacity": CAPACITY,
            "model": asdict(MODEL),
            "device_profile": H100.name,
            "batch": "bench_planner large: 8 * N * C tokens",
            "calls": {
                "default": "plan_step(lengths, pool_size=N, capacity=C) (README)",
                "balanced_cost_model": "policy='balanced', cost_model=CostModel(MODEL, H100)",
                "greedy": "policy='greedy'",
                "greedy_cost_model": "policy='greedy', cost_model=CostModel(MODEL, H100)",
            },
            "repeats": args.repeats,
            "seed": args.seed,
            "threads": 1,
        },
        "versions": environment(),
        "git_revision": git_revision(REPO),
        "machine": machine(),
        "results": results,
    }
    write(args.out, report)
    return 0


def machine() -> dict:
    """Where it ran: host, CPU model, cores, and the load when it started."""
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.processor()
    )
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
    }


def write(path: Path, report: dict) -> None:
    """Write `report` as JSON through a temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(path)
    print(f"wrote {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.policies:
        return main_policies(args)
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
    write(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
