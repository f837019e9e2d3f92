"""Ring sizes as a decision, and the step-time bound no plan can beat (pure: numpy).

A sequence needs at least `k_min` ranks for its activations (`ceil(s / C)`, or Eq. 3's
count with offloading) and may get more: a wider ring finishes sooner but moves more K/V
(`CostModel.time(s, k)` prices it). Wider rings pay off when one ring would set the step's
length, or when ranks would otherwise idle. Everything here is deterministic: every rank
derives the same sizes from the same inputs.

**The bound.** Let `t_i(k)` be sequence i's per-member time on `k` ranks and `W_i(k) =
k t_i(k)` its work. `W_i` never falls as `k` grows (compute is fixed and `k` times the
exposed ring time grows with `k`, `cost.CostModel`), and `t_i(k) >= A_i / k` with
`A_i` the compute of the whole sequence. A plan with step time `T` runs every sequence on
some `k_i` ranks with `t_i(k_i) <= T`, so `k_i >= max(k_min_i, A_i / T)`, and the ranks'
busy time `sum_i W_i(k_i)` fits in `N T`. The bound is the least `T` with

    T >= max_i min_{k_min_i <= k <= N} t_i(k)       (every sequence fits on some ring)
    N T >= sum_i W_i(max(k_min_i, ceil(A_i / T)))   (the work at the widths T forces)
    T >= sum of best times over sequences that cannot share the pool at T (below)

found by bisection (every right side falls as `T` grows). For the sequences with a table
of every width (the 8 longest, and those that may need more than half the pool, below)
the work term uses the width `T` really forces, the fewest ranks that finish them within
`T` (at least `ceil(A_i / T)`, so the term only grows, and it still falls as `T` grows):
with up to 8 sequences that is the exact fluid bound, up to 7% above the estimate on
small test batches and 4.7% in the planner benchmark (`_Conflicts.extra_work`).

Two sequences cannot run at the same time when the fewest ranks that finish each within
`T` add up to more than `N`: a sequence that needs more than `N / 2` ranks at `T` (its
best time on at most `N / 2` ranks exceeds `T`) excludes every other such sequence, and
also every sequence whose forced width exceeds what the narrowest of them leaves. Those
run one after another, each taking at least its best ring's time. It is at least the
classic `max(longest item at its best ring, total work at minimal rings / N)` and, like
it, assumes the cost model prices each sequence on its own ring (as every HDP plan and
Megatron-Core's scheduler do; packs of several documents on one ring, as the static mesh
builds, share ring messages and are bounded by their compute alone).

**The sizes.** `target_widths(T)` gives each sequence the fewest ranks that finish it
within `T` (at least `k_min`); at the bound that is the allotment the bound itself uses.
`plan_ring_sizes` is a multi-start descent over per-sequence ring widths in which every
candidate is scored by one balance-core run (its predicted step). A candidate is a width
vector in a mode: fixed widths or ranges the core chooses from (`width_ranges`), with
short sequences packed or, on small batches (`try_singles`), each a micro-batch of its
own. The starts are `target_widths(f T)` for each `f` of `TARGETS` (the bound's widths,
then tighter targets, whose smaller items fill ranks better), then the minimal widths,
each in every mode. A descent grows the critical item, the one that ends last (a ring
gets one rank more, a pack's longest sequence a ring of two), while the predicted step
falls. The search runs the starts; descends from the fastest candidate; runs each looser
start `f` of `LOOSER_TARGETS` and descends from it; on small batches descends from every
other candidate, fastest first; and, while the fastest plan is above `TIME_CEILING` of
the bound, widens the item its critical item waits for (of those on its ranks, the last
to end before it starts), even where that alone is slower, and descends again. It stops
when a candidate is accepted (`ACCEPT`: within 1% of the bound, attention balanced) or after
`min(SEARCH_RUNS, SEARCH_BUDGET / (sequences + ranks))` core runs, a quarter more
(`RESCUE_SHARE`) for the last step; no candidate is run twice. It returns, of the
candidates within `BALANCE_SLACK` of the fastest and `TIME_CEILING` of the bound, the
one whose worse ratio (step over the bound, busiest rank's attention `sum(s^2) / ring
size` over the mean, Megatron-Core's measure) is least; where that attention is more
than `ATTENTION_ACCEPT` above the mean, `attention_spread` moves ring members off the
busiest rank within the same time limits, and its plan replaces the choice where the sum
of the two ratios is lower (`_spread_attention`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_hdp.scheduler.attention_spread import (
    item_attention,
    rank_attention_peak,
    spread_plans,
)

#: A step within this share of the bound is accepted: the search stops (with attention
#: balanced, once a fast plan's attention is also within `ATTENTION_ACCEPT` of its mean).
ACCEPT = 0.01
#: The attention share accepted at once: a rank's sum of s^2 / ring size over the batch's
#: mean (Megatron-Core's own measure of balance).
ATTENTION_ACCEPT = 0.02
#: The spreading pass stops once the peak is within this share of the mean attention
#: (Megatron-Core's scheduler reaches 1.016 of it on a Byted-like batch of 8 ranks).
SPREAD_ACCEPT = 0.01
#: Candidates within this share of the fastest compete on their worse ratio to its bound.
BALANCE_SLACK = 0.02
#: ... and within this share of the bound (the benchmark's goal); also where the last
#: step (widening what the critical item waits for) stops.
TIME_CEILING = 0.03
#: Once the step is accepted, the search also stops when the candidate it would return is
#: within this share of both bounds: further runs could only improve ratios this close.
CHOSEN_ACCEPT = 0.025
#: Batch size (sequences + ranks) times runs the search may spend on attention balance
#: once the step time is accepted (none at 16,384 ranks: plan time stays as it was).
ATTENTION_BUDGET = 32_768
#: Widths chosen at placement may cost this much more work than the target width's.
WORK_SLACK = 0.02
#: Start targets, fractions of the bound: the bound's widths, then tighter, coarse first.
TARGETS = (1.0, 0.7, 0.5, 0.25, 0.125, 0.85, 0.35, 0.18)
#: Looser starts, each descended at once: a ring that just misses the bound on `k` ranks
#: may finish on `k - 1` a little later, freeing a rank for the rest.
LOOSER_TARGETS = (1.03, 1.06, 1.1, 1.2)
#: Core runs at most, and batch size (sequences + ranks) times runs at most: 3 runs at
#: 16,384 ranks with ~8 micro-batches per rank (the first is accepted on the benchmark's).
SEARCH_RUNS = 54
SEARCH_BUDGET = 450_000
#: The last step may spend this share of the runs more (none where they are under 4).
RESCUE_SHARE = 4
#: Widths of a sequence evaluated when searching for its target width.
_GRID = 48
#: Sequences whose best ring time is computed exactly for the bound (the rest: A / N).
_EXACT_LONGEST = 8


@dataclass(frozen=True)
class StepBound:
    """The lower bound on the step time and its parts (seconds)."""

    value: float
    work_at_min_rings: float
    """Total work at every sequence's minimal ring, over the pool size."""
    longest_at_best_ring: float
    """The largest over sequences of the shortest time any ring gives it."""


