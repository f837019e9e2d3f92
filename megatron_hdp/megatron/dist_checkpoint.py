"""Checkpoints in Megatron's distributed format (`--ckpt-format torch_dist`; host layer).

Writes and reads one checkpoint folder through `megatron.core.dist_checkpointing` with the
torch_dist backend, in Megatron-LM's own state-dict structure (`generate_state_dict` in
`megatron/training/checkpointing.py`), so that stock Megatron-LM loads these folders and
this job loads Megatron-LM's:

    model                   the model's `sharded_state_dict` (the unwrapped GPTModel)
    optimizer               the optimizer's `sharded_state_dict` (the distributed optimizer's
                            sharding type as Megatron-LM chooses it: `dp_reshardable`, or
                            `fully_reshardable` with --dist-ckpt-optim-fully-reshardable)
    opt_param_scheduler     `OptimizerParamScheduler.state_dict()`
    iteration, checkpoint_version (3.0), num_floating_point_operations_so_far
    args                    an argparse.Namespace with Megatron-LM's attribute names
    rng_state               Megatron-LM's ShardedObject of (PP, TP) rank, replicated over DP
    hdp                     ours (ignored by Megatron-LM): data position, consumed tokens
    hdp_rng_state           ours: every rank's RNG states, one ShardedObject per (PP, TP,
                            pool rank), so a resume at the same layout continues each rank's
                            draws exactly

Nothing here publishes a checkpoint: `checkpoint.py` writes into a `.partial` folder through
`write` and renames it once every rank is done. Reading resharding is Megatron's: the model
and a non-distributed optimizer reshard over TP, PP and pool size; the distributed
optimizer's `dp_reshardable` state over the pool size only, `fully_reshardable` over all.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_hdp.distributed.helper_processes import sigterm_blocked, start_manager
from megatron_hdp.megatron import compat
from megatron_hdp.megatron.engine import Engine
from megatron_hdp.megatron.mixed_precision_state import map_float32_params

logger = logging.getLogger(__name__)

#: Megatron-LM's `checkpoint_version` of today's checkpoints.
CHECKPOINT_VERSION = 3.0
#: The distributed optimizer's sharding types (Megatron-LM's names).
DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: what a checkpoint's RNG keys and resharding depend on."""

    tp_size: int
    pp_size: int
    pool_size: int
    tp_rank: int
    pp_rank: int
    pool_rank: int

    @classmethod
    def of(cls, engine: Engine) -> Layout:
        """This rank's layout, from Megatron's parallel state (initialised by the layout)."""
        return cls(
            tp_size=engine.tp_size,
            pp_size=engine.pp_size,
            pool_size=parallel_state.get_data_parallel_world_size(),
            tp_rank=engine.tp_rank,
            pp_rank=engine.stage,
            pool_rank=parallel_state.get_data_parallel_rank(),
        )


def sharding_type(fully_reshardable: bool) -> str:
    """The distributed optimizer's sharding type Megatron-LM writes.

    Its default, or `fully_reshardable` with `--dist-ckpt-optim-fully-reshardable`.
    """
    return FULLY_RESHARDABLE if fully_reshardable else DP_RESHARDABLE


def sharded_metadata(engine: Engine, *, fully_reshardable: bool = False) -> dict:
    """Megatron-LM's `_build_sharded_state_dict_metadata` for this engine.

    Passed to the model's and optimizer's `sharded_state_dict`; stored (without the process
    group) as the checkpoint's content metadata, which a load reads back.
    """
    metadata: dict = {}
    if engine.optimizer_is_distributed:
        metadata["distrib_optim_sharding_type"] = sharding_type(fully_reshardable)
        if fully_reshardable:
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    metadata["singleton_local_shards"] = False
    metadata["chained_optim_avoid_prefix"] = True
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return metadata


def _serializable(metadata: dict) -> dict:
    """Megatron-LM's `_clean_metadata_for_serialization`: the metadata without groups."""
    return {k: v for k, v in metadata.items() if k != "dp_cp_group"}


