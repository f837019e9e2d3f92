"""PP-Balance benchmark: predicted step on pipelines over a lower bound, and plan time.

For each length mix (GitHub-like, Byted-like: `megatron_hdp.sim.distributions`), pool of N
pipelines and pipeline depth d, `--seeds` global batches of `8 * N * C` tokens (C = 8192
tokens per pipeline per micro-batch, lengths clipped at the context `min(N * C, 2M)`) are
planned for a Mixtral-8x7B-shaped model (the paper's PP-Balance model; the cost model
prices one stage's TP group of 4 H100s, `cost.H100.replica(4)`) by:

- `pp_balance`: `plan_step(policy="balanced", pipeline_stages=d)`: PP-Balance, lock-step;
- `dp_balance_blind`: DP-Balance's plan (`plan_step(policy="balanced")`, the C++ core), its
  per-rank lists run as 1F1B pipelines as they are. Such a plan is not lock-step; it runs
  with every ring synchronised on every stage when that completes, and where 1F1B
  deadlocks (a ring at positions that make members wait for each other) with a pipeline
  flush around every ring, which any plan survives (`pipeline_timeline`, schedule
  "flush"). `deadlocks` counts the batches that needed it;
- `static`: the static DP x CP mesh on pipelines (`plan_step(policy="static",
  pipeline_stages=d)`, the smallest CP dividing N that holds the longest sequence),
  lock-step as it is.

Every plan is priced by the same execution simulator (`pipeline_timeline.execute`: 1F1B,
uniform stages, the cost model's forward/backward split) and divided by the lower bound
`pp_balance.pipeline_lower_bound`: max(the best whole-cost chain of any sequence over
ring widths k..N, per-stage work at minimal rings / N + (d - 1) x the cheapest per-stage
time). Plan time: median of `--repeats` runs of the whole `plan_step` on one core.
Medians over the seeds are reported. Run from the repository root:

    python scripts/bench/bench_pp_planner.py                 # full grid, a few minutes
    python scripts/bench/bench_pp_planner.py --pools 64 256 --stages 4 --seeds 1
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one core: set before numpy loads its pool

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict  # noqa: E402
from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from megatron_hdp.provenance import environment, git_revision  # noqa: E402
from megatron_hdp.scheduler import plan_step  # noqa: E402
from megatron_hdp.scheduler.cost import H100, CostModel  # noqa: E402
from megatron_hdp.scheduler.plan import lockstep_problems  # noqa: E402
from megatron_hdp.scheduler.pp_balance import (  # noqa: E402
    pipeline_execution,
    pipeline_lower_bound,
)
from megatron_hdp.sim.distributions import GENERATORS, M, describe  # noqa: E402
from megatron_hdp.sim.models import MODELS  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CAPACITY = 8192
MICRO_BATCHES_PER_PIPELINE = 8
MAX_CONTEXT = 2 * M
MODEL = MODELS["mixtral-8x7b"]
PROFILE = H100.replica(MODEL.tp)
SYSTEMS = ("pp_balance", "dp_balance_blind", "static")
MIXES = ("github_like", "byted_like")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pools", type=int, nargs="+", default=[64, 256, 1024, 4096])
    p.add_argument("--stages", type=int, nargs="+", default=[4, 8], help="pipeline depths d")
    p.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(GENERATORS))
    p.add_argument("--seeds", type=int, default=3, help="batches per cell (medians reported)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per plan-time figure")
    p.add_argument("--seed", type=int, default=2026, help="base seed of the batches")
    p.add_argument(
        "--out",
        type=Path,
        default=REPO / "results" / "pp_planner_bench.json",
        help="JSON path; the PNG goes next to it with the suffix .png",
    )
    args = p.parse_args(argv)
    if args.seeds < 1 or args.repeats < 1:
        p.error("--seeds and --repeats must be >= 1")
    return args


def timed(fn, repeats: int):
    """Median seconds of `repeats` runs of `fn()` and the last result."""
    runs, result = [], None
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs), result


def run_batch(mix, pool, stages, seed, args, cost_model) -> dict:
    """All systems on one batch: plan time, step, ratio to the bound."""
    rng = np.random.default_rng([args.seed, seed, pool, list(GENERATORS).index(mix)])
    lengths = GENERATORS[mix](
        rng, MICRO_BATCHES_PER_PIPELINE * pool * CAPACITY, min(pool * CAPACITY, MAX_CONTEXT)
    )
    bound = pipeline_lower_bound(
        lengths, pool_size=pool, capacity=CAPACITY, pipeline_stages=stages, cost_model=cost_model
    )
    out = {"seed": seed, "num_sequences": len(lengths), "bound": bound, "systems": {}}
    calls = {
        "pp_balance": lambda: plan_step(
            lengths,
            pool_size=pool,
            capacity=CAPACITY,
            policy="balanced",
            cost_model=cost_model,
            pipeline_stages=stages,
        ),
        "dp_balance_blind": lambda: plan_step(
            lengths, pool_size=pool, capacity=CAPACITY, policy="balanced", cost_model=cost_model
        ),
        "static": lambda: plan_step(
            lengths,
            pool_size=pool,
            capacity=CAPACITY,
            policy="static",
            cost_model=cost_model,
            pipeline_stages=stages,
        ),
    }
    for system, call in calls.items():
        seconds, plan = timed(call, args.repeats)
        plan.validate(pool_size=pool)
        ex, schedule = pipeline_execution(plan, stages, cost_model=cost_model)
        entry = {
            "plan_seconds": seconds,
            "step_s": ex.step_time,
            "ratio_to_bound": ex.step_time / bound["bound"],
            "schedule": schedule,
            "lockstep": not lockstep_problems(plan),
            "bubble_share": ex.bubble_share,
            "micro_batches": len(plan.micro_batches),
        }
        if system == "static":
            entry["cp"] = max(mb.cp_size for mb in plan.micro_batches)
        out["systems"][system] = entry
    if seed == 0:
        out["batch"] = describe(lengths)
    return out


def summarise(batches) -> dict:
    """Medians over the seeds, per system."""
    summary = {}
    for system in SYSTEMS:
        rows = [b["systems"][system] for b in batches]
        summary[system] = {
            "ratio_to_bound_median": statistics.median(r["ratio_to_bound"] for r in rows),
            "step_s_median": statistics.median(r["step_s"] for r in rows),
            "plan_seconds_median": statistics.median(r["plan_seconds"] for r in rows),
            "bubble_share_median": statistics.median(r["bubble_share"] for r in rows),
            "deadlocks": sum(r["schedule"] == "flush" for r in rows),
            "lockstep": all(r["lockstep"] for r in rows),
        }
    summary["bound_s_median"] = statistics.median(b["bound"]["bound"] for b in batches)
    return summary


def plot(cells, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(2, len(args.mixes), figsize=(5.5 * len(args.mixes), 8), squeeze=False)
    styles = {4: "-", 8: "--"}
    colors = {"pp_balance": "tab:blue", "dp_balance_blind": "tab:orange", "static": "tab:grey"}
    for col, mix in enumerate(args.mixes):
        for row, (key, label) in enumerate(
            (
                ("ratio_to_bound_median", "predicted step / lower bound (median)"),
                ("plan_seconds_median", "plan time, s (median, one core)"),
            )
        ):
            ax = axes[row][col]
            for stages in args.stages:
                for system in SYSTEMS:
                    pts = [
                        (c["pool"], c["summary"][system][key])
                        for c in cells
                        if c["mix"] == mix and c["stages"] == stages
                    ]
                    if pts:
                        ax.plot(
                            *zip(*sorted(pts)),
                            styles.get(stages, ":"),
                            marker="o",
                            color=colors[system],
                            label=f"{system}, d={stages}",
                        )
            ax.set(
                xscale="log",
                yscale="log",
                xlabel="pipelines N",
                ylabel=label,
                title=f"{mix}: {label.split(' (')[0]}",
            )
            if row == 0:
                ax.axhline(1.0, color="black", lw=0.5)
                ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
                ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(cells) -> str:
    lines = [
        "| mix | N | d | PP-Balance | DP-Balance blind (deadlocked) | static (cp) "
        "| PP-Balance plan s | DP-Balance plan s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        s = c["summary"]
        cp = c["batches"][0]["systems"]["static"]["cp"]
        lines.append(
            f"| {c['mix']} | {c['pool']} | {c['stages']} "
            f"| {s['pp_balance']['ratio_to_bound_median']:.2f} "
            f"| {s['dp_balance_blind']['ratio_to_bound_median']:.2f} "
            f"({s['dp_balance_blind']['deadlocks']}/{len(c['batches'])}) "
            f"| {s['static']['ratio_to_bound_median']:.2f} ({cp}) "
            f"| {s['pp_balance']['plan_seconds_median']:.3f} "
            f"| {s['dp_balance_blind']['plan_seconds_median']:.3f} |"
        )
    lines.append(
        "\nRatios: predicted step (1F1B execution simulator) / lower bound, medians over "
        "the seeds; deadlocked = batches whose DP-Balance plan deadlocks 1F1B and ran with "
        "a pipeline flush around every ring."
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    cost_model = CostModel(MODEL.shape, PROFILE)
    cells = []
    t_start = time.perf_counter()
    for mix in args.mixes:
        for stages in args.stages:
            for pool in args.pools:
                t0 = time.perf_counter()
                batches = [
                    run_batch(mix, pool, stages, seed, args, cost_model)
                    for seed in range(args.seeds)
                ]
                cells.append(
                    {
                        "mix": mix,
                        "pool": pool,
                        "stages": stages,
                        "batches": batches,
                        "summary": summarise(batches),
                    }
                )
                print(
                    f"[{time.perf_counter() - t0:6.1f} s] {mix} N={pool} d={stages}",
                    file=sys.stderr,
                )
    versions = environment()
    for pkg in ("numpy", "matplotlib"):
        versions[pkg] = metadata.version(pkg)
    report = {
        "benchmark": "pp_planner_bench",
        "config": {
            "capacity": CAPACITY,
            "micro_batches_per_pipeline": MICRO_BATCHES_PER_PIPELINE,
            "total_tokens": "micro_batches_per_pipeline * pool * capacity",
            "max_len": f"min(pool * capacity, {MAX_CONTEXT}) (the context; lengths clipped)",
            "model": MODEL.name,
            "model_shape": asdict(MODEL.shape),
            "device": asdict(PROFILE),
            "pools": args.pools,
            "stages": args.stages,
            "mixes": args.mixes,
            "seeds": args.seeds,
            "repeats": args.repeats,
            "seed": args.seed,
            "definitions": {
                "step_s": "pipeline_timeline execution: 1F1B per pipeline, rings "
                "synchronised on every stage, costs c / d per stage (cost model), forward "
                "share from the cost model; max finish over pipelines",
                "bound": "pp_balance.pipeline_lower_bound: max(chain, work)",
                "dp_balance_blind": "DP-Balance plan run as 1F1B pipelines; schedule "
                "'flush' (a pipeline flush around every ring) where 1F1B deadlocks",
                "plan_seconds": "whole plan_step, median of repeats, one core",
            },
        },
        "versions": versions,
        "git_revision": git_revision(REPO),
        "wall_time_s": time.perf_counter() - t_start,
        "results": cells,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    png = args.out.with_suffix(".png")
    plot(cells, args, png)
    print(markdown(cells))
    print(f"\nwrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
