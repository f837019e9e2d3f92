"""The Ray data plane's part of the run summary: per source and loader, and scale events (pure).

From the metrics records of a run on the Ray data service (`--hdp-data-service ray`):
the loaders' own measurements of the last logging step (`data_service`: one entry per
loader and shadow, `SourceLoader.stats`) and the planner's scaling log (`data_scaling`
pieces). `data_plane_totals` returns, per source, the sum over its loaders and shadow of
tokens served, CPU seconds and memory (USS, PSS), their mean busy share and how many
serve it now; per actor, the same figures; and the scale events with their reasons.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

#: A loader's figures kept per actor.
ACTOR_KEYS = ("tokens", "cpu_s", "busy_share", "uss", "pss")


def data_plane_totals(records: Sequence[Mapping]) -> dict | None:
    """`{"sources": {name: figures}, "actors": [...], "events": [...]}`; None off the service.

    A source's figures: `loaders` (serving now), `tokens`, `cpu_s`, `uss`, `pss` (sums
    over its loaders and shadow; a figure no actor reported is None) and `busy_share`
    (the mean over its serving loaders). `events`: the scale decisions that changed a
    count (`autoscale.Decision` records with `t` and `step`).
    """
    measured = [r["data_service"] for r in records if r.get("data_service")]
    if not measured:
        return None
    actors = [
        {"source": a["source"], "slot": a.get("slot"), "role": a.get("role"),
         **{k: a.get(k) for k in ACTOR_KEYS}}
        for a in measured[-1]
    ]  # fmt: skip
    sources: dict[str, dict] = {}
    for a in actors:
        s = sources.setdefault(a["source"], {"loaders": 0, "busy": []})
        if a["role"] == "loader":
            s["loaders"] += 1
            if a["busy_share"] is not None:
                s["busy"].append(a["busy_share"])
        for key in ("tokens", "cpu_s", "uss", "pss"):
            if a.get(key) is not None:
                s[key] = s.get(key, 0) + a[key]
    for s in sources.values():
        busy = s.pop("busy")
        s["busy_share"] = sum(busy) / len(busy) if busy else None
        for key in ("tokens", "cpu_s", "uss", "pss"):
            s.setdefault(key, None)
    events = [
        d
        for r in records
        for d in (r.get("data_scaling") or {}).get("decisions", [])
        if d["after"] != d["before"]
    ]
    return {"sources": sources, "actors": actors, "events": events}


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def data_plane_lines(totals: Mapping) -> list[str]:
    """The summary's lines for `data_plane_totals` (one per source, one for scale events)."""
    lines = []
    for name, s in totals["sources"].items():
        busy = "-" if s["busy_share"] is None else f"{s['busy_share']:.0%}"
        cpu = "-" if s["cpu_s"] is None else f"{s['cpu_s']:.1f} CPU s"
        tokens = "-" if s["tokens"] is None else f"{s['tokens']:,} tokens"
        lines.append(
            f"{name}: {s['loaders']} loaders, {tokens}, {cpu}, busy {busy}, "
            f"USS {_mib(s['uss'])}, PSS {_mib(s['pss'])}"
        )
    events = totals["events"]
    if events:
        moves = ", ".join(
            f"{d['source']} {d['before']}->{d['after']} (step {d['step']})" for d in events[:6]
        )
        more = f" and {len(events) - 6} more" if len(events) > 6 else ""
        lines.append(f"{len(events)} scale events: {moves}{more}")
    else:
        lines.append("no scale events")
    return lines