def rng_states() -> dict:
    """This rank's RNG states under Megatron-LM's `get_rng_state` keys.

    A CPU run has no CUDA generator: `cuda_rng_state` is then an empty byte tensor and the
    tracker's states are empty, and a load leaves the CUDA side alone.
    """
    cuda = (
        torch.cuda.get_rng_state()
        if torch.cuda.is_available()
        else torch.empty(0, dtype=torch.uint8)
    )
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": cuda,
        "rng_tracker_states": {
            name: state.clone() if torch.is_tensor(state) else state
            for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items()
        },
    }


def set_rng_states(state: dict) -> None:
    """Restore `rng_states()`' output (the CUDA side only where this run has CUDA)."""
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and state["cuda_rng_state"].numel():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tracker = state.get("rng_tracker_states")
    if tracker:
        tensor_parallel.get_cuda_rng_tracker().set_states(
            {name: s.clone() if torch.is_tensor(s) else s for name, s in tracker.items()}
        )


def _rng_objects(layout: Layout, states: dict) -> dict:
    """Megatron-LM's `rng_state` ShardedObject and ours, per (PP, TP, pool rank)."""
    return {
        "rng_state": compat.megatron_rng_sharded_object(
            [states],
            pp=(layout.pp_size, layout.pp_rank),
            tp=(layout.tp_size, layout.tp_rank),
            dp=(layout.pool_size, layout.pool_rank),
            expert_parallel=parallel_state.get_expert_model_parallel_world_size() > 1,
        ),
        "hdp_rng_state": ShardedObject(
            "hdp_rng_state",
            states,
            (layout.pp_size, layout.tp_size, layout.pool_size),
            (layout.pp_rank, layout.tp_rank, layout.pool_rank),
            replica_id=0,
        ),
    }


#: The schedule's step counts, which Megatron-LM keeps in samples (its scheduler steps by
#: the global batch size every iteration) and this job in iterations.
SCHEDULE_COUNTS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")


def samples_per_iteration(args) -> int:
    """Megatron-LM's scheduler increment per iteration for a run of `args`.

    That is its global batch size; 1 when the batch is a token budget, for which Megatron-LM
    has no sample count, or when the schedule counts samples already (`counts_samples`).
    """
    from megatron_hdp.megatron.arguments import counts_samples

    if counts_samples(args):
        return 1
    return int(getattr(args, "global_batch_size", None) or 1)


def schedule_in_samples(state: dict, args) -> dict:
    """Our schedule state (iterations) in Megatron-LM's units, for a checkpoint of `args`."""
    n = samples_per_iteration(args)
    return {k: v * n if k in SCHEDULE_COUNTS and v is not None else v for k, v in state.items()}


def schedule_in_iterations(state: dict, ckpt_args) -> dict:
    """A checkpoint's schedule state (Megatron-LM's samples) in iterations, this job's unit."""
    n = samples_per_iteration(ckpt_args)
    return {
        k: (v // n if v % n == 0 else v / n) if k in SCHEDULE_COUNTS and v is not None else v
        for k, v in state.items()
    }


def model_keys(engine: Engine) -> list[str]:
    """The state-dict keys of the engine's model chunks, as Megatron-LM names them.

    "model" for one chunk; "model0", "model1", ... with virtual pipeline stages. The sharded
    tensors inside are keyed by global layer number, so either form loads into the other.
    """
    if len(engine.chunks) == 1:
        return ["model"]
    return [f"model{i}" for i in range(len(engine.chunks))]


def state_dict(
    engine: Engine,
    metadata: dict,
    *,
    iteration: int,
    args: argparse.Namespace,
    hdp: dict | None,
    rng: dict | None,
    optimizer: bool = True,
    is_loading: bool = False,
) -> dict:
    """Megatron-LM's `generate_state_dict` for one engine, plus our `hdp` entry.

    `rng` is the output of `_rng_objects` (None: no RNG). `optimizer=False` leaves out the
    optimizer and the schedule (a load of the weights alone).
    """
    out: dict = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    models = {
        key: chunk.module.sharded_state_dict(metadata=metadata)
        for key, chunk in zip(model_keys(engine), engine.chunks, strict=True)
    }
    out.update(models)
    if optimizer:
        map_float32_params(engine.optimizer)  # --bf16 / --fp16: the norms stay float32
        model_sd = models["model"] if len(models) == 1 else models
        out["optimizer"] = engine.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=metadata
        )
        out["opt_param_scheduler"] = schedule_in_samples(engine.scheduler.state_dict(), args)
    if rng:
        out.update(rng)
    if hdp is not None:
        out["hdp"] = hdp
    return out


