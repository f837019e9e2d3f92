"""Helper processes that survive the job's SIGTERM and end with their rank."""

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from megatron_hdp.distributed import helper_processes


@pytest.fixture
def forked(monkeypatch):
    """start_manager by fork: no new interpreter (the production default is spawn)."""
    monkeypatch.setattr(helper_processes, "START_METHOD", "fork")


def _blocked() -> set:
    return signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_sigterm_is_blocked_in_the_block_only():
    assert signal.SIGTERM not in _blocked()
    with helper_processes.sigterm_blocked():
        assert signal.SIGTERM in _blocked()
    assert signal.SIGTERM not in _blocked()


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # exited (a zombie not yet reaped by init)


def test_the_manager_server_survives_sigterm_and_still_serves(forked):
    manager = helper_processes.start_manager()
    try:
        queue = manager.Queue()
        os.kill(manager._process.pid, signal.SIGTERM)
        time.sleep(0.3)
        assert manager._process.is_alive()
        queue.put("after SIGTERM")
        assert queue.get(timeout=5) == "after SIGTERM"
    finally:
        manager.shutdown()
    assert not manager._process.is_alive()


def _start_and_leave(pids):
    manager = helper_processes.start_manager()
    pids.put(manager._process.pid)
    time.sleep(0.2)
    os._exit(0)  # no exit handlers: the server is not shut down


def test_the_manager_server_ends_with_the_process_that_started_it(forked):
    ctx = multiprocessing.get_context("fork")
    pids = ctx.Queue()
    rank = ctx.Process(target=_start_and_leave, args=(pids,))
    rank.start()
    server = pids.get(timeout=30)
    rank.join(timeout=30)
    deadline = time.monotonic() + 10
    while not _gone(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not _gone(server):
        os.kill(server, signal.SIGKILL)
        pytest.fail(f"the helper server {server} outlived the process that started it")
