"""Read checkpoints of the earlier per-rank torch.save format (read only; host layer).

Folders written before `--ckpt-format torch_dist` became the only writer:

    <dir>/iter_0000100/common.pt                model, optimizer, LR schedule, data position,
                                                iteration, arguments (rank 0)
    <dir>/iter_0000100/model_tp<t>.pt           TP rank t's model and optimizer shard (t >= 1)
    <dir>/iter_0000100/model_pp<s>_tp<t>.pt     stage s's shards with pipeline parallelism
    <dir>/iter_0000100/meta.json                world size, optimizer kind, schedule, model
    <dir>/iter_0000100/rng_rank<r>.pt           every rank's RNG states
    <dir>/iter_0000100/optim_rank<r>.pt         this rank's distributed-optimizer shard

They resume at the layout that wrote them (same TP, PP and, with the distributed optimizer,
the same number of ranks); the next save writes the torch_dist format, which reshards.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from megatron_hdp.checkpoint_files import META
from megatron_hdp.megatron.engine import Engine

logger = logging.getLogger(__name__)


def is_legacy_checkpoint(folder: str | Path) -> bool:
    """True if `folder` was written in the per-rank torch.save format."""
    folder = Path(folder)
    return (folder / "common.pt").exists() and not (folder / "metadata.json").exists()


def shard_name(engine: Engine) -> str:
    """The file of this rank's model shard (its stage and TP rank) in that format."""
    if engine.pp_size == 1:
        return f"model_tp{engine.tp_rank}.pt"
    return f"model_pp{engine.stage}_tp{engine.tp_rank}.pt"


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = state.get("cuda_tracker")
    if tracker:
        tensor_parallel.get_cuda_rng_tracker().set_states(
            {name: s.clone() if torch.is_tensor(s) else s for name, s in tracker.items()}
        )


def _shard_optimizers(optimizer) -> list:
    """The distributed optimizers inside Megatron's (possibly chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _load_optimizer_shard_state(optimizer, state: dict) -> None:
    shards = _shard_optimizers(optimizer)
    for o, inner, params in zip(shards, state["inner"], state["main_params"], strict=True):
        o.optimizer.load_state_dict(inner)
        with torch.no_grad():
            mine = [p for g in o.optimizer.param_groups for p in g["params"]]
            for dst, src in zip(mine, params, strict=True):
                dst.copy_(src)


def _load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=False)


def load_legacy(folder: Path, engine: Engine, *, group: dist.ProcessGroup) -> dict:
    """Restore model, optimizer, schedule and RNG from `folder`; return its `common.pt`.

    Collective over `group` only through the engine's optimizer. Raises ValueError for a
    folder written at another TP or PP size, or by another number of ranks with the
    distributed optimizer (this format does not reshard).
    """
    if len(engine.chunks) > 1:
        raise ValueError(
            f"{folder} is in the per-rank torch format, which holds one model chunk per rank; "
            f"this job has {len(engine.chunks)} (virtual pipeline stages): load it without "
            "--num-layers-per-virtual-pipeline-stage and save it again (torch_dist)"
        )
    meta = json.loads((folder / META).read_text())
    if engine.optimizer_is_distributed and meta["world_size"] != dist.get_world_size(group):
        raise ValueError(
            f"{folder} was written by {meta['world_size']} ranks with the distributed "
            f"optimizer in the per-rank torch format, which does not reshard; this job has "
            f"{dist.get_world_size(group)}"
        )
    for what, mine in (
        ("tensor_model_parallel_size", engine.tp_size),
        ("pipeline_model_parallel_size", engine.pp_size),
    ):
        saved = meta.get(what, 1)
        if saved != mine:
            raise ValueError(
                f"{folder} was written with {what} {saved} in the per-rank torch format, which "
                f"does not reshard; this job has {mine}"
            )
    common = _load(folder / "common.pt")
    rank = dist.get_rank(group)
    shard = common
    if engine.tp_rank > 0 or engine.stage > 0:
        shard = _load(folder / shard_name(engine))
    engine.model.module.load_state_dict(shard["model"])
    engine.optimizer.reload_model_params()
    engine.optimizer.load_state_dict(shard["optimizer"])
    if engine.optimizer_is_distributed:
        _load_optimizer_shard_state(engine.optimizer, _load(folder / f"optim_rank{rank}.pt"))
    engine.scheduler.load_state_dict(common["scheduler"])
    rng_file = folder / f"rng_rank{rank}.pt"
    if rng_file.exists():
        _set_rng_state(_load(rng_file))
    return common
