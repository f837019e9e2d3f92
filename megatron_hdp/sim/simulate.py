"""Simulated training steps of the baselines and HDP on one global batch (pure).

Every system plans the SAME global batch with the planner code that trains
(`scheduler.placement`, `scheduler.balance`, `scheduler.offload_rule`) and is priced by
the ONE cost model (`scheduler.cost.CostModel`). A step's time comes from per-rank
timelines (`sim.timeline.timeline`): every rank runs its micro-batches in plan order, a ring
starts when all its members are free, so waiting is explicit; then the gradient sync (ring
all-reduce over the pool) runs after the last rank finishes.

Systems (the paper's ablation order first):

- `static`: the static DP x CP mesh with packing and zigzag (`plan_step(policy="static")`);
  CP is the smallest degree dividing the pool whose context `CP x C` holds the context
  length (not just the batch's longest sequence), as the paper's baseline.
- `megatron_dcp`: Megatron-style dynamic CP: power-of-two ring sizes. When Megatron-Core is
  installed and the pool has at most `megatron_max_ranks` ranks, Megatron-Core 0.16.1's
  `BalancedCPScheduler.get_groups_and_subsamples` is called directly (with a stub group
  whose `.size()` is the pool) and scored with its barrier-separated groups: each group is
  a timeline of its own, the next group starts when the slowest rank of the previous one
  is done. Otherwise (not installed or a larger pool, where it takes minutes) a documented
  re-implementation: ring sizes `2^ceil(log2(s / C))` placed by our greedy placement
  (`greedy_sized`), one timeline, no barriers (so it is optimistic against Megatron's).
- `hdp_greedy`: HDP with dynamic rings of `ceil(s / C)` ranks and the simple least-loaded
  placement (`plan_step(policy="greedy")`): the ablation's "+ dynamic communication".
- `hdp_offload`: "+ selective offloading" without balance: the offload rule's ring sizes
  and ratios (`offload_rule`), placed by the same greedy placement (`greedy_sized`). The
  planner has no such policy (offloading is planned by the balanced policy only), so this
  is the simulator's own composition of the two pure pieces.
- `hdp_offload_balance`: "+ balance": `plan_step(policy="balanced", offload=True)`. This
  is the paper's full "HDP balance".
- `hdp_balance`: balance without offloading (`plan_step(policy="balanced")`).

A micro-batch that offloads is priced with its copies' exposed time
(`CostModel.offload_copy_time`: host link bandwidth, shared with the NIC where the
profile says so), the same price the planner weighs when it chooses offloading.

Pipeline parallelism (`pipeline_stages > 1`, the PP models): every pool rank is a pipeline
and a step runs the plan's lists through Megatron's 1F1B schedule stage by stage
(`scheduler.pipeline_timeline.execute`, rings synchronised on every stage), with the cost
model pricing one stage's TP group (`clusters.py`). The systems then are:

- `static`: `plan_step(policy="static", pipeline_stages=PP)`: lock-step as it is.
- `hdp_balance`: PP-Balance (`plan_step(policy="balanced", pipeline_stages=PP)`).
- `hdp_offload_balance`: PP-Balance with the offload rule's ring sizes and ratios, the rule's
  ring-time limit being the per-stage work per pipeline (`pp_balance.plan_pp_balanced`
  takes them; the planner itself refuses offloading with PP, so this is the simulator's
  own composition, as `hdp_offload` is).
- `hdp_greedy`, `hdp_offload`, `megatron_dcp`: their DP plans, run on pipelines as they
  are ("applied blindly"): 1F1B with ring synchronisation when that completes, else (a
  ring sits at positions that deadlock 1F1B) 1F1B segments with a pipeline flush around
  every ring, which any plan survives. `pipeline_schedule` in the results says which.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from megatron_hdp.scheduler.cost import CostModel
from megatron_hdp.scheduler.offload_rule import offload_rule, planned_offload
from megatron_hdp.scheduler.pipeline_timeline import simulate_plan
from megatron_hdp.scheduler.placement import plan_greedy, plan_step
from megatron_hdp.scheduler.plan import MicroBatch, StepPlan, plan_from_rank_lists
from megatron_hdp.scheduler.pp_balance import (
    forward_shares,
    micro_batch_costs,
    micro_batch_sequences,
    plan_pp_balanced,
)
from megatron_hdp.sim.timeline import timeline

SYSTEMS = (
    "static",
    "megatron_dcp",
    "hdp_greedy",
    "hdp_offload",
    "hdp_offload_balance",
    "hdp_balance",
)
#: The paper's ablation (Fig. 20) in order, as our systems.
ABLATION = ("static", "hdp_greedy", "hdp_offload", "hdp_offload_balance")
LABELS = {
    "static": "static DPxCP mesh",
    "megatron_dcp": "Megatron dynamic CP (2^k)",
    "hdp_greedy": "HDP greedy",
    "hdp_offload": "HDP + offload",
    "hdp_offload_balance": "HDP + offload + balance",
    "hdp_balance": "HDP + balance",
}
MEGATRON_MAX_RANKS = 1024


@dataclass
class Segment:
    """A plan run as one unit, with per-micro-batch durations (full and compute-only)."""

    plan: StepPlan
    durations: list[float]
    compute: list[float]


@dataclass
class StepResult:
    """One simulated step of one system."""

    system: str
    step_time: float
    compute_time: float
    grad_sync: float
    tokens: int
    busy: np.ndarray
    finish: np.ndarray
    plan_seconds: float
    implementation: str = "planner"
    pipeline_stages: int = 1
    schedules: list[str] = field(default_factory=list)
    bubble_share: float = 0.0
    segments: list[Segment] = field(default_factory=list, repr=False)
    starts: list[list[float]] = field(default_factory=list, repr=False)
    offsets: list[float] = field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self) -> float:
        """Global-batch tokens over the step time."""
        return self.tokens / self.step_time

    @property
    def wait(self) -> np.ndarray:
        """Per-rank idle time before the gradient sync."""
        return (self.step_time - self.grad_sync) - self.busy

    def summary(self) -> dict:
        """JSON-ready numbers (per-rank arrays summarised)."""
        busy, wait = self.busy, self.wait
        return {
            "system": self.system,
            "implementation": self.implementation,
            "step_time": self.step_time,
            "tokens_per_s": self.tokens_per_s,
            "compute_time": self.compute_time,
            "grad_sync": self.grad_sync,
            "busy_mean": float(busy.mean()),
            "busy_min": float(busy.min()),
            "busy_max": float(busy.max()),
            "busy_std": float(busy.std()),
            "wait_mean": float(wait.mean()),
            "wait_max": float(wait.max()),
            "micro_batches": int(sum(len(s.plan.micro_batches) for s in self.segments)),
            "barrier_groups": len(self.segments),
            "plan_seconds": self.plan_seconds,
            "pipeline_stages": self.pipeline_stages,
            "pipeline_schedule": "+".join(sorted(set(self.schedules))) or "-",
            "flushed_segments": sum(s == "flush" for s in self.schedules),
            "bubble_share": self.bubble_share,
        }


def compute_only(cost_model: CostModel, lengths: Sequence[float], k: int) -> float:
    """Per-member compute seconds of a micro-batch with free communication."""
    s = np.asarray(lengths, dtype=np.float64)
    return float(np.sum(cost_model.linear_time(s)) + np.sum(cost_model.attention_time(s))) / k


def price(plan: StepPlan, cost_model: CostModel) -> Segment:
    """Price every micro-batch of `plan` with the cost model (per ring member)."""
    durations, compute = [], []
    seqlens = plan.seqlens
    for mb in plan.micro_batches:
        lengths = [seqlens[i] for i in mb.seq_indices]
        durations.append(micro_batch_seconds(cost_model, lengths, mb.cp_size, mb.offload_ratio))
        compute.append(compute_only(cost_model, lengths, mb.cp_size))
    return Segment(plan, durations, compute)


def micro_batch_seconds(cost_model: CostModel, lengths, k: int, ratio: float) -> float:
    """Per-member seconds of a micro-batch, offloading's exposed copies included."""
    t = cost_model.micro_batch_time(lengths, k)
    if ratio > 0:
        t += float(cost_model.offload_copy_time(float(sum(lengths)), k, ratio))
    return t


