"""verify.py and the package on a real Python 3.10 interpreter (the package allows >= 3.10).

torch has no build for it here, so this compiles every module of `megatron_hdp` and
`scripts/gpu` with 3.10 (syntax) and runs verify.py's argument parsing, which happens
before torch is imported (`datetime.UTC`, 3.11-only, was used there). The name scan in
test_gpu_verify.py covers what compiling cannot see.
"""

from __future__ import annotations

import glob
import subprocess

import pytest

from tests.unit.scripts_loader import REPO

FOUND = sorted(glob.glob("/root/.pyenv/versions/3.10*/bin/python3.10")) + sorted(
    glob.glob("/usr/bin/python3.10")
)
pytestmark = pytest.mark.skipif(not FOUND, reason="no Python 3.10 interpreter on this machine")


def test_every_module_compiles_on_python_310(tmp_path):
    done = subprocess.run(
        [FOUND[0], "-m", "compileall", "-q", "-d", "x", "megatron_hdp", "scripts/gpu"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={"PYTHONPYCACHEPREFIX": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_verify_parses_its_arguments_on_python_310():
    done = subprocess.run(
        [FOUND[0], "scripts/gpu/verify.py", "--sections", "nonsense"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode == 2 and "--sections: unknown" in done.stderr, done.stderr
