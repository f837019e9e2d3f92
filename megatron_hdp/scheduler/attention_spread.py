"""Spread attention off the busiest rank of a placed plan, within a step-time limit.

The balance core evens out predicted time. Where a rank's rings are narrow and its packs
few, its share of attention (the sum over its micro-batches of `sum(s^2) / ring size`,
Megatron-Core's own measure of balance) can stand well above the mean while its time does
not: on a Pareto-like batch of 8 ranks, 1.10 of the mean where Megatron-Core's scheduler
reaches 1.04. Attention is where the cost model's error is largest, so a plan that
concentrates it is the one most likely to run late.

`spread_attention` keeps every item (its sequences, width and cost) and the global order,
and moves ring members: repeatedly, off the rank with the most attention, either one of its
items' memberships moves to another rank (`shift`), or it trades places with a member of an
item on that rank (`exchange`; single-rank items are rings of one). Moves that lower the
sum of squared loads are tried best first (the lowest new peak, then the largest fall);
each is re-timed in the global order (an item starts when all its members are free) and
taken if the plan still ends within `limit`. The search stops when no move from the peak
rank fits, or when its work reaches `budget` (a unit per candidate move considered, items +
memberships per re-timing; a re-timing that would pass it is not started, a round of
candidates once started is counted whole).

`spread_attention_reference` is the specification; the C++ pass in
`megatron_hdp._planner.spread_attention` gives identical results (property tests hold
them together) and `spread_attention` runs it where it is built.
"""

from __future__ import annotations

import numpy as np

try:
    from megatron_hdp._planner import spread_attention as _native_spread
except ImportError:  # without the C++ extension the reference runs
    _native_spread = None

#: Work (`spread_attention`'s units, about 1.5 ns each in C++) one plan's pass may spend
#: over all its starting points.
SPREAD_BUDGET = 4_000_000
#: Plans the pass starts from, fastest first: from which one the search gets furthest is
#: not known in advance (on a Byted-like batch of 8 ranks, the second fastest).
SPREAD_STARTS = 16

#: A move must lower the sum of squared loads by more than this share of the peak squared
#: (floating-point noise cannot make the search cycle).
MIN_GAIN = 1e-12


def retime(costs, ring_offsets, ring_ranks, pool_size: int) -> tuple[np.ndarray, float]:
    """Starts of the items run in the global order on their rings, and the step's end."""
    ready = [0.0] * pool_size
    starts = np.zeros(len(costs), dtype=np.float64)
    end_max = 0.0
    for p in range(len(costs)):
        ring = ring_ranks[ring_offsets[p] : ring_offsets[p + 1]]
        start = max(ready[r] for r in ring)
        end = start + float(costs[p])
        for r in ring:
            ready[r] = end
        starts[p] = start
        end_max = max(end_max, end)
    return starts, end_max


def item_attention(seqlens, seq_offsets, seq_indices) -> np.ndarray:
    """Each item's `sum(s^2)` over its sequences (float64), the weights `spread_attention` takes."""
    squares = np.asarray(seqlens, dtype=np.float64)[np.asarray(seq_indices, dtype=np.int64)] ** 2
    if not len(squares):
        return squares
    return np.add.reduceat(squares, np.asarray(seq_offsets, dtype=np.int64)[:-1])


def rank_attention_peak(weights, ring_offsets, ring_ranks, pool_size: int) -> float:
    """The largest per-rank sum of the items' `weight / width` (attention with `item_attention`)."""
    widths = np.diff(ring_offsets)
    shares = np.repeat(weights / widths, widths)
    return float(np.bincount(ring_ranks, weights=shares, minlength=pool_size).max())