class RingCosts:
    """Per-member times of sequences on rings of any width (`CostModel.time`)."""

    def __init__(
        self,
        seqlens: Sequence[int],
        cost_model,
        pool_size: int,
        min_widths,
        min_time=None,
        compute=None,
    ):
        """Costs of `seqlens` on `pool_size` ranks, each on at least `min_widths`.

        `min_time`: each sequence's per-member time on its minimal ring, if known;
        `compute`: its compute alone (`time(s, 1)`), if known.
        """
        self.s = np.asarray(seqlens, dtype=np.float64)
        self.cost_model = cost_model
        self.pool_size = int(pool_size)
        self.k_min = np.asarray(min_widths, dtype=np.int64)
        if min_time is None:
            min_time = cost_model.time(self.s, self.k_min)
        self.min_time = np.asarray(min_time, dtype=np.float64)
        if compute is None:
            compute = cost_model.linear_time(self.s) + cost_model.attention_time(self.s)
        self.compute = np.asarray(compute, dtype=np.float64)
        # The widest ring a plan gives: every member holds a token, within the pool.
        self.k_max = np.maximum(self.k_min, np.minimum(self.pool_size, self.s.astype(np.int64)))

    def time(self, idx, k) -> np.ndarray:
        """Per-member seconds of sequences `idx` on rings of `k` ranks (broadcasts)."""
        return np.asarray(self.cost_model.time(self.s[idx], k), dtype=np.float64)


