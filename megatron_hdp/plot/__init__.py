"""Pictures of a training run: a step's per-rank timeline, loss and tokens/s curves.

`python -m megatron_hdp.plot RUN_DIR` reads `RUN_DIR/metrics.jsonl` (the job's
`--hdp-metrics-file`) and the newest `RUN_DIR/timelines/step-*.json` (recorded every
`--hdp-timeline-interval` steps) and writes PNG files to `RUN_DIR/pictures/`:

- `timeline-step-<iteration>.png`: per rank, the micro-batches as measured (solid bars)
  above the cost model's prediction for the same plan (hatched bars); ring micro-batches
  and packed (one-rank) ones in two colours; below, the static mesh's predicted timeline
  of the same batch;
- `curves.png`: training loss and tokens/s per step (with the static mesh's tokens/s
  estimated from the measured step time and the cost model's predicted ratio);
- `data-plane.png` (runs on the Ray data service): loaders per source and the data wait
  over the run (`plot.data_plane`).

matplotlib is imported only here, lazily (the `dev` extra installs it); its object API is
used with the Agg canvas, so the process's pyplot backend is left alone.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from megatron_hdp.plot.data_plane import data_plane_from_records, draw_data_plane
from megatron_hdp.report.summary import read_metrics
from megatron_hdp.report.timeline import read_timelines

logger = logging.getLogger(__name__)

__all__ = ["draw_curves", "draw_data_plane", "draw_run", "draw_timeline", "load_run"]

RING_COLOUR = "#d95f02"
PACKED_COLOUR = "#1b9e77"
METRICS_NAME = "metrics.jsonl"


class MatplotlibMissingError(ImportError):
    """matplotlib is not installed."""


def _figure(width: float, height: float):
    """A matplotlib Figure on the Agg canvas; MatplotlibMissingError naming the package."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise MatplotlibMissingError(
            "drawing needs matplotlib, which is not installed: pip install matplotlib "
            "(or the dev extra: pip install -e '.[dev]', as scripts/setup.sh does)"
        ) from err
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _bars(
    ax, y: float, items: Sequence[Mapping], *, measured: bool, height: float, span: float
) -> None:
    """One lane of micro-batch bars at height `y` (measured or predicted times).

    Bars wider than 4% of `span` (the x range) are labelled with their ring's size.
    """
    for item in items:
        if measured:
            if "measured_start" not in item:
                continue
            start, width = item["measured_start"], item["measured_end"] - item["measured_start"]
        else:
            if not item.get("runs", True):
                continue
            start, width = item["predicted_start"], item["predicted_cost"]
        ring = len(item["ring"]) > 1
        ax.broken_barh(
            [(start, width)],
            (y - height / 2, height),
            facecolors=RING_COLOUR if ring else PACKED_COLOUR,
            edgecolor="white" if measured else "black",
            linewidth=0.6,
            alpha=1.0 if measured else 0.45,
            hatch=None if measured else "//",
        )
        if ring and width > 0.04 * span:
            ax.text(
                start + width / 2,
                y,
                f"x{len(item['ring'])}",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if measured else "black",
            )


def _legend(fig, height: float) -> None:
    """The colour key, under the axes (it would cover bars inside them)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig.legend(
        handles=[
            Patch(facecolor=PACKED_COLOUR, label="packed on one rank (measured)"),
            Patch(facecolor=RING_COLOUR, label="ring of xN ranks (measured)"),
            Patch(facecolor="white", edgecolor="black", hatch="//", label="predicted (cost model)"),
            Line2D([], [], color="black", linestyle="--", linewidth=1, label="measured end"),
            Line2D([], [], color="grey", linestyle=":", linewidth=1, label="predicted end"),
        ],
        loc="lower center",
        ncol=5,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0.4 / height, 1, 1))


def draw_timeline(record: Mapping, path: str | Path) -> Path:
    """Draw one step's timeline record (`report.timeline` format) as a PNG at `path`."""
    ranks = record["ranks"]
    static = record.get("static")
    n = len(ranks)
    rows = 2 * n + (n if static else 0)
    height = 2.0 + 0.32 * rows + (0.8 if static else 0)
    fig = _figure(10, height)
    if static:
        top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2 * n, n])
    else:
        top, bottom = fig.subplots(1, 1), None
    ends = [record["predicted_step_s"], record.get("measured_step_s") or 0.0]
    if static:
        ends.append(static["predicted_step_s"])
    span = max(ends) or 1.0
    labels, ticks = [], []
    for lane in ranks:
        y = 2 * (n - 1 - lane["rank"])
        _bars(top, y + 1, lane["micro_batches"], measured=True, height=0.8, span=span)
        _bars(top, y, lane["micro_batches"], measured=False, height=0.8, span=span)
        ticks += [y + 1, y]
        labels += [f"rank {lane['rank']} measured", "predicted"]
    top.set_yticks(ticks, labels, fontsize=8)
    top.axvline(record["predicted_step_s"], color="grey", linestyle=":", linewidth=1)
    if record.get("measured_step_s") is not None:
        top.axvline(record["measured_step_s"], color="black", linestyle="--", linewidth=1)
    top.set_title(
        f"Step {record['iteration']}: {record['policy']} plan of {record['sequences']} sequences "
        f"({record['tokens']:,} tokens) on {record['pool_size']} ranks; measured "
        f"{_seconds(record.get('measured_step_s'))}, predicted "
        f"{_seconds(record['predicted_step_s'])}",
        fontsize=10,
    )
    last = top
    if static:
        cp = static.get("cp_size")
        for lane in static["ranks"]:
            y = n - 1 - lane["rank"]
            _bars(bottom, y, lane["micro_batches"], measured=False, height=0.8, span=span)
        bottom.set_yticks(
            [n - 1 - lane["rank"] for lane in static["ranks"]],
            [f"rank {lane['rank']}" for lane in static["ranks"]],
            fontsize=8,
        )
        bottom.axvline(static["predicted_step_s"], color="grey", linestyle=":", linewidth=1)
        mesh = f"DP {record['pool_size'] // cp} x CP {cp}" if cp else ""
        bottom.set_title(
            f"The static mesh {mesh} on the same batch, predicted by the cost model: "
            f"{_seconds(static['predicted_step_s'])}",
            fontsize=10,
        )
        last = bottom
    last.set_xlabel("seconds since the rank began its micro-batches")
    _legend(fig, height)
    path = Path(path)
    fig.savefig(path)
    return path


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.3f} s"


