"""Planning: plan types and placement policies (pure Python, no torch.distributed)."""

from megatron_hdp.scheduler.placement import POLICIES, plan_greedy, plan_static, plan_step
from megatron_hdp.scheduler.plan import MicroBatch, StepPlan, lockstep_problems
from megatron_hdp.scheduler.pp_balance import plan_pp_balanced

__all__ = [
    "POLICIES",
    "MicroBatch",
    "StepPlan",
    "lockstep_problems",
    "plan_greedy",
    "plan_pp_balanced",
    "plan_static",
    "plan_step",
]