def step_lower_bound(costs: RingCosts) -> StepBound:
    """The least step time any plan of these sequences on this pool can reach (see above)."""
    n_ranks = costs.pool_size
    k_min, compute = costs.k_min, costs.compute
    work_min = k_min * costs.min_time
    total_min = float(work_min.sum())
    # Any plan: sequence i takes at least min_k t_i(k) >= A_i / N; exact for the longest
    # (and for those that might need half the pool).
    conflicts = _Conflicts(costs, total_min / n_ranks)
    longest = float(np.max(conflicts.lower))
    lo = conflicts.lo
    # Only sequences with A_i / k_min_i > lo can be forced wider by any T >= lo.
    forceable = np.nonzero(compute / k_min > lo)[0]
    order = forceable[np.argsort(-compute[forceable] / k_min[forceable], kind="stable")]
    ratio = compute[order] / k_min[order]  # descending: widths a T forces are a prefix

    def feasible(t: float) -> bool:
        forced = int(np.searchsorted(-ratio, -t, side="left"))  # ratio > t
        idx = order[:forced]
        k = np.maximum(k_min[idx], np.ceil(compute[idx] / t)).astype(np.int64)
        work = total_min + float(np.sum(k * costs.time(idx, k)) - np.sum(work_min[idx]))
        work += conflicts.extra_work(t)
        return work <= n_ranks * t and conflicts.chain(t) <= t

    if feasible(lo):
        value = lo
    else:
        hi = 2.0 * lo
        while not feasible(hi):
            hi *= 2.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if feasible(mid):
                hi = mid
            else:
                lo = mid
            if hi - lo <= 1e-9 * hi:
                break
        value = hi
    return StepBound(value, total_min / n_ranks, longest)


