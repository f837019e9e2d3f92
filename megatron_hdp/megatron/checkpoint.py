"""Atomic, resumable checkpoints of an HDP job (torch.save files; host layer).

Layout, compatible in spirit with Megatron-LM's:

    <dir>/latest_checkpointed_iteration.txt     the newest complete checkpoint
    <dir>/iter_0000100/common.pt                model, optimizer, LR schedule, data position,
                                                iteration, arguments (written by rank 0)
    <dir>/iter_0000100/model_tp<t>.pt           with tensor parallelism: TP rank t's model and
                                                optimizer shards (t >= 1; written by rank t)
    <dir>/iter_0000100/model_pp<s>_tp<t>.pt     with pipeline parallelism: stage s's shards
                                                (all but stage 0 / TP rank 0, in common.pt)
    <dir>/iter_0000100/meta.json                world size and optimizer kind (for checks)
    <dir>/iter_0000100/rng_rank<r>.pt           every rank's RNG states (Python, NumPy, torch,
                                                CUDA and Megatron's CUDA RNG tracker)
    <dir>/iter_0000100/optim_rank<r>.pt         this rank's optimizer shard: Adam state and fp32
                                                main parameters (--use-distributed-optimizer)

All ranks write into one folder, so `<dir>` must be on a filesystem every rank sees (as
with Megatron-LM).

Atomicity: everything is written (and fsync'ed) into `iter_XXXXXXX.partial`; once every
rank has finished, rank 0 renames the folder to `iter_XXXXXXX` and then replaces the
tracker file with `os.replace`. A crash or a failed write on any rank leaves the previous
checkpoint as the latest; the failure is raised on every rank (no rank is left waiting),
and stale `.partial` folders are removed by the next save.

`group` holds every rank of the job. The model is replicated on every HDP replica (DP
semantics), so one copy is saved: one shard per (stage, TP rank), from the first replica. With the
distributed optimizer every rank saves its own shard, so a resume needs the same number of
ranks. (Megatron-Core 0.16.1's gather-to-rank-0 format drops torch AdamW's per-parameter
`step`, which breaks Adam's bias correction on resume, so it is not used.)
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from megatron_hdp.checkpoint_files import (
    META,
    TRACKER,
    fsync_path,
    iteration_dir,
    latest_iteration,
    read_meta,
)
from megatron_hdp.errors import CheckpointSaveError, NonFiniteError
from megatron_hdp.megatron.engine import Engine

logger = logging.getLogger(__name__)


@dataclass
class TrainingState:
    """What a resumed job needs besides model and optimizer."""

    iteration: int
    data_state: dict
    consumed_tokens: int = 0


def tracker_states() -> dict | None:
    """Megatron's model-parallel CUDA RNG tracker states (copies), or None if it has none.

    As Megatron-LM's `get_rng_state` saves them (`rng_tracker_states`): sequence-parallel
    dropout and expert initialisation draw from these named states, not from the default
    CUDA generator. The tracker is seeded only on CUDA (`engine.build_engine`); on a CPU run
    it is empty and nothing is saved.
    """
    states = tensor_parallel.get_cuda_rng_tracker().get_states()
    return {name: _copy(state) for name, state in states.items()} or None


def set_tracker_states(states: dict | None) -> None:
    """Give Megatron's CUDA RNG tracker `states` (from `tracker_states`); None: leave it.

    A checkpoint written before the tracker states were saved has none, and resumes as
    before (the tracker keeps the states `build_engine` seeded).
    """
    if states:
        tensor_parallel.get_cuda_rng_tracker().set_states(
            {name: _copy(state) for name, state in states.items()}
        )


def _copy(state):
    """A copy of one tracker state (generators of a CUDA-graph-safe tracker stay as they are)."""
    return state.clone() if torch.is_tensor(state) else state


def _rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "cuda_tracker": tracker_states(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    set_tracker_states(state.get("cuda_tracker"))


def _write(path: Path, obj) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _shard_optimizers(optimizer) -> list:
    """The distributed optimizers inside Megatron's (possibly chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _optimizer_shard_state(optimizer) -> dict:
    shards = _shard_optimizers(optimizer)
    return {
        "inner": [o.optimizer.state_dict() for o in shards],
        "main_params": [
            [p.detach().clone() for g in o.optimizer.param_groups for p in g["params"]]
            for o in shards
        ],
    }


def _load_optimizer_shard_state(optimizer, state: dict) -> None:
    shards = _shard_optimizers(optimizer)
    for o, inner, params in zip(shards, state["inner"], state["main_params"], strict=True):
        o.optimizer.load_state_dict(inner)
        with torch.no_grad():
            mine = [p for g in o.optimizer.param_groups for p in g["params"]]
            for dst, src in zip(mine, params, strict=True):
                dst.copy_(src)


