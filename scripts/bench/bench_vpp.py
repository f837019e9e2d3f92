"""Interleaved 1F1B (virtual pipeline stages) against 1F1B on HDP plans (issue 47 item 5).

Question: do HDP's uneven micro-batch counts per pipeline (PP-Balance gives heavy
pipelines few micro-batches, light ones many) make Megatron's interleaved schedule slower
than the non-interleaved 1F1B? Megatron refuses interleaved counts below PP and last groups
of 1 .. PP-1 micro-batches, so HDP pads each pipeline's list at the end with one-token
micro-batches (cost 0 here, `scheduler.interleaved.padded_count`).

For each length mix, pool of N pipelines, depth d and chunks per stage v, `--seeds` global
batches of `8 N C` tokens (C = 8192 tokens per micro-batch, context `min(N C, 2M)`) for a
Mixtral-8x7B-shaped model (as `bench_pp_planner.py`: one stage's TP group of 4 H100s) are
planned by PP-Balance and run by the execution simulator:

- `1f1b`: PP-Balance's plan (v = 1) under 1F1B (`pipeline_timeline`);
- `interleaved_same_plan`: the same plan under the interleaved schedule with `v` chunks;
- `interleaved`: PP-Balance told about the `v` chunks (`virtual_stages=v`, fill term
  `(d - 1) / v`) under the interleaved schedule.

Reported per cell: the median over seeds of each step, the interleaved/1F1B ratios (below 1
= interleaving is faster) and their maxima. Run from the repository root:

    python scripts/bench/bench_vpp.py                      # the grid below, ~1 minute
    python scripts/bench/bench_vpp.py --pools 16 --stages 4 --chunks 2 --seeds 1
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from megatron_hdp.provenance import environment  # noqa: E402
from megatron_hdp.scheduler import plan_step  # noqa: E402
from megatron_hdp.scheduler.cost import H100, CostModel  # noqa: E402
from megatron_hdp.scheduler.interleaved import simulate_plan_interleaved  # noqa: E402
from megatron_hdp.scheduler.plan import lockstep_problems  # noqa: E402
from megatron_hdp.scheduler.pp_balance import (  # noqa: E402
    forward_shares,
    micro_batch_costs,
    pipeline_execution,
)
from megatron_hdp.sim.distributions import GENERATORS, M  # noqa: E402
from megatron_hdp.sim.models import MODELS  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CAPACITY = 8192
MICRO_BATCHES_PER_PIPELINE = 8
MAX_CONTEXT = 2 * M
MODEL = MODELS["mixtral-8x7b"]
PROFILE = H100.replica(MODEL.tp)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pools", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    p.add_argument("--chunks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--mixes", nargs="+", default=["github_like", "byted_like"])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--out", type=Path, default=REPO / "results" / "vpp_bench.json")
    return p.parse_args(argv)


def _interleaved(plan, d, v, cost_model) -> float:
    ex = simulate_plan_interleaved(
        plan,
        d,
        v,
        costs=micro_batch_costs(plan, cost_model),
        forward_share=forward_shares(plan, cost_model),
    )
    if not ex.completed:
        raise RuntimeError(f"interleaved execution deadlocked: {ex.stuck[:3]}")
    return ex.step_time


def run_batch(mix, pool, d, chunks, seed, args, cost_model) -> dict:
    rng = np.random.default_rng([args.seed, seed, pool, list(GENERATORS).index(mix)])
    lengths = GENERATORS[mix](
        rng, MICRO_BATCHES_PER_PIPELINE * pool * CAPACITY, min(pool * CAPACITY, MAX_CONTEXT)
    )
    kw = dict(pool_size=pool, capacity=CAPACITY, policy="balanced", cost_model=cost_model)
    base = plan_step(lengths, pipeline_stages=d, **kw)
    assert not lockstep_problems(base)
    ex, schedule = pipeline_execution(base, d, cost_model=cost_model, flush_on_deadlock=False)
    assert ex.completed and schedule == "1f1b"
    counts = base.num_micro_batches_per_rank()
    out = {
        "seed": seed,
        "1f1b": ex.step_time,
        "micro_batches_min": int(min(counts)),
        "micro_batches_max": int(max(counts)),
        "pipelines_below_pp": int(sum(1 for c in counts if 0 < c < d)),
    }
    for v in chunks:
        aware = plan_step(lengths, pipeline_stages=d, virtual_stages=v, **kw)
        assert not lockstep_problems(aware)
        out[f"interleaved_same_plan_v{v}"] = _interleaved(base, d, v, cost_model)
        out[f"interleaved_v{v}"] = _interleaved(aware, d, v, cost_model)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    cost_model = CostModel(MODEL.shape, PROFILE)
    cells = []
    for mix in args.mixes:
        for pool in args.pools:
            for d in args.stages:
                rows = [
                    run_batch(mix, pool, d, args.chunks, s, args, cost_model)
                    for s in range(args.seeds)
                ]
                cell = {"mix": mix, "pool": pool, "stages": d, "batches": rows}
                cell["1f1b_median_s"] = statistics.median(r["1f1b"] for r in rows)
                for v in args.chunks:
                    for key in (f"interleaved_same_plan_v{v}", f"interleaved_v{v}"):
                        ratios = [r[key] / r["1f1b"] for r in rows]
                        cell[f"{key}_over_1f1b_median"] = statistics.median(ratios)
                        cell[f"{key}_over_1f1b_max"] = max(ratios)
                cells.append(cell)
                line = " ".join(
                    f"v{v}: {cell[f'interleaved_v{v}_over_1f1b_median']:.3f} "
                    f"(same plan {cell[f'interleaved_same_plan_v{v}_over_1f1b_median']:.3f}, "
                    f"max {cell[f'interleaved_v{v}_over_1f1b_max']:.3f})"
                    for v in args.chunks
                )
                print(f"{mix:12s} N={pool:4d} d={d}: 1f1b {cell['1f1b_median_s']:.3f} s; {line}")
    report = {
        "command": "python " + " ".join(["scripts/bench/bench_vpp.py", *sys.argv[1:]]),
        "model": MODEL.name,
        "capacity": CAPACITY,
        "micro_batches_per_pipeline": MICRO_BATCHES_PER_PIPELINE,
        "environment": environment(),
        "cells": cells,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
