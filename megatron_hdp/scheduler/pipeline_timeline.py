"""1F1B pipeline timelines and an execution simulator for plans on pipelines (pure: numpy).

With pipeline parallelism an HDP rank is a whole pipeline of `d` stages running
Megatron-Core's non-interleaved 1F1B schedule (`forward_backward_pipelining_without_interleaving`).
On stage `s` (0 = first) of a pipeline with `M` micro-batches it runs:

- warm-up: `w = min(d - s - 1, M)` forwards `F_0 .. F_{w-1}`;
- steady state: for `i = 0 .. M - w - 1`: `F_{w+i}`, then `B_i`;
- cool-down: the remaining backwards `B_{M-w} .. B_{M-1}`.

`stage_order` gives exactly this list. Execution rules (the "blocking semantics"):

1. Each stage runs its op list in order, one op at a time.
2. `F_i` on stage `s` needs `F_i` done on stage `s - 1`; `B_i` on stage `s` needs `B_i` done
   on stage `s + 1`, and on the last stage `F_i` done there. A receive blocks until the
   neighbour has produced the data; sends are treated as buffered (they never block the
   sender). Megatron pairs every send with the neighbour's matching receive in one batched
   call, which is what makes one pipeline deadlock-free; a rendezvous send would only add
   waits, so a deadlock found here is also a deadlock there.
3. A ring micro-batch (one sequence zigzag-split over `k` pipelines, see `sharding.py`) runs
   on the same stage of all `k` member pipelines together: its `F` on stage `s` starts when
   every member's stage `s` has reached it (and its inputs are there), and so does its `B`.
   Point-to-point time between stages is not modelled (activations of a stage boundary are
   small next to a long-context micro-batch); ring communication is inside the micro-batch
   cost.

These rules make execution a graph: one node per (micro-batch, stage, forward/backward),
shared by all members of a ring; edges from each stage's op order and from the data
dependencies. A plan runs to completion iff the graph is acyclic, and then every op starts
at the longest path to it (`execute`): no op can start earlier, and every op starts as soon
as its predecessors are done. A cycle is a deadlock; `execute` reports where each blocked
stage waits.

Costs. A micro-batch costing `c` (the cost model's forward + backward time of the whole
model on one pipeline stage's devices, e.g. `CostModel.micro_batch_time` with the profile of
one stage's TP group) takes `c / d` per stage on uniform stages, split forward : backward =
`share : (1 - share)`. The default share is 1/3 (backward = 2x forward, the GEMM rule);
`CostModel.forward_share` gives the cost model's own split (attention's backward is 2.5x
its forward there), which `stage_times` accepts per micro-batch.

Uniform micro-batches (`f`, `b` per stage) give the textbook step `(M + d - 1)(f + b)`; the
tests derive that and other cases by hand.

`schedule="flush"` runs a plan that is not lock-step without deadlock: every ring
micro-batch is run alone (its `F` through all stages, then its `B` back: a pipeline flush
before and after it), and the local micro-batches between two rings run as one 1F1B
segment. Any plan whose lists follow the global order is deadlock-free that way (all
members meet two rings' ops in the same relative order), at the price of a full pipeline
bubble per ring.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Forward share of a micro-batch's forward + backward time when nothing better is known.
DEFAULT_FORWARD_SHARE = 1.0 / 3.0
SCHEDULES = ("1f1b", "flush")


@functools.lru_cache(maxsize=4096)
def _order_arrays(num_micro_batches: int, stage: int, num_stages: int):
    """`stage_order` as two read-only numpy arrays (positions, backward flags)."""
    m = num_micro_batches
    warmup = min(num_stages - stage - 1, m)
    pos = list(range(warmup))
    back = [0] * warmup
    for i in range(m - warmup):
        pos += [warmup + i, i]
        back += [0, 1]
    for i in range(m - warmup, m):
        pos.append(i)
        back.append(1)
    p = np.asarray(pos, dtype=np.int64)
    b = np.asarray(back, dtype=np.int64)
    p.flags.writeable = False
    b.flags.writeable = False
    return p, b


def stage_order(num_micro_batches: int, stage: int, num_stages: int) -> list[tuple[int, int]]:
    """Megatron's 1F1B op order on one stage: `(micro-batch position, 0 forward / 1 backward)`.

    Args:
        num_micro_batches: Micro-batches `M` the pipeline runs this step.
        stage: This stage, `0 .. num_stages - 1`.
        num_stages: Pipeline stages `d`.

    Raises:
        ValueError: A stage outside the pipeline or a negative count.
    """
    if not 0 <= stage < num_stages or num_micro_batches < 0:
        raise ValueError(
            f"stage {stage} of {num_stages} stages with {num_micro_batches} micro-batches"
        )
    pos, back = _order_arrays(num_micro_batches, stage, num_stages)
    return list(zip(pos.tolist(), back.tolist(), strict=True))


def stage_times(
    costs: Sequence[float] | np.ndarray,
    num_stages: int,
    forward_share: float | Sequence[float] | np.ndarray = DEFAULT_FORWARD_SHARE,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-stage forward and backward seconds of micro-batches on uniform stages.

    Args:
        costs: Forward + backward seconds of each micro-batch through the whole model on
            one stage's devices (the cost model's per-member time).
        num_stages: Pipeline stages `d`; every stage holds `1/d` of the layers.
        forward_share: Forward share of each micro-batch's time (scalar or per micro-batch).

    Returns:
        `(forward, backward)`, each of shape `(len(costs), num_stages)`.
    """
    c = np.asarray(costs, dtype=np.float64) / num_stages
    share = np.broadcast_to(np.asarray(forward_share, dtype=np.float64), c.shape)
    fwd = np.repeat((c * share)[:, None], num_stages, axis=1)
    bwd = np.repeat((c * (1.0 - share))[:, None], num_stages, axis=1)
    return fwd, bwd


