"""The one prepared command for the GPU machine, dry-run on CPU end to end.

`scripts/gpu/device_run.sh --cpu` does what it does on the GPU machine: it says what the
machine has, installs the carried wheels into a folder of their own with --no-deps (a
wheel made here, so no network is needed), puts that folder on PYTHONPATH, and runs
verify.py (two short sections here) with its JSON and log in $OUT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

from tests.unit.scripts_loader import REPO


def make_wheel(folder):
    """A minimal wheel of a one-module package `hdp_carried_probe` (what pip installs)."""
    name = "hdp_carried_probe-1.0-py3-none-any.whl"
    info = "hdp_carried_probe-1.0.dist-info"
    files = {
        "hdp_carried_probe.py": "CARRIED = True\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: hdp-carried-probe\nVersion: 1.0\n",
        f"{info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / name, "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)


def test_the_dry_run_installs_the_carried_wheels_and_leaves_json_and_log(tmp_path):
    wheels, out, site = tmp_path / "wheels", tmp_path / "out", tmp_path / "site"
    wheels.mkdir()
    make_wheel(wheels)
    env = {
        **os.environ,
        "OUT": str(out),
        "WHEELS": str(wheels),
        "SITE": str(site),
        "PYTHON": sys.executable,
        "VERIFY_ARGS": "--sections env,kernels",
    }
    done = subprocess.run(
        ["bash", "scripts/gpu/device_run.sh", "--cpu"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (site / "hdp_carried_probe.py").is_file()  # installed, --no-deps, own folder
    log = (out / "device_run.log").read_text()
    assert "installing hdp_carried_probe-1.0-py3-none-any.whl" in log
    assert "  torch " in log and "megatron-core" in log  # what the machine has
    report = json.loads((out / "verify-cpu.json").read_text())
    assert report["sections"]["kernels"]["ok"] is True
    assert "verify cpu exited 0" in log and "done, status 0" in log
