"""Interleaved 1F1B (virtual pipeline stages) for HDP plans: order, padding, execution (pure).

With `--num-layers-per-virtual-pipeline-stage` every pipeline stage holds `v` model chunks
(Megatron-Core's `forward_backward_pipelining_with_interleaving`): chunk `c` of stage `s`
is virtual stage `c * d + s` of `v * d`, and a micro-batch crosses all `d` stages `v` times.
This module mirrors that schedule for `pipeline_timeline`'s blocking semantics (its module
docstring; a ring micro-batch runs on the same virtual stage of all its member pipelines
together, its cost split evenly over the `v * d` virtual stages).

Megatron's schedule (read from megatron-core 0.16.1 and 0.19.2, the same in both):

- forward ops come from `get_schedule_table(M, v, N)`: micro-batches in groups of `N`
  (`microbatch_group_size_per_vp_stage`, default `d`), each group through chunk 0, then
  chunk 1, ...; the last group takes the remainder. A backward op `k` is forward op `k`'s
  micro-batch on chunk `v - 1 - c`;
- stage `s` runs `W = min(v M, 2 (d - s - 1) + (v - 1) N)` forwards, then `F_{W+i}, B_i`
  pairs, then the remaining backwards;
- it refuses `N > M`, `N < d`, and a last group of `1 .. d - 1` micro-batches.

HDP gives pipelines different micro-batch counts `M`; a count Megatron refuses is padded at
the end of the list (`padded_count`) with one-token micro-batches of loss mask 0 (the
drop-in's `ep_lockstep.padding_batch`), which cost next to nothing and change no loss or
gradient. Members of a ring run equally many micro-batches (lock step), so they pad equally
and keep the ring at the same position.

`execute_interleaved` runs lists of micro-batches under these rules; a plan's step time,
bubble and deadlock freedom follow as in `pipeline_timeline`. With equal micro-batches of
per-stage time `t` and `M` a multiple of `N` it gives the textbook interleaved step
`M t + (d - 1) t / v` (the tests derive it), against 1F1B's `M t + (d - 1) t`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from megatron_hdp.scheduler.pipeline_timeline import (
    DEFAULT_FORWARD_SHARE,
    Execution,
    _longest_paths,
    plan_lists,
)


def _check(num_micro_batches: int, num_stages: int, chunks: int, group: int) -> None:
    if num_stages < 1 or chunks < 1 or num_micro_batches < 0:
        raise ValueError(
            f"{num_micro_batches} micro-batches on {num_stages} stages of {chunks} chunks"
        )
    if group < num_stages:
        raise ValueError(
            f"micro-batch group size {group} is smaller than the {num_stages} pipeline stages "
            "(Megatron's interleaved schedule needs at least one per stage)"
        )


def count_problem(num_micro_batches: int, num_stages: int, group: int) -> str | None:
    """Why Megatron's interleaved schedule refuses `M` micro-batches (None: it runs them)."""
    m, d, n = num_micro_batches, num_stages, group
    if m == 0:
        return None
    if n > m or n < d:
        return f"{m} micro-batches: the group size {n} must lie in [PP={d}, M={m}]"
    if 0 < m % n < d:
        return f"{m} micro-batches in groups of {n} leave a last group of {m % n} < PP={d}"
    return None


def padded_count(num_micro_batches: int, num_stages: int, group: int | None = None) -> int:
    """The least count `>= M` Megatron's interleaved schedule runs (0 stays 0).

    `group` is `microbatch_group_size_per_vp_stage` (default: `num_stages`).
    """
    n = num_stages if group is None else group
    _check(num_micro_batches, num_stages, 1, n)
    m = num_micro_batches
    if m == 0:
        return 0
    m = max(m, n)
    while count_problem(m, num_stages, n) is not None:
        m += 1
    return m


@functools.lru_cache(maxsize=4096)
def _order_arrays(m: int, stage: int, d: int, v: int, n: int):
    """`interleaved_order` as read-only numpy arrays (positions, chunks, backward flags)."""
    table = []
    for first in range(0, m, n):
        last = m if first + n >= m else first + n
        table += [(u, c) for c in range(v) for u in range(first, last)]
    total = m * v
    warmup = min(total, 2 * (d - stage - 1) + (v - 1) * n)
    ops = [(table[k][0], table[k][1], 0) for k in range(warmup)]
    for i in range(total - warmup):
        u, c = table[warmup + i]
        ops.append((u, c, 0))
        u, c = table[i]
        ops.append((u, v - 1 - c, 1))
    for k in range(total - warmup, total):
        u, c = table[k]
        ops.append((u, v - 1 - c, 1))
    arrays = tuple(np.asarray(x, dtype=np.int64).reshape(-1) for x in zip(*ops, strict=True))
    if not ops:
        arrays = tuple(np.zeros(0, dtype=np.int64) for _ in range(3))
    for a in arrays:
        a.flags.writeable = False
    return arrays


