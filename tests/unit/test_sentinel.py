"""The Ray sentinel speaks when its rank dies without a word, and only then."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest

#: A rank: starts the sentinel, forks a helper that outlives it (as Megatron's checkpoint
#: writer's manager does) and then either ends as Ray ends it or leaves normally.
RANK = textwrap.dedent(
    """
    import os, sys, time
    from megatron_hdp.data.service.sentinel import Sentinel
    address, save, how = sys.argv[1:]
    sentinel = Sentinel(address, save=save)
    if os.fork() == 0:
        time.sleep(30)  # the helper keeps every inherited descriptor, the pipe's too
        os._exit(0)
    if how == "normal":
        sentinel.close()
        sys.exit(0)
    os._exit(1)  # as Ray's core worker ends a rank: nothing runs
    """
)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed


def _run_rank(how, save, err_path):
    with open(err_path, "wb") as err:
        proc = subprocess.run(
            [sys.executable, "-c", RANK, f"127.0.0.1:{_closed_port()}", str(save), how],
            stderr=err,
            timeout=60,
        )
    return proc.returncode


def _wait_for_line(err_path, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        text = err_path.read_text()
        if "error:" in text:
            return text
        time.sleep(0.1)
    return err_path.read_text()


@pytest.fixture
def save(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "latest_checkpointed_iteration.txt").write_text("7")
    return folder


def test_a_rank_ended_by_ray_gets_its_line_though_a_helper_holds_the_pipe(tmp_path, save):
    err_path = tmp_path / "err"
    assert _run_rank("killed", save, err_path) == 1
    text = _wait_for_line(err_path, 10)
    assert "pretrain_hdp.py: error: the Ray cluster at 127.0.0.1:" in text
    assert f"The latest checkpoint is iteration 7 in {save}." in text


def test_a_rank_that_leaves_normally_gets_no_line(tmp_path, save):
    err_path = tmp_path / "err"
    assert _run_rank("normal", save, err_path) == 0
    time.sleep(2)
    assert "error:" not in err_path.read_text()