@dataclass(frozen=True)
class Execution:
    """The outcome of running micro-batch lists on pipelines.

    Attributes:
        completed: False when the lists deadlock (then times are partial, `nan` where an op
            never ran).
        finish: Per pipeline, when its last op ends (`nan` for a blocked pipeline).
        busy: Per pipeline and stage, seconds of compute, shape `(pipelines, stages)`.
        forward_start: Per micro-batch, when its forward starts on the first stage.
        backward_end: Per micro-batch, when its backward ends on the first stage.
        stuck: On deadlock, one line per blocked stage queue (at most 20): the op it waits
            at. Empty when completed.
        num_ops: Ops executed (forward and backward passes, all stages, rings counted once).
        starts: Start of every op, shape `(micro-batches, stages, 2)` (last axis: forward,
            backward; `nan` where it never ran).
    """

    completed: bool
    finish: np.ndarray
    busy: np.ndarray
    forward_start: np.ndarray
    backward_end: np.ndarray
    stuck: tuple[str, ...] = ()
    num_ops: int = 0
    starts: np.ndarray | None = None

    @property
    def step_time(self) -> float:
        """When the last pipeline finishes (the gradient sync can start); inf on deadlock."""
        if not self.completed:
            return float("inf")
        return float(np.max(self.finish, initial=0.0))

    @property
    def idle(self) -> np.ndarray:
        """Per pipeline and stage, seconds idle before the step ends (bubbles and waiting)."""
        return self.step_time - self.busy

    @property
    def bubble_share(self) -> float:
        """Idle share of all stage-seconds of the step (0 = no bubble at all)."""
        total = self.step_time * self.busy.size
        return float(self.idle.sum() / total) if total > 0 else 0.0


