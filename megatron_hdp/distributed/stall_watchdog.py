"""Say which rank holds up a step, and where, before the collective timeout ends the job.

A rank that stops (a hung device, a stopped process, a stuck file system) leaves the others
blocked in a collective or ring transfer until the timeout, with no word about who or why.
Every rank runs a `StallWatchdog`: a daemon thread that writes a heartbeat with what the
rank is doing (iteration, micro-batch, ring) into the process group's key-value store
every few seconds. When a rank has been in the same phase for `report_after_s`, it reads
every rank's heartbeat and the lowest such waiting rank logs one warning naming the ranks
that are not responding (no heartbeat: the process is stopped or dead) or are behind (an
earlier phase of the step), with what each was doing. Comm layer: it touches only the store.

The store should be a client of its own (`watchdog_store`), so that heartbeats never wait
behind a blocking `get` of the main thread (NCCL sets up communicators through the store).
Store traffic: one small write per rank per heartbeat (every `report_after_s / 4`, 0.25-5 s,
and once per iteration, as soon as a rank starts it, so that a rank stopped between two
periodic heartbeats is reported at its iteration, not at an older one), and when a step
stalls, one read per waiting rank plus one `multi_get` of all heartbeats by the reporting
rank. The heartbeat thread writes them all; `mark` only wakes it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

logger = logging.getLogger(__name__)

#: The phases of one step in the order every rank goes through them; a rank in an earlier
#: phase of the same iteration (or in an earlier iteration) is behind.
PHASES = (
    "reading",
    "micro-batch",
    "gradient sync",
    "optimizer step",
    "evaluation",
    "saving",
    "stop check",
)


#: Shortest heartbeat interval, however small the report threshold (keeps the store calm).
MIN_INTERVAL_S = 0.25

#: Ranks named one by one in a stall report; the rest are counted.
MAX_LISTED = 16


def _heard(state: dict | None, now: float) -> str:
    return "" if state is None else f", last heard {now - state['time']:.0f} s ago"


def phase_index(what: str) -> int:
    """Position of a progress description in `PHASES` (0 if it names none)."""
    return next((i for i, name in enumerate(PHASES) if what.startswith(name)), 0)


def watchdog_store(default_store, *, timeout_s: float = 60.0):
    """A store client for the watchdog alone, beside the process group's `default_store`.

    Under torchrun (MASTER_ADDR/MASTER_PORT set) a second TCPStore client to the same server,
    under the prefix `hdp_watchdog`; otherwise (e.g. a file store in tests) `default_store`.
    """
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return default_store
    client = dist.TCPStore(
        host,
        int(port),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return dist.PrefixStore("hdp_watchdog", client)


class StallWatchdog:
    """Heartbeats this rank's progress into `store` and reports a step that stops moving.

    Args:
        store: The process group's store (`torch.distributed` `Store`), shared by all ranks.
        rank: This rank in the pool.
        world_size: Ranks in the pool.
        report_after_s: Seconds in one phase after which the stall is reported.
        timeout_s: The collective timeout (quoted in the report).
        interval_s: Seconds between heartbeats (default: a quarter of `report_after_s`,
            within [0.25, 5]).
    """

    def __init__(
        self,
        store,
        *,
        rank: int,
        world_size: int,
        report_after_s: float,
        timeout_s: float,
        interval_s: float | None = None,
    ):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.report_after_s = report_after_s
        self.timeout_s = timeout_s
        self.interval_s = interval_s or min(5.0, max(MIN_INTERVAL_S, report_after_s / 4))
        self._lock = threading.Lock()
        self._iteration = 0
        self._seq = 0
        self._what = "starting"
        self._since = time.monotonic()
        self._reported: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hdp-stall-watchdog", daemon=True)

    def _key(self, rank: int) -> str:
        return f"hdp_progress/{rank}"

    def mark(self, what: str, *, iteration: int | None = None) -> None:
        """Record that this rank starts `what` (in `iteration`, if it changes)."""
        with self._lock:
            if iteration is not None and iteration != self._iteration:
                self._iteration = iteration
                self._wake.set()  # a heartbeat now: the new iteration is news to the others
            self._seq += 1
            self._what = what
            self._since = time.monotonic()

    def start(self) -> StallWatchdog:
        """Start the heartbeat thread."""
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the heartbeat thread (other ranks then see this rank as silent)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s + 1)

    def __enter__(self) -> StallWatchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _state(self) -> dict:
        with self._lock:
            return {
                "iteration": self._iteration,
                "seq": self._seq,
                "what": self._what,
                "waiting_s": time.monotonic() - self._since,
                "time": time.time(),
            }

    def _beat(self) -> dict:
        state = self._state()
        self.store.set(self._key(self.rank), json.dumps(state))
        return state

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                state = self._beat()
                position = (state["iteration"], state["seq"])
                if state["waiting_s"] >= self.report_after_s and self._reported != position:
                    if self._report(state):
                        self._reported = position
            except Exception as err:  # noqa: BLE001 - a watchdog must never kill the job
                logger.debug("stall watchdog: %r", err)

    def _read(self, ranks: list[int]) -> dict[int, dict | None]:
        keys = [self._key(r) for r in ranks]
        if self.store.check(keys):
            values = self.store.multi_get(keys)
            return {r: json.loads(v) for r, v in zip(ranks, values, strict=True)}
        return {
            r: json.loads(self.store.get(k)) if self.store.check([k]) else None
            for r, k in zip(ranks, keys, strict=True)
        }

    def _silent(self, state: dict | None, now: float) -> bool:
        return state is None or now - state["time"] > 3 * self.interval_s

    def _report(self, mine: dict) -> bool:
        """Log the stall if every lower rank is silent; True once it is logged.

        Rank 0 reports unless it is silent itself, then rank 1, and so on: each waiting rank
        reads the heartbeats of the ranks below it until it finds one alive (one read in the
        usual case), and only the reporter reads them all (one `multi_get`).
        """
        now = time.time()
        for lower in range(self.rank):
            if not self._silent(self._read([lower])[lower], now):
                return True  # a lower rank is alive and reports; nothing to do here
        states = self._read(list(range(self.world_size)))
        states[self.rank] = mine
        now = time.time()
        silent = [r for r, s in states.items() if self._silent(s, now)]
        alive = {r: s for r, s in states.items() if r not in silent}
        waiting = [r for r, s in alive.items() if s["waiting_s"] >= self.report_after_s]

        def position(state: dict) -> tuple[int, int]:
            return state["iteration"], phase_index(state["what"])

        front = max(position(s) for s in alive.values())
        behind = [r for r, s in alive.items() if position(s) < front]

        def where(state: dict | None) -> str:
            if state is None:
                return "never heard from"
            return f"iteration {state['iteration']}, {state['what']}"

        lines = [
            f"step stalled: rank {self.rank} has waited {mine['waiting_s']:.0f} s in "
            f"{where(mine)} (the collective timeout is {self.timeout_s:.0f} s)"
        ]
        others = [r for r in waiting if r != self.rank and r not in behind]
        described = (
            [(r, f"is not responding{_heard(states[r], now)}: {where(states[r])}") for r in silent]
            + [(r, f"is behind: {where(alive[r])}") for r in behind]
            + [(r, f"waits in {where(alive[r])}") for r in others]
        )
        for r, text in described[:MAX_LISTED]:
            lines.append(f"  rank {r} {text}")
        if len(described) > MAX_LISTED:
            lines.append(f"  ... and {len(described) - MAX_LISTED} more ranks")
        if not silent and not behind:
            lines.append("  every rank is alive and waiting: a collective or ring mismatch?")
        logger.warning("\n".join(lines))
        return True
