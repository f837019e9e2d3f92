"""Independent checks of plans shared by the planner tests."""

from megatron_hdp.scheduler.plan import StepPlan


def run_to_completion(plan: StepPlan) -> bool:
    """Simulate blocking execution: a micro-batch runs once every ring member is at it."""
    queues = [list(plan.for_rank(r)) for r in range(plan.pool_size)]
    while any(queues):
        progressed = False
        for mb in plan.micro_batches:
            if all(queues[r] and queues[r][0] is mb for r in mb.ring):
                for r in mb.ring:
                    queues[r].pop(0)
                progressed = True
        if not progressed:
            return False
    return True