class _Conflicts:
    """The time a step `T` must give sequences that cannot share the pool (module doc).

    The longest few sequences, and those that might need more than half the pool at some
    `T >= lo`, get a table of their time at every width (their best times are exact);
    the others are bounded by `A / N`. `lo`: the classic bound, max(longest sequence at
    its best ring, `work` = total work at minimal rings / N).
    """

    def __init__(self, costs: RingCosts, work: float) -> None:
        n_ranks = costs.pool_size
        self.costs, self.half = costs, n_ranks // 2
        k_min, k_max = costs.k_min, costs.k_max
        self.lower = costs.compute / n_ranks
        top = min(_EXACT_LONGEST, len(k_min))
        top = np.sort(np.argpartition(-costs.compute, top - 1)[:top])
        tables = dict(zip(top.tolist(), zip(*self._tables(top))))
        self.lo = max(work, float(self.lower.max()), max(t[0] for t in tables.values()))
        # Big at some T >= lo only if no width up to half the pool finishes within lo:
        # try the width whose compute alone fits lo, then a grid up to half the pool.
        maybe = k_min > self.half
        idx = np.nonzero(~maybe & (costs.min_time > self.lo))[0]  # else k_min finishes
        hi = np.minimum(k_max[idx], self.half)
        k = np.clip(np.ceil(costs.compute[idx] / self.lo), k_min[idx], hi).astype(np.int64)
        slow = costs.time(idx, k) > self.lo
        idx, k, hi = idx[slow], k[slow], hi[slow]
        if len(idx):
            grid = _width_grid(k, hi)
            slow = np.min(costs.time(idx[:, None], grid), axis=1) > self.lo
            maybe[idx[slow]] = True
        maybe[top] = False
        extra = np.nonzero(maybe)[0]
        if len(extra):
            tables.update(zip(extra.tolist(), zip(*self._tables(extra))))
        self.cand = np.array(sorted(tables), dtype=np.int64)
        self.best = np.array([tables[i][0] for i in self.cand])
        self.best_half = np.array([tables[i][1] for i in self.cand])
        self.tables = [tables[i][2] for i in self.cand]
        # Per table, the best time on at most k_min + j ranks (falls with j): the fewest
        # ranks that finish the sequence within T are the first j where it is <= T.
        self._best_upto = [-np.minimum.accumulate(table) for table in self.tables]
        self.lower[self.cand] = self.best

    def _tables(self, idx):
        """(best time, best time on at most half the pool, time at every width) of `idx`.

        Sequences of equal length and ring limits share one table.
        """
        costs, k_min, k_max = self.costs, self.costs.k_min, self.costs.k_max
        keys: dict = {}  # (length, k_min, k_max) -> its table's row; few rows
        inverse = np.empty(len(idx), dtype=np.int64)
        first = []
        for j, key in enumerate(
            zip(costs.s[idx].tolist(), k_min[idx].tolist(), k_max[idx].tolist())
        ):
            row = keys.setdefault(key, len(keys))
            if row == len(first):
                first.append(idx[j])
            inverse[j] = row
        first = np.asarray(first, dtype=np.int64)
        span = np.arange(int((k_max[first] - k_min[first]).max()) + 1)
        widths = np.minimum(k_min[first][:, None] + span, k_max[first][:, None])
        table = costs.time(first[:, None], widths)  # rows padded with their widest ring
        tables = [row[: int(k_max[i] - k_min[i]) + 1] for i, row in zip(first, table)]
        best = np.array([float(t.min()) for t in tables])
        best_half = np.array(
            [
                float(t[: self.half - k_min[i] + 1].min()) if k_min[i] <= self.half else np.inf
                for i, t in zip(first, tables)
            ]
        )
        return best[inverse], best_half[inverse], [tables[j] for j in inverse]

    def extra_work(self, t: float) -> float:
        """Work the tabled sequences add at step `t` beyond the fluid estimate.

        The estimate gives sequence i the width `max(k_min, ceil(A_i / t))`; a table
        knows the fewest ranks that finish it within `t` (at least that many: `t_i(k) >=
        A_i / k`), and work never falls with width, so the difference is >= 0.
        """
        extra = 0.0
        k_min, compute = self.costs.k_min, self.costs.compute
        for i, table, best_upto in zip(self.cand.tolist(), self.tables, self._best_upto):
            least = int(k_min[i])
            fits = int(np.searchsorted(best_upto, -t, side="left"))
            if fits == len(table):
                continue  # nothing finishes within t: the chain term refuses this t
            # As `step_lower_bound` sized it: wider than k_min only where A / k_min > t.
            estimate = max(least, math.ceil(compute[i] / t)) if compute[i] / least > t else least
            exact = least + fits
            if exact > estimate:
                extra += exact * float(table[fits]) - estimate * float(table[estimate - least])
        return extra

    def chain(self, t: float) -> float:
        """Seconds of sequences that run one after another in any plan of step `t`."""
        big = np.nonzero(self.best_half > t)[0]
        if len(big) == 0:
            return 0.0
        k_min = self.costs.k_min
        narrowest = min(
            int(k_min[self.cand[j]]) + int(np.argmax(self.tables[j] <= t))
            if np.any(self.tables[j] <= t)
            else self.costs.pool_size + 1
            for j in big
        )
        total = float(self.best[big].sum())
        # One more sequence may conflict with all of them: its forced width exceeds what
        # the narrowest leaves (two such sequences could still run side by side).
        forced = np.maximum(k_min, np.ceil(self.costs.compute / t))
        others = forced > self.costs.pool_size - narrowest
        others[self.cand[big]] = False
        if np.any(others):
            total += float(self.lower[others].max())
        return total


def target_widths(costs: RingCosts, target: float) -> np.ndarray:
    """Each sequence's fewest ranks (>= `k_min`) that finish it within `target` seconds.

    Searched on a grid of widths from `max(k_min, ceil(A / target))` (no fewer can reach
    the target): every width for 16 steps, then geometric to `k_max`. Where none reaches
    the target (the ring's exposed communication grows faster than its compute shrinks),
    the fastest width of a grid from `k_min` to `k_max`.
    """
    k = costs.k_min.copy()
    over = np.nonzero(costs.min_time > target)[0]
    if len(over) == 0:
        return k
    lo = np.minimum(
        costs.k_max[over], np.maximum(k[over], np.ceil(costs.compute[over] / target))
    ).astype(np.int64)
    grid = _width_grid(lo, costs.k_max[over])
    times = costs.time(over[:, None], grid)
    fits = times <= target
    first = np.argmax(fits, axis=1)
    rows = np.arange(len(over))
    k[over] = grid[rows, first]
    none = np.nonzero(~fits[rows, first])[0]
    if len(none):
        idx = over[none]
        grid = _width_grid(costs.k_min[idx], costs.k_max[idx])
        k[idx] = grid[np.arange(len(idx)), np.argmin(costs.time(idx[:, None], grid), axis=1)]
    return k


