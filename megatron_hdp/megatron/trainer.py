"""The training loop of `pretrain_hdp.py` (host layer).

Per step: the sampler gives the global batch (lengths only), every rank plans it the same
way, each rank reads its own tokens and runs its micro-batches, one gradient sync, one
update. Logging, evaluation, checkpoints and TensorBoard hang off that loop.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_hdp.checkpoint_digests import DIGESTS
from megatron_hdp.checkpoint_files import iteration_dir, latest_iteration, read_meta
from megatron_hdp.data.batching import IndexedTokens, read_local
from megatron_hdp.data.loader import GlobalBatchLoader
from megatron_hdp.data.service.address import resolve_ray_address
from megatron_hdp.data.service.client import PlannedBatch, RayDataService
from megatron_hdp.data.service.indexer import release_indexers
from megatron_hdp.data.sources import blend_sources, lengths_digest
from megatron_hdp.data.training_data import DEFAULT_CACHE, TrainingData
from megatron_hdp.distributed.layout import ParallelLayout
from megatron_hdp.distributed.stall_watchdog import StallWatchdog
from megatron_hdp.distributed.stop_signal import StopSignal
from megatron_hdp.errors import DataServiceError, NonFiniteError, OutputWriteError
from megatron_hdp.megatron.arguments import (
    capacity_of,
    uses_static_mesh,
)
from megatron_hdp.megatron.checkpoint import (
    AsyncSaves,
    TrainingState,
    load_checkpoint,
    save_checkpoint,
)
from megatron_hdp.megatron.config import device_profile, model_config, optim_config
from megatron_hdp.megatron.dist_checkpoint import close_writer_processes
from megatron_hdp.megatron.engine import (
    Engine,
    agreed_host_budget,
    build_engine,
    offload_manager,
)
from megatron_hdp.megatron.model import model_shape
from megatron_hdp.megatron.resume_checks import scheduler_override
from megatron_hdp.megatron.run_report import RunReporter
from megatron_hdp.megatron.step import (
    StepResult,
    StepRuntime,
    evaluate,
    optimizer_loss_scale,
    train_step,
)
from megatron_hdp.offload.host_budget import size_text
from megatron_hdp.report.offload import offload_line
from megatron_hdp.scheduler import StepPlan, plan_step
from megatron_hdp.scheduler.cost import CostModel
from megatron_hdp.scheduler.stats import plan_statistics

logger = logging.getLogger(__name__)


def _merge_stats(stats: list[dict]) -> dict:
    """Plan statistics of several steps: means, but the extremes stay extremes."""
    merged = {key: statistics.fmean(s[key] for s in stats) for key in stats[0]}
    for key in ("max_ranks_per_sequence", "micro_batches_per_rank_max"):
        merged[key] = max(s[key] for s in stats)
    merged["micro_batches_per_rank_min"] = min(s["micro_batches_per_rank_min"] for s in stats)
    return merged


@dataclass
class _Window:
    """Running sums between two log lines."""

    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    excluded: float = 0.0  # seconds of evaluation and checkpointing inside the window
    stats: list[dict] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    aux_losses: list[float] = field(default_factory=list)
    offload: list[dict] = field(default_factory=list)  # the steps' offload fields


class Trainer:
    """Runs `args.train_iters` steps on this rank (collective over every rank of the job).

    Steps run over this rank's HDP pool (`runtime.group`); checkpoints and the stop-signal
    agreement run over the whole job, so the TP ranks of a replica stay together.

    Args:
        args: Parsed and validated `pretrain_hdp.py` arguments.
        data: Datasets and samplers from `build_training_data`.
        runtime: Pool group, model shape, device and counters.
    """

    def __init__(self, args: argparse.Namespace, data: TrainingData, runtime: StepRuntime):
        self.args = args
        self.data = data
        self.runtime = runtime
        self.pool_size = dist.get_world_size(runtime.group)
        # The job's rank: rank 0 logs (one TP rank of pool rank 0).
        self.rank = dist.get_rank(runtime.all_ranks)
        self.pool_rank = dist.get_rank(runtime.group)
        self.feed: GlobalBatchLoader | None = None  # started by the first step, after a resume
        self.service: RayDataService | None = None  # with --hdp-data-service ray
        self.capacity = capacity_of(args)
        self.policy = "static" if uses_static_mesh(args) else args.hdp_placement
        cfg = model_config(args, data.vocab_size)
        self._resume_meta = read_meta(args.load) if args.load and not args.finetune else None
        override = scheduler_override(args, self._resume_meta)
        optim = optim_config(args, override_scheduler=override)
        self.engine: Engine = build_engine(cfg, optim, seed=args.seed)
        profile = device_profile(args.hdp_device_profile)
        host = None
        if args.hdp_offload:  # per process (device), like the profile; collective
            host = agreed_host_budget(args.hdp_host_memory_gb, runtime.all_ranks, runtime.device)
            profile = dataclasses.replace(profile, host_memory_bytes=host.nbytes)
        elif args.hdp_host_memory_gb is not None:
            profile = dataclasses.replace(profile, host_memory_bytes=args.hdp_host_memory_gb * 1e9)
        # The planner prices HDP ranks: a replica of TP devices (DeviceProfile.replica); with
        # PP, a pipeline whose 1F1B timeline the PP-Balance planner builds from these costs.
        profile = profile.replica(args.tensor_model_parallel_size)
        self.cost_model = CostModel(model_shape(cfg, args.hdp_attention_backend), profile)
        if args.hdp_offload:
            # The profile is the replica's; each of its TP processes offloads its own shard.
            runtime.offload = offload_manager(
                self.engine, profile.host_memory_bytes / self.engine.tp_size, runtime.device
            )
            if self.rank == 0:
                logger.info(
                    "--hdp-offload: each process holds a host pool of %s for offloaded "
                    "activations, allocated once%s (%s)",
                    size_text(host.nbytes),
                    ", pinned" if runtime.device.type == "cuda" else " (not pinned on CPU)",
                    host.why,
                )
                logger.info(
                    "--hdp-offload: each step the planner offloads a long sequence's ring only "
                    "where that shortens the predicted step by >= 1%% against widening the ring "
                    "(profile %s: host link %.0f GB/s%s, ring link %.0f GB/s); it pays where "
                    "rings are scarce and the network is slow (docs/offloading.md). Each log "
                    "line and the run summary say what it did.",
                    profile.name,
                    profile.host_bandwidth / 1e9,
                    ", shared with the NIC" if profile.host_link_shared else "",
                    profile.p2p_bandwidth / 1e9,
                )
        self.iteration = 0
        self.consumed_tokens = 0
        self.run_id = uuid.uuid4().hex
        # The newest checkpoint this run published (named in the tracker), and the newest it
        # wrote or, with --async-save, started writing.
        self.last_saved: int | None = None
        self._saved_iteration: int | None = None
        self.nonfinite_in_a_row = 0
        self.stop_signal: StopSignal | None = None
        self.watchdog: StallWatchdog | None = None
        # Validation refuses the flag together with resuming from --save itself.
        self._discard_on_save = bool(args.hdp_overwrite_checkpoints)
        self.async_saves = (
            AsyncSaves(runtime.all_ranks, runtime.device) if args.async_save and args.save else None
        )
        self._writer = None
        self.report = RunReporter(
            args,
            self.engine,
            runtime,
            self.cost_model,
            pool_size=self.pool_size,
            capacity=self.capacity,
            policy=self.policy,
        )
        if args.tensorboard_dir and self.rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=args.tensorboard_dir)

    def _plan_lengths(self):
        """This job's planner: sequence lengths -> `StepPlan` (picklable, for a planner actor)."""
        return functools.partial(
            plan_step,
            pool_size=self.pool_size,
            capacity=self.capacity,
            policy=self.policy,
            cp_size=self.args.context_parallel_size if self.policy == "static" else None,
            cost_model=self.cost_model,
            offload=self.args.hdp_offload,
            pipeline_stages=self.args.pipeline_model_parallel_size,
            virtual_stages=self.engine.cfg.num_chunks,
        )

    def _plan(self, units):
        return self._plan_lengths()([u.length for u in units])

    def resume(self) -> None:
        """Collective: restore everything from `--load`."""
        folder = iteration_dir(self.args.load, latest_iteration(self.args.load))
        if self.rank == 0 and not (folder / DIGESTS).exists():
            logger.warning(
                "--load %s was written before checkpoints carried digests: its content was "
                "not verified (sizes and structure only); its next save here carries them",
                folder,
            )
        if self.args.finetune:
            load_checkpoint(
                self.args.load, self.engine, group=self.runtime.all_ranks, load_optimizer=False
            )
            return  # the weights alone: iteration 0, fresh optimizer, schedule and data
        state, _ = load_checkpoint(self.args.load, self.engine, group=self.runtime.all_ranks)
        saved_data = state.data_state
        self.iteration = state.iteration
        self.consumed_tokens = state.consumed_tokens
        self.run_id = self._resume_meta.get("run_id") or self.run_id
        if saved_data is None:  # a checkpoint of Megatron-LM's own
            if self.rank == 0:
                logger.warning(
                    "--load %s: the checkpoint holds no HDP data position (written by "
                    "Megatron-LM): the data starts from its first batch",
                    self.args.load,
                )
            return
        if saved_data.get("prefixes") != self.data.prefixes:
            raise ValueError(
                f"the checkpoint was trained on {saved_data.get('prefixes')}, this run reads "
                f"{self.data.prefixes}"
            )
        self.close()
        self.data.train.load_state_dict(saved_data["sampler"])

    def _data_state(self) -> dict:
        """The sampler state after the last batch trained (not the ones prefetched)."""
        return self.feed.state_dict() if self.feed is not None else self.data.train.state_dict()

    def save(self) -> None:
        """Collective: write a checkpoint of the current iteration to `--save`."""
        state = TrainingState(
            iteration=self.iteration,
            data_state={"sampler": self._data_state(), "prefixes": self.data.prefixes},
            consumed_tokens=self.consumed_tokens,
        )
        self._mark("saving checkpoint")
        save_checkpoint(
            self.args.save,
            self.engine,
            state,
            group=self.runtime.all_ranks,
            device=self.runtime.device,
            args=self.args,
            meta_extra={
                "run_id": self.run_id,
                "train_iters": self.args.train_iters,
                "model": dataclasses.asdict(self.engine.cfg),
                "data": {
                    "prefixes": self.data.prefixes,
                    "fingerprints": self.data.fingerprints,
                    "setup": self.data.train.setup(),
                },
            },
            discard_existing=self._discard_on_save,
            fully_reshardable=self.args.dist_ckpt_optim_fully_reshardable,
            async_saves=self.async_saves,
        )
        self._discard_on_save = False
        self._saved_iteration = self.iteration
        if self.async_saves is None:
            self.last_saved = self.iteration
        else:
            self._note_published()

    def _note_published(self) -> None:
        """Take the newest published background save (--async-save) as `last_saved`."""
        if self.async_saves is not None and self.async_saves.published is not None:
            self.last_saved = self.async_saves.published

    def _mark(self, what: str, *, iteration: int | None = None) -> None:
        if self.watchdog is not None:
            self.watchdog.mark(what, iteration=iteration)

    def checkpoint_note(self) -> str:
        """Where the newest checkpoint of this run is, for messages.

        Only a published checkpoint (named in the tracker) counts: with --async-save, not
        one whose background writes are still running.
        """
        if self.last_saved is not None:
            return f"The latest checkpoint is iteration {self.last_saved} in {self.args.save}."
        if self.args.load is not None:
            return f"The latest checkpoint is the one this run resumed, in {self.args.load}."
        return "No checkpoint was written."

    def _check_finite(self, result: StepResult) -> None:
        """Stop (NonFiniteError) or skip a step whose loss or gradient norm is not finite."""
        if not result.nonfinite:
            self.nonfinite_in_a_row = 0
            return
        self.nonfinite_in_a_row += 1
        allowed = self.args.hdp_skip_nonfinite_steps
        what = (
            f"iteration {self.iteration}: the loss is {result.loss:.6g} and the gradient norm "
            f"is {result.grad_norm:.6g}, not finite: the update was not applied"
        )
        if self.nonfinite_in_a_row > allowed:
            limit = f" ({allowed} may be skipped in a row)" if allowed else ""
            raise NonFiniteError(f"{what}; stopping{limit}. {self.checkpoint_note()}")
        logger.warning(
            "%s; step skipped (%d of --hdp-skip-nonfinite-steps %d in a row)",
            what,
            self.nonfinite_in_a_row,
            allowed,
        )

    def _feed(self) -> GlobalBatchLoader:
        """The batch loader, started on the first step (after any resume).

        Collective over the job on its first call with --hdp-data-service ray (the ranks
        agree on the name of the job's planner actor).
        """
        if self.feed is None:
            batches = self.data.train
            if self.args.hdp_data_service == "ray":
                self.service = self._connect_service()
                batches = self.service.batches(self.data.train.state_dict())
            self.feed = GlobalBatchLoader(
                batches,
                self._plan_lengths(),
                self.data.datasets,
                rank=self.pool_rank,
                vocab_size=self.data.vocab_size,
                depth=self.args.hdp_prefetch_depth,
                service=self.service,
                mtp_depth=self.engine.cfg.mtp_num_layers or 0,
                # rank 0's metrics record: predicted ahead, off the step's critical path
                annotate=self.report.predictions if self.rank == 0 else None,
            )
        return self.feed

    def close(self) -> None:
        """Stop the prefetch thread and leave the data service.

        The sampler is rewound to the last batch trained (batches prepared ahead are
        dropped), so a later save or step continues exactly there.
        """
        close_writer_processes()
        if self.feed is not None:
            state = self.feed.state_dict()
            self.feed.close()
            self.data.train.load_state_dict(state)
            self.feed = None
        if self.service is not None:
            self.service.close()
            self.service = None

    def _connect_service(self) -> RayDataService:
        """Collective: join the Ray data service (rank 0 starts the planner, then the rest)."""
        key = [uuid.uuid4().hex]
        dist.broadcast_object_list(
            key, src=dist.get_global_rank(self.runtime.all_ranks, 0), group=self.runtime.all_ranks
        )
        cfg = self.data.cfg
        sources = cfg.spec.sources if cfg.spec is not None else blend_sources(self.data.prefixes)
        address = resolve_ray_address(self.args.hdp_ray_address)
        timeout_s = self.args.distributed_timeout_minutes * 60
        service = None
        if self.rank == 0:  # one rank starts the planner, so the sampler is shipped once
            service = RayDataService.start(
                address,
                job_key=key[0],
                sampler=self.data.train,
                plan=self._plan_lengths(),
                sources=sources,
                open_args={
                    "tokenizer_type": cfg.tokenizer_type,
                    "tokenizer_model": cfg.tokenizer_model,
                    "cache_dir": cfg.cache_dir or DEFAULT_CACHE,
                },
                keep=2 * self.args.hdp_prefetch_depth + 4,
                lengths=[d.sequence_lengths for d in self.data.datasets],
                timeout_s=timeout_s,
                save=self.args.save,
                plane=cfg.spec.plane if cfg.spec is not None else None,
            )
        dist.barrier(group=self.runtime.all_ranks)
        release_indexers()  # every rank has its lengths (`_prepare`, before the group)
        if service is None:
            service = RayDataService.attach(
                address, job_key=key[0], timeout_s=timeout_s, save=self.args.save
            )
        service.check_sources(
            [source.name for source in sources], [lengths_digest(d) for d in self.data.datasets]
        )
        return service

    def _schedule_increment(self) -> int:
        """What this step adds to the LR schedule: 1, or its samples when it counts them."""
        ramp = self.data.train.ramp
        if not self.engine.schedule_in_samples or ramp is None:
            return 1
        return ramp.samples_of_step(self.iteration)

    def step(self) -> tuple[StepResult, StepPlan, dict, float, list, float, dict | None]:
        """Collective: one training step.

        Returns the result, the plan, plan statistics, seconds (from the batch in hand to
        the update), units, the seconds this step waited for its batch, and (rank 0) the
        cost model's predictions for the metrics record.
        """
        self._mark("reading and planning the batch", iteration=self.iteration + 1)
        try:
            item = self._feed().next()
            if item.error is not None:
                raise item.error
            plan, source, read, predictions = item.value
            start = time.perf_counter()
            self.runtime.iteration = self.iteration  # keys this step's dropout masks
            result = train_step(
                self.engine,
                plan,
                source,
                self.runtime,
                prepared=read,
                schedule_increment=self._schedule_increment(),
            )
        except DataServiceError as err:  # the batch or its tokens (read ahead) did not come
            raise DataServiceError(f"{err}. {self.checkpoint_note()}") from err
        elapsed = time.perf_counter() - start
        self.iteration += 1
        self.consumed_tokens += result.num_loss_tokens
        stats = plan_statistics(plan)
        return result, plan, stats, elapsed, item.units, item.wait_s, predictions

    def evaluate(self) -> float | None:
        """Collective: mean validation loss over `--eval-iters` batches (None if no data)."""
        sampler = self.data.fresh_valid_sampler()
        if sampler is None or self.args.eval_iters == 0:
            return None
        self._mark("evaluation")
        loss_sum, tokens = 0.0, 0
        for _ in range(self.args.eval_iters):
            units = sampler.next_batch()
            plan = self._plan(units)
            source = IndexedTokens(self.data.datasets, units, vocab_size=self.data.vocab_size)
            read = self._fetch_eval(plan, units) if self.args.hdp_data_service == "ray" else None
            try:
                s, n = evaluate(self.engine, plan, source, self.runtime, prepared=read)
            except DataServiceError as err:
                raise DataServiceError(f"{err}. {self.checkpoint_note()}") from err
            loss_sum, tokens = loss_sum + s, tokens + n
        return loss_sum / max(tokens, 1)

    def _fetch_eval(self, plan: StepPlan, units: list) -> tuple[list, Exception | None]:
        """This rank's micro-batches of an evaluation batch, read by the source loaders.

        The rank holds lengths only. Collective on its first call (it joins the data
        service, `_feed`). A failed fetch is handed over, as in training, and raised by
        the evaluation's first all-reduce on every rank together.
        """
        self._feed()
        try:
            source = self.service.tokens(
                PlannedBatch(units, plan), self.pool_rank, read_local,
                vocab_size=self.data.vocab_size,
            )  # fmt: skip
            return read_local(plan, source, self.pool_rank), None
        except Exception as err:  # noqa: BLE001 - raised in the evaluation, on every rank
            return [], err

    def _stop_requested(self) -> bool:
        """Collective: True (after saving, with --save) if any rank received SIGTERM/SIGINT."""
        self._mark("stop check")
        name = self.stop_signal.agreed(self.runtime.all_ranks, self.runtime.device)
        if name is None:
            return False
        if self.args.save and self._saved_iteration != self.iteration:
            self.save()
        if self.async_saves is not None:
            # Publish the save in flight first, so that the line below names it only once it
            # is complete (a failure raises CheckpointSaveError, naming the one still latest).
            self.async_saves.finalize(blocking=True)
            self._note_published()
        if self.rank == 0:
            logger.warning(
                "iter %d: %s received; stopping cleanly. %s",
                self.iteration,
                name,
                self.checkpoint_note(),
            )
        return True

    def _log(self, window: _Window) -> None:
        lr = self.engine.optimizer.param_groups[0]["lr"]
        loss = statistics.fmean(window.losses)
        # Wall-clock since the last log line: sampling, planning and the steps themselves
        # (evaluation and checkpointing restart the window).
        elapsed = time.perf_counter() - window.started - window.excluded
        throughput = window.tokens / elapsed if elapsed > 0 else 0.0
        merged = _merge_stats(window.stats)
        grad_norm = statistics.fmean(window.grad_norms) if window.grad_norms else float("nan")
        record = {
            "iteration": self.iteration,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": throughput,
            **merged,
        }
        logger.info(
            "iter %d/%d | loss %.4f | lr %.3e | grad norm %.3f | %.0f tokens/s | ranks/seq "
            "mean %.2f max %d (token-weighted %.2f) | micro-batches/rank %d-%d | predicted "
            "imbalance %.3f",
            self.iteration,
            self.args.train_iters,
            loss,
            lr,
            grad_norm,
            throughput,
            merged["mean_ranks_per_sequence"],
            merged["max_ranks_per_sequence"],
            merged["token_weighted_ranks_per_sequence"],
            merged["micro_batches_per_rank_min"],
            merged["micro_batches_per_rank_max"],
            merged["predicted_imbalance"],
        )
        line = offload_line(window.offload)
        if line is not None:
            logger.info("iter %d | %s", self.iteration, line)
        if window.aux_losses:
            record["moe_aux_loss"] = statistics.fmean(window.aux_losses)
            logger.info(
                "iter %d | MoE load-balancing loss %.4f", self.iteration, record["moe_aux_loss"]
            )
        if self._writer is not None:
            for key, value in record.items():
                if key != "iteration":
                    self._writer.add_scalar(f"train/{key}", value, self.iteration)
            self._writer.flush()

    def log_summary(self, records: list[dict]) -> None:
        """Rank 0: log the run's summary, computed from its per-step records (local)."""
        self.report.log_summary(records, self.last_saved)

    def train(self, progress=None) -> list[dict]:
        """Collective: train to `--train-iters`; returns one record per step (rank 0 logs).

        A record holds the iteration, loss, learning rate, grad norm, tokens, the seconds
        waited for data and the units `(dataset, doc, start, length)` of the step's batch.
        """
        try:
            return self._train(progress)
        finally:
            self.close()

    def _train(self, progress) -> list[dict]:
        args = self.args
        window = _Window()
        steps = []
        metrics = None
        if args.hdp_metrics_file and self.rank == 0:
            with _writing("--hdp-metrics-file", args.hdp_metrics_file):
                Path(args.hdp_metrics_file).parent.mkdir(parents=True, exist_ok=True)
                metrics = open(args.hdp_metrics_file, "a")  # noqa: SIM115 - closed below
        while self.iteration < args.train_iters:
            result, plan, stats, elapsed, units, data_wait, predictions = self.step()
            if self.async_saves is not None:
                self.async_saves.finalize()  # publish a finished background save
                self._note_published()
            self._check_finite(result)
            record = {
                "iteration": self.iteration,
                "loss": result.loss,
                "lr": self.engine.optimizer.param_groups[0]["lr"],
                "grad_norm": result.grad_norm,
                # Not applied: non-finite, or a float16 overflow the loss scaler skipped.
                "skipped": result.nonfinite or not result.update_successful,
                "tokens": result.num_loss_tokens,
                "seconds": elapsed,
                "data_wait_s": data_wait,
                "num_sequences": stats["num_sequences"],
                "mean_ranks_per_sequence": stats["mean_ranks_per_sequence"],
                "max_ranks_per_sequence": stats["max_ranks_per_sequence"],
                "micro_batches_per_rank_min": stats["micro_batches_per_rank_min"],
                "micro_batches_per_rank_max": stats["micro_batches_per_rank_max"],
                "offloaded_bytes": (
                    self.runtime.offload.engine.bytes_to_host
                    if self.runtime.offload is not None
                    else 0
                ),
            }
            if self.engine.cfg.num_experts is not None:
                record["moe_aux_loss"] = result.moe_aux_loss
            if self.engine.cfg.dtype == torch.float16:  # the scale for the next step
                record["loss_scale"] = optimizer_loss_scale(self.engine)
            record["attention_bytes"] = result.attention_bytes_total
            decision = getattr(plan, "offload_decision", None)
            if decision is not None:
                record.update(decision.as_record(), offload_bytes=result.offload_bytes_total)
                window.offload.append(record)
            if predictions is not None:
                record.update(predictions)
            if (
                self.service is not None
                and self.rank == 0
                and (self.iteration % args.log_interval == 0 or self.iteration == args.train_iters)
            ):  # the source loaders' measurements, on logging steps
                try:
                    record["data_service"] = self.service.loader_stats()
                    record["data_scaling"] = self.service.scaling_log()
                except DataServiceError as err:
                    # rank 0 alone asks: a dead planner is reported by every rank at its
                    # next batch (one line each, with the checkpoint), not here by one
                    logger.warning("no loader measurements this step: %s", err)
                    record["data_service"] = None
            if self.report.timeline_due(self.iteration):
                with _writing("a step timeline (--hdp-timeline-interval)", None):
                    self.report.record_timeline(self.iteration, plan, result)
            if metrics is not None:
                with _writing("--hdp-metrics-file", args.hdp_metrics_file):
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
            steps.append(
                {**record, "units": [(u.dataset, u.doc, u.start, u.length) for u in units]}
            )
            window.losses.append(result.loss)
            if self.engine.cfg.num_experts is not None:
                window.aux_losses.append(result.moe_aux_loss)
            window.tokens += result.num_loss_tokens
            window.stats.append(stats)
            if result.grad_norm is not None and not result.nonfinite:
                window.grad_norms.append(result.grad_norm)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{result.loss:.4f}")
            if self.iteration % args.log_interval == 0 or self.iteration == args.train_iters:
                if self.rank == 0:
                    self._log(window)
                window = _Window()
            if self.iteration % args.eval_interval == 0 or self.iteration == args.train_iters:
                paused = time.perf_counter()
                valid_loss = self.evaluate()
                if valid_loss is not None:
                    steps[-1]["valid_loss"] = valid_loss  # the returned records only
                if valid_loss is not None and self.rank == 0:
                    logger.info("iter %d | validation loss %.4f", self.iteration, valid_loss)
                    if self._writer is not None:
                        self._writer.add_scalar("valid/loss", valid_loss, self.iteration)
                window.excluded += time.perf_counter() - paused
            exiting = bool(args.exit_interval) and self.iteration % args.exit_interval == 0
            if args.save and (
                (args.save_interval and self.iteration % args.save_interval == 0)
                or self.iteration == args.train_iters
                or exiting
            ):
                paused = time.perf_counter()
                self.save()
                window.excluded += time.perf_counter() - paused
            if exiting and self.iteration < args.train_iters:
                logger.info("iter %d: --exit-interval reached, stopping", self.iteration)
                break
            if self.stop_signal is not None and self._stop_requested():
                break
        if self.async_saves is not None:
            self.async_saves.close()  # the last save is complete and published before exit
            self._note_published()
            self.async_saves = None
        if self._writer is not None:
            self._writer.close()
        if metrics is not None:
            metrics.close()
        return steps


@contextlib.contextmanager
def _writing(what: str, path: str | None):
    """OutputWriteError naming `what` (and the file) for an OSError inside the block."""
    try:
        yield
    except OSError as err:
        where = f" {path}" if path is not None else ""
        reason = f"{err.strerror} ({err.filename})" if err.strerror else str(err)
        raise OutputWriteError(f"cannot write {what}{where}: {reason}") from err


def runtime_for(args, layout: ParallelLayout, device) -> StepRuntime:
    """The step runtime of this rank in `layout` (its pool; every rank of the job).

    With `--fp16` and a dynamic loss scale the non-finite check is off, as Megatron-LM turns
    `--check-for-nan-in-loss-and-grad` off then: an overflow is the scaler's signal (it
    skips the step and halves the scale).
    """
    dynamic_scale = getattr(args, "fp16", False) and args.loss_scale is None
    return StepRuntime(
        group=layout.pool_group,
        job_group=layout.world_group,
        backend=args.hdp_attention_backend,
        device=device,
        check_plans=args.hdp_check_plans,
        check_nonfinite=args.check_for_nan_in_loss_and_grad and not dynamic_scale,
        seed=args.seed,
        mtp_depth=args.mtp_num_layers or 0,
    )
