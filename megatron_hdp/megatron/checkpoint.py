"""Atomic, resumable checkpoints of an HDP job in Megatron's distributed format (host layer).

Layout, Megatron-LM's own (`--ckpt-format torch_dist`):

    <dir>/latest_checkpointed_iteration.txt     the newest complete checkpoint
    <dir>/iter_0000100/                         `dist_checkpointing`'s files (torch_dist
                                                backend: `.metadata`, `__<rank>_<n>.distcp`,
                                                `common.pt` with 0.16, `metadata.json`),
                                                the state dict `dist_checkpoint.py` describes
    <dir>/iter_0000100/meta.json                ours: run id, world size, layout, optimizer
                                                kind, LR schedule, model shape, data set-up
                                                (read by the start-up checks without torch)

All ranks write into one folder, so `<dir>` must be on a filesystem every rank sees (as
with Megatron-LM). Folders of the earlier per-rank torch.save format are still read
(`legacy_checkpoint.py`); only this format is written.

Atomicity: everything is written into `iter_XXXXXXX.partial`; once every rank has finished,
rank 0 renames the folder to `iter_XXXXXXX` and then replaces the tracker file with
`os.replace`. A crash or a failed write on any rank leaves the previous checkpoint as the
latest; the failure is raised on every rank (no rank is left waiting), and stale `.partial`
folders are removed by the next save. With `--async-save` the sharded writes run in the
background (Megatron-Core's `AsyncCallsQueue`) and the rename and tracker update are the
save's last finalisation step, so the same holds.

`group` holds every rank of the job.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from megatron_hdp.checkpoint_digests import checkpoint_files, digests, share, write_digests
from megatron_hdp.checkpoint_files import (
    META,
    TRACKER,
    fsync_path,
    hidden_write_causes,
    iteration_dir,
    latest_iteration,
    read_meta,
)
from megatron_hdp.distributed.helper_processes import sigterm_blocked
from megatron_hdp.errors import CheckpointSaveError, NonFiniteError
from megatron_hdp.megatron import compat, dist_checkpoint
from megatron_hdp.megatron.engine import Engine
from megatron_hdp.megatron.legacy_checkpoint import is_legacy_checkpoint, load_legacy

logger = logging.getLogger(__name__)


@dataclass
class TrainingState:
    """What a resumed job needs besides model and optimizer."""

    iteration: int
    data_state: dict
    consumed_tokens: int = 0


def _all_ok(ok: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, group=group)
    return int(flag.item()) == 0


def _cause(err: BaseException) -> str:
    """One line for a failed write: the OS's reason and the file, or the error's first line."""
    while isinstance(err, RuntimeError) and isinstance(err.__cause__, OSError):
        err = err.__cause__  # dist_checkpointing's writer wraps the worker's error
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror} ({err.filename})" if err.filename else err.strerror
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _os_error(err: BaseException) -> BaseException:
    """The OSError inside a wrapped write failure, where one can be recovered.

    Megatron's writer reports a worker's failure as `RuntimeError("Worker failure: <the
    OSError>")`; gathered from another rank, the chained OSError is gone, its text is not.
    """
    while isinstance(err, RuntimeError) and isinstance(err.__cause__, OSError):
        err = err.__cause__
    if isinstance(err, RuntimeError):
        found = re.search(r"\[Errno (\d+)\] ([^:]+): '([^']*)'", str(err))
        if found:
            return OSError(int(found[1]), found[2], found[3])
    return err


def _report(error: BaseException | None, rank: int) -> tuple[int, BaseException] | None:
    """(failing rank, its error) as far as this rank knows; None if it knows of none.

    `dist_checkpointing`'s collective write raises a `CheckpointException` on every rank
    when any rank's write failed, but only the coordinator's holds the failures (by rank).
    """
    if error is None:
        return None
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict):
        if not failures:
            return None  # a follower of the collective failure: the coordinator reports it
        failing = min(failures)
        wrapped = failures[failing]
        return failing, wrapped[0] if isinstance(wrapped, tuple) else wrapped
    return rank, error


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
    if _all_ok(error is None, group, device):
        return
    rank = dist.get_rank(group)
    mine = _report(error, dist.get_global_rank(group, rank))
    if mine is not None:
        failing, err = mine
        err = _os_error(err)
        cause = err.args[0] if isinstance(err, ValueError) else _cause(err)
        if isinstance(err, OSError) and err.errno is not None:
            cause += _free_space(root)
        elif not isinstance(err, ValueError):  # the zip writer hides ENOSPC and EFBIG
            cause += hidden_write_causes(root if root.exists() else root.parent)
        mine = (failing, cause)
    reports: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, mine, group=group)
    known = sorted(r for r in reports if r is not None)
    failing, cause = known[0] if known else ("?", "the collective write failed")
    raise CheckpointSaveError(
        f"could not save iteration {iteration} to {root}: rank {failing}: {cause}; "
        f"{_still_latest(root)}"
    ) from error


def _parameters_finite(engine: Engine) -> bool:
    return all(
        bool(torch.isfinite(p).all()) for chunk in engine.chunks for p in chunk.module.parameters()
    )


def _discard_others(root: Path, kept: Path) -> None:
    """Rank 0, once `kept` is published: delete every other checkpoint folder in `root`.

    `--hdp-overwrite-checkpoints`: the earlier run's checkpoints go only after this run's
    first one is complete and named in the tracker, so a crash before that leaves them.
    """
    others = [folder for folder in root.glob("iter_*") if folder != kept]
    for folder in others:
        shutil.rmtree(folder, ignore_errors=True)
    if others:
        fsync_path(root)
        logger.warning(
            "deleted the %d earlier checkpoint folder(s) in %s now that iteration %s is "
            "published (--hdp-overwrite-checkpoints)",
            len(others),
            root,
            kept.name.removeprefix("iter_").lstrip("0") or "0",
        )


def _prepare_folder(
    root: Path, partial: Path, iteration: int, discard_existing: bool, run_id: str | None
) -> None:
    """Rank 0: make the folder, drop stale partial saves, refuse another run's or an older one."""
    root.mkdir(parents=True, exist_ok=True)
    if not discard_existing and (root / TRACKER).exists():
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


