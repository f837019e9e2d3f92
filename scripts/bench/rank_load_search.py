"""A lower bound on the step time of small batches: the rank-load relaxation, by branch and bound.

The relaxation is `rank_load_relaxation.py`'s: every sequence runs on `k` distinct ranks,
`k_min <= k <= min(N, s)`, each member busy `t(s, k)` (`CostModel.time`), every rank
busy at most `T`; only the timing of rings is dropped. Any plan that prices each sequence
on its own ring satisfies it, so a `T` it rules out is a lower bound on the step time.
HiGHS solves it as a MILP, but where a batch holds about one sequence per rank its dual
bound rises slowly (the ranks are interchangeable): on the planner benchmark's
Pareto-like 16-rank batch it reached 1.018 of the fluid bound in 300 s. This module
decides "is there an assignment with every rank within `T`?" by a depth-first search and
bisects on `T`; there it proves 1.03 in a few seconds.

The search, at a given `T`:

- each sequence may take every width whose member time fits `T` and whose work `k t(s, k)`
  fits beside the least work of all the others;
- sequences are placed largest piece first, each width narrowest first; a ring's members
  go to distinct ranks, and ranks with the same load are interchangeable, so a choice is
  how many members go to each distinct load (fullest loads first);
- a branch is cut when the loads so far, the least work the remaining sequences need, and
  the room left on ranks that no remaining piece fits add up to more than `N T`.

A decision that needs more than `node_budget` nodes is left undecided, and the bisection
treats it as feasible: the bound returned is the largest `T` the search has ruled out
(or `lower`), so the budget costs only tightness, never validity. Pieces fit with a
tolerance of 1e-9 of `T`, which can only lower the bound.
"""

from __future__ import annotations

import time

import numpy as np

#: Nodes one decision may visit before it is left undecided.
NODE_BUDGET = 50_000
#: The bisection stops when the bracket is within this share of its top.
TOLERANCE = 1e-5
#: Pieces fit a rank within this share of `T` (lenient: it can only lower the bound).
FIT_TOLERANCE = 1e-9


def rank_load_search_bound(
    seqlens,
    pool: int,
    cost_model,
    capacity: int,
    *,
    lower: float,
    upper: float,
    node_budget: int = NODE_BUDGET,
) -> dict:
    """The largest step time the rank-load relaxation rules out, between `lower` and `upper`.

    `lower`: a bound already known (the fluid one; the result is at least this);
    `upper`: the step time of a known plan (the relaxation allows it, so the result is at
    most this). Returns `value` (the bound, seconds), `proven` (the search ruled out a `T`
    above `lower`), `decisions`, `undecided` (decisions that ran out of nodes), `nodes`,
    `seconds`.
    """
    if not (np.isfinite(lower) and np.isfinite(upper) and 0.0 <= lower <= upper):
        raise ValueError(f"need 0 <= lower <= upper, got lower={lower!r}, upper={upper!r}")
    if len(seqlens) == 0:
        raise ValueError("need at least one sequence, got an empty batch")
    if int(node_budget) != node_budget or node_budget < 1:
        raise ValueError(f"node_budget must be a positive integer, got {node_budget!r}")
    t0 = time.perf_counter()
    table = _width_table(seqlens, pool, cost_model, capacity, upper)
    lo, hi = float(lower), float(upper)
    decisions = undecided = nodes = 0
    proven = False
    while hi - lo > TOLERANCE * hi:
        mid = 0.5 * (lo + hi)
        verdict, spent = _decide(table, pool, mid, int(node_budget))
        decisions, nodes = decisions + 1, nodes + spent
        if verdict is False:
            lo, proven = mid, True
        else:
            hi = mid
            undecided += verdict is None
    return {
        "value": lo,
        "proven": proven,
        "decisions": decisions,
        "undecided": undecided,
        "nodes": nodes,
        "seconds": time.perf_counter() - t0,
    }


def _width_table(seqlens, pool: int, cost_model, capacity: int, upper: float) -> list:
    """Per sequence: (widths, member times) of the widths whose time fits `upper`."""
    s = np.asarray(seqlens, dtype=np.float64)
    k_min, _, _ = cost_model.cost_arrays(np.asarray(seqlens, dtype=np.int64), capacity)
    k_max = np.maximum(k_min, np.minimum(pool, s.astype(np.int64)))
    table = []
    for x, lo, hi in zip(s, k_min, k_max):
        ks = np.arange(int(lo), int(hi) + 1)
        ts = np.asarray(cost_model.time(np.full(len(ks), x), ks), dtype=np.float64)
        keep = ts <= upper * (1.0 + FIT_TOLERANCE)
        table.append((ks[keep], ts[keep]))
    return table


