"""One step's micro-batches per rank, measured beside the plan's prediction (pure).

The training job measures, on a sampled step, when each rank started and ended each of its
micro-batches (`time.perf_counter()` relative to that rank's start of its micro-batches,
right after the step's token-count all-reduce, so the ranks' clocks start together within
that collective's skew). `timeline_record` joins these times with the plan: for every rank,
its micro-batches in run order, with the cost model's predicted start and cost, and the
same for the plan the static mesh would run on the batch. `python -m megatron_hdp.plot`
draws the JSON files `write_timeline` writes.

File format (`timelines/step-<iteration>.json`, one per sampled step)::

    {"iteration": 30, "policy": "balanced", "pool_size": 4, "capacity": 1024,
     "predicted_step_s": 0.61, "measured_step_s": 0.83,
     "ranks": [{"rank": 0, "measured_compute_s": 0.82,
                "micro_batches": [{"order": 0, "ring": [0, 1], "lengths": [2048],
                                   "tokens": 2048, "local_tokens": 1024, "runs": true,
                                   "predicted_start": 0.0, "predicted_cost": 0.3,
                                   "measured_start": 0.0, "measured_end": 0.41}, ...]},
               ...],
     "static": {"cp_size": 4, "predicted_step_s": 0.9, "ranks": [...]} or null}

A ring member that holds no token of a micro-batch skips it: its entry has
`"runs": false` and no measured times. `measured_count` and `planned_count` (the
micro-batches the rank runs) agree unless the measurement is broken.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from megatron_hdp.scheduler.plan import StepPlan
from megatron_hdp.sharding import rank_token_counts
from megatron_hdp.sim.timeline import timeline


def local_token_counts(plan: StepPlan, rank: int) -> list[tuple[int, int]]:
    """`(position in plan order, tokens this rank holds)` for each micro-batch of `rank`."""
    out = []
    for m in plan.rank_items(rank).tolist():
        mb = plan.micro_batch(m)
        counts = rank_token_counts([plan.seqlens[i] for i in mb.seq_indices], mb.cp_size)
        out.append((m, counts[mb.ring.index(rank)]))
    return out


def _rank_lanes(plan: StepPlan, starts: Sequence[float]) -> list[dict]:
    """Every rank's micro-batches in run order, with the predicted start and cost."""
    lanes = []
    for rank in range(plan.pool_size):
        items = []
        for m, local in local_token_counts(plan, rank):
            mb = plan.micro_batch(m)
            items.append(
                {
                    "order": mb.order,
                    "ring": list(mb.ring),
                    "lengths": [plan.seqlens[i] for i in mb.seq_indices],
                    "tokens": int(sum(plan.seqlens[i] for i in mb.seq_indices)),
                    "local_tokens": int(local),
                    "runs": local > 0,
                    "predicted_start": float(starts[m]),
                    "predicted_cost": mb.predicted_cost,
                }
            )
        lanes.append({"rank": rank, "micro_batches": items})
    return lanes


def timeline_record(
    plan: StepPlan,
    measured: Mapping[int, tuple[float, Sequence[tuple[float, float]]]],
    *,
    iteration: int,
    static_plan: StepPlan | None = None,
    static_cp: int | None = None,
) -> dict:
    """The JSON-ready timeline of one step (format in the module docstring).

    Args:
        plan: The step's plan (its `predicted_cost` column priced by the cost model).
        measured: Per pool rank, `(compute seconds, [(start, end) of each micro-batch it
            ran, in run order])`, seconds since that rank began its micro-batches.
        iteration: The step's iteration.
        static_plan: The static mesh's plan of the same batch (predicted only), or None.
        static_cp: That mesh's CP size.
    """
    predicted = timeline(plan)
    lanes = _rank_lanes(plan, predicted.starts)
    for lane in lanes:
        compute_s, times = measured.get(lane["rank"], (None, []))
        runs = [item for item in lane["micro_batches"] if item["runs"]]
        for item, (start, end) in zip(runs, times, strict=False):
            item["measured_start"], item["measured_end"] = float(start), float(end)
        lane["measured_compute_s"] = None if compute_s is None else float(compute_s)
        lane["measured_count"] = len(times)
        lane["planned_count"] = len(runs)
    computes = [lane["measured_compute_s"] for lane in lanes]
    record = {
        "iteration": int(iteration),
        "policy": plan.policy,
        "pool_size": plan.pool_size,
        "capacity": plan.capacity,
        "sequences": len(plan.lengths),
        "tokens": plan.total_tokens(),
        "predicted_step_s": predicted.step_time,
        "measured_step_s": max((c for c in computes if c is not None), default=None),
        "ranks": lanes,
        "static": None,
    }
    if static_plan is not None:
        static = timeline(static_plan)
        record["static"] = {
            "cp_size": static_cp,
            "predicted_step_s": static.step_time,
            "ranks": _rank_lanes(static_plan, static.starts),
        }
    return record


def timeline_path(folder: str | Path, iteration: int) -> Path:
    """Where the timeline of `iteration` goes in a run's `timelines/` folder."""
    return Path(folder) / f"step-{iteration:06d}.json"


def write_timeline(folder: str | Path, record: dict) -> Path:
    """Write `record` to `folder/step-<iteration>.json` (folder made if missing)."""
    path = timeline_path(folder, record["iteration"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)
    return path


def read_timelines(folder: str | Path) -> list[Path]:
    """The timeline files in `folder`, oldest step first (empty if there is none)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(folder.glob("step-*.json"))
