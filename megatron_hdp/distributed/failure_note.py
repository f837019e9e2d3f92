"""One rank's reason for stopping the job, left for the ranks it leaves behind (comm layer).

A rank that stops on its own (the data service failed under it, an unexpected error) leaves
the others blocked in a collective until its sockets close, and they then fail with the
transport's "connection closed by peer", which says nothing about why. Before it stops, the
rank writes one line into the process group's key-value store (`leave`); a rank whose
collective fails reads it (`reason`) and stops with that line instead. The first note
written wins. Store traffic: one write by the failing rank, one read per other rank.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

KEY = "hdp_failure_note"


def leave(store, rank: int, message: str) -> str:
    """Write `rank: message` unless another rank wrote first; returns the note that holds."""
    note = f"rank {rank}: {message}"
    try:
        held = store.compare_set(KEY, "", note)
        return held.decode() if isinstance(held, bytes) else str(held)
    except Exception as err:  # noqa: BLE001 - the store may be gone with the job
        logger.debug("could not leave a failure note: %r", err)
        return note


def reason(store, *, wait_s: float = 2.0) -> str | None:
    """The note another rank left (waiting up to `wait_s` for it), or None."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if store.check([KEY]):
                return store.get(KEY).decode()
        except Exception as err:  # noqa: BLE001 - the store may be gone with the job
            logger.debug("could not read a failure note: %r", err)
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