def interleaved_order(
    num_micro_batches: int, stage: int, num_stages: int, chunks: int, group: int | None = None
) -> list[tuple[int, int, int]]:
    """Megatron's interleaved op order on one stage: `(position, chunk, 0 fwd / 1 bwd)`.

    Args:
        num_micro_batches: `M`, a count Megatron accepts (`padded_count`).
        stage: This stage, `0 .. num_stages - 1`.
        num_stages: Pipeline stages `d`.
        chunks: Model chunks per stage `v`.
        group: `microbatch_group_size_per_vp_stage` (default `d`).

    Raises:
        ValueError: A stage outside the pipeline, or a count Megatron refuses.
    """
    n = num_stages if group is None else group
    _check(num_micro_batches, num_stages, chunks, n)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} of {num_stages} stages")
    problem = count_problem(num_micro_batches, num_stages, n)
    if problem is not None:
        raise ValueError(f"Megatron's interleaved schedule refuses {problem}")
    pos, chunk, back = _order_arrays(num_micro_batches, stage, num_stages, chunks, n)
    return list(zip(pos.tolist(), chunk.tolist(), back.tolist(), strict=True))


def execute_interleaved(
    lists: Sequence[Sequence[int]],
    forward: np.ndarray,
    backward: np.ndarray,
    *,
    num_stages: int,
    chunks: int,
    group: int | None = None,
) -> Execution:
    """Run micro-batch lists on pipelines of `num_stages` stages of `chunks` chunks each.

    Args:
        lists: `lists[p]`: the micro-batch ids pipeline `p` runs, in order (a count
            Megatron accepts: pad first, `padded_count`). An id listed by several pipelines
            is a ring over them.
        forward: Per micro-batch and virtual stage (`chunk * num_stages + stage`) forward
            seconds, shape `(micro-batches, chunks * num_stages)`.
        backward: The same for backward passes.
        num_stages: Pipeline stages `d`.
        chunks: Model chunks per stage `v`.
        group: `microbatch_group_size_per_vp_stage` (default `d`).

    Returns:
        The `Execution` (`busy` per pipeline and physical stage; `starts` per virtual stage).

    Raises:
        ValueError: Mismatched shapes, a micro-batch listed twice by one pipeline, or a
            count Megatron refuses.
    """
    d, v = int(num_stages), int(chunks)
    n = d if group is None else int(group)
    fwd = np.asarray(forward, dtype=np.float64)
    bwd = np.asarray(backward, dtype=np.float64)
    vd = v * d
    if fwd.ndim != 2 or fwd.shape != bwd.shape or fwd.shape[1] != vd:
        raise ValueError(
            f"forward {fwd.shape} and backward {bwd.shape} must be (micro-batches, {vd})"
        )
    num_mb = fwd.shape[0]
    arrays = [np.asarray(x, dtype=np.int64) for x in lists]
    for p, a in enumerate(arrays):
        if len(np.unique(a)) != len(a):
            raise ValueError(f"pipeline {p} lists a micro-batch twice")
        if len(a) and (a.min() < 0 or a.max() >= num_mb):
            raise ValueError(f"pipeline {p} lists a micro-batch outside 0 .. {num_mb - 1}")
        _check(len(a), d, v, n)
        problem = count_problem(len(a), d, n)
        if problem is not None:
            raise ValueError(f"pipeline {p}: Megatron's interleaved schedule refuses {problem}")
    members = np.bincount(np.concatenate(arrays), minlength=num_mb) if arrays else np.zeros(0)
    # Node of (micro-batch u, virtual stage w, backward flag f) = (u * vd + w) * 2 + f.
    num_nodes = num_mb * vd * 2
    dur = np.stack([fwd, bwd], axis=2).reshape(-1)
    src_parts, dst_parts = [], []
    last_node = np.full((len(arrays), d), -1, dtype=np.int64)
    busy = np.zeros((len(arrays), d))
    for p, a in enumerate(arrays):
        if len(a) == 0:
            continue
        for s in range(d):
            pos, chunk, back = _order_arrays(len(a), s, d, v, n)
            nodes = (a[pos] * vd + chunk * d + s) * 2 + back
            src_parts.append(nodes[:-1])
            dst_parts.append(nodes[1:])
            last_node[p, s] = nodes[-1]
            busy[p, s] = dur[nodes].sum()
    u = np.arange(num_mb, dtype=np.int64)
    if vd > 1:
        w = np.arange(vd - 1, dtype=np.int64)
        fw = ((u[:, None] * vd + w[None, :]) * 2).reshape(-1)
        src_parts.append(fw)
        dst_parts.append(fw + 2)  # F(u, w) -> F(u, w + 1)
        bw = fw + 1
        src_parts.append(bw + 2)  # B(u, w + 1) -> B(u, w)
        dst_parts.append(bw)
    last = (u * vd + vd - 1) * 2
    src_parts.append(last)
    dst_parts.append(last + 1)
    src = np.concatenate(src_parts) if src_parts else np.zeros(0, dtype=np.int64)
    dst = np.concatenate(dst_parts) if dst_parts else np.zeros(0, dtype=np.int64)
    listed = np.zeros(num_nodes, dtype=bool)
    listed.reshape(num_mb, vd * 2)[members > 0] = True
    end, processed = _longest_paths(num_nodes, src, dst, dur, listed)
    start = end - dur
    completed = bool(processed[listed].all())
    has = last_node >= 0
    safe = np.maximum(last_node, 0)
    ends = np.where(has, end[safe], 0.0)
    ends = np.where(has & ~processed[safe], np.nan, ends)
    finish = np.where(has.any(axis=1), np.max(ends, axis=1, initial=0.0), 0.0)
    f0 = (u * vd) * 2
    stuck = ()
    if not completed:
        stuck = tuple(
            f"pipeline {p}: a node of micro-batch {int(x)} never ran"
            for p, a in enumerate(arrays)
            for x in a[~processed[(a * vd) * 2]][:1]
        )[:20]
    return Execution(
        completed=completed,
        finish=finish,
        busy=busy,
        forward_start=np.where(processed[f0], start[f0], np.nan),
        backward_end=np.where(processed[f0 + 1], end[f0 + 1], np.nan),
        stuck=stuck,
        num_ops=int(listed.sum()),
        starts=np.where(processed, start, np.nan).reshape(num_mb, vd, 2),
    )


