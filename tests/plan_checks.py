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
