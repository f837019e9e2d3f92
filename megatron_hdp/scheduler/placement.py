"""Placement policies: turn the lengths of a global batch into a `StepPlan` (pure Python).

The policies (`"balanced"` is `plan_step`'s default):
- `"greedy"` (HDP, the ablation baseline, `greedy.py`): a sequence of at most `capacity`
  tokens goes whole to one rank, packed best-fit with other short ones; a longer sequence
  gets a ring of `ceil(s / capacity)` ranks (any integer, any ranks). Rings are placed
  first, longest first, on the least loaded ranks; packs follow, heaviest first, each on
  the least loaded rank.
- `"static"` (the baseline mesh, `static_mesh.py`): `pool_size = dp * cp`; sequences are
  packed best-fit up to the context `cp * capacity`, and every pack is sharded over one
  fixed, contiguous CP group; packs go round robin over the DP groups.
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

from collections.abc import Sequence

import numpy as np

from megatron_hdp.scheduler.balance import (
    placement_arrays,
    plan_from_placements,
    ring_sequences,
)
from megatron_hdp.scheduler.greedy import plan_greedy
from megatron_hdp.scheduler.offload_choice import OffloadRingCosts, decide
from megatron_hdp.scheduler.offload_rule import offload_rule
from megatron_hdp.scheduler.plan import StepPlan, validate_inputs
from megatron_hdp.scheduler.pp_balance import plan_pp_balanced, with_pipeline_predictions
from megatron_hdp.scheduler.ring_sizing import (
    RingCosts,
    offload_ratios_for,
    plan_ring_sizes,
    step_lower_bound,
)
from megatron_hdp.scheduler.static_mesh import (  # noqa: F401  (re-exported)
    CostFn,
    plan_static,
    simple_cost,
    simple_cost_arrays,
    static_cp_size,
)

POLICIES = ("greedy", "balanced", "static")


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
    `balance.balance_core`'s signature (the C++ core by default). With `offload` (needs a
    cost model), offloading is a choice (`offload_choice`): the plan without offloading
    and the one whose rings may shrink to the offload rule's counts, each ring offloading
    the least share that fits its placed width with its copies priced; the faster is
    returned, with its `offload_decision`. An offloading plan records the model's layer
    count for its memory check.
    """
    lengths = validate_inputs(seqlens, pool_size, capacity)
    if offload:
        if cost_model is None:
            raise ValueError("offloading needs a cost model (bandwidths and activation sizes)")
        return _plan_offload_choice(
            lengths, pool_size, capacity, cost_model, delta=delta, core=core, size_rings=size_rings
        )
    if cost_model is not None:
        ring_sizes, local, ring = cost_model.cost_arrays(lengths, capacity)
    else:
        ring_sizes, local, ring = simple_cost_arrays(lengths, capacity)
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
        placements = plan_ring_sizes(costs, runner, bound=bound, try_singles=small).placements
    else:
        kwargs = dict(pool_size=pool_size, capacity=capacity, delta=delta)
        placements = _place(core, lengths, ring_sizes, local, ring, **kwargs)
    return plan_from_placements(
        placements, lengths, pool_size=pool_size, capacity=capacity, policy="balanced"
    )


def _plan_offload_choice(
    lengths, pool_size: int, capacity: int, cost_model, *, delta, core, size_rings: bool
) -> StepPlan:
    """`plan_balanced(..., offload=True)`: the faster of widening and offloading.

    The plan without offloading, and the one whose rings may shrink to Eq. 3's counts and
    offload (`offload_choice.OffloadRingCosts`: copies priced); the faster is returned with
    its `offload_decision` (`offload_choice.decide`).
    """
    widen = plan_balanced(
        lengths,
        pool_size=pool_size,
        capacity=capacity,
        cost_model=cost_model,
        delta=delta,
        core=core,
        size_rings=size_rings,
    )
    k_min, _ = offload_rule(lengths, capacity, cost_model)
    base = np.maximum(1, -(-lengths // capacity))
    offload = None
    if np.any(k_min < base):
        if core is None:
            from megatron_hdp.scheduler.planner import default_core

            core = default_core()
        _, local, _ = cost_model.cost_arrays(lengths, capacity, ring_sizes=k_min)
        costs = OffloadRingCosts(lengths, cost_model, pool_size, k_min, capacity, compute=local)
        if size_rings:
            # The bound with free copies: copies only add time, so it bounds this plan too.
            free = RingCosts(lengths, cost_model, pool_size, k_min, compute=local)
            bound = step_lower_bound(free)
            pack_tokens = pack_limit(cost_model, capacity, bound.value)
            runner = _CoreRunner(core, lengths, local, costs, capacity, pack_tokens, delta)
            small = pack_tokens < capacity or len(lengths) < 2 * pool_size
            placements = plan_ring_sizes(
                costs, runner, bound=bound, try_singles=small, balance_attention=False
            ).placements
        else:
            ring = np.where(k_min > 1, costs.min_time, 0.0)
            kwargs = dict(pool_size=pool_size, capacity=capacity, delta=delta)
            placements = _place(core, lengths, k_min, local, ring, **kwargs)
        seqs, widths = ring_sequences(placements)
        placed = np.ones(len(lengths), dtype=np.int64)
        placed[seqs] = widths
        ratios = offload_ratios_for(lengths, placed, capacity, cost_model.model.num_layers)
        offload = plan_from_placements(
            placements,
            lengths,
            pool_size=pool_size,
            capacity=capacity,
            policy="balanced",
            offload_ratios=ratios,
            num_layers=cost_model.model.num_layers,
        )
    plan, decision = decide(widen, offload, cost_model)
    plan.offload_decision = decision
    return plan


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
    policy: str = "balanced",
    cp_size: int | None = None,
    cost_model=None,
    offload: bool = False,
    pipeline_stages: int = 1,
    virtual_stages: int = 1,
) -> StepPlan:
    """Plan one step with the named policy (`"balanced"`, `"greedy"` or the `"static"` mesh).

    The default is `"balanced"`, the policy `pretrain_hdp.py` runs: the balance scheduler
    on the C++ core (`planner.default_core`). Without a `cost_model` it prices a
    micro-batch by `simple_cost` (tokens plus `s^2 / (2 capacity)` per sequence, only
    relative values matter) and gives every long sequence its minimal ring of
    `ceil(s / capacity)` ranks; with one (`cost.CostModel(shape, device)`, as the trainer
    builds it) costs are seconds and ring sizes are chosen to shorten the step.
    `"greedy"` is the ablation baseline (`greedy.plan_greedy`).

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
    timeline. `"greedy"` and `offload` are refused with the reason. `virtual_stages` > 1:
    each stage holds that many model chunks (interleaved 1F1B); PP-Balance prices the
    interleaved schedule's fill (`pp_balance`, decision 2).
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
            virtual_stages=virtual_stages,
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
    seqlens, *, pool_size, capacity, policy, cp_size, cost_model, offload, stages, virtual_stages=1
) -> StepPlan:
    """`plan_step` for pool ranks that are pipelines of `stages` stages (lock-step plans)."""
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
            virtual_stages=virtual_stages,
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