def write(
    folder: Path,
    engine: Engine,
    *,
    iteration: int,
    args: argparse.Namespace,
    hdp: dict,
    fully_reshardable: bool = False,
    async_save: bool = False,
):
    """Collective over the job: write the checkpoint into the existing, empty `folder`.

    Returns None, or with `async_save` Megatron's `AsyncRequest` whose sharded writes run
    in the background (schedule it on an `AsyncCallsQueue` under `sigterm_blocked()`;
    `metadata.json` is written by its finalisation). The writer's helper processes started
    here (its results-queue server, its write workers) do not get the job's SIGTERM
    (`helper_processes`), so a preemption signal that lands during the save does not break it.
    """
    layout = Layout.of(engine)
    metadata = sharded_metadata(engine, fully_reshardable=fully_reshardable)
    _allocate_optimizer_state(engine.optimizer)  # before the first step it has none
    sd = state_dict(
        engine,
        metadata,
        iteration=iteration,
        args=args,
        hdp=hdp,
        rng=_rng_objects(layout, rng_states()),
    )
    sd["num_floating_point_operations_so_far"] = 0
    _slow_writes_for_tests()
    writer_results_queue()
    with sigterm_blocked():  # the write workers Megatron forks (sync save) inherit it
        return dist_checkpointing.save(
            sd,
            str(folder),
            async_sharded_save=async_save,
            **compat.async_save_kwargs(async_save),
            content_metadata=_serializable(metadata),
        )


#: Test hook (tests/e2e/test_preemption.py): seconds each of Megatron's write workers sleeps
#: before writing its files, so that a test can signal the job while a checkpoint is being
#: written even on a tiny model. Unset (every real run): no effect.
SLOW_WRITES_ENV = "HDP_TEST_SLOW_CHECKPOINT_WRITES_S"


def _slow_writes_for_tests() -> None:
    """With `SLOW_WRITES_ENV` set, make Megatron's write workers sleep first (test only)."""
    delay = float(os.environ.get(SLOW_WRITES_ENV) or 0)
    if delay <= 0:
        return
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    original = FileSystemWriterAsync.write_preloaded_data  # a staticmethod: the function
    if getattr(original, "hdp_slowed", False):
        return

    def slowed(*args, **kwargs):
        time.sleep(delay)
        return original(*args, **kwargs)

    slowed.hdp_slowed = True
    FileSystemWriterAsync.write_preloaded_data = staticmethod(slowed)


def is_dist_checkpoint(folder: str | Path) -> bool:
    """True if `folder` holds a `dist_checkpointing` checkpoint (its `metadata.json`)."""
    return (Path(folder) / "metadata.json").exists()


def read_common(folder: str | Path) -> dict:
    """The checkpoint's common (non-sharded) part: args, iteration, schedule, ours. Local."""
    return dist_checkpointing.load_common_state_dict(str(folder))


def _layout_of_args(ckpt_args) -> tuple[int, int]:
    return (
        getattr(ckpt_args, "tensor_model_parallel_size", 1),
        getattr(ckpt_args, "pipeline_model_parallel_size", 1),
    )


