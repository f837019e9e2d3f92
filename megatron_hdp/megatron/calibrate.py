"""Calibrate the cost model's compute speeds on this machine (host layer, one process).

Times forward + backward of the real HDP model (a Megatron-Core GPT with HDP attention)
on one rank for single sequences of several lengths, fits `t(s) = a s^2 + b s + c` by least
squares, and turns the coefficients into a `DeviceProfile`: `attention_flops` from `a`
(the cost model's attention FLOPs per s^2), `linear_flops` from `b` (its GEMM FLOPs per
token). Ring and host bandwidths are not measured here; they keep the values of the
profile named by `--base` (for CPU: gloo over loopback, cpu-gloo-facts.md section 1).

    python -m megatron_hdp.megatron.calibrate --out results/cpu_profile.json

Every flag is listed by `--help`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_hdp.attention.kernels.registry import job_kernel
from megatron_hdp.data.batching import InMemoryTokens, gather_local_batch
from megatron_hdp.distributed.layout import ParallelDims
from megatron_hdp.megatron.cpu_shim import maybe_cpu_shims
from megatron_hdp.megatron.engine import (
    OptimConfig,
    build_engine,
)
from megatron_hdp.megatron.model import GPTConfig, model_shape
from megatron_hdp.megatron.step import StepRuntime, forward_backward
from megatron_hdp.scheduler.cost import PROFILES, CostModel, DeviceProfile, ModelShape
from megatron_hdp.scheduler.placement import plan_step

logger = logging.getLogger(__name__)


def fit_profile(
    lengths: list[int], seconds: list[float], shape: ModelShape, base: DeviceProfile, name: str
) -> DeviceProfile:
    """Least-squares fit of `a s^2 + b s + c` mapped onto a device profile."""
    s = np.asarray(lengths, dtype=np.float64)
    design = np.stack([s * s, s, np.ones_like(s)], axis=1)
    (a, b, _), *_ = np.linalg.lstsq(design, np.asarray(seconds), rcond=None)
    if a <= 0 or b <= 0:
        raise ValueError(
            f"calibration fit has non-positive coefficients (a={a:.3e}, b={b:.3e}); the "
            "timings are too noisy: use longer --lengths or more --repeats"
        )
    unit = CostModel(shape, dataclasses.replace(base, linear_flops=1.0, attention_flops=1.0))
    attention_flops_per_s2 = unit.attention_time(1.0)
    linear_flops_per_token = unit.linear_time(1.0)
    return dataclasses.replace(
        base,
        name=name,
        attention_flops=float(attention_flops_per_s2 / a),
        linear_flops=float(linear_flops_per_token / b),
    )


CPU_DEVICE = torch.device("cpu")


def time_lengths(
    cfg: GPTConfig,
    lengths: list[int],
    repeats: int,
    *,
    device: torch.device = CPU_DEVICE,
    backend: str = "auto",
) -> list[float]:
    """Median forward+backward seconds of one sequence per length (collective-free, 1 rank).

    The batches go to `device` (where `build_engine` puts the model) and attend with the
    kernel `backend`, resolved for the device as the job resolves it (`job_kernel`), so a
    GPU calibration times the flash kernel the job would run, never a CPU kernel.
    """
    backend = job_kernel(
        backend, device, dtype=cfg.dtype, head_dim=cfg.head_dim, head_dim_v=cfg.head_dim_v
    )
    engine = build_engine(cfg, OptimConfig())
    runtime = StepRuntime(group=dist.group.WORLD, device=device, backend=backend)
    gen = torch.Generator().manual_seed(0)
    medians = []
    for n in lengths:
        ids = torch.randint(0, cfg.vocab_size, (n + 1,), generator=gen)
        source = InMemoryTokens([ids[:-1]], [ids[1:]])
        plan = plan_step([n], pool_size=1, capacity=n, policy="greedy")
        depth = cfg.mtp_num_layers or 0  # an MTP model times its MTP layers too
        batch = gather_local_batch(plan, plan.micro_batches[0], 0, source, mtp_depth=depth)
        batch = batch.to(device)
        samples = []
        for _ in range(repeats + 1):  # the first run warms up
            _synchronize(device)
            start = time.perf_counter()
            forward_backward(engine, [batch], runtime, loss_scale=1.0 / n)
            _synchronize(device)
            samples.append(time.perf_counter() - start)
            engine.model.zero_grad_buffer()
        medians.append(statistics.median(samples[1:]))
        logger.info("length %d: %.4f s forward+backward", n, medians[-1])
    return medians


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(
        description="Fit the cost model's compute speeds to this machine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    p.add_argument("--name", default="cpu-calibrated", help="profile name")
    p.add_argument("--base", choices=sorted(PROFILES), default="cpu", help="bandwidths from")
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[256, 512, 1024, 2048, 3072, 4096],
        help="sequence lengths to time",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per length")
    p.add_argument("--num-layers", type=int, default=2, help="model layers")
    p.add_argument("--hidden-size", type=int, default=64, help="model hidden size")
    p.add_argument("--num-attention-heads", type=int, default=4, help="query heads")
    p.add_argument("--num-query-groups", type=int, default=2, help="KV heads")
    p.add_argument("--vocab-size", type=int, default=384, help="vocabulary (padded)")
    p.add_argument(
        "--bf16", action="store_true", help="compute in bfloat16 (needed on GPU: flash kernels)"
    )
    args = p.parse_args(argv)
    if len(args.lengths) < 3 or min(args.lengths) < 1:
        p.error(f"--lengths needs at least 3 positive lengths, got {args.lengths}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def main(argv=None) -> int:
    """Calibrate and write the profile; returns the exit status."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        vocab_size=args.vocab_size,
        max_position_embeddings=max(args.lengths),
        params_dtype="bfloat16" if args.bf16 else "float32",
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        backend = job_kernel(
            "auto", device, dtype=cfg.dtype, head_dim=cfg.head_dim, head_dim_v=cfg.head_dim_v
        )
    except ValueError as err:
        logger.error("calibrate: error: %s", err)
        return 2
    with tempfile.TemporaryDirectory() as folder:
        cuda = device.type == "cuda"
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"file://{folder}/store",
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=60),
            **({"device_id": torch.device("cuda", 0)} if cuda else {}),
        )
        try:
            with maybe_cpu_shims():
                layout = ParallelDims.of_world().initialize()
                try:
                    seconds = time_lengths(
                        cfg, args.lengths, args.repeats, device=device, backend=backend
                    )
                finally:
                    layout.destroy()
        finally:
            dist.destroy_process_group()
    shape = model_shape(cfg, backend)
    profile = fit_profile(args.lengths, seconds, shape, PROFILES[args.base], args.name)
    model = CostModel(shape, profile)
    report = {
        "profile": json.loads(profile.to_json()),
        "model": dataclasses.asdict(cfg),
        "lengths": args.lengths,
        "kernel": backend,
        "measured_s": seconds,
        "predicted_s": [model.time(n, 1) for n in args.lengths],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(profile.to_json() + "\n")
    tmp.replace(args.out)
    args.out.with_suffix(".fit.json").write_text(json.dumps(report, indent=2) + "\n")
    logger.info("wrote %s: %s", args.out, profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
