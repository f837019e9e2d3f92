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

Float arithmetic is plain IEEE double in a fixed order, so the C++ core reproduces the
same starts bit for bit.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_hdp.scheduler.plan import MicroBatch, StepPlan, plan_from_rank_lists


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
    """
    n = len(lengths)
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
            members = [heapq.heappop(free) for _ in range(k)]
            start = max(t for t, _ in members)
            for t, rank in members:
                if start - t > delta:
                    bisect.insort(gaps, (start - t, t, rank))
                heapq.heappush(free, (start + cost, rank))
            ring = tuple(sorted(rank for _, rank in members))
        placed.append((start, -k, ring[0], position, Placement(start, cost, ring, seqs)))
    placed.sort(key=lambda p: p[:4])
    return [p[4] for p in placed]


def plan_from_placements(
    placements: Sequence[Placement],
    seqlens: Sequence[int],
    *,
    pool_size: int,
    capacity: int,
    policy: str,
    offload_ratios=None,
    num_layers: int = 0,
) -> StepPlan:
    """A `StepPlan` whose orders follow the placements' global order.

    `offload_ratios[i]` is sequence i's ratio; a ring micro-batch (one sequence) takes its
    sequence's ratio, packs never offload.
    """
    micro_batches = [
        MicroBatch(
            order=n,
            ring=p.ring,
            seq_indices=p.seq_indices,
            predicted_cost=p.cost,
            predicted_start=p.start,
            offload_ratio=(
                float(offload_ratios[p.seq_indices[0]])
                if offload_ratios is not None and len(p.ring) > 1
                else 0.0
            ),
        )
        for n, p in enumerate(placements)
    ]
    return plan_from_rank_lists(
        seqlens, pool_size, capacity, policy, micro_batches, num_layers=num_layers
    )