def spread_attention_reference(
    costs, ring_offsets, ring_ranks, weights, *, pool_size: int, limit: float, budget: int
):
    """The specification of `spread_attention`: `(starts, ring_ranks, work spent)`.

    `costs[p]`, `ring_ranks[ring_offsets[p]:ring_offsets[p + 1]]` (ascending) and
    `weights[p]` (the item's `sum(s^2)`) describe item p in the global order. Returns the
    re-timed starts, the rings after the moves (each ascending; widths unchanged) and the
    work spent (see the module docstring). With no move taken the rings are the input's.
    """
    _check(costs, ring_offsets, ring_ranks, weights, pool_size, limit, budget)
    costs = [float(c) for c in costs]
    offsets = [int(o) for o in ring_offsets]
    rings = [[int(r) for r in ring_ranks[offsets[p] : offsets[p + 1]]] for p in range(len(costs))]
    shares = [float(weights[p]) / len(rings[p]) for p in range(len(costs))]
    load = [0.0] * pool_size
    for ring, share in zip(rings, shares, strict=True):
        for r in ring:
            load[r] += share
    work = 0
    eval_work = len(costs) + len(ring_ranks)
    while work < budget:
        top = sorted(range(pool_size), key=lambda r: (-load[r], r))[:3]
        a = top[0]
        moves = []
        for p in range(len(rings)):
            if a not in rings[p]:
                continue
            for b in range(pool_size):
                if b in rings[p]:
                    continue
                partners = [q for q in range(len(rings)) if b in rings[q] and a not in rings[q]]
                for q in [-1] + partners:
                    work += 1
                    d = shares[p] - (shares[q] if q >= 0 else 0.0)
                    if d <= 0.0:
                        continue
                    new_a, new_b = load[a] - d, load[b] + d
                    gain = (load[a] * load[a] + load[b] * load[b]) - (new_a * new_a + new_b * new_b)
                    if gain <= MIN_GAIN * load[a] * load[a]:
                        continue
                    others = [load[r] for r in top if r != a and r != b]
                    peak = max([new_a, new_b] + others[:1])
                    moves.append((peak, -gain, p, b, q, d))
        moves.sort()
        taken = False
        for _, _, p, b, q, d in moves:
            if work + eval_work > budget:
                break
            trial = list(rings)
            trial[p] = sorted(r if r != a else b for r in rings[p])
            if q >= 0:
                trial[q] = sorted(r if r != b else a for r in rings[q])
            flat = [r for ring in trial for r in ring]
            _, end = retime(costs, offsets, flat, pool_size)
            work += eval_work
            if end <= limit:
                rings = trial
                load[a] -= d
                load[b] += d
                taken = True
                break
        if not taken:
            break
    flat = np.asarray([r for ring in rings for r in ring], dtype=np.int64)
    starts, _ = retime(costs, offsets, flat, pool_size)
    return starts, flat, work


def spread_plans(plans, seqlens, *, pool_size: int, limits, accept: float) -> list:
    """What `spread_attention` makes of `plans`: `(peak, makespan, placements, index)` each.

    `plans` are `(makespan, flat placements)` (`balance.placement_arrays` order), fastest
    first; `index` names the one a result started from. Each is spread within its own
    makespan (no slower) and then, while its attention peak is above `accept`, within each
    of `limits` in turn (ascending). Stops after the first result within `accept`, after
    `SPREAD_STARTS` plans, or when `SPREAD_BUDGET` is spent.
    """
    results = []
    left = SPREAD_BUDGET
    for index, (makespan, placements) in enumerate(plans[:SPREAD_STARTS]):
        if left <= 0:
            break
        starts, costs, ring_offsets, ring_ranks, seq_offsets, seq_indices = placements
        weights = item_attention(seqlens, seq_offsets, seq_indices)
        for stage_limit in (makespan, *limits):
            starts, ring_ranks, work = spread_attention(
                costs,
                ring_offsets,
                ring_ranks,
                weights,
                pool_size=pool_size,
                limit=stage_limit,
                budget=left,
            )
            left -= work
            peak = rank_attention_peak(weights, ring_offsets, ring_ranks, pool_size)
            if peak <= accept or left <= 0:
                break
        end = float(np.max(starts + costs)) if len(costs) else 0.0
        spread = (starts, costs, ring_offsets, ring_ranks, seq_offsets, seq_indices)
        results.append((peak, end, spread, index))
        if peak <= accept:
            break
    return results


def _check(costs, ring_offsets, ring_ranks, weights, pool_size, limit, budget) -> None:
    """ValueError for input the C++ pass refuses, with the same reasons."""
    n = len(costs)
    if pool_size < 1:
        raise ValueError("pool_size must be >= 1")
    if len(weights) != n or len(ring_offsets) != n + 1:
        raise ValueError("costs, weights and ring_offsets (one entry more) differ in length")
    if ring_offsets[0] != 0 or ring_offsets[n] != len(ring_ranks):
        raise ValueError("ring_offsets must start at 0 and end at len(ring_ranks)")
    for p in range(n):
        if not (np.isfinite(costs[p]) and costs[p] >= 0.0):
            raise ValueError(f"cost of item {p} is negative or not finite")
        if not (np.isfinite(weights[p]) and weights[p] >= 0.0):
            raise ValueError(f"weight of item {p} is negative or not finite")
        if ring_offsets[p + 1] <= ring_offsets[p]:
            raise ValueError(f"item {p} has an empty ring")
        ring = [int(r) for r in ring_ranks[ring_offsets[p] : ring_offsets[p + 1]]]
        for j, r in enumerate(ring):
            if r < 0 or r >= pool_size or r in ring[:j]:
                raise ValueError(f"item {p} names rank {r} outside the pool or twice")
    if np.isnan(limit):
        raise ValueError("limit is NaN")
    if budget < 0:
        raise ValueError("budget must be >= 0")


def spread_attention(
    costs, ring_offsets, ring_ranks, weights, *, pool_size: int, limit: float, budget: int
):
    """`spread_attention_reference`'s result, from the C++ pass where it is built."""
    run = spread_attention_reference if _native_spread is None else _native_spread
    return run(
        costs, ring_offsets, ring_ranks, weights, pool_size=pool_size, limit=limit, budget=budget
    )


__all__ = [
    "item_attention",
    "rank_attention_peak",
    "retime",
    "spread_attention",
    "spread_attention_reference",
    "spread_plans",
]
