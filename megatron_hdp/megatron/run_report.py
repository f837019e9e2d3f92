"""What a run records about itself besides losses (host layer): predictions, timelines, summary.

`RunReporter` is owned by the `Trainer`. Per step it adds the cost model's predictions for
the step's plan and for the static mesh on the same batch to rank 0's metrics record; on
sampled steps it gathers every rank's micro-batch times into a timeline file; at the end
it logs the run summary computed from the records (`report.summary`).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_hdp.attention.kernels.base import accumulation_dtype
from megatron_hdp.megatron.engine import Engine
from megatron_hdp.megatron.step import StepResult, StepRuntime
from megatron_hdp.report.prediction import (
    predicted_step_seconds,
    ring_attention_bytes,
    static_mesh_cp,
)
from megatron_hdp.report.summary import format_summary, run_summary
from megatron_hdp.report.timeline import timeline_record, write_timeline
from megatron_hdp.scheduler import StepPlan, plan_step
from megatron_hdp.scheduler.cost import CostModel

logger = logging.getLogger(__name__)


class RunReporter:
    """Predictions, timelines and the summary of one training run.

    Args:
        args: The job's arguments.
        engine: The model engine (its dtype and TP rank).
        runtime: The step runtime (pool group, every rank, device).
        cost_model: The planner's cost model.
        pool_size, capacity, policy: The pool, the tokens per rank, the placement policy.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        engine: Engine,
        runtime: StepRuntime,
        cost_model: CostModel,
        *,
        pool_size: int,
        capacity: int,
        policy: str,
    ) -> None:
        self.args, self.engine, self.runtime, self.cost_model = args, engine, runtime, cost_model
        self.pool_size, self.capacity, self.policy = pool_size, capacity, policy
        self.rank = dist.get_rank(runtime.all_ranks)
        self.pool_rank = dist.get_rank(runtime.group)
        self._timelines: list[Path] = []
        self._static: tuple | None = None  # (plan, its static plan and CP size), last asked

    def static_plan(self, plan: StepPlan) -> tuple[StepPlan | None, int | None]:
        """The static mesh's plan of `plan`'s batch and its CP size (None if it has none).

        The mesh trains `--seq-length` with this run's capacity: `--context-parallel-size`
        if its context holds the sequence length, else the smallest CP that does.
        """
        if self._static is not None and self._static[0] is plan:  # predictions, then timeline
            return self._static[1]
        self._static = (plan, self._plan_static(plan))
        return self._static[1]

    def _plan_static(self, plan: StepPlan) -> tuple[StepPlan | None, int | None]:
        args = self.args
        try:
            cp = static_mesh_cp(
                args.seq_length, self.capacity, self.pool_size, args.context_parallel_size
            )
            if self.policy == "static" and cp == args.context_parallel_size:
                return plan, cp
            static = plan_step(
                plan.seqlens,
                pool_size=self.pool_size,
                capacity=self.capacity,
                policy="static",
                cp_size=cp,
                cost_model=self.cost_model,
                pipeline_stages=args.pipeline_model_parallel_size,
            )
        except ValueError as err:  # e.g. no lock-step static plan of this batch for pipelines
            logger.debug("no static mesh plan for this batch: %s", err)
            return None, None
        return static, cp

    def predictions(self, plan: StepPlan) -> dict:
        """The cost model's step time and attention bytes of `plan` and of the static mesh.

        Local: rank 0's prefetch thread runs it on each plan ahead of its step, for the
        metrics record. The static mesh's numbers are None when it has no plan for the batch.
        """
        stages = self.args.pipeline_model_parallel_size
        shape = self.cost_model.model
        dtype = self.engine.cfg.dtype
        sizes = {
            "num_layers": shape.num_layers,
            "kv_dim": shape.kv_dim,
            "kv_element_bytes": torch.empty((), dtype=dtype).element_size(),
            "grad_element_bytes": torch.empty((), dtype=accumulation_dtype(dtype)).element_size(),
        }
        static, cp = self.static_plan(plan)
        return {
            "predicted_step_s": predicted_step_seconds(plan, stages),
            "attention_bytes_predicted": ring_attention_bytes(plan, **sizes),
            "static_cp_size": cp,
            "static_predicted_step_s": (
                predicted_step_seconds(static, stages) if static is not None else None
            ),
            "static_attention_bytes_predicted": (
                ring_attention_bytes(static, **sizes) if static is not None else None
            ),
        }

    def _timeline_folder(self) -> Path | None:
        """`timelines/` next to the metrics file, or None without one."""
        if not self.args.hdp_metrics_file:
            return None
        return Path(self.args.hdp_metrics_file).parent / "timelines"

    def timeline_due(self, iteration: int) -> bool:
        """Whether this step's timeline is recorded (the same answer on every rank)."""
        args = self.args
        interval = args.hdp_timeline_interval
        if interval is None:
            interval = args.log_interval
        if not interval or self._timeline_folder() is None:
            return False
        if args.pipeline_model_parallel_size > 1:  # 1F1B interleaves the micro-batches
            return False
        return iteration % interval == 0 or iteration == args.train_iters

    def record_timeline(self, iteration: int, plan: StepPlan, result: StepResult) -> None:
        """Collective over the job (one all-gather): write this step's timeline on rank 0.

        Every process sends its pool rank, its compute seconds and its micro-batch times
        (the TP ranks of a replica run the same micro-batches; TP rank 0's are kept).
        """
        most = max(plan.num_micro_batches_per_rank(), default=0)
        times = result.micro_batch_times
        rows = torch.zeros((most + 1, 3), dtype=torch.float64)
        own = self.pool_rank if self.engine.tp_rank == 0 else -1
        rows[0] = torch.tensor([own, len(times), result.compute_seconds], dtype=torch.float64)
        if times:
            rows[1 : len(times) + 1, :2] = torch.tensor(times, dtype=torch.float64)
        rows = rows.to(self.runtime.device)
        gathered = [
            torch.empty_like(rows) for _ in range(dist.get_world_size(self.runtime.all_ranks))
        ]
        dist.all_gather(gathered, rows, group=self.runtime.all_ranks)
        if self.rank != 0:
            return
        measured = {}
        for block in gathered:
            block = block.cpu()
            rank, count, compute_s = int(block[0, 0]), int(block[0, 1]), float(block[0, 2])
            if rank >= 0:
                measured[rank] = (compute_s, block[1 : count + 1, :2].tolist())
        static, cp = self.static_plan(plan)
        record = timeline_record(
            plan, measured, iteration=iteration, static_plan=static, static_cp=cp
        )
        self._timelines.append(write_timeline(self._timeline_folder(), record))

    def log_summary(self, records: list[dict], last_saved: int | None) -> None:
        """Rank 0: log the run's summary, computed from its per-step records (local)."""
        if self.rank != 0 or not records:
            return
        args = self.args
        run = Path(args.hdp_metrics_file).parent if args.hdp_metrics_file else None
        saved = f" (latest: iteration {last_saved})" if last_saved else ""
        timelines = self._timeline_folder()
        written = self._timelines
        locations = [
            ("checkpoints", f"{args.save}{saved}" if args.save else "none (no --save)"),
            ("metrics", args.hdp_metrics_file or "none (no --hdp-metrics-file)"),
            ("tensorboard", args.tensorboard_dir or "none (no --tensorboard-dir)"),
            (
                "timelines",
                f"{timelines} ({len(written)} steps)"
                if written
                else "none (--hdp-metrics-file and --hdp-timeline-interval record them)",
            ),
            (
                "pictures",
                f"{run / 'pictures'} (drawn by: python -m megatron_hdp.plot {run})"
                if run is not None
                else "none (python -m megatron_hdp.plot draws them from a metrics file)",
            ),
        ]
        summary = run_summary(
            records, pool_size=self.pool_size, policy=self.policy, locations=locations
        )
        logger.info("%s", format_summary(summary))
        totals = summary["offload"]
        if totals is not None and totals["rings_offloaded"] == 0:
            logger.warning("%s", summary["offload_line"])
