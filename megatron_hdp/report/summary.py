"""The end-of-run summary, computed from the per-step metrics records (pure).

`run_summary(records)` takes the records the training job writes to `--hdp-metrics-file`
(one JSON object per step; `read_metrics` reads the file back) and returns plain numbers;
`format_summary` lays them out on one screen. Everything in the summary follows from the
records, so anyone can recompute it from the metrics file:

- tokens/s: the sum of `tokens` over the sum of `seconds` (each step from its batch in
  hand to its update; the time spent waiting for data, `data_wait_s`, is shown apart);
- ranks per sequence: the mean over every sequence of the run (each step's
  `mean_ranks_per_sequence` weighted by its `num_sequences`) and the maximum, beside the
  static mesh's CP size (the ranks it gives every sequence);
- step time: the measured mean, and the cost model's prediction for this run's plans
  (`predicted_step_s`) next to its prediction for the static mesh on the same batches
  (`static_predicted_step_s`), over the steps that have both; their ratio applied to the
  measured step time is shown only as an estimate;
- ring attention traffic: bytes measured over all ranks (`attention_bytes`), the formula's
  prediction for this run's plans (`attention_bytes_predicted`) and for the static mesh's
  (`static_attention_bytes_predicted`); saved = static (predicted) - measured, and one
  sentence on why (`traffic_tradeoff`: fewer ranks per sequence, or wider rings for a
  shorter predicted step);
- offloading (runs with `--hdp-offload`): rings offloaded of all rings, bytes moved to the
  host (measured and predicted) and why the other rings did not (`report.offload`); a run
  that never offloaded says so in one line;
- the Ray data plane (runs with `--hdp-data-service ray`): per source its loaders, tokens
  served, CPU seconds, busy share and memory (USS/PSS), and the scale events
  (`report.data_plane`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from megatron_hdp.report.data_plane import data_plane_lines, data_plane_totals
from megatron_hdp.report.offload import offload_line, offload_totals


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics file (one JSON object per line; blank lines skipped)."""
    lines = Path(path).read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {number}: not a JSON record ({err.msg})") from err
    return records


def _sum(records: Sequence[Mapping], key: str) -> float:
    return float(sum(r[key] for r in records))


def _both(records: Sequence[Mapping], a: str, b: str) -> list[Mapping]:
    """The records where `a` and `b` are both present (not None)."""
    return [r for r in records if r.get(a) is not None and r.get(b) is not None]


