"""Placement policies: turn the lengths of a global batch into a `StepPlan` (pure Python).

Two policies live here:
- `"greedy"` (HDP): a sequence of at most `capacity` tokens goes whole to one rank, packed
  best-fit with other short ones; a longer sequence gets a ring of `ceil(s / capacity)`
  ranks (any integer, any ranks). Rings are placed first, longest first, on the least
  loaded ranks; packs follow, heaviest first, each on the least loaded rank.
- `"static"` (the baseline mesh): `pool_size = dp * cp`; sequences are packed best-fit up
  to the context `cp * capacity`, and every pack is sharded over one fixed, contiguous CP
  group; packs go round robin over the DP groups, as Megatron's static mesh does.

- `"balanced"` (HDP): ByteScale's balance scheduler (`balance.py`): the same rings and
  packs, placed by predicted cost so that all ranks reach the gradient sync together.

With pipeline parallelism (`plan_step(..., pipeline_stages=d)`, `d > 1`) every pool rank is
a pipeline and plans must be lock-step (`plan.lockstep_problems`): `"balanced"` runs
PP-Balance (`pp_balance.py`), `"static"` is lock-step as it is (all members of a CP group
run the same packs; packs too small to give every member a token are merged or refilled),
`"greedy"` is refused (its rings sit at different positions of their members' lists, which
deadlocks 1F1B pipelines, see `pipeline_timeline`), and so is offloading (its memory rule
counts one micro-batch per rank, not the 1F1B warm-up's micro-batches in flight).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

import numpy as np

from megatron_hdp.scheduler.balance import (
    best_fit_decreasing,
    placement_arrays,
    plan_from_placements,
    ring_sequences,
)
from megatron_hdp.scheduler.offload_rule import planned_offload
from megatron_hdp.scheduler.plan import MicroBatch, StepPlan, plan_from_rank_lists, validate_inputs
from megatron_hdp.scheduler.ring_sizing import (
    RingCosts,
    offload_ratios_for,
    plan_ring_sizes,
    step_lower_bound,
)

POLICIES = ("greedy", "balanced", "static")

#: Cost of one micro-batch for one ring member: f(lengths, cp_size, capacity) -> float.
CostFn = Callable[[Sequence[int], int, int], float]


def simple_cost(lengths: Sequence[int], cp_size: int, capacity: int) -> float:
    """Per-member cost: linear work plus causal attention, in units of one token's linear work.

    The attention term `s^2 / (2 * capacity)` makes a full-capacity sequence cost 1.5x its
    tokens. A stand-in until the calibrated cost model arrives; only relative values matter.
    """
    return sum(s + s * s / (2.0 * capacity) for s in lengths) / cp_size


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
    validate_inputs(seqlens, pool_size, capacity)
    if ring_sizes is None:
        ring_sizes = [math.ceil(s / capacity) for s in seqlens]
    loads = [(0.0, r) for r in range(pool_size)]  # heap of (load, rank)
    micro_batches: list[MicroBatch] = []
    long_ids = sorted(
        (i for i in range(len(seqlens)) if ring_sizes[i] > 1), key=lambda i: (-seqlens[i], i)
    )
    for i in long_ids:
        k = int(ring_sizes[i])
        members = [heapq.heappop(loads) for _ in range(k)]
        c = cost([seqlens[i]], k, capacity)
        for load, r in members:
            heapq.heappush(loads, (load + c, r))
        micro_batches.append(
            MicroBatch(
                order=len(micro_batches),
                ring=tuple(sorted(r for _, r in members)),
                seq_indices=(i,),
                predicted_cost=c,
                offload_ratio=0.0 if offload_ratios is None else float(offload_ratios[i]),
            )
        )
    short = [i for i in range(len(seqlens)) if ring_sizes[i] <= 1]
    packs = best_fit_decreasing(seqlens, short, capacity)
    costed = [(cost([seqlens[i] for i in p], 1, capacity), n, p) for n, p in enumerate(packs)]
    for c, _, pack in sorted(costed, key=lambda x: (-x[0], x[1])):
        load, rank = heapq.heappop(loads)
        heapq.heappush(loads, (load + c, rank))
        micro_batches.append(
            MicroBatch(
                order=len(micro_batches), ring=(rank,), seq_indices=tuple(pack), predicted_cost=c
            )
        )
    return plan_from_rank_lists(
        seqlens, pool_size, capacity, policy, micro_batches, num_layers=num_layers
    )


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


def plan_balanced(
    seqlens: Sequence[int],
    *,
    pool_size: int,
    capacity: int,
    cost_model=None,
    delta: float = 0.0,
    core=None,
    offload: bool = False,
    size_rings: bool = True,
) -> StepPlan:
    """HDP with the balance scheduler; costs from `cost_model` (a `cost.CostModel`).

    Without a cost model the costs are `simple_cost`'s and every sequence keeps its
    minimal ring. With one (and `size_rings`), ring sizes are a decision
    (`ring_sizing.plan_ring_sizes`): a sequence gets at least its minimal ring and more
    where that shortens the predicted step. `core` is the placement core with
    `balance.balance_core`'s signature (the C++ core by default). With `offload`, the
    minimal rings are the offload rule's (needs a cost model) and each ring offloads the
    least share that fits its placed width; the plan then records the model's layer count
    for its memory check.
    """
    lengths = validate_inputs(seqlens, pool_size, capacity)
    if offload:
        if cost_model is None:
            raise ValueError("offloading needs a cost model (bandwidths and activation sizes)")
        ring_sizes, _ = planned_offload(
            lengths, pool_size=pool_size, capacity=capacity, cost_model=cost_model
        )
        ring_sizes, local, ring = cost_model.cost_arrays(lengths, capacity, ring_sizes=ring_sizes)
    elif cost_model is not None:
        ring_sizes, local, ring = cost_model.cost_arrays(lengths, capacity)
    else:
        ring_sizes = [max(1, math.ceil(s / capacity)) for s in lengths]
        local = [simple_cost([s], 1, capacity) for s in lengths]
        ring = [
            simple_cost([s], k, capacity) if k > 1 else 0.0
            for s, k in zip(lengths, ring_sizes, strict=True)
        ]
    if core is None:
        from megatron_hdp.scheduler.planner import default_core

        core = default_core()
    if cost_model is not None and size_rings:
        costs = RingCosts(
            lengths,
            cost_model,
            pool_size,
            ring_sizes,
            np.where(ring_sizes > 1, ring, local),
            compute=local,
        )
        bound = step_lower_bound(costs)
        pack_tokens = pack_limit(cost_model, capacity, bound.value)
        runner = _CoreRunner(core, lengths, local, costs, capacity, pack_tokens, delta)
        small = pack_tokens < capacity or len(lengths) < 2 * pool_size
        placements = plan_ring_sizes(
            costs, runner, bound=bound, try_singles=small, balance_attention=not offload
        ).placements
    else:
        kwargs = dict(pool_size=pool_size, capacity=capacity, delta=delta)
        placements = _place(core, lengths, ring_sizes, local, ring, **kwargs)
    ratios = None
    if offload:
        seqs, widths = ring_sequences(placements)
        placed = np.ones(len(lengths), dtype=np.int64)
        placed[seqs] = widths
        ratios = offload_ratios_for(lengths, placed, capacity, cost_model.model.num_layers)
    return plan_from_placements(
        placements,
        lengths,
        pool_size=pool_size,
        capacity=capacity,
        policy="balanced",
        offload_ratios=ratios,
        num_layers=cost_model.model.num_layers if offload else 0,
    )


#: Packs cost at most this share of the step's lower bound (where the capacity allows less).
PACK_SHARE = 0.25


def pack_limit(cost_model, capacity: int, bound: float) -> int:
    """Tokens per pack: the capacity, or fewer where a full pack would take long.

    Fewer where a full pack costs more than `PACK_SHARE` of the step's lower bound.
    Small batches balance better with finer packs; large ones keep full packs.
    """
    full = float(cost_model.micro_batch_time([capacity], 1))
    if full <= PACK_SHARE * bound:
        return int(capacity)
    return max(1, int(capacity * PACK_SHARE * bound / full))


class _CoreRunner:
    """Runs the balance core for `plan_ring_sizes`.

    The C++ core runs in its array form (no Python object per placement); any other core
    (the reference) runs as given and its placements are flattened the same way.
    """

    def __init__(
        self, core, lengths, local, costs: RingCosts, capacity: int, pack_tokens: int, delta
    ) -> None:
        self.lengths, self.local, self.costs = lengths, local, costs
        self.capacity, self.delta = int(capacity), delta
        self.core = core
        # The core packs by these lengths into `capacity`: scaled so that a pack holds at
        # most `pack_tokens` real tokens (a longer sequence is a pack of its own).
        self.pack_lengths = lengths
        if pack_tokens < capacity:
            scaled = -(-lengths * self.capacity // max(1, int(pack_tokens)))
            self.pack_lengths = np.minimum(self.capacity, scaled).astype(np.int64)
        # The core's inputs at the minimal widths; a call patches where its widths differ.
        self._ring_at_min = np.where(costs.k_min > 1, costs.min_time, 0.0)
        self._core_lengths = {}

    def _lengths_at_min(self, singles: bool) -> np.ndarray:
        """The core's lengths at the minimal widths: rings their own, packed ones scaled."""
        if singles not in self._core_lengths:
            packed = self.capacity if singles else self.pack_lengths
            self._core_lengths[singles] = np.where(self.costs.k_min > 1, self.lengths, packed)
        return self._core_lengths[singles]

    def __call__(self, widths, ranges, singles):
        """Place with these widths: `(makespan, last item, flat placements)`.

        Packs hold at most `pack_tokens` tokens; with `singles` every packed sequence is a
        micro-batch of its own (its packing length is the whole capacity).
        """
        ring, lengths = self._ring_at_min, self._lengths_at_min(singles)
        wider = np.nonzero(widths != self.costs.k_min)[0]
        if len(wider):
            ring, lengths = ring.copy(), lengths.copy()
            packed = self.capacity if singles else self.pack_lengths[wider]
            k = widths[wider]
            ring[wider] = np.where(k > 1, self.costs.time(wider, k), 0.0)
            lengths[wider] = np.where(k > 1, self.lengths[wider], packed)
        placed = _place(
            self.core,
            lengths,
            widths,
            self.local,
            ring,
            pool_size=self.costs.pool_size,
            capacity=self.capacity,
            delta=self.delta,
            widths=ranges,
        )
        starts, costs, ring_off, _, seq_off, seqs = placed
        ends = starts + costs
        last = int(np.argmax(ends))
        item = (
            seqs[seq_off[last] : seq_off[last + 1]],
            int(ring_off[last + 1] - ring_off[last]),
        )
        return float(ends[last]), item, placed