def _plain(value) -> bool:
    """Whether `value` is a plain value (what a checkpoint's `args` may hold)."""
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def checkpoint_args(
    engine: Engine, world_size: int, args: argparse.Namespace | None = None
) -> argparse.Namespace:
    """The `args` entry of a checkpoint: Megatron-LM's argument names and meanings.

    This job's flags (Megatron-LM's names already) plus what Megatron-LM's load reads
    (`check_checkpoint_args`, `load_checkpoint`, `--use-checkpoint-args`) from the model
    the engine really built: the padded vocabulary, the layout (`world_size`,
    `data_parallel_size` = the pool), the format. Megatron-LM counts samples, HDP counts
    tokens: `consumed_train_samples` is 0 and our data position is in the `hdp` entry.
    """
    cfg = engine.cfg
    out = {k: v for k, v in vars(args).items() if _plain(v)} if args is not None else {}
    heads = cfg.num_attention_heads
    out.update(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size or 4 * cfg.hidden_size,
        num_attention_heads=heads,
        # MLA's head dims are its own flags; kv_channels stays Megatron-LM's hidden / heads.
        kv_channels=(cfg.kv_channels or cfg.hidden_size // heads)
        if cfg.multi_latent_attention
        else cfg.head_dim,
        qk_layernorm=cfg.qk_layernorm,
        softmax_type=cfg.softmax_type,
        rotary_percent=cfg.rotary_percent,
        rotary_interleaved=cfg.rotary_interleaved,
        group_query_attention=cfg.num_query_groups is not None,
        num_query_groups=cfg.num_query_groups or heads,
        max_position_embeddings=cfg.max_position_embeddings,
        position_embedding_type=cfg.position_embedding_type,
        add_position_embedding=True,  # Megatron-LM's default; RoPE models ignore it
        rotary_base=cfg.rotary_base,
        normalization=cfg.normalization,
        swiglu=cfg.swiglu,
        add_bias_linear=cfg.add_bias_linear,
        untie_embeddings_and_output_weights=not cfg.tie_embeddings,
        padded_vocab_size=cfg.vocab_size,
        init_method_std=cfg.init_method_std,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        bf16=cfg.params_dtype == "bfloat16",
        fp16=cfg.params_dtype == "float16",
        tensor_model_parallel_size=engine.tp_size,
        pipeline_model_parallel_size=engine.pp_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        num_experts=cfg.num_experts,
        moe_router_topk=cfg.moe_router_topk,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        sequence_parallel=cfg.sequence_parallel,
        context_parallel_size=1,
        world_size=world_size,
        data_parallel_size=world_size // (engine.tp_size * engine.pp_size),
        use_distributed_optimizer=engine.optimizer_is_distributed,
        ckpt_format="torch_dist",
        use_dist_ckpt=True,
        ckpt_fully_parallel_save=False,
        no_save_optim=False,
        no_save_rng=False,
        data_parallel_random_init=False,
        consumed_train_samples=0,
        skipped_train_samples=0,
        consumed_valid_samples=0,
    )
    return argparse.Namespace(**out)


def save_checkpoint(
    root: str | Path,
    engine: Engine,
    state: TrainingState,
    *,
    group: dist.ProcessGroup,
    device: torch.device | None = None,
    args: argparse.Namespace | None = None,
    meta_extra: dict | None = None,
    discard_existing: bool = False,
    fully_reshardable: bool = False,
    async_saves: AsyncSaves | None = None,
) -> Path:
    """Collective over `group`: write the checkpoint of `state.iteration` atomically.

    Returns the checkpoint folder. `args` (the job's flags) goes into the checkpoint's
    `args` (`checkpoint_args`), `meta_extra` (small, JSON) into `meta.json`, where start-up
    checks read it without loading the model. `discard_existing` deletes the folder's
    earlier checkpoints once this one is published (a failed save leaves them); otherwise
    a save that would move the tracker backwards, or
    (with a `run_id` in `meta_extra`) overwrite the checkpoints of another run, is refused.
    `fully_reshardable`: the distributed optimizer's state in Megatron's
    `fully_reshardable` form (loads at any TP and PP; gathered over the pool on save)
    instead of `dp_reshardable` (loads at another pool size only). With `async_saves` the
    sharded writes run in the background; the checkpoint is published (renamed, named in
    the tracker) when `async_saves.finalize` finds them done.

    Raises (on every rank, nothing published): `NonFiniteError` if any rank's parameters
    are not finite; `CheckpointSaveError` naming the rank and the cause if any rank failed
    to prepare, write or publish its part (a full disk, a refused folder).
    """
    device = device or torch.device("cpu")
    root = Path(root)
    rank = dist.get_rank(group)
    final = iteration_dir(root, state.iteration)
    partial = final.with_name(final.name + ".partial")
    if async_saves is not None:
        async_saves.finalize(blocking=True)  # one save in flight; the tracker moves in order
    if not _all_ok(_parameters_finite(engine), group, device):
        raise NonFiniteError(
            f"refusing to save iteration {state.iteration} to {root}: the parameters are not "
            "finite (NaN or infinite); the latest checkpoint there is unchanged"
        )
    error: BaseException | None = None
    run_id = (meta_extra or {}).get("run_id")
    if rank == 0:
        try:
            _prepare_folder(root, partial, state.iteration, discard_existing, run_id)
        except (OSError, ValueError) as err:
            error = err
    _raise_if_any_failed(error, group, device, root, state.iteration)
    hdp = {"data_state": state.data_state, "consumed_tokens": state.consumed_tokens}
    request = None
    try:
        with compat.deferred_common_save_errors() as common_errors:
            request = dist_checkpoint.write(
                partial,
                engine,
                iteration=state.iteration,
                args=checkpoint_args(engine, dist.get_world_size(group), args),
                hdp=hdp,
                fully_reshardable=fully_reshardable,
                async_save=async_saves is not None,
            )
        if common_errors:
            raise common_errors[0]
        if rank == 0:
            meta = {
                **(meta_extra or {}),
                "format": "torch_dist",
                "iteration": state.iteration,
                "world_size": dist.get_world_size(group),
                "tensor_model_parallel_size": engine.tp_size,
                "pipeline_model_parallel_size": engine.pp_size,
                "distributed_optimizer": engine.optimizer_is_distributed,
                "distrib_optim_sharding_type": (
                    dist_checkpoint.sharding_type(fully_reshardable)
                    if engine.optimizer_is_distributed
                    else None
                ),
                "schedule": engine.scheduler.state_dict(),
            }
            _write_text(partial / META, json.dumps(meta) + "\n")
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - any write failure
        error = err  # reported on every rank below
    _raise_if_any_failed(error, group, device, root, state.iteration)

    def publish() -> None:
        """Collective: digest every file; rank 0 renames the folder, names it in the tracker."""
        failure = _write_digests(partial, group, run_id=run_id, iteration=state.iteration)
        _raise_if_any_failed(failure, group, device, root, state.iteration)
        failure = None
        if rank == 0:
            try:
                _publish(root, partial, final, state.iteration)
                if discard_existing:
                    _discard_others(root, final)
            except OSError as err:
                failure = err
        _raise_if_any_failed(failure, group, device, root, state.iteration)
        if rank == 0:
            logger.info("saved checkpoint %s", final)

    if request is None:
        publish()
    else:
        request.add_finalize_fn(publish)
        async_saves.schedule(request, root=root, iteration=state.iteration)
    return final


def _write_digests(
    partial: Path, group: dist.ProcessGroup, *, run_id: str | None, iteration: int
) -> BaseException | None:
    """Collective over `group`: hash the checkpoint's files, rank 0 writes `hdp_digests.json`.

    The ranks share the files out (every rank reads about 1/N of the bytes, in threads);
    rank 0 lists them once every rank's writes are done. Returns this rank's error, if any,
    for `_raise_if_any_failed`.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    names: list = [None]
    if rank == 0:
        try:
            names = [checkpoint_files(partial)]
        except OSError as err:
            names = [err]
    dist.broadcast_object_list(names, src=dist.get_global_rank(group, 0), group=group)
    if isinstance(names[0], BaseException):
        return names[0] if rank == 0 else None
    mine: dict | BaseException
    try:
        mine = digests(partial, share(names[0], rank, world))
    except OSError as err:
        mine = err
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    if isinstance(mine, BaseException):
        return mine
    if rank != 0 or any(isinstance(g, BaseException) for g in gathered):
        return None
    files = {name: digest for part in gathered for name, digest in part.items()}
    try:
        write_digests(partial, files, run_id=run_id, iteration=iteration)
    except OSError as err:
        return err
    return None


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class AsyncSaves:
    """`--async-save`: Megatron-Core's `AsyncCallsQueue`, one checkpoint in flight at a time.

    The sharded writes of a save run in a forked process, started with SIGTERM blocked so
    that a preemption signal to the whole job does not kill it; `finalize` (collective over
    the job) completes those that are done (all of them with `blocking=True`):
    `metadata.json`, then our rename and tracker update. `published` is the iteration of
    the newest save it published (None: none yet). Call it once per step and before the
    job ends.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue(persistent=False)
        self.group, self.device = group, device
        self.pending: tuple[Path, int] | None = None
        self.published: int | None = None

    def schedule(self, request, *, root: Path, iteration: int) -> None:
        """Start the background writes of a save (`save_checkpoint` calls it). Local."""
        with sigterm_blocked():  # the forked writer and its workers inherit it
            self.queue.schedule_async_request(request)
        self.pending = (root, iteration)

    def finalize(self, *, blocking: bool = False) -> None:
        """Collective: publish the pending save if its writes are done (wait: `blocking`).

        Raises `CheckpointSaveError` on every rank if its writes failed (the previous
        checkpoint stays the latest).
        """
        if self.pending is None:
            return
        root, iteration = self.pending
        try:
            self.queue.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointSaveError:
            self.pending = None
            raise
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - the background write's
            self.pending = None
            _raise_if_any_failed(err, self.group, self.device, root, iteration)
            raise
        if self.queue.get_num_unfinalized_calls() == 0:
            self.pending = None
            self.published = iteration

    def close(self) -> None:
        """Collective: wait for the pending save, publish it, stop the queue."""
        try:
            self.finalize(blocking=True)
        finally:
            self.queue.close()


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
    root: str | Path,
    engine: Engine,
    *,
    group: dist.ProcessGroup,
    load_optimizer: bool = True,
    load_rng: bool = True,
) -> tuple[TrainingState, dict]:
    """Collective over `group`: restore model, optimizer, schedule and RNG; return the state.

    Reads the latest checkpoint in `root` in either format: Megatron's distributed one
    (resharded to this job's TP, PP and pool size where Megatron can) or the earlier
    per-rank torch format (same layout only). `load_optimizer=False` loads the weights
    alone (no optimizer state, schedule or RNG). Returns `(training_state, extra)`, extra
    holding the checkpoint's `args` as a dict. Raises ValueError for a missing, incomplete
    or unloadable checkpoint.
    """
    root = Path(root)
    iteration = latest_iteration(root)
    folder = iteration_dir(root, iteration)
    if is_legacy_checkpoint(folder):
        common = load_legacy(folder, engine, group=group)
        logger.info("loaded checkpoint %s (iteration %d)", folder, iteration)
        state = TrainingState(
            iteration=iteration,
            data_state=common["data_state"],
            consumed_tokens=common.get("consumed_tokens", 0),
        )
        return state, common.get("extra", {})
    loaded = dist_checkpoint.read(
        folder, engine, load_optimizer=load_optimizer, load_rng=load_rng and load_optimizer
    )
    hdp = loaded.get("hdp") or {}
    logger.info("loaded checkpoint %s (iteration %d)", folder, loaded["iteration"])
    state = TrainingState(
        iteration=loaded["iteration"],
        data_state=hdp.get("data_state"),
        consumed_tokens=hdp.get("consumed_tokens", 0),
    )
    ckpt_args = loaded.get("args")
    return state, {"args": vars(ckpt_args) if ckpt_args is not None else {}}
