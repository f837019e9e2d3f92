"""Helper processes that must outlive the job's SIGTERM and end with their rank (comm layer).

On `scancel` or preemption SLURM sends SIGTERM to every process of the job step at once:
torchrun, the ranks and the processes the ranks started. The ranks stop at the next step
boundary and save (`stop_signal.py`). The helper processes of Megatron's checkpoint writer
(its results-queue server, its background writer and write workers) must not die from that
signal, or the save in flight, and the one the ranks make before stopping, fails.

Two tools:

- `sigterm_blocked()`: SIGTERM is blocked in the calling thread for the block. A process
  started in it (fork, or spawn: the signal mask survives `exec`) starts with SIGTERM
  blocked, so the job's SIGTERM never reaches it. The rank itself still gets its signal:
  the kernel hands it to another thread, and the Python handler runs in the main thread as
  usual; with no other thread it is delivered when the block ends.
- `start_manager()`: a `multiprocessing` manager server started that way, which also ignores
  SIGTERM for good and is killed when the rank that started it ends (PR_SET_PDEATHSIG), as
  a normal exit (its finaliser) or `close_writer_processes` would stop it.

Only the standard library is imported here: a spawned helper imports this module.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing
import os
import signal
from multiprocessing.managers import SyncManager

#: How `start_manager` starts its server: "spawn", as Megatron-Core starts its own (safe with
#: CUDA). Tests whose ranks are forked from a parent without CUDA set "fork" (no new
#: interpreter to import torch in).
START_METHOD = "spawn"

_PR_SET_PDEATHSIG = 1


@contextlib.contextmanager
def sigterm_blocked():
    """Block SIGTERM in this thread for the block; processes started in it inherit that.

    Local. A SIGTERM for this process in the meantime is handled by another thread, or
    delivered when the block ends: it is never lost.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _die_with_parent(parent_pid: int) -> None:
    """In a helper: SIGKILL when the process that started it ends; exit if it already has."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(0)


def helper_setup(parent_pid: int) -> None:
    """Initializer of a helper process: ignore SIGTERM, end with `parent_pid`.

    Also collects nothing it inherited (a forked copy has no garbage of its own, and
    collecting the parent's objects could join threads that do not exist here).
    """
    gc.freeze()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent(parent_pid)


def start_manager() -> SyncManager:
    """A started `SyncManager` whose server ignores SIGTERM and ends with this process. Local.

    Stop it with `shutdown()` (its finaliser does that at a normal exit).
    """
    manager = SyncManager(ctx=multiprocessing.get_context(START_METHOD))
    with sigterm_blocked():  # covers the server's start-up, before `helper_setup` runs
        manager.start(initializer=helper_setup, initargs=(os.getpid(),))
    return manager
