"""Planning: plan types and placement policies (pure Python, no torch.distributed)."""

from megatron_hdp.scheduler.placement import POLICIES, plan_greedy, plan_static, plan_step
from megatron_hdp.scheduler.plan import MicroBatch, StepPlan

__all__ = ["POLICIES", "MicroBatch", "StepPlan", "plan_greedy", "plan_static", "plan_step"]