def grad_sync_time(params: float, pool_size: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of fp32 gradients (4 bytes per parameter) over the pool.

    Megatron-LM accumulates and all-reduces bf16 models' gradients in fp32
    (`accumulate_allreduce_grads_in_fp32`).
    """
    n = pool_size
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n * 4.0 * params / bandwidth + 2.0 * (n - 1) * latency


def static_cp(context: int, pool_size: int, capacity: int) -> int:
    """Smallest CP dividing the pool whose context `CP x C` holds `context` tokens."""
    for cp in range(1, pool_size + 1):
        if pool_size % cp == 0 and cp * capacity >= context:
            return cp
    raise ValueError(f"no CP of a {pool_size}-rank pool holds {context} tokens at C={capacity}")


def pow2_ring(s: int, capacity: int) -> int:
    """Megatron's `gpus_needed`: `max(1, 2^ceil(log2(s / C)))`."""
    return max(1, 2 ** math.ceil(math.log2(s / capacity)))


def greedy_sized(
    seqlens: Sequence[int],
    ring_sizes: Sequence[int],
    *,
    pool_size: int,
    capacity: int,
    cost_model: CostModel,
    ratios: Sequence[float] | None = None,
    policy: str = "greedy_sized",
) -> StepPlan:
    """`placement.plan_greedy` with given ring sizes (and offload ratios).

    Rings (ring size > 1), longest sequence first, each on the `k` least-loaded ranks;
    then the other sequences packed best-fit decreasing into `capacity` and placed
    heaviest first on the least-loaded rank. Loads are the cost model's per-member times.
    """
    return plan_greedy(
        seqlens,
        pool_size=pool_size,
        capacity=capacity,
        cost=cost_model.planner_cost,
        ring_sizes=ring_sizes,
        offload_ratios=ratios,
        num_layers=cost_model.model.num_layers if ratios is not None else 0,
        policy=policy,
    )


def megatron_available() -> bool:
    """True when Megatron-Core's `BalancedCPScheduler` can be imported."""
    from megatron_hdp.megatron import dynamic_cp

    return dynamic_cp.available()


def megatron_groups(seqlens: Sequence[int], pool_size: int, capacity: int) -> list[list[list[int]]]:
    """Megatron-Core's groups: `groups[g][rank]` = sequence ids the rank runs in group g."""
    from megatron_hdp.megatron import dynamic_cp

    return dynamic_cp.scheduler_groups(seqlens, pool_size, capacity)


def plans_from_groups(
    groups: list[list[list[int]]], seqlens: Sequence[int], pool_size: int, capacity: int
) -> list[StepPlan]:
    """One `StepPlan` per barrier group; a sequence's ring is the ranks that list it.

    The global order within a group is a topological order of the ranks' lists (each
    rank's order is kept), so the timeline runs exactly what every rank would run.
    """
    plans = []
    for group in groups:
        members: dict[int, list[int]] = {}
        for r, ids in enumerate(group):
            for i in ids:
                members.setdefault(i, []).append(r)
        succ: dict[int, set[int]] = {i: set() for i in members}
        indeg = dict.fromkeys(members, 0)
        for ids in group:
            for a, b in zip(ids, ids[1:]):
                if b not in succ[a]:
                    succ[a].add(b)
                    indeg[b] += 1
        ready = [i for i in members if indeg[i] == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for j in succ[i]:
                indeg[j] -= 1
                if indeg[j] == 0:
                    heapq.heappush(ready, j)
        if len(order) != len(members):
            raise RuntimeError("Megatron's group has inconsistent per-rank orders (deadlock)")
        mbs = [
            MicroBatch(order=n, ring=tuple(members[i]), seq_indices=(i,))
            for n, i in enumerate(order)
        ]
        # StepPlan needs every sequence of seqlens placed only for validate(); the group
        # plan keeps the full seqlens so indices stay global.
        plans.append(plan_from_rank_lists(seqlens, pool_size, capacity, "megatron_dcp", mbs))
    return plans


def plan_system(
    system: str,
    seqlens: Sequence[int],
    *,
    pool_size: int,
    capacity: int,
    context: int,
    cost_model: CostModel,
    megatron: str = "auto",
    megatron_max_ranks: int = MEGATRON_MAX_RANKS,
    pipeline_stages: int = 1,
) -> tuple[list[StepPlan], str]:
    """The plans (barrier-separated groups; one for all but Megatron's) and the implementation.

    `megatron`: "auto" (Megatron-Core when installed and the pool is at most
    `megatron_max_ranks`, else the re-implementation), "core" (always Megatron-Core) or
    "reimpl" (always the re-implementation). `pipeline_stages > 1`: see the module
    docstring.
    """
    kw = {"pool_size": pool_size, "capacity": capacity}
    pp = pipeline_stages
    if pp > 1 and system in ("static", "hdp_balance", "hdp_offload_balance"):
        if system == "static":
            cp = static_cp(context, pool_size, capacity)
            plan = plan_step(
                seqlens,
                policy="static",
                cp_size=cp,
                cost_model=cost_model,
                pipeline_stages=pp,
                **kw,
            )
            return [plan], f"planner (cp={cp})"
        if system == "hdp_balance":
            plan = plan_step(
                seqlens, policy="balanced", cost_model=cost_model, pipeline_stages=pp, **kw
            )
            return [plan], "planner (PP-Balance)"
        sizes, ratios = pipeline_offload(seqlens, pool_size, capacity, cost_model, pp)
        plan = plan_pp_balanced(
            seqlens,
            pipeline_stages=pp,
            cost_model=cost_model,
            ring_sizes=sizes,
            offload_ratios=ratios,
            num_layers=cost_model.model.num_layers,
            **kw,
        )
        return [plan], "PP-Balance + the offload rule's ring sizes"
    if system == "static":
        cp = static_cp(context, pool_size, capacity)
        return [plan_step(seqlens, policy="static", cp_size=cp, cost_model=cost_model, **kw)], (
            f"planner (cp={cp})"
        )
    if system == "hdp_greedy":
        return [plan_step(seqlens, policy="greedy", cost_model=cost_model, **kw)], "planner"
    if system == "hdp_balance":
        return [plan_step(seqlens, policy="balanced", cost_model=cost_model, **kw)], "planner"
    if system == "hdp_offload_balance":
        plan = plan_step(seqlens, policy="balanced", offload=True, cost_model=cost_model, **kw)
        return [plan], "planner"
    if system == "hdp_offload":
        sizes, ratios = planned_offload(
            seqlens, pool_size=kw["pool_size"], capacity=capacity, cost_model=cost_model
        )
        plan = greedy_sized(seqlens, sizes, ratios=ratios, cost_model=cost_model, **kw)
        return [plan], "greedy placement + the planner's offload ring sizes"
    if system == "megatron_dcp":
        use_core = megatron == "core" or (
            megatron == "auto" and pool_size <= megatron_max_ranks and megatron_available()
        )
        if use_core:
            groups = megatron_groups(seqlens, pool_size, capacity)
            return plans_from_groups(groups, seqlens, pool_size, capacity), "megatron-core 0.16.1"
        sizes = [pow2_ring(s, capacity) for s in seqlens]
        why = "not installed" if not megatron_available() else f"pool > {megatron_max_ranks}"
        plan = greedy_sized(seqlens, sizes, cost_model=cost_model, **kw)
        return [plan], f"re-implementation (Megatron-Core skipped: {why})"
    raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")


def pipeline_offload(seqlens, pool_size: int, capacity: int, cost_model: CostModel, stages: int):
    """The offload rule for pipelines: ring time limited to the per-stage work per pipeline.

    `offload_rule.planned_offload`'s limit (total work / pool) divided by the stages: a ring
    runs its whole time `c` from its first stage's forward to its backward there, and a
    pipeline's step is about its per-stage work, so no ring made smaller by offloading
    outlasts that.
    """
    s = np.asarray(seqlens, dtype=np.float64)
    base = np.maximum(1, np.ceil(s / capacity))
    _, local, ring = cost_model.cost_arrays(seqlens, capacity)
    work = float(np.where(base > 1, ring * base, local).sum()) / pool_size / stages
    return offload_rule(seqlens, capacity, cost_model, max_ring_time=work)


def compute_costs(plan: StepPlan, cost_model: CostModel) -> np.ndarray:
    """Per micro-batch per-member compute seconds with free communication (vectorised)."""
    ids, owner, _ = micro_batch_sequences(plan)
    s = np.asarray(plan.seqlens, dtype=np.float64)[ids]
    n = len(plan.micro_batches)
    work = np.bincount(owner, cost_model.linear_time(s) + cost_model.attention_time(s), minlength=n)
    k = np.fromiter((mb.cp_size for mb in plan.micro_batches), dtype=np.float64, count=n)
    return work / k


def run_on_pipelines(plan: StepPlan, stages: int, costs, shares):
    """1F1B with ring synchronisation; a pipeline flush around every ring if that deadlocks."""
    ex = simulate_plan(plan, stages, costs=costs, forward_share=shares)
    if ex.completed:
        return ex, "1f1b"
    return simulate_plan(plan, stages, costs=costs, forward_share=shares, schedule="flush"), "flush"


def score(
    system: str,
    plans: list[StepPlan],
    cost_model: CostModel,
    *,
    params: float,
    implementation: str = "planner",
    plan_seconds: float = 0.0,
    pipeline_stages: int = 1,
) -> StepResult:
    """Run the plans' timelines back to back (barriers between them) and add the sync.

    With `pipeline_stages > 1` every plan runs through the 1F1B pipeline simulator; a
    rank's `busy` is then its stages' mean busy time, and the gradient sync moves each
    stage's share of the parameters.
    """
    stages = pipeline_stages
    pool = plans[0].pool_size
    busy = np.zeros(pool)
    finish = np.zeros(pool)
    offset = compute_offset = idle = 0.0
    segments, starts, offsets, schedules = [], [], [], []
    for plan in plans:
        if stages > 1:
            costs = micro_batch_costs(plan, cost_model)
            compute = compute_costs(plan, cost_model)
            shares = forward_shares(plan, cost_model)
            ex, schedule = run_on_pipelines(plan, stages, costs, shares)
            ex_c, _ = run_on_pipelines(plan, stages, compute, shares)
            busy += ex.busy.mean(axis=1)
            finish = offset + ex.finish
            idle += float(ex.idle.sum())
            segments.append(Segment(plan, costs.tolist(), compute.tolist()))
            starts.append(ex.forward_start.tolist())
            schedules.append(schedule)
            step, compute_step = ex.step_time, ex_c.step_time
        else:
            seg = price(plan, cost_model)
            t = timeline(plan, seg.durations)
            busy += np.asarray(t.busy)
            finish = offset + np.asarray(t.finish)
            segments.append(seg)
            starts.append(list(t.starts))
            step, compute_step = t.step_time, timeline(plan, seg.compute).step_time
        offsets.append(offset)
        offset += step
        compute_offset += compute_step
    dev = cost_model.device
    sync = grad_sync_time(params / stages, pool, dev.p2p_bandwidth, dev.p2p_latency)
    pipelined = {}
    if stages > 1:
        pipelined = {
            "pipeline_stages": stages,
            "schedules": schedules,
            "bubble_share": idle / (offset * pool * stages) if offset > 0 else 0.0,
        }
    return StepResult(
        system=system,
        step_time=offset + sync,
        compute_time=compute_offset,
        grad_sync=sync,
        tokens=int(sum(plans[0].seqlens)),
        busy=busy,
        finish=finish,
        plan_seconds=plan_seconds,
        implementation=implementation,
        segments=segments,
        starts=starts,
        offsets=offsets,
        **pipelined,
    )


def simulate_step(
    system: str,
    seqlens: Sequence[int],
    *,
    pool_size: int,
    capacity: int,
    context: int,
    cost_model: CostModel,
    params: float,
    megatron: str = "auto",
    megatron_max_ranks: int = MEGATRON_MAX_RANKS,
    pipeline_stages: int = 1,
) -> StepResult:
    """Plan and score one step of `system` on the global batch `seqlens`."""
    t0 = time.perf_counter()
    plans, impl = plan_system(
        system,
        seqlens,
        pool_size=pool_size,
        capacity=capacity,
        context=context,
        cost_model=cost_model,
        megatron=megatron,
        megatron_max_ranks=megatron_max_ranks,
        pipeline_stages=pipeline_stages,
    )
    elapsed = time.perf_counter() - t0
    return score(
        system,
        plans,
        cost_model,
        params=params,
        implementation=impl,
        plan_seconds=elapsed,
        pipeline_stages=pipeline_stages,
    )


def placed_once(result: StepResult) -> bool:
    """Every sequence of the batch appears in exactly one micro-batch of the step."""
    n = len(result.segments[0].plan.seqlens)
    seen = np.zeros(n, dtype=np.int64)
    for seg in result.segments:
        for mb in seg.plan.micro_batches:
            seen[list(mb.seq_indices)] += 1
    return bool(np.all(seen == 1))


def total_cost(result: StepResult, cost_model: CostModel) -> float:
    """Rank-seconds of the step by the cost model, micro-batch by micro-batch."""
    total = 0.0
    for seg in result.segments:
        seqlens = seg.plan.seqlens
        for mb in seg.plan.micro_batches:
            lengths = [seqlens[i] for i in mb.seq_indices]
            total += mb.cp_size * micro_batch_seconds(
                cost_model, lengths, mb.cp_size, mb.offload_ratio
            )
    return total
