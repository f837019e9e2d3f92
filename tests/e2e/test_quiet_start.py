"""A real launch starts quietly: no warnings, a few lines of our own before the first step."""

import os
import re
import subprocess

from tests.e2e.harness import REPO, corpus_args, torchrun_command

WARNING_LINE = re.compile(r"\b\w*Warning\b")  # UserWarning, FutureWarning, "warnings.warn("
RANK_LINE = re.compile(r"^\S+ \S+ \[rank(\d+)\] megatron_hdp\.[\w.]+ INFO: ")


def test_torchrun_start_shows_no_warnings(corpus_cache, tmp_path):
    """torchrun starts every rank in a fresh interpreter, as in production and the demo."""
    cmd = torchrun_command(2, corpus_args(corpus_cache, iters=2, extra=["--log-interval", "1"]))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONWARNINGS", None)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (done.stdout + done.stderr).splitlines()
    assert not [line for line in lines if WARNING_LINE.search(line)], done.stderr[-3000:]
    first_step = next(k for k, line in enumerate(lines) if " iter 1/2 " in line)
    before = lines[:first_step]
    # One line before training: rank 0's data line (the corpus and its sequence counts).
    assert all(RANK_LINE.match(line) for line in before), before
    assert {RANK_LINE.match(line).group(1) for line in before} <= {"0"}, before
    assert len(before) <= 1, before
