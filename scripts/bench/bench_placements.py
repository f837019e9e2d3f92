"""HDP placements vs the static DP x CP mesh on one mixed-length batch (launch with torchrun).

The balanced and greedy HDP placements and the static mesh train the same model from the
same weights on the same global batch, their steps interleaved (rotating which goes
first) in one run. Rank 0 writes JSON: step time (median over the measured steps, slowest
rank), attention point-to-point bytes per step (all ranks), micro-batches each rank ran,
each rank's measured forward+backward time next to the plan's prediction from the cost
model (a calibrated CPU profile), and the loss of every step (all placements must agree).
With `--tensor-model-parallel-size 2` each HDP rank is a replica of 2 TP ranks (attention
bytes then count both TP ranks' rings).

    torchrun --standalone --nproc-per-node 4 scripts/bench/bench_placements.py \
        --device-profile results/cpu_profile.json --out results/placements_cpu4.json
    torchrun --standalone --nproc-per-node 4 scripts/bench/bench_placements.py \
        --tensor-model-parallel-size 2 --out results/placements_cpu4_tp2.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
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
from megatron_hdp.megatron.engine import (
    OptimConfig,
    build_engine,
)
from megatron_hdp.megatron.model import GPTConfig, model_shape
from megatron_hdp.megatron.step import StepRuntime, train_step
from megatron_hdp.provenance import environment
from megatron_hdp.scheduler import plan_step
from megatron_hdp.scheduler.cost import CostModel
from megatron_hdp.sim.timeline import timeline

logger = logging.getLogger("bench_placements")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/placements_cpu4.json"))
    p.add_argument(
        "--device-profile",
        default="results/cpu_profile.json",
        help="cost-model profile name or JSON from python -m megatron_hdp.megatron.calibrate",
    )
    p.add_argument("--capacity", type=int, default=1024, help="tokens per rank per micro-batch")
    p.add_argument("--short-tokens", type=int, default=12000, help="tokens of short sequences")
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--steps", type=int, default=7, help="measured steps per placement (>= 5)")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--num-query-groups", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="TP ranks per HDP replica: the pool is world / TP replicas",
    )
    add_kernel_flags(p)
    args = p.parse_args(argv)
    if args.steps < 5:
        p.error(f"--steps must be >= 5 for a median, got {args.steps}")
    return args


def mixed_lengths(pool_size: int, capacity: int, short_tokens: int, seed: int) -> list[int]:
    """Two long sequences (whole pool, half the pool) and log-normal short ones."""
    rng = random.Random(seed)
    lengths = [pool_size * capacity - capacity // 8, max(capacity + 1, pool_size * capacity // 2)]
    total = 0
    while total < short_tokens:
        n = min(capacity, max(16, int(rng.lognormvariate(math.log(capacity / 6), 0.9))))
        lengths.append(n)
        total += n
    rng.shuffle(lengths)
    return lengths


class PolicyRun:
    """One placement's engine, plan and measurements."""

    def __init__(self, policy, args, cfg, source, pool_size, cost_model):
        self.policy = policy
        self.plan = plan_step(
            source.seqlens,
            pool_size=pool_size,
            capacity=args.capacity,
            policy=policy,
            cost_model=cost_model,
        )
        self.engine = build_engine(cfg, OptimConfig(lr=1e-3), seed=args.seed)
        self.losses, self.times, self.bytes, self.compute = [], [], [], []
        self.micro_batches = []

    def step(self, source, runtime, pool_size, measured):
        """Collective: one training step, timed on the slowest rank."""
        dist.barrier()
        start = time.perf_counter()
        result = train_step(self.engine, self.plan, source, runtime)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        sent = torch.tensor([result.attention_bytes_sent], dtype=torch.float64)
        dist.all_reduce(sent)
        per_rank = [torch.zeros(2) for _ in range(pool_size)]
        mine = torch.tensor([result.compute_seconds, result.num_micro_batches])
        dist.all_gather(per_rank, mine, group=runtime.group)
        self.losses.append(result.loss)
        self.micro_batches = [int(t[1].item()) for t in per_rank]
        if measured:
            self.times.append(elapsed.item())
            self.bytes.append(int(sent.item()))
            self.compute.append([t[0].item() for t in per_rank])
        logger.info("%s: loss %.5f, %.3f s", self.policy, result.loss, elapsed.item())

    def report(self, pool_size):
        measured = [statistics.median(c[r] for c in self.compute) for r in range(pool_size)]
        predicted_timeline = timeline(self.plan)
        predicted = list(predicted_timeline.busy)
        predicted_step = predicted_timeline.step_time
        return {
            "predicted_busy_s_per_rank": predicted,
            "busy_prediction_error_per_rank": [
                (p - m) / m for p, m in zip(predicted, measured, strict=True)
            ],
            "predicted_step_time_s": predicted_step,
            "measured_over_predicted_step_time": statistics.median(self.times) / predicted_step,
            "policy": self.policy,
            "ring_sizes": sorted((mb.cp_size for mb in self.plan.micro_batches), reverse=True),
            "micro_batches_run_per_rank": self.micro_batches,
            "step_time_s_median": statistics.median(self.times),
            "step_time_s_all": self.times,
            "attention_p2p_bytes_per_step": statistics.median(self.bytes),
            "compute_s_per_rank_median": [
                statistics.median(c[r] for c in self.compute) for r in range(pool_size)
            ],
            "losses": self.losses,
        }


