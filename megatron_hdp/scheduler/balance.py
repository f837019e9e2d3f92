"""The balance scheduler (ByteScale Alg. 2, DP-Balance), pure-Python reference.

This file is the specification of the planner core; `csrc/planner/` implements the same
contract in C++ and property tests hold the two to identical plans.

The paper leaves most of Alg. 2 open (bytescale-paper.md, section 7, item 7). Decided here:

1. *Items.* A sequence longer than the capacity is one ring item of `k` ranks (its minimal
   rank count; offloading may lower `k`), costing `ring_cost` per member. Shorter sequences
   are packed best-fit decreasing by tokens into packs of at most `capacity` tokens (the
   memory constraint); a pack is one single-rank item costing the sum of its sequences'
   `local_cost`. Costs come from the cost model; the core only compares them.
2. *Buckets and order.* Items are taken in decreasing cost (ties: larger ring first, then
   lower first sequence index). This is the paper's "sorted, bucketed, longest bucket
   first" with buckets of one item: micro-batches that run side by side come from
   neighbouring positions of the cost order, so they cost about the same (DP-Balance).
3. *Targets.* Ranks are always filled earliest-free first (list scheduling): a ring takes
   the `k` ranks that become free first (ties: lower rank) and starts on all of them at the
   latest of their free times, so all members start the ring together. There is no empty
   first iteration: every rank is a target at time 0.
4. *Idle gaps and the tolerance delta.* Members that wait for a ring's start leave an idle
   gap. Gaps longer than `delta` are remembered, and a later pack that fits into a gap runs
   there (best fit: the shortest gap that holds it; ties: earlier start, lower rank)
   instead of at the end of a rank's list. Gaps of at most `delta` stay idle.
5. *Order.* Every micro-batch gets a start time; the global order is by (start, larger
   ring first, lowest rank, item position). All members of a ring share its start, and a
   rank's micro-batches have strictly increasing starts, so every rank's list is in global
   order and no schedule can deadlock.
6. *End of the batch.* Nothing is left over: every item is placed, and the predicted step
   time is the latest finish.
7. *Ring widths chosen at placement* (optional `widths`). A ring sequence may list the
   widths it can run on, a contiguous range `low .. low + m - 1` with the per-member cost
   of each. It is still ordered by its nominal `ring_sizes`/`ring_cost`, but placed on the
   width whose ring finishes first: with the ranks taken earliest-free first, width `w`
   starts when the `w`-th of them is free, and `start_w + cost_w` is minimal (ties: the
   narrower width). The ranks it does not take stay free as they were. Which widths are
   worth listing is the caller's decision (`ring_sizing.py`).
8. *Rings back-fill gaps too.* A ring whose placement by rule 3 (or 7) would leave a
   member waiting longer than `delta` may instead run inside the idle gaps of rule 4: on
   width `w` at cost `c`, at the earliest `t` (a gap's start) at which at least `w` gaps
   each cover `[t, t + c]` (among the `64 + 4 w` shortest gaps that hold `c`), on the `w`
   of them that end first (ties: lower rank). It runs there when that finishes strictly
   before its placement by rule 3 (or 7), and the earliest finish over its widths wins
   (ties: the narrower). What is left of each gap before `t` and after `t + c` stays a
   gap (if longer than `delta`). Without this only packs use a ring's wait: two rings of
   174 ranks on 509 left the other 161 ranks idle for a whole ring's time.

Float arithmetic is plain IEEE double in a fixed order, so the C++ core reproduces the
same starts bit for bit.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_hdp.scheduler.plan import StepPlan

#: Rule 8 looks for a ring's window among this many of the shortest gaps that hold it.
WINDOW_SCAN_BASE = 64
WINDOW_SCAN_PER_MEMBER = 4


@dataclass(frozen=True)
class Placement:
    """One placed item: its start, per-member cost, ring and sequences."""

    start: float
    cost: float
    ring: tuple[int, ...]
    seq_indices: tuple[int, ...]


def best_fit_decreasing(lengths: Sequence[int], indices: Sequence[int], capacity: int) -> list:
    """Pack `indices` (by `lengths`) best-fit decreasing into bins of `capacity` tokens.

    Sorted by (length desc, index asc); each goes into the bin with the least room that
    still holds it (ties: the earliest bin). O(n log n) with a sorted list of (room, bin).
    """
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # sorted (room, bin id)
    for i in order:
        size = lengths[i]
        pos = bisect.bisect_left(rooms, (size, -1))
        if pos == len(rooms):
            bins.append([i])
            bisect.insort(rooms, (capacity - size, len(bins) - 1))
        else:
            room, b = rooms.pop(pos)
            bins[b].append(i)
            bisect.insort(rooms, (room - size, b))
    return bins


def balance_core(
    lengths: Sequence[int],
    ring_sizes: Sequence[int],
    local_cost: Sequence[float],
    ring_cost: Sequence[float],
    *,
    pool_size: int,
    capacity: int,
    delta: float = 0.0,
    widths=None,
) -> list[Placement]:
    """Place every sequence; return placements sorted into the global order.

    Args:
        lengths: Tokens of each sequence.
        ring_sizes: Ranks each sequence needs (1 = packed with others on one rank).
        local_cost: Cost of each sequence alone on one rank (used for packs).
        ring_cost: Per-member cost of each sequence on its ring (used when ring size > 1).
        pool_size: Ranks in the pool.
        capacity: Tokens per rank per micro-batch (the packing limit).
        delta: Idle gaps at most this long are not back-filled.
        widths: None, or `(low, offsets, costs)`: ring sequence i (ring size > 1) may run
            on any width `low[i] + j` for `j < offsets[i + 1] - offsets[i]`, at per-member
            cost `costs[offsets[i] + j]` (rule 7); an empty range keeps `ring_sizes[i]`.
    """
    n = len(lengths)
    options = _width_options(widths, ring_sizes, ring_cost, pool_size)
    short = [i for i in range(n) if ring_sizes[i] == 1]
    items = []  # (cost, k, first index, seq indices)
    for pack in best_fit_decreasing(lengths, short, capacity):
        cost = 0.0
        for i in pack:
            cost += local_cost[i]
        items.append((cost, 1, pack[0], tuple(pack)))
    for i in range(n):
        if ring_sizes[i] > 1:
            items.append((float(ring_cost[i]), int(ring_sizes[i]), i, (i,)))
    items.sort(key=lambda it: (-it[0], -it[1], it[2]))

    free = [(0.0, r) for r in range(pool_size)]  # heap of (free time, rank)
    gaps: list[tuple[float, float, int]] = []  # sorted (length, start, rank)
    placed = []  # (start, -k, min rank, position, Placement)
    for position, (cost, k, _, seqs) in enumerate(items):
        if k == 1:
            pos = bisect.bisect_left(gaps, (cost, float("-inf"), -1))
            if pos < len(gaps):
                length, start, rank = gaps.pop(pos)
                rest = length - cost
                if rest > delta:
                    bisect.insort(gaps, (rest, start + cost, rank))
            else:
                start, rank = heapq.heappop(free)
                heapq.heappush(free, (start + cost, rank))
            ring = (rank,)
        else:
            choices = options.get(seqs[0], ((k, cost),))
            popped = [heapq.heappop(free) for _ in range(choices[-1][0])]
            k, cost, finish = choices[0][0], choices[0][1], None
            for width, width_cost in choices:
                end = popped[width - 1][0] + width_cost
                if finish is None or end < finish:
                    k, cost, finish = width, width_cost, end
            window = None
            waits = popped[k - 1][0] - popped[0][0] > delta
            for width, width_cost in choices if gaps and waits else ():
                found = _gap_window(gaps, width, width_cost, finish)
                if found is not None:
                    k, cost, finish, window = width, width_cost, found[0] + width_cost, found
            if window is not None:
                for member in popped:
                    heapq.heappush(free, member)
                start, chosen = window
                for gap in chosen:
                    gaps.remove(gap)
                    length, gap_start, rank = gap
                    if start - gap_start > delta:
                        bisect.insort(gaps, (start - gap_start, gap_start, rank))
                    rest = gap_start + length - (start + cost)
                    if rest > delta:
                        bisect.insort(gaps, (rest, start + cost, rank))
                ring = tuple(sorted(rank for _, _, rank in chosen))
            else:
                members = popped[:k]
                for t, rank in popped[k:]:
                    heapq.heappush(free, (t, rank))
                start = max(t for t, _ in members)
                for t, rank in members:
                    if start - t > delta:
                        bisect.insort(gaps, (start - t, t, rank))
                    heapq.heappush(free, (start + cost, rank))
                ring = tuple(sorted(rank for _, rank in members))
        placed.append((start, -k, ring[0], position, Placement(start, cost, ring, seqs)))
    placed.sort(key=lambda p: p[:4])
    return [p[4] for p in placed]


def _gap_window(gaps, width: int, cost: float, finish: float):
    """Rule 8: `(t, gaps)` of the earliest window of `width` gaps covering `[t, t + cost]`.

    `gaps` is the sorted list of `(length, start, rank)`; None when no window finishes
    before `finish` (`t + cost < finish`). Only the `WINDOW_SCAN_BASE +
    WINDOW_SCAN_PER_MEMBER * width` shortest gaps that hold `cost` take part (the best
    fits; this bounds the work per ring). Candidates `t` are the gaps' starts, ascending;
    at each, the gaps that began by `t` and end at or after `t + cost` qualify, and the
    `width` ending first (ties: lower rank) are taken.
    """
    first = bisect.bisect_left(gaps, (cost, float("-inf"), -1))
    scanned = gaps[first : first + WINDOW_SCAN_BASE + WINDOW_SCAN_PER_MEMBER * width]
    by_start = sorted((g for g in scanned if g[1] + cost < finish), key=lambda g: g[1:])
    if len(by_start) < width:
        return None
    open_gaps: list = []  # heap of (end, rank, gap)
    j = 0
    while j < len(by_start):
        t = by_start[j][1]
        if not t + cost < finish:
            return None
        while j < len(by_start) and by_start[j][1] == t:
            gap = by_start[j]
            heapq.heappush(open_gaps, (gap[1] + gap[0], gap[2], gap))
            j += 1
        while open_gaps and open_gaps[0][0] < t + cost:
            heapq.heappop(open_gaps)
        if len(open_gaps) >= width:
            return t, [entry[2] for entry in heapq.nsmallest(width, open_gaps)]
    return None


def _width_options(widths, ring_sizes, ring_cost, pool_size) -> dict:
    """{sequence: ((width, cost), ...) ascending} from `balance_core`'s `widths` argument.

    Raises ValueError for ranges outside [2, pool_size], for non-finite costs and for a
    range given to a sequence of ring size 1.
    """
    if widths is None:
        return {}
    low, offsets, costs = widths
    n = len(ring_sizes)
    if len(low) != n or len(offsets) != n + 1 or offsets[0] != 0 or offsets[n] != len(costs):
        raise ValueError(
            "widths must be (low, offsets, costs) with one low per sequence and n + 1 offsets "
            "from 0 to len(costs)"
        )
    options = {}
    for i in range(n):
        first, last = int(offsets[i]), int(offsets[i + 1])
        if last < first:
            raise ValueError(f"widths offsets decrease at sequence {i}")
        if last == first:
            continue
        lo, hi = int(low[i]), int(low[i]) + last - first - 1
        if ring_sizes[i] <= 1 or lo < 2 or hi > pool_size:
            raise ValueError(
                f"sequence {i} (ring size {ring_sizes[i]}) lists widths {lo}..{hi}; widths "
                f"need a ring sequence and must lie in [2, {pool_size}]"
            )
        choice = tuple((lo + j, float(costs[first + j])) for j in range(last - first))
        if not all(math.isfinite(c) for _, c in choice):
            raise ValueError(f"sequence {i} lists a non-finite width cost")
        options[i] = choice
    return options


def placement_arrays(placements: Sequence[Placement]) -> tuple:
    """Placements in the flat form of the C++ `balance_core_arrays`.

    `(starts, costs, ring_offsets, ring_ranks, seq_offsets, seq_indices)`: placement p
    runs on `ring_ranks[ring_offsets[p]:ring_offsets[p + 1]]` and holds
    `seq_indices[seq_offsets[p]:seq_offsets[p + 1]]`.
    """
    ring_offsets = np.zeros(len(placements) + 1, dtype=np.int64)
    seq_offsets = np.zeros(len(placements) + 1, dtype=np.int64)
    np.cumsum([len(p.ring) for p in placements], out=ring_offsets[1:])
    np.cumsum([len(p.seq_indices) for p in placements], out=seq_offsets[1:])
    return (
        np.array([p.start for p in placements], dtype=np.float64),
        np.array([p.cost for p in placements], dtype=np.float64),
        ring_offsets,
        np.array([r for p in placements for r in p.ring], dtype=np.int64),
        seq_offsets,
        np.array([i for p in placements for i in p.seq_indices], dtype=np.int64),
    )


def ring_sequences(placements: tuple) -> tuple[np.ndarray, np.ndarray]:
    """The sequence and the width of every ring placement of flat `placements` arrays.

    A ring placement (more than one rank) holds exactly one sequence.
    """
    _, _, ring_offsets, _, seq_offsets, seq_indices = placements
    widths = np.diff(ring_offsets)
    rings = np.nonzero(widths > 1)[0]
    return seq_indices[seq_offsets[rings]], widths[rings]


def plan_from_placements(
    placements,
    seqlens: Sequence[int],
    *,
    pool_size: int,
    capacity: int,
    policy: str,
    offload_ratios=None,
    num_layers: int = 0,
) -> StepPlan:
    """A `StepPlan` whose orders follow the placements' global order.

    `placements` is a sequence of `Placement` or their flat arrays (`placement_arrays`,
    `balance_core_arrays`). `offload_ratios[i]` is sequence i's ratio; a ring micro-batch
    (one sequence) takes its sequence's ratio, packs never offload.
    """
    if not (isinstance(placements, tuple) and placements and isinstance(placements[0], np.ndarray)):
        placements = placement_arrays(placements)
    starts, costs, ring_offsets, ring_ranks, seq_offsets, seq_indices = placements
    ratios = np.zeros(len(starts), dtype=np.float64)
    if offload_ratios is not None:
        seqs, _ = ring_sequences(placements)
        ratios[np.diff(ring_offsets) > 1] = np.asarray(offload_ratios, dtype=np.float64)[seqs]
    return StepPlan(
        pool_size=pool_size,
        capacity=capacity,
        seqlens=seqlens,
        policy=policy,
        order=np.arange(len(starts), dtype=np.int64),
        ring_offsets=ring_offsets,
        ring_ranks=ring_ranks,
        seq_offsets=seq_offsets,
        seq_ids=seq_indices,
        offload_ratio=ratios,
        predicted_cost=costs,
        predicted_start=starts,
        num_layers=num_layers,
    )
