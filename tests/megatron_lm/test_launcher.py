"""The launcher's own command line (its runs are in test_pretrain_gpt.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.megatron_lm.harness import REPO


def _launch(*args):
    return subprocess.run(
        [sys.executable, "-m", "megatron_hdp.megatron_lm", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "usage: python -m megatron_hdp.megatron_lm SCRIPT.py"),
        (("--hdp",), "usage: python -m megatron_hdp.megatron_lm SCRIPT.py"),
        (("no_such_script.py", "--hdp"), "no_such_script.py: no such file"),
    ],
)
def test_launcher_needs_a_script_first(args, message):
    result = _launch(*args)
    assert result.returncode == 1 and message in result.stderr, result.stderr
