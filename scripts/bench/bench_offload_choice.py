"""Where offloading pays: simulated step times with and without it (planner's choice).

Two parts, both LLaMA-7B (TP 2, so an HDP rank is 2 GPUs), C = 8K tokens per rank, priced
by the one cost model (`scheduler.cost`, copies included: `offload_copy_time`) on two
cluster profiles: `h100` (400 Gb/s InfiniBand per GPU, `sim.clusters`) and a
bandwidth-limited one (`--slow-ib-scale`, default 0.25: 100 Gb/s per GPU).

(a) The paper's ablation order (static -> +dynamic rings -> +offload -> +balance, and
    balance without offloading) on one Byted-like 2M-context batch of `--tokens` tokens
    on `--ablation-gpus` GPUs.
(b) Batches of several 1M-2M sequences (uniform lengths; their minimal rings add up to
    `--oversubscribe` times the pool, so without offloading they cannot all run at once)
    plus 10% of their tokens in 4K-8K sequences, at `--gpus` GPUs: `hdp_balance` (no
    offloading) against `hdp_offload_balance` (the planner weighs offloading per ring).

    .venv/bin/python scripts/bench/bench_offload_choice.py --out results/offload_choice.json

Writes the JSON (config, git revision, per-run step times, speedups, the planner's
offload decision line) and logs a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import time
from pathlib import Path

import numpy as np

from megatron_hdp.scheduler.cost import CostModel
from megatron_hdp.sim.clusters import H100_CLUSTER
from megatron_hdp.sim.distributions import GENERATORS
from megatron_hdp.sim.models import MODELS
from megatron_hdp.sim.simulate import simulate_step

LOG = logging.getLogger("bench_offload_choice")
K, M = 1024, 1024 * 1024
CAPACITY = 8 * K
ABLATION = ("static", "hdp_greedy", "hdp_offload", "hdp_offload_balance", "hdp_balance")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/offload_choice.json"))
    p.add_argument("--slow-ib-scale", type=float, default=0.25)
    p.add_argument("--ablation-gpus", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=32 * M, help="tokens of the ablation batch")
    p.add_argument("--gpus", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--oversubscribe", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def long_batch(rng, pool: int, oversubscribe: float) -> list[int]:
    """1M-2M sequences whose minimal rings add up to `oversubscribe` x the pool, + 10% short."""
    lengths, ranks = [], 0
    while ranks < oversubscribe * pool:
        s = int(rng.integers(1 * M, 2 * M + 1))
        lengths.append(s)
        ranks += math.ceil(s / CAPACITY)
    short_tokens = 0.1 * sum(lengths)
    while short_tokens > 0:
        s = int(rng.integers(4 * K, 8 * K + 1))
        lengths.append(s)
        short_tokens -= s
    return lengths


def run(system, lengths, cm, pool, context, params):
    t0 = time.perf_counter()
    r = simulate_step(
        system,
        lengths,
        pool_size=pool,
        capacity=CAPACITY,
        context=context,
        cost_model=cm,
        params=params,
        megatron="reimpl",
    )
    plan = r.segments[0].plan
    decision = getattr(plan, "offload_decision", None)
    ratios = np.asarray(plan.offload_ratio)
    return {
        "system": system,
        "step_time_s": r.step_time,
        "tokens_per_s": r.tokens_per_s,
        "rings": int(np.sum(np.diff(plan.ring_offsets) > 1)),
        "rings_offloaded": int(np.sum(ratios > 0)),
        "max_ratio": float(ratios.max()) if len(ratios) else 0.0,
        "decision": decision.message() if decision is not None else None,
        "wall_s": time.perf_counter() - t0,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = MODELS["llama-7b"]
    clusters = {
        "h100": H100_CLUSTER,
        f"h100-ib-x{args.slow_ib_scale:g}": H100_CLUSTER.scaled(
            ib_bandwidth=H100_CLUSTER.ib_bandwidth * args.slow_ib_scale
        ),
    }
    out = {
        "benchmark": "offload_choice",
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": model.name,
            "tp": model.tp,
            "capacity": CAPACITY,
            "clusters": {n: c.rank_profile(model.tp).__dict__ for n, c in clusters.items()},
        },
        "git_revision": git_revision(),
        "ablation": [],
        "long_batches": [],
    }
    started = time.perf_counter()
    for name, cluster in clusters.items():
        cm = CostModel(model.shape, cluster.rank_profile(model.tp))
        pool = model.pool_size(args.ablation_gpus)
        rng = np.random.default_rng([args.seed, 1])
        lengths = GENERATORS["byted_like"](rng, args.tokens, 2 * M)
        runs = [run(s, lengths, cm, pool, 2 * M, model.total_params) for s in ABLATION]
        static = runs[0]["step_time_s"]
        for r in runs:
            r["speedup_over_static"] = static / r["step_time_s"]
            LOG.info(
                "ablation %-14s %-20s %7.2fx  %s",
                name,
                r["system"],
                r["speedup_over_static"],
                r["decision"] or "",
            )
        out["ablation"].append(
            {
                "cluster": name,
                "gpus": args.ablation_gpus,
                "pool": pool,
                "sequences": len(lengths),
                "runs": runs,
            }
        )
        for gpus in args.gpus:
            pool = model.pool_size(gpus)
            rng = np.random.default_rng([args.seed, 2, gpus])
            lengths = long_batch(rng, pool, args.oversubscribe)
            plain, offload = (
                run(s, lengths, cm, pool, 2 * M, model.total_params)
                for s in ("hdp_balance", "hdp_offload_balance")
            )
            entry = {
                "cluster": name,
                "gpus": gpus,
                "pool": pool,
                "long_sequences": sum(s >= M for s in lengths),
                "sequences": len(lengths),
                "tokens": int(sum(lengths)),
                "without_offload": plain,
                "with_offload": offload,
                "speedup": plain["step_time_s"] / offload["step_time_s"],
            }
            LOG.info(
                "long %-14s %6d GPUs %3d long seqs: %.2f s -> %.2f s (x%.2f)  %s",
                name,
                gpus,
                entry["long_sequences"],
                plain["step_time_s"],
                offload["step_time_s"],
                entry["speedup"],
                offload["decision"],
            )
            out["long_batches"].append(entry)
    out["wall_s"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    LOG.info("wrote %s (%.0f s)", args.out, out["wall_s"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
