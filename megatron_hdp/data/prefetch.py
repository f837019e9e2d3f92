"""Batches prepared ahead in a background thread, so that planning and reading leave the step.

`Prefetcher` draws global batches from a sampler in order (the in-process sampler, or the
Ray data service's `RemoteBatches`) and runs a `prepare(batch)` function on each (the
trainer plans the batch, or takes the service's plan, and reads this rank's tokens) up to
`depth` batches ahead, while the current step trains. It is deterministic (one thread,
batches in sampler order, `prepare` a pure function of the batch) and resumable:
`state_dict()` is the sampler's state after the last batch handed out, never after the ones
still queued.

No collective runs here: `prepare` must be local work (planning, reading, CPU tensors).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: Seconds between checks for a stop request while the queue is full or empty.
_POLL_S = 0.05


@dataclass
class Prepared:
    """One prepared batch.

    Its units, what `prepare` made of them (or the error it raised), the sampler state
    after it, and how long the consumer waited for it (seconds).
    """

    units: list
    value: Any
    error: BaseException | None
    state: dict
    wait_s: float = 0.0


class Prefetcher:
    """Hands out prepared batches in sampler order, preparing up to `depth` ahead.

    `depth` 0 prepares each batch when it is asked for (no thread). Call `close()` when
    done (the trainer does); the thread is a daemon and stops at the next batch boundary.
    """

    def __init__(self, sampler, prepare: Callable[[Any], Any], depth: int) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"prefetch depth must be an integer >= 0, got {depth!r}")
        self.sampler, self.prepare, self.depth = sampler, prepare, depth
        self._state = sampler.state_dict()
        self._stop = threading.Event()
        self._queue: queue.Queue[Prepared] = queue.Queue(maxsize=max(1, depth))
        self._thread = None
        if depth > 0:
            self._thread = threading.Thread(target=self._run, name="hdp-prefetch", daemon=True)
            self._thread.start()

    def _make(self) -> Prepared:
        batch = self.sampler.next_batch()
        units = getattr(batch, "units", batch)  # a data service's batch carries its plan
        state = self.sampler.state_dict()
        try:
            return Prepared(units, self.prepare(batch), None, state)
        except Exception as err:  # handed to the consumer, raised in its step
            return Prepared(units, None, err, state)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                item = self._make()
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=_POLL_S)
                        break
                    except queue.Full:
                        continue
        except BaseException as err:  # the sampler itself failed: the consumer raises it
            logger.debug("prefetch thread stops: %r", err)
            self._queue.put(Prepared([], None, err, self._state))

    def next(self) -> Prepared:
        """The next batch in order (its `wait_s` says how long this call blocked)."""
        start = time.perf_counter()
        if self._thread is None:
            item = self._make()
        else:
            while True:
                try:
                    item = self._queue.get(timeout=_POLL_S)
                    break
                except queue.Empty:
                    if not self._thread.is_alive() and self._queue.empty():
                        raise RuntimeError("the prefetch thread stopped without a batch") from None
        item.wait_s = time.perf_counter() - start
        self._state = item.state
        return item

    def state_dict(self) -> dict:
        """The sampler state after the last batch handed out (what a checkpoint stores)."""
        return self._state

    def close(self) -> None:
        """Stop the thread (batches already prepared are dropped; the state is kept)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
