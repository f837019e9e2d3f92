"""A picture of the Ray data plane over a run: loaders per source and the ranks' data wait.

`draw_data_plane(runs, path)` draws one or more runs (the benchmark compares two) in two
panels over seconds since the planner started:

- top: the loader count of each source (or of `source` alone), stepped, from the
  planner's scaling log (`data_scaling` samples), with its scale-ups and -downs marked;
- bottom: the share of each step the ranks waited for data (`data_wait_s / seconds`),
  the mean over ranks per step.

A run is `{"log": {"samples": [...], "decisions": [...]}, "rows": [[[t, step_s, wait_s,
tokens], ...] per rank]}`; `data_plane_from_records` makes one from a metrics file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

COLOURS = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e"]


def data_plane_from_records(records: Sequence[Mapping]) -> dict | None:
    """A run for `draw_data_plane` from metrics records; None without a scaling log.

    The samples and decisions are the `data_scaling` pieces of the logging steps put
    together; the rows are rank 0's steps (`t` from the summed step and wait seconds).
    """
    logs = [r["data_scaling"] for r in records if r.get("data_scaling")]
    if not logs:
        return None
    rows, t = [], 0.0
    for r in records:
        wait, seconds = float(r.get("data_wait_s", 0.0)), float(r.get("seconds", 0.0))
        rows.append([t, seconds + wait, wait, int(r.get("tokens", 0))])
        t += seconds + wait
    return {
        "log": {
            "samples": [s for log in logs for s in log.get("samples", [])],
            "decisions": [d for log in logs for d in log.get("decisions", [])],
        },
        "rows": [rows],
    }


def draw_data_plane(runs: Mapping[str, Mapping], path: str | Path, *, source=None) -> Path:
    """Draw loader counts and data wait of `runs` (label -> run) as a PNG at `path`."""
    from megatron_hdp.plot import _figure

    fig = _figure(10, 6)
    count_ax, wait_ax = fig.subplots(2, 1, sharex=True)
    for k, (label, run) in enumerate(runs.items()):
        colour = COLOURS[k % len(COLOURS)]
        samples = run["log"]["samples"]
        names = sorted({n for s in samples for n in s["loaders"]})
        for j, name in enumerate(n for n in names if source is None or n == source):
            ts = [s["t"] for s in samples]
            counts = [s["loaders"][name] for s in samples]
            style = ["-", "--", ":", "-."][j % 4]
            count_ax.step(ts, counts, where="post", color=colour, linestyle=style,
                          label=f"{label}: {name}")  # fmt: skip
        for d in run["log"]["decisions"]:
            if d["after"] != d["before"] and (source is None or d["source"] == source):
                marker = "^" if d["after"] > d["before"] else "v"
                count_ax.plot([d["t"]], [d["after"]], marker=marker, color=colour, markersize=7)
        per_step = list(zip(*run["rows"], strict=False))  # one tuple of rank rows per step
        ts = [sum(r[0] for r in rows) / len(rows) for rows in per_step]
        share = [sum(r[2] for r in rows) / max(sum(r[1] for r in rows), 1e-9) for rows in per_step]
        wait_ax.plot(ts, share, color=colour, linewidth=1.0, label=label)
    count_ax.set_ylabel("loaders")
    count_ax.set_title("data plane: loaders (^ scale-up, v scale-down) and data wait", fontsize=10)
    count_ax.legend(fontsize=8, loc="lower right")
    count_ax.set_ylim(bottom=0)
    wait_ax.set_ylabel("data wait / step time")
    wait_ax.set_xlabel("seconds since start")
    wait_ax.set_ylim(0, 1)
    wait_ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