def run_summary(
    records: Iterable[Mapping],
    *,
    pool_size: int | None = None,
    policy: str | None = None,
    locations: Sequence[tuple[str, str]] = (),
) -> dict:
    """The summary's numbers (keys below), from per-step metrics records.

    Keys: `steps`, `first_iteration`, `last_iteration`, `tokens`, `seconds`,
    `tokens_per_s`, `data_wait_s`, `mean_step_s`, `mean_ranks_per_sequence`,
    `max_ranks_per_sequence`, `predicted_step_s` and `static_predicted_step_s` (means over
    the steps that have both), `predicted_speedup` (static over ours, predicted),
    `static_step_estimate_s` (the measured mean step time times that ratio: an estimate),
    `static_cp_size`, `attention_bytes`, `attention_bytes_predicted`,
    `static_attention_bytes_predicted`, `attention_bytes_saved` and
    `attention_bytes_saved_share` (over the steps that have the measurement and the static
    prediction), `offload` (`report.offload.offload_totals`, None without `--hdp-offload`)
    and `offload_line`, `data_plane` (`report.data_plane.data_plane_totals`, None off the
    Ray data service), plus `pool_size`, `policy` and `locations` as given. A number the
    records do not hold is None. ValueError if there is no record.
    """
    records = list(records)
    if not records:
        raise ValueError("no step records to summarise (the run trained no step)")
    tokens, seconds = _sum(records, "tokens"), _sum(records, "seconds")
    out: dict = {
        "steps": len(records),
        "first_iteration": records[0]["iteration"],
        "last_iteration": records[-1]["iteration"],
        "tokens": int(tokens),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "data_wait_s": float(sum(r.get("data_wait_s", 0.0) for r in records)),
        "mean_step_s": seconds / len(records),
        "pool_size": pool_size,
        "policy": policy,
        "locations": list(locations),
    }
    ranked = _both(records, "mean_ranks_per_sequence", "num_sequences")
    sequences = _sum(ranked, "num_sequences")
    out["mean_ranks_per_sequence"] = (
        sum(r["mean_ranks_per_sequence"] * r["num_sequences"] for r in ranked) / sequences
        if sequences > 0
        else None
    )
    widest = [r["max_ranks_per_sequence"] for r in records if "max_ranks_per_sequence" in r]
    out["max_ranks_per_sequence"] = max(widest) if widest else None

    predicted = _both(records, "predicted_step_s", "static_predicted_step_s")
    out["predicted_step_s"] = out["static_predicted_step_s"] = None
    out["predicted_speedup"] = out["static_step_estimate_s"] = None
    if predicted:
        ours, static = (
            _sum(predicted, "predicted_step_s"),
            _sum(predicted, "static_predicted_step_s"),
        )
        out["predicted_step_s"] = ours / len(predicted)
        out["static_predicted_step_s"] = static / len(predicted)
        if ours > 0:
            out["predicted_speedup"] = static / ours
            measured = _sum(predicted, "seconds") / len(predicted)
            out["static_step_estimate_s"] = measured * static / ours
    cps = [r["static_cp_size"] for r in records if r.get("static_cp_size") is not None]
    out["static_cp_size"] = cps[-1] if cps else None

    traffic = _both(records, "attention_bytes", "static_attention_bytes_predicted")
    out["attention_bytes"] = out["attention_bytes_predicted"] = None
    out["static_attention_bytes_predicted"] = None
    out["attention_bytes_saved"] = out["attention_bytes_saved_share"] = None
    if traffic:
        sent = int(_sum(traffic, "attention_bytes"))
        static_bytes = int(_sum(traffic, "static_attention_bytes_predicted"))
        out["attention_bytes"] = sent
        out["static_attention_bytes_predicted"] = static_bytes
        own = [r["attention_bytes_predicted"] for r in traffic if "attention_bytes_predicted" in r]
        out["attention_bytes_predicted"] = int(sum(own)) if len(own) == len(traffic) else None
        out["attention_bytes_saved"] = static_bytes - sent
        out["attention_bytes_saved_share"] = (
            (static_bytes - sent) / static_bytes if static_bytes > 0 else None
        )
    out["offload"] = offload_totals(records)
    out["offload_line"] = offload_line(records)
    out["data_plane"] = data_plane_totals(records)
    return out