def _width_grid(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per row, `_GRID` widths from `lo` to `hi`: every width for 16, then geometric."""
    steps = np.arange(_GRID)
    ratio = np.maximum(hi / (lo + 16.0), 1.0)[:, None]
    grid = np.where(
        steps[None, :] < 16,
        lo[:, None] + steps[None, :],
        np.ceil((lo + 16)[:, None] * np.power(ratio, (steps[None, :] - 16) / (_GRID - 17))),
    ).astype(np.int64)
    return np.minimum(grid, hi[:, None])


def width_ranges(costs: RingCosts, widths: np.ndarray, slack: float = WORK_SLACK):
    """`balance_core`'s `widths` argument: each ring may run on `k_min .. k_hi` ranks.

    `k_hi` is the widest ring whose work stays within `1 + slack` of the work at `widths`
    (at least `widths` itself); sequences of width 1 keep being packed.
    """
    n = len(widths)
    ring = np.nonzero(widths > 1)[0]
    low = np.where(widths > 1, np.maximum(2, costs.k_min), 0).astype(np.int64)
    k_hi = widths.copy()
    if len(ring):
        limit = (1.0 + slack) * widths[ring] * costs.time(ring, widths[ring])
        lo, hi = widths[ring].copy(), costs.k_max[ring].copy()
        while np.any(lo < hi):  # largest k in [lo, hi] with work(k) <= limit (monotone)
            mid = (lo + hi + 1) // 2
            ok = mid * costs.time(ring, mid) <= limit
            lo = np.where(ok, mid, lo)
            hi = np.where(ok, hi, mid - 1)
        k_hi[ring] = lo
    counts = np.where(widths > 1, k_hi - low + 1, 0)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    seq = np.repeat(np.arange(n), counts)
    k_all = low[seq] + (np.arange(offsets[-1]) - offsets[seq])
    return low, offsets, costs.time(seq, k_all)


@dataclass
class _Candidate:
    makespan: float
    widths: np.ndarray
    ranges: tuple | None
    singles: bool
    last: tuple  # (sequence indices, ring width) of the item that finishes last
    placements: object  # whatever `run_core` returned for them
    seqlens: np.ndarray
    pool_size: int

    @functools.cached_property
    def attention(self) -> float:
        """The largest per-rank sum of s^2 / ring size (computed when first asked)."""
        return attention_peak(self.placements, self.seqlens, self.pool_size)


def _no_packs(placements) -> bool:
    """Whether every micro-batch of flat placements holds one sequence."""
    seq_offsets = placements[4]
    return len(seq_offsets) - 1 == seq_offsets[-1]


def attention_peak(placements, seqlens: np.ndarray, pool_size: int) -> float:
    """The largest per-rank sum of `s^2 / ring size` of flat placements (`placement_arrays`).

    Megatron-Core's scheduler balances this (its `get_total_workload`); a plan that is
    fast under the cost model but concentrates attention on some ranks is scored by it.
    """
    _, _, ring_offsets, ring_ranks, seq_offsets, seq_indices = placements
    weights = item_attention(seqlens, seq_offsets, seq_indices)
    return rank_attention_peak(weights, ring_offsets, ring_ranks, pool_size)


def plan_ring_sizes(
    costs: RingCosts,
    run_core: Callable,
    *,
    bound: StepBound | None = None,
    try_singles: bool = False,
    balance_attention: bool = True,
):
    """Search ring sizes with the balance core; return the chosen candidate (module doc).

    The candidate holds `widths`, `ranges` (None: fixed widths), `singles` (packed
    sequences were micro-batches of their own), the predicted `makespan` and `placements`
    (as `run_core` returned them).

    `run_core(widths, ranges, singles)` runs the core with per-sequence ring sizes
    `widths` (1 = packed), optional ranges and packing, and returns `(makespan, last,
    placements)`; `last` is the last-finishing item's (sequence indices, width), and
    `placements` are flat arrays (`balance.placement_arrays`).
    `try_singles`: also try unpacked sequences (small batches). Without
    `balance_attention` (offloading plans: wider rings would undo the offload) the
    fastest candidate is returned and the search stops once the step time is accepted.
    """
    if bound is None:
        bound = step_lower_bound(costs)
    target = bound.value
    attention_bound = float(np.sum(costs.s**2)) / costs.pool_size
    n = len(costs.s)
    seen = set()
    tried: list[_Candidate] = []

    def candidate(widths, ranged=False, singles=False) -> _Candidate | None:
        wider = np.nonzero(widths != costs.k_min)[0]  # a short key: where widths differ
        key = (wider.tobytes(), widths[wider].tobytes(), ranged, singles)
        if key in seen:
            return None
        seen.add(key)
        ranges = width_ranges(costs, widths) if ranged else None
        makespan, last, placements = run_core(widths, ranges, singles)
        if not singles and _no_packs(placements):
            seen.add(key[:3] + (True,))  # unpacking would place the same items
        tried.append(
            _Candidate(
                makespan, widths, ranges, singles, last, placements, costs.s, costs.pool_size
            )
        )
        return tried[-1]

    attention_runs = min(SEARCH_RUNS, ATTENTION_BUDGET // (n + costs.pool_size))
    if not balance_attention:
        attention_runs = 0

    def done() -> bool:
        fast = [c for c in tried if c.makespan <= (1.0 + ACCEPT) * target]
        if not fast:
            return False
        if len(tried) > attention_runs or any(
            c.attention <= (1.0 + ATTENTION_ACCEPT) * attention_bound for c in fast
        ):
            return True
        pick = chosen()
        return max(pick.makespan / target, pick.attention / attention_bound) <= 1.0 + CHOSEN_ACCEPT

    def chosen() -> _Candidate:
        fastest = min(c.makespan for c in tried)
        if not balance_attention:
            return next(c for c in tried if c.makespan == fastest)
        limit = _time_limit(tried, target)
        close = [c for c in tried if c.makespan <= limit]
        if len(close) == 1:
            return close[0]
        return min(
            close,
            key=lambda c: (max(c.makespan / target, c.attention / attention_bound), c.makespan),
        )

    packings = (False, True) if try_singles else (False,)
    runs = min(SEARCH_RUNS, max(1, SEARCH_BUDGET // (n + costs.pool_size)))
    descended = set()  # candidates a descent has started from (by identity)

    @functools.cache
    def widths_for(f: float) -> np.ndarray:
        return target_widths(costs, f * target) if f else costs.k_min.copy()

    def stop() -> bool:
        return len(tried) >= runs or done()

    def widened(c: _Candidate, item) -> _Candidate | None:
        """`c` run again with `item` (sequences, width) one rank wider (None: not run)."""
        widths = None if item is None else _one_rank_wider(c, costs, *item)
        return None if widths is None else candidate(widths, c.ranges is not None, c.singles)

    def descend(c: _Candidate) -> _Candidate:
        """The critical item of `c` grows while the predicted step falls; the last reached."""
        descended.add(id(c))
        while not stop():
            child = widened(c, c.last)
            if child is None or child.makespan >= c.makespan:
                break
            c = child
        return c

    # Every start in every mode; f = 0 stands for the minimal widths.
    starts = [(f, r, p) for f in (*TARGETS, 0.0) for r in (False, True) for p in packings]
    for f, ranged, singles in starts:
        if stop():
            break
        candidate(widths_for(f), ranged, singles)
    if not stop():
        descend(min(tried, key=lambda c: c.makespan))
    for f in LOOSER_TARGETS:
        start = None if stop() else candidate(widths_for(f), singles=try_singles)
        if start is not None:
            descend(start)
    while try_singles and not stop():
        rest = [c for c in tried if id(c) not in descended]
        if not rest:
            break
        descend(min(rest, key=lambda c: c.makespan))
    runs += runs // RESCUE_SHARE
    c = min(tried, key=lambda c: c.makespan)
    while c is not None and not stop() and c.makespan > (1.0 + TIME_CEILING) * target:
        c = widened(c, _awaited_item(c.placements))
        if c is not None:
            c = descend(c)
    pick = chosen()
    if attention_runs and pick.attention > (1.0 + ATTENTION_ACCEPT) * attention_bound:
        limits = (_time_limit(tried, target), (1.0 + TIME_CEILING) * target)
        minimal = [c.makespan for c in tried if np.array_equal(c.widths, costs.k_min)]
        if minimal:  # at most BALANCE_SLACK above the minimal rings' plan, as `chosen`
            limits = tuple(min(limit, (1.0 + BALANCE_SLACK) * min(minimal)) for limit in limits)
        starts = [c for c in tried if c.makespan <= limits[0]]
        pick = _spread_attention(pick, starts, sorted(limits), target, attention_bound)
    return pick


def _time_limit(tried, target: float) -> float:
    """The slowest predicted step `chosen` accepts.

    Within `BALANCE_SLACK` of the fastest and `TIME_CEILING` of the bound (or the fastest,
    if that is above it).
    """
    fastest = min(c.makespan for c in tried)
    return min((1.0 + BALANCE_SLACK) * fastest, max(fastest, (1.0 + TIME_CEILING) * target))


def _spread_attention(pick, starts, limits, target: float, attention_bound: float):
    """`pick`, or a plan with attention spread over more ranks, within `limits`.

    `spread_plans` starts from the candidates `starts` (those within the chooser's time
    limit), fastest first, and goes through the ascending `limits`: that limit, then
    `TIME_CEILING` of the bound, neither more than `BALANCE_SLACK` later than the minimal
    rings' plan where that was run; it stops once the peak is within `SPREAD_ACCEPT` of
    the mean. A result replaces `pick` where the sum of its two ratios (step over
    `target`, attention peak over `attention_bound`) is lower: a point of attention is
    worth a point of time. Pareto-like large batches: 8 ranks 1.099 -> 1.004 of the mean
    attention, 16 ranks 1.133 -> 1.046; Byted-like large 8: 1.030 -> 1.013.
    """

    def score(peak, makespan):
        return makespan / target + peak / attention_bound

    starts = sorted(starts, key=lambda c: c.makespan)
    results = spread_plans(
        [(c.makespan, c.placements) for c in starts],
        pick.seqlens,
        pool_size=pick.pool_size,
        limits=limits,
        accept=(1.0 + SPREAD_ACCEPT) * attention_bound,
    )
    best = min(results, key=lambda r: (score(r[0], r[1]), r[1]), default=None)
    if best is None or score(best[0], best[1]) >= score(pick.attention, pick.makespan):
        return pick
    _, makespan, placements, index = best
    return dataclasses.replace(starts[index], makespan=makespan, placements=placements)


def _one_rank_wider(c: _Candidate, costs: RingCosts, seqs, width: int):
    """`c`'s widths with an item of `c` wider (None: it cannot grow).

    The item holds `seqs` on `width` ranks: a ring gets one rank more (at the width the core
    placed it on, if it chose), a pack's longest sequence a ring of two.
    """
    widths = c.widths.copy()
    if width > 1:
        i = int(seqs[0])
        widths[i] = width
        if widths[i] >= costs.k_max[i]:
            return None
        widths[i] += 1
    else:
        i = max((int(j) for j in seqs), key=lambda j: (costs.s[j], -j))
        if costs.k_max[i] < 2:
            return None
        widths[i] = 2
    return widths


def _awaited_item(placements) -> tuple | None:
    """(sequences, width) of the item the last-finishing item waits for, if any.

    Of the items on the last item's ranks that end by its start, the one ending last.
    """
    starts, durations, ring_offsets, ring_ranks, seq_offsets, seqs = placements
    ends = starts + durations
    last = int(np.argmax(ends))
    members = ring_ranks[ring_offsets[last] : ring_offsets[last + 1]]
    shares = np.add.reduceat(np.isin(ring_ranks, members), ring_offsets[:-1]) > 0
    before = np.nonzero(shares & (ends <= starts[last]))[0]
    if len(before) == 0:
        return None
    p = int(before[np.argmax(ends[before])])
    return seqs[seq_offsets[p] : seq_offsets[p + 1]], int(ring_offsets[p + 1] - ring_offsets[p])


def offload_ratios_for(seqlens, widths, capacity: int, num_layers: int) -> np.ndarray:
    """Offload ratios at the placed widths: the least that fits, 0 from `ceil(s / C)` on."""
    from megatron_hdp.scheduler.offload_rule import least_ratio

    s = np.asarray(seqlens, dtype=np.int64)
    k = np.asarray(widths, dtype=np.int64)
    base = np.maximum(1, -(-s // capacity))
    ratios = np.zeros(len(s))
    saved = (k > 1) & (k < base)
    if saved.any():
        ratios[saved] = least_ratio(-(-s[saved] // k[saved]), capacity, num_layers)
    return ratios


__all__ = [
    "RingCosts",
    "StepBound",
    "offload_ratios_for",
    "plan_ring_sizes",
    "step_lower_bound",
    "target_widths",
    "width_ranges",
]
