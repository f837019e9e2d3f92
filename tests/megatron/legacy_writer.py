"""A test-only writer of the earlier per-rank torch.save checkpoint format.

The library no longer writes it (only reads it: `megatron/legacy_checkpoint.py`); this is
the old writer's file layout, for tests that resume such folders. One replica's TP 1 / PP 1
model and a non-distributed optimizer, as the old `save_checkpoint` wrote them.
"""

import json
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist


def write_legacy(root, engine, iteration: int, data_state: dict, cuda_tracker=None) -> Path:
    """Collective: write `root/iter_<iteration>` in the old format and name it in the tracker."""
    rank = dist.get_rank()
    folder = Path(root) / f"iter_{iteration:07d}"
    if rank == 0:
        folder.mkdir(parents=True)
    dist.barrier()
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": None,
        "cuda_tracker": cuda_tracker,
    }
    torch.save(rng, folder / f"rng_rank{rank}.pt")
    if rank == 0:
        common = {
            "iteration": iteration,
            "consumed_tokens": 0,
            "data_state": data_state,
            "model": engine.model.module.state_dict(),
            "optimizer": engine.optimizer.state_dict(),
            "scheduler": engine.scheduler.state_dict(),
            "extra": {},
        }
        torch.save(common, folder / "common.pt")
        meta = {
            "iteration": iteration,
            "world_size": dist.get_world_size(),
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "distributed_optimizer": False,
            "schedule": engine.scheduler.state_dict(),
        }
        (folder / "meta.json").write_text(json.dumps(meta))
        (Path(root) / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    dist.barrier()
    return folder