def _bytes(n: float) -> str:
    """Decimal units: 1.5 MB, 2.0 GB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _step_lines(s: Mapping) -> list[str]:
    lines = [f"step time    {s['mean_step_s']:.3f} s per step, measured"]
    if s["predicted_step_s"] is None:
        return lines
    mesh = "static mesh"
    if s["static_cp_size"] is not None:
        dp = f"DP {s['pool_size'] // s['static_cp_size']} x " if s["pool_size"] else ""
        mesh = f"static mesh ({dp}CP {s['static_cp_size']})"
    speedup = s["predicted_speedup"]
    ratio = f": {speedup:.2f}x" if speedup is not None else ""
    lines.append(
        f"             predicted by the cost model (micro-batches only): "
        f"{s['predicted_step_s']:.3f} s this run's plans vs {s['static_predicted_step_s']:.3f} s "
        f"the {mesh}{ratio}"
    )
    if s["static_step_estimate_s"] is not None:
        lines.append(
            f"             {mesh} at this run's measured pace (estimate: measured x predicted "
            f"ratio): {s['static_step_estimate_s']:.3f} s per step"
        )
    return lines


def traffic_tradeoff(s: Mapping) -> str | None:
    """One sentence on why the run's ring traffic differs from the static mesh's, or None.

    Fewer bytes: a sequence on one rank sends nothing, and the mesh shards every sequence
    over its CP group. More bytes: rings wider than the mesh's CP group, the price of the
    shorter step the cost model predicts for the run's plans (by how much), or of none.
    """
    saved, cp = s["attention_bytes_saved"], s["static_cp_size"]
    widest = s["max_ranks_per_sequence"]
    if saved is None or cp is None:
        return None
    if saved >= 0:
        return (
            "why: a sequence whole on one rank sends nothing; the static mesh shards every "
            f"sequence over its CP group of {cp}."
        )
    if widest is not None and widest > cp:
        rings = f"widened long sequences' rings to up to {widest} ranks (the static mesh: {cp})"
    else:
        rings = f"gave sequences rings that send more than the static mesh's CP group of {cp}"
    speedup = s["predicted_speedup"]
    if speedup is not None and speedup > 1:
        return (
            f"the trade-off: the planner {rings} for a step the cost model predicts "
            f"{speedup:.2f}x shorter."
        )
    ratio = f" ({speedup:.2f}x)" if speedup is not None else ""
    return (
        f"the trade-off: the planner {rings}, but the cost model predicts no shorter step{ratio}."
    )


def format_summary(s: Mapping) -> str:
    """The summary of `run_summary` as lines of text for one screen (no trailing newline)."""
    where = f" on a pool of {s['pool_size']} ranks" if s["pool_size"] else ""
    how = f", {s['policy']} placement" if s["policy"] else ""
    lines = [
        f"run summary: {s['steps']} steps (iterations {s['first_iteration']}-"
        f"{s['last_iteration']}){where}{how}"
    ]
    if s["tokens_per_s"] is not None:
        lines.append(
            f"  throughput   {s['tokens_per_s']:,.0f} tokens/s ({s['tokens']:,} tokens in "
            f"{s['seconds']:.2f} s of steps; {s['data_wait_s']:.2f} s more waiting for data)"
        )
    if s["mean_ranks_per_sequence"] is not None:
        cp = s["static_cp_size"]
        mesh = f" (the static mesh: {cp} for every sequence)" if cp is not None else ""
        lines.append(
            f"  ranks/seq    mean {s['mean_ranks_per_sequence']:.2f}, "
            f"max {s['max_ranks_per_sequence']}{mesh}"
        )
    lines.extend("  " + line for line in _step_lines(s))
    if s["attention_bytes"] is not None:
        own = s["attention_bytes_predicted"]
        own_text = f" ({_bytes(own)} predicted)" if own is not None else ""
        saved, share = s["attention_bytes_saved"], s["attention_bytes_saved_share"]
        share_text = f" ({abs(share):.1%})" if share is not None else ""
        verdict = (
            f"{_bytes(saved)}{share_text} saved"
            if saved >= 0
            else f"{_bytes(-saved)}{share_text} more"
        )
        lines.append(
            f"  attention    ring traffic {_bytes(s['attention_bytes'])} measured{own_text} vs "
            f"{_bytes(s['static_attention_bytes_predicted'])} predicted for the static mesh: "
            + verdict
        )
        why = traffic_tradeoff(s)
        if why:
            lines.append(f"               {why}")
    if s.get("offload_line"):
        lines.append(f"  {'offloading':<12} {s['offload_line']}")
    if s.get("data_plane"):
        for k, line in enumerate(data_plane_lines(s["data_plane"])):
            lines.append(f"  {'data plane' if k == 0 else '':<12} {line}")
    for label, text in s["locations"]:
        lines.append(f"  {label:<12} {text}")
    return "\n".join(lines)