def simulate_plan_interleaved(
    plan,
    num_stages: int,
    chunks: int,
    *,
    group: int | None = None,
    costs: Sequence[float] | np.ndarray | None = None,
    forward_share: float | Sequence[float] | np.ndarray = DEFAULT_FORWARD_SHARE,
) -> Execution:
    """Execute a lock-step `StepPlan` on pipelines of `num_stages` stages x `chunks` chunks.

    Each pipeline's list is padded (`padded_count`) with micro-batches of cost 0, as the
    drop-in pads it with one-token micro-batches. `costs` (default each micro-batch's
    `predicted_cost`) is the forward + backward time of the whole model on one stage's
    devices; each virtual stage takes `1 / (chunks * num_stages)` of it.
    """
    d, v = int(num_stages), int(chunks)
    n = d if group is None else int(group)
    if costs is None:
        costs = [mb.predicted_cost for mb in plan.micro_batches]
    costs = np.asarray(costs, dtype=np.float64)
    share = np.broadcast_to(np.asarray(forward_share, dtype=np.float64), costs.shape)
    lists = [list(x) for x in plan_lists(plan)]
    extra = 0
    for a in lists:
        pad = padded_count(len(a), d, n) - len(a)
        a.extend(range(len(costs) + extra, len(costs) + extra + pad))
        extra += pad
    all_costs = np.concatenate([costs, np.zeros(extra)]) / (v * d)
    all_share = np.concatenate([share, np.full(extra, DEFAULT_FORWARD_SHARE)])
    fwd = np.repeat((all_costs * all_share)[:, None], v * d, axis=1)
    bwd = np.repeat((all_costs * (1.0 - all_share))[:, None], v * d, axis=1)
    return execute_interleaved(lists, fwd, bwd, num_stages=d, chunks=v, group=n)