def read(
    folder: Path,
    engine: Engine,
    *,
    load_optimizer: bool = True,
    load_rng: bool = True,
) -> dict:
    """Collective over the job: load `folder` into the engine, resharding where needed.

    Mirrors Megatron-LM's `load_checkpoint` for torch_dist: the sharding type of the
    distributed optimizer comes from the checkpoint's content metadata; the RNG states are
    restored per rank when the layout is the same (ours), else Megatron-LM's per (PP, TP)
    state when TP and PP are the same, else not at all. Returns the common state dict
    (`iteration`, `args`, `hdp`, ...).

    Raises ValueError (before any collective) when the distributed optimizer's state was
    saved `dp_reshardable` and TP or PP changed.
    """
    common = read_common(folder)
    layout = Layout.of(engine)
    ckpt_args = common.get("args") or argparse.Namespace()
    same_tp_pp = _layout_of_args(ckpt_args) == (layout.tp_size, layout.pp_size)
    saved_pool = getattr(ckpt_args, "data_parallel_size", None)
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
    if load_optimizer and engine.optimizer_is_distributed:
        sharding = metadata.get("distrib_optim_sharding_type")
        if sharding is None:  # Megatron-LM's rule for checkpoints before content metadata
            fully = getattr(ckpt_args, "ckpt_fully_parallel_save", False)
            sharding = "fully_sharded_model_space" if fully else "dp_zero_gather_scatter"
            metadata["distrib_optim_sharding_type"] = sharding
        if not same_tp_pp and sharding not in compat.fully_reshardable_formats():
            raise ValueError(
                f"{folder}: the distributed optimizer's state was saved {sharding}, which "
                "reshards over the pool size only; this job changes TP x PP from "
                f"{_layout_of_args(ckpt_args)} to {(layout.tp_size, layout.pp_size)}"
            )
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if load_optimizer and engine.optimizer_is_distributed:
        _allocate_optimizer_state(engine.optimizer)
    rng = None
    if load_rng and same_tp_pp:
        rng = _rng_objects(layout, rng_states())
        if saved_pool != layout.pool_size or "hdp" not in common:
            del rng["hdp_rng_state"]
    sd = state_dict(
        engine,
        metadata,
        iteration=0,
        args=None,
        hdp=None,
        rng=rng,
        optimizer=load_optimizer,
        is_loading=True,
    )
    loaded = dist_checkpointing.load(sd, str(folder))
    for key, chunk in zip(model_keys(engine), engine.chunks, strict=True):
        chunk.load_state_dict(loaded[key], strict=True)
    if load_optimizer:
        # no_grad: fp32 main parameters are views of the model's leaves
        if not engine.optimizer_is_distributed:
            _step_zero_where_missing(loaded["optimizer"])
        with torch.no_grad(), _steps_kept_on_load():
            engine.optimizer.load_state_dict(loaded["optimizer"])
        if engine.optimizer_is_distributed:
            _restore_steps(engine.optimizer, loaded["optimizer"])
        schedule = loaded["opt_param_scheduler"]
        if not engine.schedule_in_samples:  # else the checkpoint's unit already
            schedule = schedule_in_iterations(schedule, ckpt_args)
        engine.scheduler.load_state_dict(schedule)
    else:
        engine.optimizer.reload_model_params()
    if rng is not None:
        if "hdp_rng_state" in loaded:
            set_rng_states(loaded["hdp_rng_state"])
        elif "rng_state" in loaded:
            set_rng_states(loaded["rng_state"][0])
    elif load_rng:
        logger.info(
            "%s: TP x PP changed from %s: the RNG states are not restored (as in Megatron-LM)",
            folder,
            _layout_of_args(ckpt_args),
        )
    return loaded


def _allocate_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer's torch Adam the state its first step would create.

    Zeros and step 0, as torch's Adam initialises them lazily, so this changes no update.
    A checkpoint saved before the first step then holds the optimizer state a load asks
    for; and without Transformer Engine or Apex (every CPU machine) the distributed
    optimizer's `state_dict()`, which its loading `sharded_state_dict` calls, reads each
    parameter's torch `step` and fails without it. A load overwrites all of it.
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = inner.optimizer
        if len(torch_optimizer.state):
            continue
        inner.init_state_fn(torch_optimizer, inner.config)
        for group in torch_optimizer.param_groups:
            for p in group["params"]:
                torch_optimizer.state[p]["step"] = torch.tensor(0.0)


