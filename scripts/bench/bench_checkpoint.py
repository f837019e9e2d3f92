"""Save and load time of a checkpoint of the demo model in both formats (launch with torchrun).

The model `scripts/run_cpu.sh` trains (2 layers, hidden 64, 4 heads, the byte-level
vocabulary padded to 384), its Adam state after one step, written and read back
`--repeats` times in each format: `torch_dist` (Megatron's distributed format, what
`--save` writes: `megatron/checkpoint.py`) and the earlier per-rank `torch` format (the
old writer's files, `tests/megatron/legacy_writer.py`; read by the library's reader).
Rank 0 writes JSON: the median wall time of the slowest rank per format and operation,
and of the pre-start content check of a torch_dist checkpoint (its digests: by one process,
and shared out over the ranks).

    torchrun --standalone --nproc-per-node 2 scripts/bench/bench_checkpoint.py \\
        --out results/checkpoint_cpu2.json
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_hdp.checkpoint_digests import digest_problems, read_digests  # noqa: E402
from megatron_hdp.distributed.layout import ParallelDims  # noqa: E402
from megatron_hdp.launch import init_distributed, megatron_device_context, setup_logging  # noqa: E402
from megatron_hdp.megatron import checkpoint  # noqa: E402
from megatron_hdp.megatron.dist_checkpoint import close_writer_processes  # noqa: E402
from megatron_hdp.megatron.engine import OptimConfig, build_engine  # noqa: E402
from megatron_hdp.megatron.model import GPTConfig  # noqa: E402
from megatron_hdp.provenance import environment  # noqa: E402
from tests.megatron.legacy_writer import write_legacy  # noqa: E402

logger = logging.getLogger("bench_checkpoint")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=384)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a tmp dir)")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def _verified(problems: list[str]) -> None:
    if problems:
        raise RuntimeError(f"a fresh checkpoint fails its digests: {problems}")


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def main(argv=None) -> None:
    args = parse_args(argv)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    setup_logging(rank)
    cfg = GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=args.vocab_size,
    )
    names = [tempfile.mkdtemp(dir=args.dir)] if rank == 0 else [None]
    dist.broadcast_object_list(names, src=0)
    root = Path(names[0])
    times = {f"{fmt}_{op}": [] for fmt in ("torch_dist", "torch") for op in ("save", "load")}
    times["torch_dist_verify_one_process"] = []
    times["torch_dist_verify_shared"] = []
    with megatron_device_context():
        layout = ParallelDims.of_world().initialize()
        try:
            engine = build_engine(cfg, OptimConfig(lr=1e-4))
            for p in engine.model.module.parameters():
                p.main_grad.fill_(1e-3)
            engine.optimizer.step()  # Adam state to save
            group = dist.group.WORLD
            for n in range(args.repeats):
                new, old = root / f"dist{n}", root / f"torch{n}"
                state = checkpoint.TrainingState(iteration=1, data_state={})
                times["torch_dist_save"].append(
                    _timed(
                        lambda new=new, state=state: checkpoint.save_checkpoint(
                            new, engine, state, group=group
                        )
                    )
                )
                times["torch_dist_load"].append(
                    _timed(lambda new=new: checkpoint.load_checkpoint(new, engine, group=group))
                )
                # The pre-start content check of a resume: one process reading every file
                # (--hdp-validate-only), and the job's ranks sharing the files out.
                folder = new / "iter_0000001"
                record = read_digests(folder)
                times["torch_dist_verify_one_process"].append(
                    _timed(lambda f=folder, r=record: _verified(digest_problems(f, r)))
                )
                times["torch_dist_verify_shared"].append(
                    _timed(
                        lambda f=folder, r=record: _verified(
                            digest_problems(f, r, rank=rank, world=world)
                        )
                    )
                )
                times["torch_save"].append(_timed(lambda old=old: write_legacy(old, engine, 1, {})))
                times["torch_load"].append(
                    _timed(lambda old=old: checkpoint.load_checkpoint(old, engine, group=group))
                )
            params = sum(p.numel() for p in engine.model.module.parameters())
            sizes = {
                fmt: sum(f.stat().st_size for f in (root / f"{fmt}0").rglob("*") if f.is_file())
                for fmt in ("dist", "torch")
            }
        finally:
            close_writer_processes()
            layout.destroy()
    if rank == 0:
        medians = {k: statistics.median(v) for k, v in times.items()}
        result = {
            "config": {
                **{k: v for k, v in vars(args).items() if k not in ("out", "dir")},
                "world_size": world,
                "parameters_per_rank": params,
            },
            "environment": environment(),
            "seconds_median": medians,
            "seconds": times,
            "bytes_on_disk": {"torch_dist": sizes["dist"], "torch": sizes["torch"]},
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        logger.info("medians (s): %s -> %s", medians, args.out)
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
