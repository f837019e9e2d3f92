"""The `"greedy"` HDP placement (`plan_step(policy="greedy")`), in array form (pure).

Rings of `ceil(s / capacity)` ranks for long sequences, longest first, each on the `k`
least-loaded ranks (ties: lower rank); packs (best-fit decreasing) follow, heaviest first,
each on the least-loaded rank. The plans are exactly those of the first, per-object
implementation (kept as the reference in `tests/unit/test_greedy.py`); what changed is the
cost: best-fit packing on a blocked sorted list (O(n sqrt n) memory moves in place of
O(n^2); equal lengths placed a bin at a time), micro-batch costs computed as arrays for
the two known cost functions (`simple_cost`, `CostModel.planner_cost`) with the same
floating-point operations in the same order, and the plan built as columns, not objects.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Sequence

import numpy as np

from megatron_hdp.scheduler.cost import CostModel
from megatron_hdp.scheduler.plan import StepPlan, validate_inputs
from megatron_hdp.scheduler.static_mesh import CostFn, simple_cost

#: Largest integer below which int -> float64 is exact (costs then equal the reference's).
_EXACT = 2**53
#: Entries per block of the blocked sorted list of bin rooms.
_BLOCK = 512


def best_fit_decreasing(lengths, indices, capacity: int) -> list[list[int]]:
    """`balance.best_fit_decreasing`'s bins (same order, same contents), faster.

    Sorted by (length desc, index asc); each goes into the bin with the least room that
    still holds it (ties: the earliest bin). The (room, bin) pairs are kept as one integer
    key `room * B + bin` in a list of sorted blocks, so a search or an insert moves at
    most one block; a run of equal lengths fills each bin it picks in one step.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if isinstance(indices, np.ndarray):
        idx = indices.astype(np.int64, copy=False)
    else:
        idx = np.fromiter(indices, dtype=np.int64)
    if len(idx) == 0:
        return []
    sizes = lengths[idx]
    order = np.lexsort((idx, -sizes))
    idx, sizes = idx[order], sizes[order]
    runs = np.flatnonzero(np.diff(sizes)) + 1  # equal lengths run side by side
    starts = [0, *runs.tolist()]
    ends = [*runs.tolist(), len(idx)]
    idx, sizes = idx.tolist(), sizes.tolist()
    scale = len(idx) + 1  # > any bin id
    bins: list[list[int]] = []
    blocks: list[list[int]] = []  # sorted keys, block after block
    maxes: list[int] = []  # last key of each block
    for first, end in zip(starts, ends):
        # A run of equal lengths: the best-fit bin takes as many as fit (each one after
        # the first would pick it again: its room stays the least that holds one more).
        size = sizes[first]
        want = size * scale
        while first < end:
            bi = bisect_left(maxes, want)
            if bi < len(maxes):
                block = blocks[bi]
                key = block.pop(bisect_left(block, want))
                take = min(end - first, (key // scale) // size)
                bins[key % scale].extend(idx[first : first + take])
                first += take
                new = key - take * want  # (room - take * size) * scale + bin: below `key`
                if block and (bi == 0 or maxes[bi - 1] < new):  # it stays in this block
                    insort(block, new)
                    if key > block[-1]:
                        maxes[bi] = block[-1]
                    if len(block) > 2 * _BLOCK:
                        _split(blocks, maxes, bi)
                    continue
                if not block:
                    del blocks[bi], maxes[bi]
                elif key > block[-1]:
                    maxes[bi] = block[-1]
            else:  # a new bin, filled as far as the run goes
                take = min(end - first, max(1, capacity // size))
                bins.append(idx[first : first + take])
                first += take
                new = (capacity - take * size) * scale + len(bins) - 1
            _insert(blocks, maxes, new)
    return bins


def _insert(blocks: list[list[int]], maxes: list[int], key: int) -> None:
    """Insert `key` into the first block whose last key exceeds it (else the last block)."""
    bi = bisect_left(maxes, key)
    if bi == len(maxes):
        if not blocks:
            blocks.append([])
            maxes.append(key)
        bi -= bi == len(blocks)
        blocks[bi].append(key)
        maxes[bi] = key
    else:
        insort(blocks[bi], key)
    if len(blocks[bi]) > 2 * _BLOCK:
        _split(blocks, maxes, bi)


def _split(blocks: list[list[int]], maxes: list[int], bi: int) -> None:
    """Split block `bi` of the blocked sorted list in two."""
    block = blocks[bi]
    blocks.insert(bi + 1, block[_BLOCK:])
    maxes.insert(bi + 1, block[-1])
    del block[_BLOCK:]
    maxes[bi] = block[-1]


def _sequential_sums(terms: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per group `terms[offsets[g]:offsets[g+1]]`, summed left to right as Python's `sum`."""
    sizes = np.diff(offsets)
    out = np.zeros(len(sizes), dtype=np.float64)
    by_size = np.argsort(-sizes, kind="stable")
    starts, sizes = offsets[:-1][by_size], sizes[by_size]
    acc = np.zeros(len(sizes), dtype=np.float64)
    for j in range(int(sizes.max(initial=0))):
        live = int(np.searchsorted(-sizes, -j, side="left"))  # groups with size > j
        acc[:live] += terms[starts[:live] + j]
    out[by_size] = acc
    return out


def _numpy_sums(terms: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per group `np.sum(terms[offsets[g]:offsets[g+1]])` (numpy's own summation order)."""
    sizes = np.diff(offsets)
    out = np.zeros(len(sizes), dtype=np.float64)
    for n in np.unique(sizes):
        groups = np.nonzero(sizes == n)[0]
        rows = offsets[groups][:, None] + np.arange(n)[None, :]
        out[groups] = np.sum(terms[rows], axis=1)
    return out


def micro_batch_costs(cost: CostFn, lengths, offsets, ids, ks, capacity: int) -> np.ndarray:
    """`cost([lengths[i] for i in group], k, capacity)` for every group, as an array.

    Groups are `ids[offsets[g]:offsets[g+1]]` on rings of `ks[g]`. `simple_cost` and a
    `CostModel`'s `planner_cost` are computed as arrays with the same operations in the
    same order (equal floats); any other cost function is called per group.
    """
    lengths = np.asarray(lengths)
    model = getattr(cost, "__self__", None)
    exact = len(ids) == 0 or int(lengths[ids].max()) < _EXACT
    ks = np.asarray(ks, dtype=np.int64)
    if exact and cost is simple_cost:
        s = lengths[ids].astype(np.float64)
        return _sequential_sums(s + s * s / (2.0 * capacity), offsets) / ks
    if (
        exact
        and isinstance(model, CostModel)
        and getattr(cost, "__func__", None) is CostModel.planner_cost
        and all(  # a subclass that prices differently is called per group
            getattr(type(model), name) is getattr(CostModel, name)
            for name in ("micro_batch_time", "linear_time", "attention_time", "_exposed")
        )
        and np.all((ks == 1) | (np.diff(offsets) == 1))
    ):
        s = lengths[ids].astype(np.float64)
        attention = _numpy_sums(model.attention_time(s), offsets)
        compute = (_numpy_sums(model.linear_time(s), offsets) + attention) / ks
        tokens = _numpy_sums(s, offsets)
        if model._windowed:
            windowed = _numpy_sums(model.windowed_attention_time(s), offsets)
            exposed = model._exposed(tokens, attention, ks, windowed)
        else:
            exposed = model._exposed(tokens, attention, ks)
        return compute + np.asarray(exposed, dtype=np.float64)
    seqs = [int(x) for x in lengths.tolist()] if lengths.dtype.kind in "iu" else lengths
    return np.array(
        [
            cost([seqs[i] for i in ids[offsets[g] : offsets[g + 1]]], int(ks[g]), capacity)
            for g in range(len(ks))
        ],
        dtype=np.float64,
    )


def _place(pool_size: int, ring_k: list, ring_cost: list, pack_cost: np.ndarray) -> list[int]:
    """Ranks of every micro-batch, laid end to end.

    Rings on the `k` least-loaded ranks (sorted), then packs each on the least-loaded
    one; loads in a heap of (load, rank).
    """
    pop, push, replace = heapq.heappop, heapq.heappush, heapq.heapreplace
    loads = [(0.0, r) for r in range(pool_size)]
    ranks: list[int] = []
    extend = ranks.extend
    for k, c in zip(ring_k, ring_cost):
        members = [pop(loads) for _ in range(k)]
        for load, r in members:
            push(loads, (load + c, r))
        extend(sorted([r for _, r in members]))
    append = ranks.append
    for c in pack_cost.tolist():
        load, rank = loads[0]
        replace(loads, (load + c, rank))
        append(rank)
    return ranks


def plan_greedy(
    seqlens: Sequence[int],
    *,
    pool_size: int,
    capacity: int,
    cost: CostFn = simple_cost,
    ring_sizes: Sequence[int] | None = None,
    offload_ratios: Sequence[float] | None = None,
    num_layers: int = 0,
    policy: str = "greedy",
) -> StepPlan:
    """HDP placement: rings of `ceil(s / capacity)` ranks for long sequences, packs for short.

    Rings go first, longest first, each on the `k` least-loaded ranks (ties: lower rank);
    packs (best-fit decreasing) follow, heaviest first, each on the least-loaded rank.
    `ring_sizes` overrides the rank count of every sequence (1 = packed), e.g. with the
    offload rule's counts and `offload_ratios`; `num_layers` then goes into the plan for its
    memory check. `policy` names the result.
    """
    lengths = validate_inputs(seqlens, pool_size, capacity)
    pool_size, capacity = int(pool_size), int(capacity)
    if ring_sizes is None:
        if int(lengths.max()) < _EXACT:  # float division as math.ceil(s / capacity) does it
            ring_sizes = np.ceil(lengths / float(capacity)).astype(np.int64)
        else:
            ring_sizes = np.array([math.ceil(int(s) / capacity) for s in lengths], np.int64)
    ring_sizes = np.asarray(ring_sizes, dtype=np.int64)
    ids = np.arange(len(lengths), dtype=np.int64)
    long_ids = ids[ring_sizes > 1]
    long_ids = long_ids[np.lexsort((long_ids, -lengths[long_ids]))]
    ring_k = ring_sizes[long_ids]
    ring_cost = micro_batch_costs(
        cost, lengths, np.arange(len(long_ids) + 1), long_ids, ring_k, capacity
    )
    packs = best_fit_decreasing(lengths, ids[ring_sizes <= 1], capacity)
    pack_offsets = np.zeros(len(packs) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in packs], out=pack_offsets[1:])
    pack_ids = np.fromiter((i for p in packs for i in p), np.int64, count=int(pack_offsets[-1]))
    pack_cost = micro_batch_costs(
        cost, lengths, pack_offsets, pack_ids, np.ones(len(packs), np.int64), capacity
    )
    by_cost = np.lexsort((np.arange(len(packs)), -pack_cost))

    ring_ranks = _place(pool_size, ring_k.tolist(), ring_cost.tolist(), pack_cost[by_cost])

    counts = np.concatenate([ring_k, np.ones(len(packs), dtype=np.int64)])
    ring_offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=ring_offsets[1:])
    sizes = np.diff(pack_offsets)[by_cost]
    seq_offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(np.concatenate([np.ones(len(long_ids), np.int64), sizes]), out=seq_offsets[1:])
    pack_rows = [pack_ids[pack_offsets[p] : pack_offsets[p + 1]] for p in by_cost.tolist()]
    ratio = np.zeros(len(counts), dtype=np.float64)
    if offload_ratios is not None:
        ratio[: len(long_ids)] = np.asarray(offload_ratios, dtype=np.float64)[long_ids]
    return StepPlan(
        pool_size=pool_size,
        capacity=capacity,
        seqlens=seqlens,
        policy=policy,
        order=np.arange(len(counts), dtype=np.int64),
        ring_offsets=ring_offsets,
        ring_ranks=np.asarray(ring_ranks, dtype=np.int64),
        seq_offsets=seq_offsets,
        seq_ids=np.concatenate([long_ids, *pack_rows]).astype(np.int64),
        offload_ratio=ratio,
        predicted_cost=np.concatenate([ring_cost, pack_cost[by_cost]]),
        predicted_start=np.zeros(len(counts), dtype=np.float64),
        num_layers=num_layers,
    )
