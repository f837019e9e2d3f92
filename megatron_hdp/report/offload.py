"""What selective offloading did, from the per-step metrics records (pure).

With `--hdp-offload` every step record carries the planner's decision
(`scheduler.offload_choice.OffloadDecision.as_record`): `offload_rings` (rings that
offloaded), `offload_rings_total` (rings of the step), `offload_bytes_predicted` and
`offload_reason` (why the other rings did not), plus `offload_bytes`, the bytes the
step's copy engines really moved to the host over every rank. Records without these keys
(a run without `--hdp-offload`) give None / no line.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

KEYS = ("offload_rings", "offload_rings_total", "offload_bytes_predicted", "offload_reason")


def _bytes(n: float) -> str:
    """Decimal units: 1.5 MB, 2.0 GB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def offload_totals(records: Sequence[Mapping]) -> dict | None:
    """Totals over the records that hold the offload keys (None if none does).

    Keys: `steps`, `rings_offloaded`, `rings`, `bytes` (measured, None if no record holds
    `offload_bytes`), `bytes_predicted`, `reason` (the most frequent reason of the steps
    with rings that did not offload; '' if every ring offloaded).
    """
    rows = [r for r in records if all(k in r for k in KEYS)]
    if not rows:
        return None
    measured = [r["offload_bytes"] for r in rows if r.get("offload_bytes") is not None]
    reasons = Counter(
        r["offload_reason"]
        for r in rows
        if r["offload_reason"]
        and (r["offload_rings"] < r["offload_rings_total"] or r["offload_rings_total"] == 0)
    )
    return {
        "steps": len(rows),
        "rings_offloaded": int(sum(r["offload_rings"] for r in rows)),
        "rings": int(sum(r["offload_rings_total"] for r in rows)),
        "bytes": int(sum(measured)) if measured else None,
        "bytes_predicted": float(sum(r["offload_bytes_predicted"] for r in rows)),
        "reason": reasons.most_common(1)[0][0] if reasons else "",
    }


def offload_line(records: Sequence[Mapping]) -> str | None:
    """One line for a log interval or the run: rings offloaded, bytes, why not (None: no data)."""
    t = offload_totals(records)
    if t is None:
        return None
    steps = f"{t['steps']} step" + ("s" if t["steps"] != 1 else "")
    if t["rings_offloaded"] == 0:
        why = f": {t['reason']}" if t["reason"] else ""
        return f"--hdp-offload never offloaded in {steps} ({t['rings']} rings){why}"
    measured = f"{_bytes(t['bytes'])} measured, " if t["bytes"] is not None else ""
    line = (
        f"offloaded {t['rings_offloaded']} of {t['rings']} rings in {steps}, "
        f"{measured}{_bytes(t['bytes_predicted'])} predicted to host"
    )
    rest = t["rings"] - t["rings_offloaded"]
    if rest:
        line += f"; {rest} not: {t['reason']}"
    return line