def _decide(table, pool: int, step: float, node_budget: int) -> tuple[bool | None, int]:
    """(True: some assignment keeps every rank within `step`; False: none does; None:
    undecided within `node_budget` nodes, nodes visited)."""
    room = pool * step * (1.0 + FIT_TOLERANCE)
    fit = step * (1.0 + FIT_TOLERANCE)
    widths = []
    for ks, ts in table:
        keep = ts <= fit
        if not keep.any():
            return False, 0
        widths.append((ks[keep], ts[keep]))
    least = np.array([float(np.min(ks * ts)) for ks, ts in widths])
    total = float(least.sum())
    if total > room:
        return False, 0
    items = []  # per sequence: [(width, member time)], narrowest first
    for (ks, ts), w in zip(widths, least):
        ok = ks * ts <= room - (total - w)
        items.append(list(zip(ks[ok].tolist(), ts[ok].tolist())))
    order = sorted(range(len(items)), key=lambda i: -items[i][0][1])  # largest piece first
    items = [items[i] for i in order]
    n = len(items)
    work_after = np.concatenate([np.cumsum(least[order][::-1])[::-1], [0.0]]).tolist()
    pieces = np.array([min(t for _, t in options) for options in items])
    piece_after = np.minimum.accumulate(pieces[::-1])[::-1].tolist() + [np.inf]

    loads = [0.0] * pool
    used = 0.0
    placed: list[tuple[list[int], list[float], float]] = []  # ranks, their loads before, used
    stack = [_choices(items[0], loads, fit)]
    nodes = 0
    while stack:
        choice = next(stack[-1], None)
        if choice is None:
            stack.pop()
            if placed:
                ranks, before, used = placed.pop()
                for r, x in zip(ranks, before):
                    loads[r] = x  # restored exactly: equal loads stay equal
            continue
        nodes += 1
        if nodes > node_budget:
            return None, nodes
        ranks, t = choice
        j = len(stack)  # sequences placed once this choice is taken
        if j == n:
            return True, nodes
        before = [loads[r] for r in ranks]
        for r in ranks:
            loads[r] += t
        smallest = piece_after[j]
        idle = sum(step - x for x in loads if x + smallest > fit)
        if used + t * len(ranks) + idle + work_after[j] > room:
            for r, x in zip(ranks, before):
                loads[r] = x
            continue
        placed.append((ranks, before, used))
        used += t * len(ranks)
        stack.append(_choices(items[j], loads, fit))
    return False, nodes


def _choices(options, loads: list[float], fit: float):
    """Every (ranks, member time) placement of one sequence, narrowest width first.

    Reads `loads` as they are at each width's first placement: the caller restores them
    before asking for the next one.
    """
    for k, t in options:
        groups: dict[float, list[int]] = {}
        for r, x in enumerate(loads):
            if x + t <= fit:
                groups.setdefault(x, []).append(r)
        if sum(len(g) for g in groups.values()) < k:
            continue
        ordered = [groups[x] for x in sorted(groups, reverse=True)]  # fullest first
        for counts in _counts(tuple(len(g) for g in ordered), k):
            yield [r for g, c in zip(ordered, counts) for r in g[:c]], t


def _counts(caps: tuple[int, ...], k: int):
    """Every way to take `k` from groups of sizes `caps`, most from the first groups first."""
    if k == 1:
        for i in range(len(caps)):
            yield tuple(1 if m == i else 0 for m in range(len(caps)))
        return
    after = [0] * (len(caps) + 1)
    for i in range(len(caps) - 1, -1, -1):
        after[i] = after[i + 1] + caps[i]

    def take(i: int, need: int):
        if need == 0:
            yield (0,) * (len(caps) - i)
            return
        for c in range(min(need, caps[i]), max(0, need - after[i + 1]) - 1, -1):
            for rest in take(i + 1, need - c):
                yield (c,) + rest

    yield from take(0, k)