@contextlib.contextmanager
def _steps_kept_on_load():
    """Within the block, the distributed optimizer's parameter-state load keeps `step`.

    Without Transformer Engine or Apex, each parameter's torch Adam state holds a `step`,
    which the `fully_reshardable` checkpoint's canonical state (param, exp_avg, exp_avg_sq)
    does not: Megatron-Core's `_set_main_param_and_optimizer_states` then fails with
    KeyError 'step'. The current step is passed through (`_restore_steps` sets it after).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if "step" not in tensors:
            current = self._get_main_param_and_optimizer_states(model_param)
            if "step" in current:
                tensors = {**tensors, "step": current["step"]}
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original


def _saved_steps(tree) -> set:
    """The `step` values of every parameter group in a loaded optimizer state dict."""
    steps: set = set()
    if isinstance(tree, dict):
        for group in (
            tree.get("param_groups", []) if isinstance(tree.get("param_groups"), list) else []
        ):
            if isinstance(group, dict) and "step" in group:
                steps.add(float(group["step"]))
        for value in tree.values():
            steps |= _saved_steps(value)
    elif isinstance(tree, list | tuple):
        for value in tree:
            steps |= _saved_steps(value)
    return steps


def _restore_steps(optimizer, loaded: dict) -> None:
    """Give every parameter of the distributed optimizer's torch Adam the saved `step`.

    Without Transformer Engine or Apex, Megatron-Core's distributed optimizer keeps torch
    Adam's per-parameter `step` only in its parameter groups (`state_dict`), and its
    `load_state_dict` gives all parameters one shared `step` tensor, which the parameter
    state's load then overwrites with the loading template's value. Torch's Adam adds 1 to
    each parameter's `step` in place, so both would break the bias correction of the
    resumed steps: each parameter gets its own tensor holding the saved count.
    """
    steps = _saved_steps(loaded)
    if len(steps) != 1:
        raise ValueError(f"the checkpoint's optimizer holds step counts {sorted(steps)}, not one")
    step = steps.pop()
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in inner.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32)


def _step_zero_where_missing(tree) -> None:
    """Step 0 for a torch optimizer state saved before its first step.

    Megatron-Core's non-distributed optimizer saves the parameters' common Adam step only
    when it is not 0 (`if step:`), and its load then hands torch's Adam states without
    `step`, which torch refuses. Step 0 is what the missing entry meant.
    """
    if isinstance(tree, dict):
        state = tree.get("state")
        if isinstance(state, dict) and "param_groups" in tree and "common_step" not in state:
            if state and all(isinstance(v, dict) and "step" not in v for v in state.values()):
                state["common_step"] = torch.tensor(0.0)
        for value in tree.values():
            _step_zero_where_missing(value)
    elif isinstance(tree, list | tuple):
        for value in tree:
            _step_zero_where_missing(value)


def writer_results_queue():
    """The results queue of Megatron's checkpoint writer in this process, in a safe server.

    `dist_checkpointing`'s file writer sends its workers' results through a queue held by a
    `multiprocessing` manager server, which Megatron-Core (0.16 to 0.19) starts at the first
    save and keeps in `filesystem_async._results_queue`; a server that got the job's
    SIGTERM would die and break the save ("Broken pipe"). This starts it first, through
    `helper_processes.start_manager` (SIGTERM ignored, ends with this rank), and starts a
    fresh one if the one kept has died. Megatron's own code then finds and uses it. Local.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = filesystem_async._results_queue
    if queue is not None:
        process = getattr(getattr(queue, "_manager", None), "_process", None)
        if process is None or process.is_alive():
            return queue
        logger.warning("the checkpoint writer's helper process had died; starting a new one")
        close_writer_processes()
    filesystem_async._results_queue = start_manager().Queue()
    return filesystem_async._results_queue


def close_writer_processes() -> None:
    """Stop the helper process Megatron's checkpoint writer started in this process.

    `dist_checkpointing`'s file writer keeps its results queue in a multiprocessing
    manager, a spawned server process (~200 MB) started at the first save
    (`writer_results_queue`) and kept for later ones. It ends with this process anyway;
    call this when done saving to give its memory back earlier. Local.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = getattr(filesystem_async, "_results_queue", None)
    manager = getattr(queue, "_manager", None)
    if manager is not None:
        try:
            manager.shutdown()
        except (OSError, EOFError):  # it died already (killed)
            pass
    if queue is not None:
        filesystem_async._results_queue = None