def _all_ok(ok: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, group=group)
    return int(flag.item()) == 0


def _cause(err: BaseException) -> str:
    """One line for a failed write: the OS's reason and the file, or the error's first line."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror} ({err.filename})" if err.filename else err.strerror
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _still_latest(root: Path) -> str:
    try:
        return f"the latest checkpoint there is still iteration {latest_iteration(root)}"
    except (OSError, ValueError):
        return "there is no complete checkpoint there"


def _free_space(root: Path) -> str:
    try:
        return f", {shutil.disk_usage(root).free / 2**20:.0f} MiB free there"
    except OSError:
        return ""


def _raise_if_any_failed(
    error: BaseException | None,
    group: dist.ProcessGroup,
    device: torch.device,
    root: Path,
    iteration: int,
) -> None:
    """Collective over `group`: the same `CheckpointSaveError` on every rank if any failed.

    The message is the cause on the lowest failing rank: every rank stops with one line
    that names it, instead of one rank's traceback and the others' "connection closed".
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    first = torch.tensor([rank if error is not None else world], dtype=torch.int64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    failed = int(first.item())
    if failed == world:
        return
    cause = [None]
    if rank == failed:
        cause = [error.args[0] if isinstance(error, ValueError) else _cause(error)]
        if isinstance(error, OSError) and error.errno is not None:
            cause[0] += _free_space(root)
    src = dist.get_global_rank(group, failed)
    dist.broadcast_object_list(cause, src=src, group=group, device=device)
    raise CheckpointSaveError(
        f"could not save iteration {iteration} to {root}: rank {failed}: {cause[0]}; "
        f"{_still_latest(root)}"
    ) from error


def _parameters_finite(engine: Engine) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in engine.model.module.parameters())


def _discard_checkpoints(root: Path) -> None:
    """Delete the tracker first (so it never names a missing folder), then every iter_*."""
    tracker = root / TRACKER
    if tracker.exists():
        os.remove(tracker)
        fsync_path(root)
    for folder in root.glob("iter_*"):
        shutil.rmtree(folder)
    logger.warning("deleted the earlier checkpoints in %s (--hdp-overwrite-checkpoints)", root)


def _prepare_folder(
    root: Path, partial: Path, iteration: int, discard_existing: bool, run_id: str | None
) -> None:
    """Rank 0: make the folder, drop stale partial saves, refuse another run's or an older one."""
    root.mkdir(parents=True, exist_ok=True)
    if discard_existing:
        _discard_checkpoints(root)
    elif (root / TRACKER).exists():
        latest = latest_iteration(root)
        if latest > iteration:
            raise ValueError(
                f"{root} already holds iteration {latest}; saving iteration {iteration} there "
                "would move its latest checkpoint backwards"
            )
        owner = read_meta(root).get("run_id")
        if run_id is not None and owner is not None and owner != run_id:
            raise ValueError(
                f"{root} now holds the checkpoints of another run (run id {owner}, iteration "
                f"{latest}); refusing to overwrite them"
            )
    for stale in root.glob("iter_*.partial"):
        shutil.rmtree(stale, ignore_errors=True)
    partial.mkdir()