def _place(core, *args, **kwargs) -> tuple:
    """Run a balance core; its placements as flat arrays (`balance.placement_arrays`).

    The C++ core runs in its array form (no Python object per placement); any other core
    (the reference) runs as given and its placements are flattened.
    """
    try:
        from megatron_hdp import _planner
    except ImportError:  # the reference core runs without the extension
        _planner = None
    if _planner is not None and core is _planner.balance_core:
        return _planner.balance_core_arrays(*args, **kwargs)
    return placement_arrays(core(*args, **kwargs))


def plan_step(
    seqlens: Sequence[int],
    *,
    pool_size: int,
    capacity: int,
    policy: str = "greedy",
    cp_size: int | None = None,
    cost_model=None,
    offload: bool = False,
    pipeline_stages: int = 1,
) -> StepPlan:
    """Plan one step with the named policy (`"greedy"`, `"balanced"` or the `"static"` mesh).

    Deterministic: equal inputs give equal plans on every rank. Raises ValueError for bad
    input before anything else happens. The policies' invariants are held by property
    tests, not re-checked here (`StepPlan.validate()` does that, at O(plan) Python cost).
    `cp_size` applies to the static policy only; `cost_model` (a `cost.CostModel`) prices
    micro-batches for the balanced policy and fills every policy's `predicted_cost`;
    `offload` applies the selective-offloading capacity rule (balanced policy only).

    `pipeline_stages` > 1: every pool rank is a pipeline of that many stages (Megatron's
    1F1B); the plan is lock-step (`plan.lockstep_problems`). `"balanced"` is PP-Balance
    (`pp_balance.plan_pp_balanced`), `"static"` the static mesh with every CP member given
    a token; both set `predicted_start` to the forward start on the first stage in the 1F1B
    timeline. `"greedy"` and `offload` are refused with the reason.
    """
    if isinstance(pipeline_stages, bool) or not isinstance(pipeline_stages, (int, np.integer)):
        raise ValueError(f"pipeline_stages must be an integer >= 1, got {pipeline_stages!r}")
    if pipeline_stages < 1:
        raise ValueError(f"pipeline_stages must be an integer >= 1, got {pipeline_stages!r}")
    if offload and policy != "balanced":
        raise ValueError(f"offloading is planned by the balanced policy, not {policy!r}")
    if policy != "static" and cp_size is not None:
        raise ValueError(f"cp_size {cp_size} applies to the static policy only, not {policy!r}")
    if policy not in POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}; choose one of {POLICIES}")
    cost = cost_model.planner_cost if cost_model is not None else simple_cost
    if pipeline_stages > 1:
        return _plan_pipelines(
            seqlens,
            pool_size=pool_size,
            capacity=capacity,
            policy=policy,
            cp_size=cp_size,
            cost_model=cost_model,
            offload=offload,
            stages=int(pipeline_stages),
        )
    if policy == "greedy":
        plan = plan_greedy(seqlens, pool_size=pool_size, capacity=capacity, cost=cost)
    elif policy == "balanced":
        plan = plan_balanced(
            seqlens, pool_size=pool_size, capacity=capacity, cost_model=cost_model, offload=offload
        )
    else:
        plan = plan_static(
            seqlens, pool_size=pool_size, capacity=capacity, cp_size=cp_size, cost=cost
        )
    return plan


