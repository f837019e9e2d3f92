"""Independent checks of plans shared by the planner tests."""

from megatron_hdp.scheduler.plan import MicroBatch, StepPlan, plan_from_rank_lists


def ring_waits_plan() -> StepPlan:
    """Two ranks busy for 1 and 3 s, then a ring of both for 2 s: it runs 3-5 s."""
    return plan_from_rank_lists(
        [4, 4, 16],
        2,
        8,
        "manual",
        [
            MicroBatch(order=0, ring=(0,), seq_indices=(0,), predicted_cost=1.0),
            MicroBatch(order=1, ring=(1,), seq_indices=(1,), predicted_cost=3.0),
            MicroBatch(order=2, ring=(0, 1), seq_indices=(2,), predicted_cost=2.0),
        ],
    )


def run_to_completion(plan: StepPlan) -> bool:
    """Simulate blocking execution: a micro-batch runs once every ring member is at it."""
    queues = [list(plan.for_rank(r)) for r in range(plan.pool_size)]
    while any(queues):
        progressed = False
        for mb in plan.micro_batches:
            if all(queues[r] and queues[r][0].order == mb.order for r in mb.ring):
                for r in mb.ring:
                    queues[r].pop(0)
                progressed = True
        if not progressed:
            return False
    return True


def megatron_order(m, stage, stages):
    """`forward_backward_pipelining_without_interleaving`'s loops, written out."""
    warmup = min(stages - stage - 1, m)
    ops = [(i, "F") for i in range(warmup)]
    for i in range(m - warmup):
        ops += [(warmup + i, "F"), (i, "B")]
    ops += [(i, "B") for i in range(m - warmup, m)]
    return ops


def brute_force_pipelines(plan, stages, costs=None, share=1 / 3):
    """Run a plan on 1F1B pipelines one op at a time from the queue heads.

    Each pool rank is a pipeline of `stages` stages running `megatron_order`; a ring op
    runs when it heads the queue of that stage on every member and its inputs are done.
    Returns (completed, per-rank finish times); costs default to `predicted_cost`.
    """
    mbs = plan.micro_batches
    c = [mb.predicted_cost for mb in mbs] if costs is None else costs
    dur = {}
    for u in range(len(mbs)):
        dur[(u, "F")] = c[u] * share / stages
        dur[(u, "B")] = c[u] * (1 - share) / stages
    lists = [[u for u, mb in enumerate(mbs) if r in mb.ring] for r in range(plan.pool_size)]
    queues = {}
    for r, lst in enumerate(lists):
        for s in range(stages):
            queues[(r, s)] = [(lst[p], k) for p, k in megatron_order(len(lst), s, stages)]
    head = dict.fromkeys(queues, 0)
    free = dict.fromkeys(queues, 0.0)
    done = {}
    pending = sum(len(q) for q in queues.values())
    while pending:
        progressed = False
        for (r, s), q in queues.items():
            if head[(r, s)] >= len(q):
                continue
            u, k = q[head[(r, s)]]
            members = mbs[u].ring
            if any(
                head[(m, s)] >= len(queues[(m, s)]) or queues[(m, s)][head[(m, s)]] != (u, k)
                for m in members
            ):
                continue
            if k == "F":
                deps = [(u, s - 1, "F")] if s > 0 else []
            else:
                deps = [(u, s + 1, "B")] if s < stages - 1 else [(u, s, "F")]
            if any(dep not in done for dep in deps):
                continue
            start = max([free[(m, s)] for m in members] + [done[dep] for dep in deps])
            end = start + dur[(u, k)]
            done[(u, s, k)] = end
            for m in members:
                free[(m, s)] = end
                head[(m, s)] += 1
                pending -= 1
            progressed = True
        if not progressed:
            return False, None
    finish = [
        max((free[(r, s)] for s in range(stages)), default=0.0) for r in range(plan.pool_size)
    ]
    return True, finish


def megatron_interleaved_order(m, stage, stages, chunks, group):
    """`forward_backward_pipelining_with_interleaving`'s op order, written out.

    `(micro-batch, chunk, "F"/"B")`: forward op k is the k-th entry of Megatron's schedule
    table (groups of `group` micro-batches through chunk 0, then chunk 1, ...; the last
    group takes the rest), backward op k the same micro-batch on the mirrored chunk; the
    warm-up is `2 (stages - stage - 1) + (chunks - 1) group` forwards.
    """
    table = []
    start = 0
    while start < m:
        end = m if start + group >= m else start + group
        table += [(u, c) for c in range(chunks) for u in range(start, end)]
        start = end
    total = len(table)
    warmup = min(total, 2 * (stages - stage - 1) + (chunks - 1) * group)
    ops = [(*table[k], "F") for k in range(warmup)]
    for k in range(total - warmup):
        ops.append((*table[warmup + k], "F"))
        u, c = table[k]
        ops.append((u, chunks - 1 - c, "B"))
    for k in range(total - warmup, total):
        u, c = table[k]
        ops.append((u, chunks - 1 - c, "B"))
    return ops


def brute_force_interleaved(lists, costs, stages, chunks, group, share=1 / 3):
    """Run micro-batch lists on interleaved pipelines one op at a time from the queue heads.

    `lists[p]`: pipeline p's micro-batch ids (a ring: listed by each member); `costs[u]`:
    u's forward + backward time on one stage's devices, split evenly over the
    `stages x chunks` virtual stages. A ring op runs when it heads that stage's queue on
    every member and its inputs are done. Returns (completed, per-pipeline finish).
    """
    vd = stages * chunks
    members = {}
    for p, lst in enumerate(lists):
        for u in lst:
            members.setdefault(u, []).append(p)
    queues = {}
    for p, lst in enumerate(lists):
        for s in range(stages):
            queues[(p, s)] = [
                (lst[i], c * stages + s, k)
                for i, c, k in megatron_interleaved_order(len(lst), s, stages, chunks, group)
            ]
    head = dict.fromkeys(queues, 0)
    free = dict.fromkeys(queues, 0.0)
    done = {}
    pending = sum(len(q) for q in queues.values())
    while pending:
        progressed = False
        for (p, s), q in queues.items():
            if head[(p, s)] >= len(q):
                continue
            u, w, k = q[head[(p, s)]]
            if any(
                head[(m, s)] >= len(queues[(m, s)]) or queues[(m, s)][head[(m, s)]] != (u, w, k)
                for m in members[u]
            ):
                continue
            if k == "F":
                deps = [(u, w - 1, "F")] if w > 0 else []
            else:
                deps = [(u, w + 1, "B")] if w < vd - 1 else [(u, w, "F")]
            if any(dep not in done for dep in deps):
                continue
            start = max([free[(m, s)] for m in members[u]] + [done[dep] for dep in deps])
            part = share if k == "F" else 1 - share
            end = start + costs[u] * part / vd
            done[(u, w, k)] = end
            for m in members[u]:
                free[(m, s)] = end
                head[(m, s)] += 1
                pending -= 1
            progressed = True
        if not progressed:
            return False, None
    finish = [max((free[(p, s)] for s in range(stages)), default=0.0) for p in range(len(lists))]
    return True, finish
