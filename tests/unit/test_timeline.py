"""Plan timelines: rings wait for all members, ranks run in plan order."""

import pytest

from megatron_hdp.scheduler import plan_step
from megatron_hdp.sim.timeline import timeline
from tests.plan_checks import ring_waits_plan


def test_ring_waits_for_its_slowest_member():
    plan = ring_waits_plan()
    t = timeline(plan)
    assert t.starts == (0.0, 0.0, 3.0)
    assert t.finish == (5.0, 5.0) and t.busy == (3.0, 5.0) and t.step_time == 5.0
    assert t.waiting == (2.0, 0.0)


def test_balanced_plan_timeline_reproduces_the_planner_s_starts():
    plan = plan_step([5, 40, 17, 3, 3, 16, 70, 9, 12], pool_size=5, capacity=16, policy="balanced")
    t = timeline(plan)
    for mb, start in zip(plan.micro_batches, t.starts):
        assert start == pytest.approx(mb.predicted_start)
