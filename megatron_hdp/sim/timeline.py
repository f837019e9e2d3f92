"""Per-rank timelines of a plan: when each micro-batch starts and ends (pure).

Every rank runs its micro-batches in plan order; a ring starts when all its members are
free (they wait for each other), a local micro-batch as soon as its rank is free. Durations
are the plan's `predicted_cost` (or any other per-member time given).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_hdp.scheduler.plan import StepPlan


@dataclass(frozen=True)
class Timeline:
    """Start of every micro-batch (plan order) and per-rank busy and finish times."""

    starts: tuple[float, ...]
    busy: tuple[float, ...]
    finish: tuple[float, ...]

    @property
    def step_time(self) -> float:
        """When the last rank finishes (the gradient sync can start)."""
        return max(self.finish, default=0.0)

    @property
    def waiting(self) -> tuple[float, ...]:
        """Idle time of every rank before the step ends."""
        end = self.step_time
        return tuple(end - b for b in self.busy)


def timeline(plan: StepPlan, durations: Sequence[float] | None = None) -> Timeline:
    """Simulate `plan`'s execution; `durations[i]` overrides micro-batch i's predicted cost."""
    free = [0.0] * plan.pool_size
    busy = [0.0] * plan.pool_size
    starts = []
    for i, mb in enumerate(plan.micro_batches):
        duration = mb.predicted_cost if durations is None else durations[i]
        start = max(free[r] for r in mb.ring)
        for r in mb.ring:
            free[r] = start + duration
            busy[r] += duration
        starts.append(start)
    return Timeline(starts=tuple(starts), busy=tuple(busy), finish=tuple(free))