def _ops(length: int, stage: int, num_stages: int, ring_flags, schedule: str):
    """Positions and backward flags of one stage's ops for a list of `length` micro-batches."""
    if schedule == "1f1b" or length == 0:
        return _order_arrays(length, stage, num_stages)
    pos_parts, back_parts = [], []
    start = 0
    # Segments: maximal runs of local micro-batches, and each ring micro-batch alone.
    bounds = []
    for j in range(length):
        if ring_flags[j]:
            if j > start:
                bounds.append((start, j))
            bounds.append((j, j + 1))
            start = j + 1
    if start < length:
        bounds.append((start, length))
    for a, b in bounds:
        p, f = _order_arrays(b - a, stage, num_stages)
        pos_parts.append(p + a)
        back_parts.append(f)
    return np.concatenate(pos_parts), np.concatenate(back_parts)


def execute(
    lists: Sequence[Sequence[int]],
    forward: np.ndarray,
    backward: np.ndarray,
    *,
    ring: Sequence[bool] | np.ndarray | None = None,
    schedule: str = "1f1b",
) -> Execution:
    """Run micro-batch lists on pipelines under the module's blocking semantics.

    Args:
        lists: `lists[p]` holds the micro-batch ids pipeline `p` runs, in its order. A
            micro-batch id listed by several pipelines is a ring over them (it must sit in
            each list once).
        forward: Per micro-batch and stage forward seconds, shape `(micro-batches, stages)`.
        backward: The same for backward passes.
        ring: Per micro-batch, True for a ring (only needed by `schedule="flush"`; default:
            listed by more than one pipeline).
        schedule: `"1f1b"` (Megatron's schedule on every list) or `"flush"` (see the module
            docstring).

    Returns:
        The `Execution`: completion or the deadlock, per-pipeline finish and per-stage busy.

    Raises:
        ValueError: Mismatched shapes, an unknown schedule or a micro-batch listed twice by
            one pipeline.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    fwd = np.asarray(forward, dtype=np.float64)
    bwd = np.asarray(backward, dtype=np.float64)
    if fwd.ndim != 2 or fwd.shape != bwd.shape:
        raise ValueError(
            f"forward {fwd.shape} and backward {bwd.shape} must be (micro-batches, stages)"
        )
    num_mb, d = fwd.shape
    num_pipes = len(lists)
    arrays = [np.asarray(x, dtype=np.int64) for x in lists]
    members = np.bincount(np.concatenate(arrays), minlength=num_mb) if arrays else np.zeros(0)
    for p, a in enumerate(arrays):
        if len(np.unique(a)) != len(a):
            raise ValueError(f"pipeline {p} lists a micro-batch twice")
        if len(a) and (a.min() < 0 or a.max() >= num_mb):
            raise ValueError(f"pipeline {p} lists a micro-batch outside 0 .. {num_mb - 1}")
    is_ring = members > 1 if ring is None else np.asarray(ring, dtype=bool)

    # Node id of (micro-batch u, stage s, backward flag f) = (u * d + s) * 2 + f.
    num_nodes = num_mb * d * 2
    dur = np.stack([fwd, bwd], axis=2).reshape(-1)
    src_parts, dst_parts = [], []
    queue_last = np.full((num_pipes, d), -1, dtype=np.int64)
    busy = np.zeros((num_pipes, d))
    first_nodes = {}
    if schedule == "1f1b":
        # Vectorise over pipelines of equal length: same op pattern on every stage.
        by_len: dict[int, list[int]] = {}
        for p, a in enumerate(arrays):
            by_len.setdefault(len(a), []).append(p)
        for m, pipes in by_len.items():
            if m == 0:
                continue
            mat = np.stack([arrays[p] for p in pipes])  # (n, m)
            pipes_a = np.asarray(pipes)
            for s in range(d):
                pos, back = _order_arrays(m, s, d)
                nodes = (mat[:, pos] * d + s) * 2 + back[None, :]  # (n, 2m)
                src_parts.append(nodes[:, :-1].reshape(-1))
                dst_parts.append(nodes[:, 1:].reshape(-1))
                queue_last[pipes_a, s] = nodes[:, -1]
                busy[pipes_a, s] = dur[nodes].sum(axis=1)
                first_nodes[(m, s)] = (pipes_a, nodes[:, 0])
    else:
        for p, s, _, _, _, nodes in _stage_queues(arrays, is_ring, d, schedule):
            src_parts.append(nodes[:-1])
            dst_parts.append(nodes[1:])
            queue_last[p, s] = nodes[-1]
            busy[p, s] = dur[nodes].sum()
    # Data dependencies, once per micro-batch.
    u = np.arange(num_mb, dtype=np.int64)
    if d > 1:
        s = np.arange(d - 1, dtype=np.int64)
        fw_src = ((u[:, None] * d + s[None, :]) * 2).reshape(-1)
        src_parts.append(fw_src)
        dst_parts.append(fw_src + 2)  # F(u, s) -> F(u, s + 1)
        bw_dst = ((u[:, None] * d + s[None, :]) * 2 + 1).reshape(-1)
        src_parts.append(bw_dst + 2)  # B(u, s + 1) -> B(u, s)
        dst_parts.append(bw_dst)
    last = (u * d + d - 1) * 2
    src_parts.append(last)
    dst_parts.append(last + 1)  # F(u, d - 1) -> B(u, d - 1)
    src = np.concatenate(src_parts) if src_parts else np.zeros(0, dtype=np.int64)
    dst = np.concatenate(dst_parts) if dst_parts else np.zeros(0, dtype=np.int64)
    listed = np.zeros(num_nodes, dtype=bool)
    listed.reshape(num_mb, d * 2)[members > 0] = True

    end, processed = _longest_paths(num_nodes, src, dst, dur, listed)
    start = end - dur
    completed = bool(processed[listed].all())
    finish = np.full(num_pipes, np.nan)
    has = queue_last >= 0
    ends = np.where(has, end[np.maximum(queue_last, 0)], 0.0)
    ends = np.where(has & ~processed[np.maximum(queue_last, 0)], np.nan, ends)
    nonempty = has.any(axis=1)
    finish[nonempty] = np.max(ends[nonempty], axis=1)
    finish[~nonempty] = 0.0
    f0 = (u * d) * 2
    forward_start = np.where(processed[f0], start[f0], np.nan)
    backward_end = np.where(processed[f0 + 1], end[f0 + 1], np.nan)
    stuck = () if completed else _stuck(arrays, is_ring, d, schedule, processed)
    return Execution(
        completed=completed,
        finish=finish,
        busy=busy,
        forward_start=forward_start,
        backward_end=backward_end,
        stuck=stuck,
        num_ops=int(listed.sum()),
        starts=np.where(processed, start, np.nan).reshape(num_mb, d, 2),
    )


def _longest_paths(num_nodes, src, dst, dur, listed):
    """End time of every node by level-synchronous Kahn; `processed` marks reached nodes."""
    indeg = np.bincount(dst, minlength=num_nodes).astype(np.int64)
    order = np.argsort(src, kind="stable")
    dst_sorted = dst[order]
    counts = np.bincount(src, minlength=num_nodes)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    ready = np.zeros(num_nodes)
    end = np.full(num_nodes, np.nan)
    processed = np.zeros(num_nodes, dtype=bool)
    frontier = np.nonzero((indeg == 0) & listed)[0]
    while frontier.size:
        processed[frontier] = True
        end[frontier] = ready[frontier] + dur[frontier]
        n_out = counts[frontier]
        total = int(n_out.sum())
        if total == 0:
            break
        # Indices of all out-edges of the frontier, without a Python loop.
        starts = np.repeat(offsets[frontier] - np.cumsum(n_out) + n_out, n_out)
        idx = starts + np.arange(total)
        targets = dst_sorted[idx]
        values = np.repeat(end[frontier], n_out)
        by_target = np.argsort(targets, kind="stable")
        targets = targets[by_target]
        values = values[by_target]
        uniq, first, cnt = np.unique(targets, return_index=True, return_counts=True)
        best = np.maximum.reduceat(values, first)
        ready[uniq] = np.maximum(ready[uniq], best)
        indeg[uniq] -= cnt
        frontier = uniq[indeg[uniq] == 0]
    return end, processed


def _stage_queues(arrays, is_ring, d, schedule):
    """Each non-empty stage queue in order: `(p, s, a, pos, back, nodes)`.

    Pipeline `p`'s micro-batches `a`, stage `s`'s ops (`_ops`) and their node ids.
    """
    for p, a in enumerate(arrays):
        if len(a) == 0:
            continue
        flags = is_ring[a]
        for s in range(d):
            pos, back = _ops(len(a), s, d, flags, schedule)
            yield p, s, a, pos, back, (a[pos] * d + s) * 2 + back


def _stuck(arrays, is_ring, d, schedule, processed) -> tuple[str, ...]:
    """One line per blocked stage queue: the first op it has not run."""
    lines = []
    for p, s, a, pos, back, nodes in _stage_queues(arrays, is_ring, d, schedule):
        waiting = np.nonzero(~processed[nodes])[0]
        if waiting.size:
            t = int(waiting[0])
            kind = "B" if back[t] else "F"
            ring = " (ring)" if is_ring[a[pos[t]]] else ""
            lines.append(
                f"pipeline {p} stage {s}: waits at op {t}, {kind} of micro-batch "
                f"{int(a[pos[t]])}{ring} (position {int(pos[t])} of {len(a)})"
            )
            if len(lines) >= 20:
                return tuple(lines)
    return tuple(lines)


def pipeline_timeline(
    forward: Sequence[float] | np.ndarray,
    backward: Sequence[float] | np.ndarray,
    num_stages: int,
) -> Execution:
    """The 1F1B timeline of one pipeline.

    Args:
        forward: Per micro-batch (in run order) forward seconds per stage: shape `(M,)` for
            uniform stages or `(M, num_stages)`.
        backward: The same for backward.
        num_stages: Pipeline stages `d`.
    """
    f = np.asarray(forward, dtype=np.float64)
    b = np.asarray(backward, dtype=np.float64)
    if f.ndim == 1:
        f = np.repeat(f[:, None], num_stages, axis=1)
        b = np.repeat(b[:, None], num_stages, axis=1)
    return execute([list(range(len(f)))], f, b)


def plan_lists(plan) -> list[list[int]]:
    """Each pool rank's micro-batch indices (into `plan.micro_batches`) in run order."""
    lists: list[list[int]] = [[] for _ in range(plan.pool_size)]
    for i, mb in enumerate(plan.micro_batches):
        for r in mb.ring:
            lists[r].append(i)
    return lists


def simulate_plan(
    plan,
    num_stages: int,
    *,
    costs: Sequence[float] | np.ndarray | None = None,
    forward_share: float | Sequence[float] | np.ndarray = DEFAULT_FORWARD_SHARE,
    schedule: str = "1f1b",
) -> Execution:
    """Execute a `StepPlan` whose pool ranks are pipelines of `num_stages` stages.

    Args:
        plan: The `StepPlan`; each rank runs `plan.for_rank(r)` in order.
        num_stages: Pipeline stages `d`.
        costs: Per micro-batch (plan order) forward + backward seconds per member; default
            each micro-batch's `predicted_cost`.
        forward_share: Forward share of each micro-batch's time (scalar or per micro-batch).
        schedule: `"1f1b"` or `"flush"` (see the module docstring).
    """
    if costs is None:
        costs = [mb.predicted_cost for mb in plan.micro_batches]
    fwd, bwd = stage_times(costs, num_stages, forward_share)
    ring = [not mb.is_local for mb in plan.micro_batches]
    return execute(plan_lists(plan), fwd, bwd, ring=ring, schedule=schedule)
