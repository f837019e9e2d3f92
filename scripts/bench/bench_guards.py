"""What the training job's safety checks cost per step (launch with torchrun).

Two variants of the same training step, interleaved in one run on the same model and batch:
`plain` (no non-finite check, no stop-signal agreement) and `guarded` (what
`pretrain_hdp.py` does by default: the gradient norm computed before the update and
all-reduced with the loss, plus one all-reduce of the stop-signal flags per step). Rank 0
writes JSON: the median step time of the slowest rank per variant and their ratio.

    torchrun --standalone --nproc-per-node 4 scripts/bench/bench_guards.py \
        --out results/guards_cpu4.json
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_hdp.attention.kernels.registry import add_kernel_flags, job_kernel
from megatron_hdp.data.batching import InMemoryTokens
from megatron_hdp.distributed.layout import ParallelDims
from megatron_hdp.distributed.stop_signal import StopSignal
from megatron_hdp.launch import init_distributed, megatron_device_context, setup_logging
from megatron_hdp.megatron.engine import (
    OptimConfig,
    build_engine,
)
from megatron_hdp.megatron.model import GPTConfig
from megatron_hdp.megatron.step import StepRuntime, train_step
from megatron_hdp.provenance import environment
from megatron_hdp.scheduler import plan_step

logger = logging.getLogger("bench_guards")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/guards_cpu4.json"))
    p.add_argument("--capacity", type=int, default=1024, help="tokens per rank per micro-batch")
    p.add_argument("--tokens", type=int, default=16384, help="tokens of the global batch")
    p.add_argument("--steps", type=int, default=10, help="measured steps per variant (>= 5)")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    add_kernel_flags(p)
    args = p.parse_args(argv)
    if args.steps < 5:
        p.error(f"--steps must be >= 5 for a median, got {args.steps}")
    return args


def batch_lengths(tokens: int, capacity: int, pool_size: int, seed: int) -> list[int]:
    """One sequence over the whole pool, the rest short sequences of random lengths."""
    rng = random.Random(seed)
    lengths = [pool_size * capacity - 7]
    while sum(lengths) < tokens:
        lengths.append(rng.randint(32, capacity))
    return lengths


def main(argv=None) -> None:
    args = parse_args(argv)
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    setup_logging(rank)
    cfg = GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=8,
        num_query_groups=2,
        vocab_size=256,
        params_dtype="bfloat16" if args.bf16 else "float32",
    )
    kernel = job_kernel(args.hdp_attention_backend, device, dtype=cfg.dtype, head_dim=cfg.head_dim)
    lengths = batch_lengths(args.tokens, args.capacity, world, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    docs = [torch.randint(0, 256, (n + 1,), generator=gen) for n in lengths]
    source = InMemoryTokens([d[:-1] for d in docs], [d[1:] for d in docs])
    plan = plan_step(lengths, pool_size=world, capacity=args.capacity, policy="balanced")
    stop = StopSignal()
    times: dict[str, list[float]] = {"plain": [], "guarded": []}
    with megatron_device_context():
        layout = ParallelDims.of_world().initialize()
        try:
            engine = build_engine(cfg, OptimConfig(lr=1e-4), seed=args.seed)
            for step in range(args.steps + 1):
                order = ["plain", "guarded"] if step % 2 else ["guarded", "plain"]
                for variant in order:
                    runtime = StepRuntime(
                        group=dist.group.WORLD,
                        device=device,
                        backend=kernel,
                        check_nonfinite=variant == "guarded",
                    )
                    dist.barrier()
                    start = time.perf_counter()
                    train_step(engine, plan, source, runtime)
                    if variant == "guarded":
                        stop.agreed(dist.group.WORLD, device)
                    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    if step > 0:  # the first round warms up
                        times[variant].append(elapsed.item())
        finally:
            layout.destroy()
    if rank == 0:
        medians = {k: statistics.median(v) for k, v in times.items()}
        result = {
            "config": {**vars(args), "out": str(args.out), "world_size": world, "kernel": kernel},
            "environment": environment(),
            "step_seconds_median": medians,
            "step_seconds": times,
            "guarded_over_plain": medians["guarded"] / medians["plain"],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        logger.info(
            "median step: plain %.3f s, guarded %.3f s (ratio %.3f) -> %s",
            medians["plain"],
            medians["guarded"],
            result["guarded_over_plain"],
            args.out,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