def main(argv=None):
    args = parse_args(argv)
    device = init_distributed()
    tp = args.tensor_model_parallel_size
    rank, pool_size = dist.get_rank(), dist.get_world_size() // tp
    setup_logging(rank)
    cfg = GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        vocab_size=256,
        tensor_model_parallel_size=tp,
        params_dtype="bfloat16" if args.bf16 else "float32",
    )
    kernel = job_kernel(args.hdp_attention_backend, device, dtype=cfg.dtype, head_dim=cfg.head_dim)
    lengths = mixed_lengths(pool_size, args.capacity, args.short_tokens, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    ids = [torch.randint(0, 256, (n + 1,), generator=gen) for n in lengths]
    source = InMemoryTokens([t[:-1] for t in ids], [t[1:] for t in ids])
    with megatron_device_context():
        layout = ParallelDims.of_world(tensor_model_parallel_size=tp).initialize()
        try:
            runtime = StepRuntime(group=layout.pool_group, device=device, backend=kernel)
            profile = device_profile(args.device_profile).replica(tp)
            cost_model = CostModel(model_shape(cfg), profile)
            runs = [
                PolicyRun(p, args, cfg, source, pool_size, cost_model)
                for p in ("balanced", "greedy", "static")
            ]
            for step in range(args.warmup_steps + args.steps):
                # Rotate which placement goes first, so drift on the machine hits all of them.
                shift = step % len(runs)
                for run in runs[shift:] + runs[:shift]:
                    run.step(source, runtime, pool_size, measured=step >= args.warmup_steps)
            results = {run.policy: run.report(pool_size) for run in runs}
        finally:
            layout.destroy()
    if rank == 0:
        balanced, greedy, static = results["balanced"], results["greedy"], results["static"]
        loss_diff = max(
            abs(a - b)
            for other in (greedy, static)
            for a, b in zip(balanced["losses"], other["losses"], strict=True)
        )
        report = {
            "benchmark": "placements",
            "config": {
                **vars(args),
                "out": str(args.out),
                "pool_size": pool_size,
                "kernel": kernel,
            },
            "environment": environment(),
            "global_batch": {
                "num_sequences": len(lengths),
                "num_tokens": sum(lengths),
                "lengths": lengths,
            },
            "device_profile": args.device_profile,
            "placements": results,
            "summary": {
                "step_time_s_median": {k: v["step_time_s_median"] for k, v in results.items()},
                "static_over_balanced_step_time": static["step_time_s_median"]
                / balanced["step_time_s_median"],
                "greedy_over_balanced_step_time": greedy["step_time_s_median"]
                / balanced["step_time_s_median"],
                "attention_bytes_per_step": {
                    k: v["attention_p2p_bytes_per_step"] for k, v in results.items()
                },
                "max_abs_busy_prediction_error": {
                    k: max(abs(e) for e in v["busy_prediction_error_per_rank"])
                    for k, v in results.items()
                },
                "max_abs_loss_difference": loss_diff,
                "losses_agree": loss_diff <= 1e-4 * abs(balanced["losses"][0]),
            },
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(args.out)
        logger.info("wrote %s: %s", args.out, json.dumps(report["summary"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
