"""Selective offloading: planner rank counts, and measured vs predicted activation memory.

Part 1 (no processes): for a LLaMA-7B-shaped model on the H100 profile with capacity 8K,
the ranks a long sequence gets without offloading (`ceil(s / C)`) and with the Eq. 3 rule,
and the ratio used.

Part 2 (launch with torchrun, 2 gloo ranks): one long sequence on a ring of 2 trains with
offload ratios 0, 0.25, 0.5 and 1; each rank's offload manager reports the peak bytes held
by saved activations during the forward pass and the bytes moved to host. The plan's
prediction is the resident fraction `(2 + (1 - r)(l - 2)) / l` of the no-offload peak of the
offloadable layers; both are written to JSON with their difference.

    torchrun --standalone --nproc-per-node 2 scripts/bench/bench_offload.py \
        --out results/offload_cpu2.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_hdp.attention.kernels.registry import add_kernel_flags, job_kernel
from megatron_hdp.data.batching import InMemoryTokens
from megatron_hdp.distributed.layout import ParallelDims
from megatron_hdp.launch import init_distributed, megatron_device_context, setup_logging
from megatron_hdp.megatron.config import device_profile
from megatron_hdp.megatron.engine import (
    OptimConfig,
    build_engine,
    offload_manager,
)
from megatron_hdp.megatron.model import GPTConfig, model_shape
from megatron_hdp.megatron.step import StepRuntime, forward_backward, local_batches
from megatron_hdp.provenance import environment
from megatron_hdp.scheduler.cost import H100, CostModel
from megatron_hdp.scheduler.offload_rule import offload_rule, resident_fraction
from megatron_hdp.scheduler.plan import MicroBatch, plan_from_rank_lists
from megatron_hdp.scheduler.stats import predicted_activation_bytes
from megatron_hdp.sim.models import MODELS

logger = logging.getLogger("bench_offload")

LLAMA7B = MODELS["llama-7b"].shape  # the paper's LLaMA-7B (Table 1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/offload_cpu2.json"))
    p.add_argument("--seq-length", type=int, default=4096, help="tokens of the long sequence")
    p.add_argument("--num-layers", type=int, default=6, help="layers of the CPU model")
    p.add_argument("--hidden-size", type=int, default=128, help="hidden size of the CPU model")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0])
    p.add_argument(
        "--host-memory-gb",
        type=float,
        default=4.0,
        help="host pool of each rank's copy engine, allocated (pinned on GPU) per ratio",
    )
    add_kernel_flags(p)
    return p.parse_args(argv)


def planner_rank_counts() -> list[dict]:
    """Ranks per long sequence with and without offloading (7B, H100, C = 8K)."""
    model, capacity = CostModel(LLAMA7B, H100), 8192
    lengths = [16384, 65536, 131072, 262144, 524288, 1 << 20, 1 << 21]
    ranks, ratios = offload_rule(lengths, capacity, model)
    return [
        {
            "tokens": s,
            "ranks_without_offload": math.ceil(s / capacity),
            "ranks_with_offload": int(k),
            "offload_ratio": float(r),
        }
        for s, k, r in zip(lengths, ranks, ratios, strict=True)
    ]


def measure(args, device, kernel: str) -> list[dict]:
    """Collective over the 2-rank world: one ring micro-batch per ratio, manager statistics."""
    cfg = model_config(args)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (args.seq_length + 1,), generator=gen)
    source = InMemoryTokens([ids[:-1]], [ids[1:]])
    rows = []
    for ratio in args.ratios:
        engine = build_engine(cfg, OptimConfig(), seed=1)
        runtime = StepRuntime(group=dist.group.WORLD, device=device, backend=kernel)
        runtime.offload = offload_manager(engine, args.host_memory_gb * 1e9, device)
        plan = plan_from_rank_lists(
            [args.seq_length],
            2,
            args.seq_length,
            "manual",
            [MicroBatch(order=0, ring=(0, 1), seq_indices=(0,), offload_ratio=ratio)],
            num_layers=cfg.num_layers,
        )
        batches = local_batches(plan, source, runtime)
        start = time.perf_counter()
        forward_backward(engine, batches, runtime, loss_scale=1.0 / args.seq_length)
        seconds = time.perf_counter() - start
        stats = runtime.offload.stats()
        runtime.offload.uninstall()
        model = CostModel(model_shape(cfg), device_profile("cpu"))
        # The plan's own prediction, from the cost model's bytes per token (all layers;
        # the manager measures the hooked transformer layers).
        plan_bytes = predicted_activation_bytes(plan, model.activation_bytes_per_token())[0]
        rows.append(
            {"ratio": ratio, "seconds": seconds, "plan_predicted_bytes": plan_bytes, **stats}
        )
        logger.info("ratio %.2f: %s", ratio, stats)
    return rows


def model_config(args) -> GPTConfig:
    """The measured model."""
    return GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=256,
        params_dtype="bfloat16" if args.bf16 else "float32",
    )


def main(argv=None):
    args = parse_args(argv)
    device = init_distributed()
    cfg = model_config(args)
    kernel = job_kernel(args.hdp_attention_backend, device, dtype=cfg.dtype, head_dim=cfg.head_dim)
    rank = dist.get_rank()
    setup_logging(rank)
    with megatron_device_context():
        layout = ParallelDims.of_world().initialize()
        try:
            rows = measure(args, device, kernel)
        finally:
            layout.destroy()
    if rank == 0:
        base = rows[0]["peak_resident_bytes"]
        for row in rows:
            predicted = base * float(resident_fraction(row["ratio"], args.num_layers))
            row["predicted_peak_resident_bytes"] = predicted
            row["prediction_error"] = (predicted - row["peak_resident_bytes"]) / row[
                "peak_resident_bytes"
            ]
            row["plan_prediction_error"] = (
                row["plan_predicted_bytes"] - row["peak_resident_bytes"]
            ) / row["peak_resident_bytes"]
        report = {
            "benchmark": "offload",
            "config": {**vars(args), "out": str(args.out), "kernel": kernel},
            "environment": environment(),
            "planner_rank_counts_7b_h100_c8k": planner_rank_counts(),
            "measured_ring_of_2_rank0": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        logger.info("wrote %s", args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
