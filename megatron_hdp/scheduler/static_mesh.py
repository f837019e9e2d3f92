"""The static DP x CP mesh as a placement policy, and the planner's default cost (pure Python).

`"static"` (the baseline): `pool_size = dp * cp`; sequences are packed best-fit up to the
context `cp * capacity`, and every pack is sharded over one fixed, contiguous CP group;
packs go round robin over the DP groups, as Megatron's static mesh does. PP-Balance falls
back to it (`pp_balance.py`), and `placement.plan_step` offers it as a policy; both import it
from here, so neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from megatron_hdp.scheduler.balance import best_fit_decreasing
from megatron_hdp.scheduler.plan import MicroBatch, StepPlan, plan_from_rank_lists, validate_inputs

#: Cost of one micro-batch for one ring member: f(lengths, cp_size, capacity) -> float.
CostFn = Callable[[Sequence[int], int, int], float]


def simple_cost(lengths: Sequence[int], cp_size: int, capacity: int) -> float:
    """Per-member cost: linear work plus causal attention, in units of one token's linear work.

    The attention term `s^2 / (2 * capacity)` makes a full-capacity sequence cost 1.5x its
    tokens. A stand-in until the calibrated cost model arrives; only relative values matter.
    """
    return sum(s + s * s / (2.0 * capacity) for s in lengths) / cp_size


def simple_cost_arrays(lengths, capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`simple_cost` as the balance core's inputs: minimal ring sizes, local and ring costs.

    Per sequence `ceil(s / capacity)` (at least 1), `simple_cost([s], 1, capacity)` and,
    on a ring, `simple_cost([s], k, capacity)` (0 where packed); the same floats as the
    per-sequence calls, computed as arrays.
    """
    s = np.asarray(lengths, dtype=np.float64)
    ring_sizes = np.maximum(1, np.ceil(s / capacity)).astype(np.int64)
    local = s + s * s / (2.0 * capacity)
    ring = np.where(ring_sizes > 1, local / ring_sizes, 0.0)
    return ring_sizes, local, ring


def static_cp_size(seqlens: Sequence[int], pool_size: int, capacity: int) -> int:
    """Smallest CP size that divides the pool and whose context holds the longest sequence."""
    longest = max(seqlens)
    for cp in range(1, pool_size + 1):
        if pool_size % cp == 0 and cp * capacity >= longest:
            return cp
    raise ValueError(
        f"no CP size dividing the pool of {pool_size} ranks gives a context of at least "
        f"{longest} tokens with capacity {capacity}"
    )


def plan_static(
    seqlens: Sequence[int],
    *,
    pool_size: int,
    capacity: int,
    cp_size: int | None = None,
    cost: CostFn = simple_cost,
    token_per_member: bool = False,
) -> StepPlan:
    """The static DP x CP mesh: pack to the context `cp * capacity`, shard every pack over CP.

    With `token_per_member` (pipelines: a member cannot skip a position) every pack holds at
    least `cp` tokens, so every CP member gets one (`_fill_small_packs`); ValueError if the
    batch cannot give it.
    """
    validate_inputs(seqlens, pool_size, capacity)
    if cp_size is None:
        cp_size = static_cp_size(seqlens, pool_size, capacity)
    if cp_size < 1 or pool_size % cp_size != 0:
        raise ValueError(f"cp_size {cp_size} does not divide the pool of {pool_size} ranks")
    context = cp_size * capacity
    longest = max(range(len(seqlens)), key=lambda i: seqlens[i])
    if seqlens[longest] > context:
        raise ValueError(
            f"sequence {longest} has {seqlens[longest]} tokens, more than the static context "
            f"cp_size {cp_size} x capacity {capacity} = {context}"
        )
    dp_size = pool_size // cp_size
    packs = best_fit_decreasing(seqlens, range(len(seqlens)), context)
    if token_per_member and cp_size > 1:
        packs = _fill_small_packs(seqlens, packs, cp_size, context)
    micro_batches = []
    for n, pack in enumerate(packs):
        group = n % dp_size
        ring = tuple(range(group * cp_size, (group + 1) * cp_size))
        c = cost([seqlens[i] for i in pack], cp_size, capacity)
        micro_batches.append(
            MicroBatch(order=n, ring=ring, seq_indices=tuple(pack), predicted_cost=c)
        )
    return plan_from_rank_lists(seqlens, pool_size, capacity, "static", micro_batches)


def _fill_small_packs(seqlens, packs, cp_size: int, context: int) -> list[list[int]]:
    """Packs with fewer than `cp_size` tokens merged into others, or topped up from others.

    Zigzag gives every member a token of a pack of at least `cp_size` tokens
    (`sharding.rank_token_counts`). A small pack goes into the pack with the most room if
    it fits there; otherwise the shortest sequences that other packs can spare (keeping
    `cp_size` tokens) move into it. Raises ValueError when neither works.
    """
    packs = [list(p) for p in packs]

    def tokens(p):
        return sum(seqlens[i] for i in p)

    while True:
        small = [n for n, p in enumerate(packs) if tokens(p) < cp_size]
        if not small:
            return packs
        n = small[0]
        load = tokens(packs[n])
        rooms = [(context - tokens(p), -m) for m, p in enumerate(packs) if m != n]
        if rooms and max(rooms)[0] >= load:
            m = -max(rooms)[1]
            packs[m] = sorted(packs[m] + packs[n])
            del packs[n]
            continue
        moved = False
        donors = sorted(
            ((seqlens[i], i, m) for m, p in enumerate(packs) if m != n for i in p),
        )
        for length, i, m in donors:
            if tokens(packs[m]) - length >= cp_size and load + length <= context:
                packs[m].remove(i)
                packs[n] = sorted(packs[n] + [i])
                moved = True
                break
        if not moved:
            raise ValueError(
                f"the static mesh cannot give every one of the {cp_size} CP members a token "
                f"of every pack on pipelines: the batch holds {sum(seqlens)} tokens"
            )
