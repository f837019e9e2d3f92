"""The door to Megatron-Core's own dynamic-CP scheduler, for the simulator's comparison (host).

`sim.simulate` runs Megatron-Core's `BalancedCPScheduler` (the wheel's hybrid-CP grouping)
next to HDP on the same batches; it reaches it through here, so that `megatron.core` is
imported in the host layer only.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence


def available() -> bool:
    """True when Megatron-Core's `BalancedCPScheduler` can be imported."""
    try:
        _scheduler_class()
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def _scheduler_class():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    return BalancedCPScheduler


class _StubGroup:
    """What `BalancedCPScheduler` needs of a process group: `.size()`."""

    def __init__(self, n: int) -> None:
        self._n = n

    def size(self) -> int:
        return self._n


def scheduler_groups(
    seqlens: Sequence[int], pool_size: int, capacity: int
) -> list[list[list[int]]]:
    """Megatron-Core's groups: `groups[g][rank]` = sequence ids the rank runs in group g."""
    sched = _scheduler_class()(capacity, _StubGroup(pool_size))
    _, sample_id_groups = sched.get_groups_and_subsamples(list(enumerate(seqlens)), None)
    return [[list(ids) for ids in group] for group in sample_id_groups]