def save_checkpoint(
    root: str | Path,
    engine: Engine,
    state: TrainingState,
    *,
    group: dist.ProcessGroup,
    device: torch.device | None = None,
    extra: dict | None = None,
    meta_extra: dict | None = None,
    discard_existing: bool = False,
) -> Path:
    """Collective over `group`: write the checkpoint of `state.iteration` atomically.

    Returns the checkpoint folder. `extra` (e.g. the arguments) is stored in `common.pt`,
    `meta_extra` (small, JSON) in `meta.json`, where start-up checks read it without
    loading the model. `discard_existing` deletes the folder's earlier checkpoints first;
    otherwise a save that would move the tracker backwards, or (with a `run_id` in
    `meta_extra`) overwrite the checkpoints of another run, is refused.

    Raises (on every rank, nothing written): `NonFiniteError` if any rank's parameters are
    not finite; `CheckpointSaveError` naming the rank and the cause if any rank failed to
    prepare, write or publish its part (a full disk, a refused folder).
    """
    device = device or torch.device("cpu")
    root = Path(root)
    rank = dist.get_rank(group)
    final = iteration_dir(root, state.iteration)
    partial = final.with_name(final.name + ".partial")
    if not _all_ok(_parameters_finite(engine), group, device):
        raise NonFiniteError(
            f"refusing to save iteration {state.iteration} to {root}: the parameters are not "
            "finite (NaN or infinite); the latest checkpoint there is unchanged"
        )
    error: BaseException | None = None
    if rank == 0:
        try:
            run_id = (meta_extra or {}).get("run_id")
            _prepare_folder(root, partial, state.iteration, discard_existing, run_id)
        except (OSError, ValueError) as err:
            error = err
    _raise_if_any_failed(error, group, device, root, state.iteration)
    try:
        if engine.optimizer_is_distributed:
            _write(partial / f"optim_rank{rank}.pt", _optimizer_shard_state(engine.optimizer))
        _write(partial / f"rng_rank{rank}.pt", _rng_state())
        if engine.replica == 0 and rank != 0:  # the first replica's other shards
            _write(
                partial / engine.shard_name,
                {
                    "model": engine.model.module.state_dict(),
                    "optimizer": engine.optimizer.state_dict(),
                },
            )
        if rank == 0:
            _write(
                partial / "common.pt",
                {
                    "iteration": state.iteration,
                    "consumed_tokens": state.consumed_tokens,
                    "data_state": state.data_state,
                    "model": engine.model.module.state_dict(),
                    "optimizer": engine.optimizer.state_dict(),
                    "scheduler": engine.scheduler.state_dict(),
                    "extra": extra or {},
                },
            )
            meta = {
                **(meta_extra or {}),
                "iteration": state.iteration,
                "world_size": dist.get_world_size(group),
                "tensor_model_parallel_size": engine.tp_size,
                "pipeline_model_parallel_size": engine.pp_size,
                "distributed_optimizer": engine.optimizer_is_distributed,
                "schedule": engine.scheduler.state_dict(),
            }
            (partial / META).write_text(json.dumps(meta) + "\n")
            fsync_path(partial / META)
    except (OSError, RuntimeError) as err:  # torch.save reports a full disk as RuntimeError
        error = err
    _raise_if_any_failed(error, group, device, root, state.iteration)
    if rank == 0:
        try:
            _publish(root, partial, final, state.iteration)
        except OSError as err:
            error = err
    _raise_if_any_failed(error, group, device, root, state.iteration)
    if rank == 0:
        logger.info("saved checkpoint %s", final)
    return final


def _publish(root: Path, partial: Path, final: Path, iteration: int) -> None:
    """Rank 0: rename the complete `partial` folder to `final`, then point the tracker at it.

    A failure before the tracker's `os.replace` leaves the tracker at the previous
    checkpoint and removes the new folder (which also gives its space back).
    """
    fsync_path(partial)
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    tracker_tmp = root / (TRACKER + ".tmp")
    try:
        tracker_tmp.write_text(f"{iteration}\n")
        fsync_path(tracker_tmp)
        os.replace(tracker_tmp, root / TRACKER)
    except OSError:
        shutil.rmtree(final, ignore_errors=True)
        raise
    finally:
        tracker_tmp.unlink(missing_ok=True)
    fsync_path(root)


def load_checkpoint(
    root: str | Path, engine: Engine, *, group: dist.ProcessGroup
) -> tuple[TrainingState, dict]:
    """Collective over `group`: restore model, optimizer, schedule and RNG; return the state.

    Returns `(training_state, extra)`. Raises ValueError for a missing or incomplete
    checkpoint, or one written by a pool of another size with the distributed optimizer.
    """
    root = Path(root)
    iteration = latest_iteration(root)
    folder = iteration_dir(root, iteration)
    meta = json.loads((folder / META).read_text())
    if engine.optimizer_is_distributed and meta["world_size"] != dist.get_world_size(group):
        raise ValueError(
            f"{folder} was written by {meta['world_size']} ranks with the distributed "
            f"optimizer; this job has {dist.get_world_size(group)}"
        )
    for what, mine in (
        ("tensor_model_parallel_size", engine.tp_size),
        ("pipeline_model_parallel_size", engine.pp_size),
    ):
        saved = meta.get(what, 1)
        if saved != mine:
            raise ValueError(f"{folder} was written with {what} {saved}; this job has {mine}")
    common = torch.load(folder / "common.pt", map_location="cpu", weights_only=False)
    rank = dist.get_rank(group)
    shard = common
    if engine.tp_rank > 0 or engine.stage > 0:
        shard = torch.load(folder / engine.shard_name, map_location="cpu", weights_only=False)
    engine.model.module.load_state_dict(shard["model"])
    engine.optimizer.reload_model_params()
    engine.optimizer.load_state_dict(shard["optimizer"])
    if engine.optimizer_is_distributed:
        own = torch.load(folder / f"optim_rank{rank}.pt", map_location="cpu", weights_only=False)
        _load_optimizer_shard_state(engine.optimizer, own)
    engine.scheduler.load_state_dict(common["scheduler"])
    rng_file = folder / f"rng_rank{rank}.pt"
    if rng_file.exists():
        _set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
    logger.info("loaded checkpoint %s (iteration %d)", folder, iteration)
    state = TrainingState(
        iteration=iteration,
        data_state=common["data_state"],
        consumed_tokens=common.get("consumed_tokens", 0),
    )
    return state, common.get("extra", {})
