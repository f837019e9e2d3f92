"""The stall watchdog's heartbeats and report, on an in-process store (comm layer, no ranks)."""

import json
import logging
import time

import torch.distributed as dist

from megatron_hdp.distributed.stall_watchdog import StallWatchdog
from tests import polling


def _stored(store, rank: int) -> dict:
    return json.loads(store.get(f"hdp_progress/{rank}"))


def test_a_new_iteration_is_heartbeaten_at_once_not_at_the_next_interval():
    """Steps faster than the heartbeat interval: the store still holds the latest iteration
    (a rank stopped right after would otherwise be reported at "iteration 0, starting")."""
    store = dist.HashStore()
    with StallWatchdog(
        store, rank=1, world_size=2, report_after_s=120, timeout_s=600, interval_s=30
    ) as watchdog:
        assert _stored(store, 1)["what"] == "starting"
        for iteration in range(1, 5):
            watchdog.mark("reading and planning the batch", iteration=iteration)
            watchdog.mark("micro-batch 1 of 2")
        polling.wait_for(lambda: _stored(store, 1)["iteration"] == 4, 5, "iteration 4", poll=0.01)
        state = _stored(store, 1)
        assert state["what"] in ("reading and planning the batch", "micro-batch 1 of 2")
        watchdog.mark("micro-batch 2 of 2")  # the same iteration: no extra write
        time.sleep(0.2)
        assert _stored(store, 1)["seq"] == state["seq"]


def test_a_stopped_rank_is_reported_at_its_last_iteration(caplog):
    store = dist.HashStore()
    stopped = StallWatchdog(store, rank=1, world_size=2, report_after_s=60, timeout_s=600)
    stopped.interval_s = 30
    stopped.start()
    for iteration in range(1, 4):
        stopped.mark("reading and planning the batch", iteration=iteration)
    polling.wait_for(lambda: _stored(store, 1)["iteration"] == 3, 5, "iteration 3", poll=0.01)
    stopped.stop()  # silent from now on, as a stopped process
    time.sleep(1.0)  # longer than 3 heartbeat intervals of the waiting rank: "not responding"
    waiting = StallWatchdog(
        store, rank=0, world_size=2, report_after_s=0.5, timeout_s=600, interval_s=0.25
    )
    waiting.mark("micro-batch 1 of 2 (ring (0, 1))", iteration=3)
    with caplog.at_level(logging.WARNING), waiting:
        polling.wait_for(lambda: "step stalled" in caplog.text, 10, "the report", poll=0.05)
    lines = caplog.text[caplog.text.index("step stalled") :].splitlines()
    assert "rank 0 has waited" in lines[0] and "iteration 3, micro-batch 1 of 2" in lines[0]
    assert lines[1].startswith("  rank 1 is not responding, last heard ")
    assert lines[1].endswith(": iteration 3, reading and planning the batch")
