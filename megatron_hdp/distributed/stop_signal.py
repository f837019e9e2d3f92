"""Stop at a step boundary on SIGTERM/SIGINT, all ranks together (comm layer).

A scheduler's preemption (SLURM, Kubernetes) sends SIGTERM, Ctrl-C sends SIGINT, and not
necessarily to every rank at the same moment. The handler only records the signal; at each
step boundary `StopSignal.agreed()` all-reduces the flags over the pool, so every rank stops
after the same step (and can save one consistent checkpoint) even if one rank alone was
signalled. A second SIGINT (Ctrl-C twice) stops at once, as usual; a repeated SIGTERM is
ignored, because SLURM and torchrun each send one (SLURM to every process of the step,
torchrun again to its workers) and the launcher's SIGKILL is the hard stop.
"""

from __future__ import annotations

import logging
import signal
import threading

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Records SIGTERM/SIGINT on this rank; `agreed()` says whether any rank got one.

    Install it with `install()` (main thread only) and undo with `uninstall()`; a context
    manager does both.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            if signum == signal.SIGINT and self.received == signal.SIGINT:
                self.uninstall()
                signal.raise_signal(signum)  # Ctrl-C twice: stop now
            return
        self.received = signum
        again = " (Ctrl-C again stops at once)" if signum == signal.SIGINT else ""
        logger.warning(
            "received %s: stopping after this step%s", signal.Signals(signum).name, again
        )

    def install(self) -> StopSignal:
        """Route SIGTERM and SIGINT to this object (a no-op outside the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were there before `install()`."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def __enter__(self) -> StopSignal:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def agreed(self, group: dist.ProcessGroup, device: torch.device) -> str | None:
        """Collective over `group`: the signal's name if any rank received one, else None."""
        flag = torch.tensor([self.received or 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        value = int(flag.item())
        return signal.Signals(value).name if value else None
