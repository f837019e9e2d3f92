"""Real torchrun jobs under SIGTERM (preemption) and SIGSTOP (a stalled rank)."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from megatron_hdp.checkpoint_digests import DIGESTS
from megatron_hdp.checkpoint_files import iteration_dir, latest_iteration
from megatron_hdp.megatron.dist_checkpoint import SLOW_WRITES_ENV
from tests import polling
from tests.e2e.harness import SMALL_MODEL, torchrun_command

REPO = Path(__file__).resolve().parents[2]
RECORD_EXIT = Path(__file__).resolve().parent / "record_exit.py"


def start_job(cache, tmp_path, *, nproc, iters, extra=(), env=None, session=False):
    """torchrun in the background; stderr goes to a file the test can read while it runs.

    `env`: more environment for the job. `session`: torchrun leads a new session and
    process group (as the SLURM step's), and each rank records its exit status in
    `tmp_path/exits` (`record_exit.py`).
    """
    argv = [
        *SMALL_MODEL,
        "--seq-length",
        "512",
        "--hdp-capacity",
        "256",
        "--hdp-global-batch-tokens",
        "1024",
        "--train-iters",
        str(iters),
        "--lr",
        "1e-3",
        "--data-cache-path",
        str(cache),
        "--hdp-metrics-file",
        str(tmp_path / "metrics.jsonl"),
        *extra,
    ]
    cmd = torchrun_command(nproc, argv)
    log = open(tmp_path / "stderr.log", "w")  # noqa: SIM115 - closed by finish()
    # The ranks run this checkout's code (the venv's editable install may point elsewhere).
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(env or {})}
    if session:
        (tmp_path / "exits").mkdir()
        env["HDP_TEST_EXIT_DIR"] = str(tmp_path / "exits")
        script = cmd.index(str(REPO / "pretrain_hdp.py"))
        cmd[script:script] = [str(RECORD_EXIT)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=log, cwd=REPO, env=env, start_new_session=session
    )
    proc.log = log
    return proc


def finish(proc, timeout=120):
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.log.close()


def wait_for(predicate, timeout, what):
    return polling.wait_for(predicate, timeout, what, poll=0.1)


def steps_done(tmp_path):
    path = tmp_path / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def worker_pids(proc):
    """Global rank -> pid of torchrun's worker processes."""
    children = []
    for task in Path(f"/proc/{proc.pid}/task").iterdir():
        children += (task / "children").read_text().split()
    ranks = {}
    for pid in children:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        for item in env:
            if item.startswith(b"RANK="):
                ranks[int(item[5:])] = int(pid)
    return ranks


def stop_rank_1_after_two_steps(proc, tmp_path):
    """SIGSTOP rank 1 once two steps are done; its pid and the time it was stopped."""
    wait_for(lambda: len(steps_done(tmp_path)) >= 2, 90, "two steps")
    stalled = worker_pids(proc)[1]
    os.kill(stalled, signal.SIGSTOP)
    return stalled, time.monotonic()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_one_rank_saves_at_the_next_step_and_exits_cleanly(
    corpus_cache, tmp_path, signum
):
    ckpt = tmp_path / "ckpt"
    proc = start_job(corpus_cache, tmp_path, nproc=2, iters=400, extra=["--save", str(ckpt)])
    try:
        wait_for(lambda: len(steps_done(tmp_path)) >= 3, 90, "three steps")
        os.kill(worker_pids(proc)[1], signum)  # rank 1 alone, as a node-local signal
    finally:
        status = finish(proc)
    log = (tmp_path / "stderr.log").read_text()
    assert status == 0, log[-3000:]
    last = steps_done(tmp_path)[-1]["iteration"]
    assert 3 <= last < 400
    assert latest_iteration(ckpt) == last  # the step in flight finished, and was saved
    assert f"iter {last}: {signum.name} received; stopping cleanly" in log
    assert f"The latest checkpoint is iteration {last} in {ckpt}" in log


def test_sigterm_to_torchrun_and_every_rank_as_slurm_sends_it_saves(corpus_cache, tmp_path):
    """scancel: SIGTERM to every process of the step, so each rank gets it twice (directly,
    then forwarded by torchrun). The repeat must not abort the save."""
    ckpt = tmp_path / "ckpt"
    proc = start_job(corpus_cache, tmp_path, nproc=2, iters=400, extra=["--save", str(ckpt)])
    try:
        wait_for(lambda: len(steps_done(tmp_path)) >= 3, 90, "three steps")
        for pid in worker_pids(proc).values():
            os.kill(pid, signal.SIGTERM)
        os.kill(proc.pid, signal.SIGTERM)
    finally:
        finish(proc)  # torchrun itself exits 1 when signalled (its SignalException)
    log = (tmp_path / "stderr.log").read_text()
    last = steps_done(tmp_path)[-1]["iteration"]
    assert latest_iteration(ckpt) == last, log[-3000:]
    assert f"iter {last}: SIGTERM received; stopping cleanly" in log
    assert "Traceback" not in log.split("SIGTERM received")[0]  # no rank died before saving


def newest_partial(ckpt: Path) -> Path | None:
    found = sorted(ckpt.glob("iter_*.partial"))
    return found[-1] if found else None


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigterm_to_the_whole_job_during_a_save_saves_and_every_rank_exits_0(
    corpus_cache, tmp_path, mode
):
    """scancel or preemption while a checkpoint is being written (sweep cases K6, K7).

    SLURM signals every process of the step at once: torchrun, the ranks and the helper
    processes of Megatron's checkpoint writer. SIGTERM goes to torchrun's whole process
    group while `iter_0000004.partial` exists (each write worker sleeps 3 s, a test hook).
    The save in flight must be published (or abandoned with the previous checkpoint the
    latest), every rank must exit 0 before torchrun's 30 s grace period runs out, and the
    "latest checkpoint" line must name the checkpoint the tracker names, a complete one.
    """
    ckpt = tmp_path / "ckpt"
    extra = ["--save", str(ckpt), "--save-interval", "2"]
    if mode == "async":
        extra.append("--async-save")
    proc = start_job(
        corpus_cache,
        tmp_path,
        nproc=2,
        iters=40,
        extra=extra,
        env={SLOW_WRITES_ENV: "3"},
        session=True,
    )
    try:
        polling.wait_for(
            lambda: (ckpt / "iter_0000004.partial").exists(),
            90,
            "the save of iteration 4",
            poll=0.005,
        )
        time.sleep(0.5)  # into the writers' sleep: the write workers exist
        assert (ckpt / "iter_0000004.partial").exists()  # the signal lands during the save
        signalled = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        finish(proc, timeout=60)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            finish(proc)
    log = (tmp_path / "stderr.log").read_text()
    exits = {p.name: p.read_text().strip() for p in (tmp_path / "exits").iterdir()}
    assert exits == {"rank0": "0", "rank1": "0"}, log[-4000:]
    assert "forcefully exiting" not in log, log[-4000:]  # no rank outlived the grace period
    assert took < 30, log[-4000:]
    assert "could not save" not in log, log[-4000:]
    latest = latest_iteration(ckpt)
    notes = re.findall(r"The latest checkpoint is iteration (\d+) in (\S+)\.", log)
    assert notes, log[-4000:]
    assert all(int(n) == latest and Path(where) == ckpt for n, where in notes), (notes, latest)
    folder = iteration_dir(ckpt, latest)
    assert (folder / "metadata.json").exists() and (folder / DIGESTS).exists()
    if mode == "sync":
        assert latest == 4  # the save the signal landed in was finished, then the job stopped
    else:
        assert latest >= 4  # the background save went on; the job stopped at a step after it
    assert newest_partial(ckpt) is None  # nothing left half-written
    stop_line = log.index(f"iter {latest}: SIGTERM received; stopping cleanly")
    # named only once published (--async-save: not while its writes still run)
    assert log.index(f"saved checkpoint {folder}\n") < stop_line


def test_a_stopped_rank_is_reported_before_the_timeout(corpus_cache, tmp_path):
    extra = ["--hdp-stall-report-seconds", "2", "--distributed-timeout-minutes", "1"]
    proc = start_job(corpus_cache, tmp_path, nproc=2, iters=60, extra=extra)
    log_path = tmp_path / "stderr.log"
    try:
        stalled, stopped_at = stop_rank_1_after_two_steps(proc, tmp_path)
        try:
            report = wait_for(
                lambda: "rank 1 is not responding" in log_path.read_text() and log_path.read_text(),
                30,
                "the stall report",
            )
            reported_after = time.monotonic() - stopped_at
        finally:
            os.kill(stalled, signal.SIGCONT)
    finally:
        status = finish(proc)
    assert status == 0, log_path.read_text()[-3000:]  # the job survives a transient stall
    assert reported_after < 60  # before the collective timeout
    block = report[report.index("step stalled: rank 0 has waited") :]
    assert "(the collective timeout is 60 s)" in block
    assert "rank 1 is not responding, last heard" in block
    assert "iteration" in block.splitlines()[1]
    stopped_in = int(block.splitlines()[1].split(": iteration ")[1].split(",")[0])
    assert stopped_in >= 3  # two steps were done when it stopped: its latest state, not a stale one
    assert steps_done(tmp_path)[-1]["iteration"] == 60


def test_the_collective_timeout_is_the_flags(corpus_cache, tmp_path):
    """--distributed-timeout-minutes 0.1: a rank stopped for good fails the job in ~6 s."""
    extra = ["--hdp-stall-report-seconds", "2", "--distributed-timeout-minutes", "0.1"]
    proc = start_job(corpus_cache, tmp_path, nproc=2, iters=400, extra=extra)
    log_path = tmp_path / "stderr.log"
    try:
        stalled, stopped_at = stop_rank_1_after_two_steps(proc, tmp_path)
        wait_for(lambda: "rank 1 is not responding" in log_path.read_text(), 30, "the report")
        reported_after = time.monotonic() - stopped_at
        wait_for(lambda: "Traceback" in log_path.read_text(), 60, "rank 0's timeout")
        failed_after = time.monotonic() - stopped_at
        os.kill(stalled, signal.SIGKILL)
    finally:
        status = finish(proc)
    assert status != 0
    assert reported_after < 6 <= failed_after + 0.5 < 30  # reported first, then the timeout