def draw_curves(records: Sequence[Mapping], path: str | Path) -> Path:
    """Draw loss and tokens/s per step from metrics records as a PNG at `path`."""
    fig = _figure(10, 6)
    loss_ax, speed_ax = fig.subplots(2, 1, sharex=True)
    its = [r["iteration"] for r in records]
    loss_ax.plot(its, [r["loss"] for r in records], color="#1f77b4", linewidth=1.2)
    loss_ax.set_ylabel("training loss")
    loss_ax.set_title(f"{len(records)} steps (iterations {its[0]}-{its[-1]})", fontsize=10)
    speed = [r["tokens"] / r["seconds"] if r["seconds"] > 0 else float("nan") for r in records]
    speed_ax.plot(its, speed, color="#1f77b4", linewidth=1.2, label="this run, measured")
    estimate = [
        r["tokens"] / (r["seconds"] * r["static_predicted_step_s"] / r["predicted_step_s"])
        if r.get("static_predicted_step_s") and r.get("predicted_step_s") and r["seconds"] > 0
        else float("nan")
        for r in records
    ]
    if any(e == e for e in estimate):  # not all NaN
        speed_ax.plot(
            its,
            estimate,
            color="grey",
            linestyle="--",
            linewidth=1.0,
            label="static mesh, estimate (measured x cost-model ratio)",
        )
    speed_ax.set_ylabel("tokens/s (step time)")
    speed_ax.set_xlabel("iteration")
    speed_ax.set_ylim(bottom=0)
    speed_ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path


class RunDirError(ValueError):
    """RUN_DIR is not a run folder the plot command can read."""


def load_run(run_dir: str | Path) -> tuple[list[dict], list[Path]]:
    """The metrics records and timeline files of a run folder; RunDirError naming it."""
    run = Path(run_dir)
    if not run.exists():
        raise RunDirError(f"RUN_DIR {run}: no such folder")
    if not run.is_dir():
        raise RunDirError(f"RUN_DIR {run} is not a folder")
    metrics = run / METRICS_NAME
    if not metrics.is_file():
        raise RunDirError(
            f"RUN_DIR {run} has no {METRICS_NAME} (the run's --hdp-metrics-file; "
            "scripts/run_cpu.sh writes it there)"
        )
    try:
        records = read_metrics(metrics)
    except (ValueError, UnicodeDecodeError) as err:
        raise RunDirError(str(err)) from err
    needed = ("iteration", "loss", "tokens", "seconds")
    missing = [k for k in needed if records and k not in records[0]]
    if not records or missing:
        raise RunDirError(
            f"{metrics}: " + ("no step records" if not records else f"records lack {missing}")
        )
    return records, read_timelines(run / "timelines")


def draw_run(run_dir: str | Path, *, step: int | None = None) -> list[Path]:
    """Draw a run folder's pictures into `RUN_DIR/pictures/`; return the files written.

    `step`: the timeline to draw (default the newest recorded). Without any timeline the
    curves are drawn alone and a warning says why. Raises RunDirError for a folder that is
    not a run, or a `step` that was not recorded; MatplotlibMissingError without matplotlib.
    """
    run = Path(run_dir)
    records, timelines = load_run(run)
    if step is not None:  # refused before anything is drawn
        chosen = [p for p in timelines if p.name == f"step-{step:06d}.json"]
        if not chosen:
            steps = ", ".join(str(int(p.stem.split("-")[1])) for p in timelines) or "none"
            raise RunDirError(
                f"no timeline of step {step} in {run / 'timelines'} (recorded: {steps})"
            )
        timelines = chosen
    out = run / "pictures"
    out.mkdir(exist_ok=True)
    written = [draw_curves(records, out / "curves.png")]
    plane = data_plane_from_records(records)
    if plane is not None:
        written.append(draw_data_plane({"this run": plane}, out / "data-plane.png"))
    if not timelines:
        logger.warning(
            "no timeline in %s (the job records them next to --hdp-metrics-file every "
            "--hdp-timeline-interval steps): drawing the curves only",
            run / "timelines",
        )
        return written
    record = json.loads(timelines[-1].read_text())
    written.append(draw_timeline(record, out / f"timeline-step-{record['iteration']:06d}.png"))
    return written
