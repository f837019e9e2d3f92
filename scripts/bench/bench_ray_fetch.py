"""One rank's fetch time from the Ray data service against the loader count.

A synthetic source (`docs/data.md`) whose reads wait `--latency-us` microseconds per token
(a sleep: the number does not depend on how loaded the CPUs are) is served by 1, 2 and 4
source loaders, each owning a token-balanced range of its documents. One rank fetches
the tokens of each planned global batch (`RayDataService.tokens`: every share sent at
once, one wait). With a serial fetch the time would be tokens x latency whatever the
loader count; with the partitioned, parallel fetch it falls with the loaders. Writes the
median fetch time over steps 2.. per loader count as JSON, with versions.

    PYTHONPATH=$PWD python scripts/bench/bench_ray_fetch.py --out results/ray_fetch_cpu2.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import time

import numpy as np

from megatron_hdp.provenance import environment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--latency-us", type=float, default=200.0)
    parser.add_argument("--loaders", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    import ray

    from megatron_hdp.data.batching import read_local
    from megatron_hdp.data.sampler import DatasetUnits, TokenBudgetSampler
    from megatron_hdp.data.service.actors import PlannerActor
    from megatron_hdp.data.service.client import RayDataService
    from megatron_hdp.data.sources import open_source
    from megatron_hdp.data.spec import parse_spec
    from megatron_hdp.scheduler import plan_step

    plan = functools.partial(plan_step, pool_size=1, capacity=4096, policy="greedy")
    synthetic = {"documents": 64, "min_tokens": 200, "max_tokens": 400}
    source = parse_spec(
        {
            "sources": [
                {"name": "syn", "synthetic": {**synthetic, "latency_us_per_token": args.latency_us}}
            ]
        }
    ).sources[0]
    open_args = {"tokenizer_type": "ByteLevel", "tokenizer_model": None, "cache_dir": None}
    reader = open_source(source, **open_args)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=10**8)
    rows = []
    for n in args.loaders:
        units = DatasetUnits.from_documents(
            np.arange(len(reader)), reader.sequence_lengths, max_seq_length=256
        )
        sampler = TokenBudgetSampler([units], [1.0], seed=1, tokens_per_batch=4096)
        planner = (
            ray.remote(PlannerActor)
            .options(num_cpus=0)
            .remote(
                sampler, plan, [dataclasses.replace(source, loaders=n)], open_args, 8,
                [reader.sequence_lengths],
            )
        )  # fmt: skip
        service = RayDataService(planner, timeout_s=300)
        feed = service.batches({"steps": 0})
        times, tokens = [], []
        for _ in range(args.steps):
            batch = feed.next_batch()
            start = time.perf_counter()
            service.tokens(batch, 0, read_local)
            times.append(time.perf_counter() - start)
            tokens.append(sum(u.length for u in batch.units))
        rows.append(
            {
                "loaders": n,
                "median_fetch_s": float(np.median(times[1:])),
                "median_tokens": float(np.median(tokens[1:])),
                "serial_s": float(np.median(tokens[1:])) * args.latency_us * 1e-6,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        ray.kill(planner)
    ray.shutdown()
    result = {
        "what": "one rank's fetch of a 4096-token global batch, synthetic source, sleep latency",
        "latency_us_per_token": args.latency_us,
        "rows": rows,
        "versions": {"python": platform.python_version(), "ray": ray.__version__},
        "machine": f"{platform.machine()}, Ray local with num_cpus=2",
        "environment": environment(),  # git revision, torch, megatron-core, platform
    }
    with open(args.out, "w") as out:
        json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