def _plan_pipelines(
    seqlens, *, pool_size, capacity, policy, cp_size, cost_model, offload, stages
) -> StepPlan:
    """`plan_step` for pool ranks that are pipelines of `stages` stages (lock-step plans)."""
    from megatron_hdp.scheduler.pp_balance import plan_pp_balanced, with_pipeline_predictions

    if offload:
        raise ValueError(
            f"offloading is not planned with pipeline parallelism (pipeline_stages={stages}): "
            "the offload rule budgets one micro-batch's activations per rank, but a 1F1B "
            "stage holds up to pipeline_stages micro-batches in flight"
        )
    if policy == "greedy":
        raise ValueError(
            f"the 'greedy' placement policy is not lock-step and cannot plan pipelines "
            f"(pipeline_stages={stages}): its rings sit at different positions of their "
            "members' lists, which can deadlock 1F1B; use 'balanced' (PP-Balance) or 'static'"
        )
    if policy == "balanced":
        return plan_pp_balanced(
            seqlens,
            pool_size=pool_size,
            capacity=capacity,
            pipeline_stages=stages,
            cost_model=cost_model,
        )
    cost = cost_model.planner_cost if cost_model is not None else simple_cost
    plan = plan_static(
        seqlens,
        pool_size=pool_size,
        capacity=capacity,
        cp_size=cp_size,
        cost=cost,
        token_per_member=True,
    )
    return with_pipeline_predictions(plan, stages, cost_model=cost_model)
