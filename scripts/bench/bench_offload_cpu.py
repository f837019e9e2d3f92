"""Offloading chosen by the planner vs the plan without it, trained on 4 CPU ranks.

The batch holds `--long` sequences of `pool x C` tokens: without offloading each needs the
whole pool, so they run one after another; with `plan_step(..., offload=True)` on this
machine's calibrated profile (`results/cpu_profile.json`) the planner puts each on a ring
of 2 with offload ratio 0.75 (6 layers), two side by side. Two engines with the same
initial weights train the same batch `--warmup-steps + --steps` times, steps interleaved
(the order rotates so drift on the machine hits both). Rank 0 writes JSON: median step
time (slowest rank) of each, the per-step losses of both (they must agree), bytes copied
to host per step over all ranks (measured), the planner's prediction and its decision line.

    torchrun --standalone --nproc-per-node 4 scripts/bench/bench_offload_cpu.py \
        --out results/offload_choice_cpu4.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_hdp.attention.kernels.registry import add_kernel_flags, job_kernel
from megatron_hdp.data.batching import InMemoryTokens
from megatron_hdp.distributed.layout import ParallelDims
from megatron_hdp.launch import init_distributed, megatron_device_context, setup_logging
from megatron_hdp.megatron.config import device_profile
from megatron_hdp.megatron.engine import OptimConfig, build_engine, offload_manager
from megatron_hdp.megatron.model import GPTConfig, model_shape
from megatron_hdp.megatron.step import StepRuntime, train_step
from megatron_hdp.provenance import environment
from megatron_hdp.scheduler import plan_step
from megatron_hdp.scheduler.cost import CostModel
from megatron_hdp.scheduler.offload_choice import predicted_step

logger = logging.getLogger("bench_offload_cpu")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/offload_choice_cpu4.json"))
    p.add_argument("--device-profile", default="results/cpu_profile.json")
    p.add_argument("--capacity", type=int, default=256)
    p.add_argument("--long", type=int, default=4, help="sequences of pool x C tokens")
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--host-memory-gb", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=7)
    add_kernel_flags(p)
    return p.parse_args(argv)


class Variant:
    """One plan's engine and measurements."""

    def __init__(self, name, plan, cfg, args, device, kernel: str, offload: bool):
        self.name, self.plan = name, plan
        self.engine = build_engine(cfg, OptimConfig(lr=1e-3), seed=args.seed)
        self.runtime = StepRuntime(group=dist.group.WORLD, device=device, backend=kernel)
        if offload:
            self.runtime.offload = offload_manager(
                self.engine, args.host_memory_gb * 1e9, device, min_offload_bytes=0
            )
        self.losses, self.times, self.host_bytes = [], [], []

    def step(self, source, measured: bool) -> None:
        """Collective: one training step, timed on the slowest rank."""
        dist.barrier()
        start = time.perf_counter()
        result = train_step(self.engine, self.plan, source, self.runtime)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        self.losses.append(result.loss)
        if measured:
            self.times.append(elapsed.item())
            self.host_bytes.append(result.offload_bytes_total)
        logger.info("%s: loss %.6f, %.3f s", self.name, result.loss, elapsed.item())

    def report(self) -> dict:
        plan = self.plan
        return {
            "rings": [
                {"ranks": list(mb.ring), "offload_ratio": mb.offload_ratio}
                for mb in plan.micro_batches
            ],
            "predicted_step_s": predicted_step(plan),
            "step_time_s_median": statistics.median(self.times),
            "step_time_s_all": self.times,
            "host_bytes_per_step": self.host_bytes,
            "losses": self.losses,
        }


def main(argv=None):
    args = parse_args(argv)
    device = init_distributed()
    rank, pool = dist.get_rank(), dist.get_world_size()
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
    lengths = [pool * args.capacity] * args.long
    gen = torch.Generator().manual_seed(args.seed)
    ids = [torch.randint(0, 256, (n + 1,), generator=gen) for n in lengths]
    source = InMemoryTokens([t[:-1] for t in ids], [t[1:] for t in ids])
    cost_model = CostModel(model_shape(cfg), device_profile(args.device_profile))
    kw = dict(pool_size=pool, capacity=args.capacity, policy="balanced", cost_model=cost_model)
    offload_plan = plan_step(lengths, offload=True, **kw)
    plain_plan = plan_step(lengths, **kw)
    with megatron_device_context():
        layout = ParallelDims.of_world().initialize()
        try:
            runs = [
                Variant("without_offload", plain_plan, cfg, args, device, kernel, offload=False),
                Variant("with_offload", offload_plan, cfg, args, device, kernel, offload=True),
            ]
            for step in range(args.warmup_steps + args.steps):
                shift = step % len(runs)
                for run in runs[shift:] + runs[:shift]:
                    run.step(source, measured=step >= args.warmup_steps)
            results = {run.name: run.report() for run in runs}
        finally:
            layout.destroy()
    if rank == 0:
        plain, offload = results["without_offload"], results["with_offload"]
        diff = max(
            abs(a - b) / abs(b) for a, b in zip(offload["losses"], plain["losses"], strict=True)
        )
        report = {
            "benchmark": "offload_choice_cpu",
            "config": {
                **vars(args),
                "out": str(args.out),
                "pool_size": pool,
                "lengths": lengths,
                "kernel": kernel,
            },
            "environment": environment(),
            "decision": offload_plan.offload_decision.message(),
            "runs": results,
            "summary": {
                "step_time_s_median": {k: v["step_time_s_median"] for k, v in results.items()},
                "measured_speedup": plain["step_time_s_median"] / offload["step_time_s_median"],
                "predicted_speedup": plain["predicted_step_s"] / offload["predicted_step_s"],
                "host_bytes_per_step": statistics.median(offload["host_bytes_per_step"]),
                "max_relative_loss_difference": diff,
                "losses_agree": diff <= 1e-5,
            },
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        logger.info("wrote %s: %s", args.out, json.dumps(report["summary"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
