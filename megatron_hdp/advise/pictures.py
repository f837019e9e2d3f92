"""Gantt pictures of one simulated step (matplotlib, imported when drawing).

Without pipeline parallelism: the simulator's own per-rank chart (`sim.__main__.gantt`).
With it: `pipeline_gantt`, one row per (pipeline, stage) of the first pipelines, every
forward and backward pass where the 1F1B timeline put it (`pipeline_timeline`, re-run on
the simulated plan with the simulator's costs, so the chart is the simulated step).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from megatron_hdp.advise.report import runnable
from megatron_hdp.scheduler.pipeline_timeline import stage_times
from megatron_hdp.scheduler.pp_balance import forward_shares
from megatron_hdp.sim.simulate import LABELS, StepResult, run_on_pipelines

#: (forward, backward) colours of local and ring micro-batches.
_COLOURS = {"local": ("#a1d99b", "#31a354"), "ring": ("#9ecae1", "#3182bd")}


def shown_systems(outcomes: Mapping, your_system: str, pipeline_stages: int) -> list[str]:
    """Static mesh, Megatron's dynamic CP, the fastest HDP system the job runs, yours."""
    hdp = [s for s in outcomes if s.startswith("hdp") and runnable(s, pipeline_stages)]
    best = max(hdp, key=lambda s: outcomes[s].results[0].tokens_per_s, default=None)
    show: list[str] = []
    for s in ("static", "megatron_dcp", best, your_system):
        if s in outcomes and s not in show:
            show.append(s)
    return show


def pipeline_gantt(res: StepResult, cost_model, out: Path, n_ranks: int, plt) -> str:
    """Per-stage chart of the first pipelines of `res` (its first barrier group's plan)."""
    stages = res.pipeline_stages
    seg, offset = res.segments[0], res.offsets[0]
    plan = seg.plan
    costs = np.asarray(seg.durations)
    shares = forward_shares(plan, cost_model)
    ex, schedule = run_on_pipelines(plan, stages, costs, shares)
    fwd, bwd = stage_times(costs, stages, shares)
    pipes = list(range(min(max(1, n_ranks // stages), plan.pool_size)))
    shown = set(pipes)
    fig, ax = plt.subplots(figsize=(10, max(3, 0.16 * len(pipes) * (stages + 1) + 1.5)))
    for u, mb in enumerate(plan.micro_batches):
        kind = "local" if mb.is_local else "ring"
        for p in mb.ring:
            if p not in shown:
                continue
            for s in range(stages):
                row = p * (stages + 1) + s
                for k, dur in ((0, fwd[u, s]), (1, bwd[u, s])):
                    start = ex.starts[u, s, k]
                    if np.isfinite(start):
                        ax.broken_barh(
                            [(offset + start, dur)], (row - 0.4, 0.8), facecolors=_COLOURS[kind][k]
                        )
    end = res.step_time - res.grad_sync
    for p in pipes:
        for s in range(stages):
            row = p * (stages + 1) + s
            ax.broken_barh([(end, res.grad_sync)], (row - 0.4, 0.8), facecolors="tab:purple")
    for label, colour in (
        ("local forward", _COLOURS["local"][0]),
        ("local backward", _COLOURS["local"][1]),
        ("ring forward", _COLOURS["ring"][0]),
        ("ring backward", _COLOURS["ring"][1]),
        ("grad sync", "tab:purple"),
    ):
        ax.plot([], [], color=colour, lw=6, label=label)
    ax.legend(fontsize=7, loc="lower right")
    ticks = [p * (stages + 1) + s for p in pipes for s in range(stages)]
    ax.set_yticks(ticks, [f"P{p} s{s}" for p in pipes for s in range(stages)], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    groups = f", first of {len(res.segments)} barrier groups" if len(res.segments) > 1 else ""
    ax.set_title(
        f"{LABELS[res.system]}: step {res.step_time:.1f} s, pipelines 0-{pipes[-1]} of "
        f"{plan.pool_size}, {stages} stages, {schedule}{groups} (white = waiting)",
        fontsize=9,
    )
    fig.tight_layout()
    name = f"gantt_{res.system}.png"
    fig.savefig(out / name, dpi=90)
    plt.close(fig)
    return name


def draw(outcomes: Mapping, job, cost_model, out: Path, n_ranks: int) -> tuple[list[str], str]:
    """Gantt charts of the first batch for `shown_systems`, or why there are none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "No Gantt picture: matplotlib is not installed (pip install matplotlib)."
    from megatron_hdp.sim.__main__ import gantt

    files = []
    for s in shown_systems(outcomes, job.your_system, job.model.pp):
        res = outcomes[s].results[0]
        if job.model.pp > 1:
            files.append(pipeline_gantt(res, cost_model, out, n_ranks, plt))
        else:
            files.append(gantt(res, out, n_ranks, plt))
    return files, ""
