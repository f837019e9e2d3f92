"""scripts/slurm/pretrain_hdp.sbatch on a real single-node SLURM (Debian's 22.05, CPU, gloo).

The job is submitted as a user would (sbatch options on the command line, the script's own
variables in the environment), trains, is requeued after its first checkpoint (SLURM sends
SIGTERM, the ranks save), runs again under the same job id and resumes from that checkpoint.
`scontrol requeuehold` (a requeue that keeps the job pending until `scontrol release`) lets
the test read run 1's files before run 2 starts, with no race.
`scripts/slurm/local_slurm.sh` starts and stops the cluster; without SLURM installed
(`scripts/slurm/install_local_slurm.sh`) the test is skipped.
"""

import contextlib
import json
import logging
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_hdp.checkpoint_files import iteration_dir, latest_iteration
from tests.polling import wait_for

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "scripts" / "slurm" / "pretrain_hdp.sbatch"
LOCAL_SLURM = REPO / "scripts" / "slurm" / "local_slurm.sh"
TRAIN_ITERS = 60  # ~0.3 s a step here: run 1 is requeued long before it could finish
SAVE_INTERVAL = 2

log = logging.getLogger(__name__)

# the daemons live in sbin, which is not always on PATH
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
_MISSING = [
    cmd
    for cmd in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue")
    if shutil.which(cmd, path=SEARCH_PATH) is None
]
pytestmark = pytest.mark.skipif(
    bool(_MISSING),
    reason=f"SLURM is not installed ({', '.join(_MISSING)} missing): "
    "run scripts/slurm/install_local_slurm.sh as root",
)


@dataclass
class Cluster:
    """A running local SLURM: its state folder and the environment its commands need."""

    folder: Path
    env: dict

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster (10 s at most)."""
        return subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, timeout=10, check=check
        )

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...); {} if unknown."""
        line = self.run("scontrol", "show", "job", "--oneliner", job_id, check=False).stdout
        return dict(item.split("=", 1) for item in line.split() if "=" in item)


def _clean_env() -> dict:
    """This process's environment without SLURM's variables (sbatch reads SBATCH_* as options)."""
    prefixes = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    return {**env, "PATH": SEARCH_PATH}


def _local_slurm(verb: str, folder: Path, env: dict, timeout: float):
    """`local_slurm.sh VERB FOLDER`, its output captured."""
    return subprocess.run(
        ["bash", str(LOCAL_SLURM), verb, str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def slurm():
    """A single-node SLURM started for this test and stopped after it, also on failure."""
    # a short folder: the munge socket's path must fit a unix socket address (108 bytes)
    folder = Path(tempfile.mkdtemp(prefix="hdp-slurm-"))
    env = {**_clean_env(), "SLURM_CONF": str(folder / "slurm.conf")}
    try:
        started = _local_slurm("start", folder, env, timeout=120)
        assert started.returncode == 0, (
            f"local_slurm.sh start failed:\n{started.stdout}\n{started.stderr}"
        )
        yield Cluster(folder, env)
    finally:
        stopped = _local_slurm("stop", folder, env, timeout=180)
        if stopped.returncode != 0:
            log.warning("local_slurm.sh stop: %s %s", stopped.stdout, stopped.stderr)
        shutil.rmtree(folder, ignore_errors=True)


def _tail(path: Path, lines: int) -> str:
    """The last lines of a file, or a note that it does not exist."""
    if not path.exists():
        return f"({path} does not exist)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def diagnostics(cluster: Cluster, job_id: str, out_file: Path) -> str:
    """squeue, scontrol show job, the daemons' logs and the job's output, for a failure."""
    parts = []
    for cmd in (("squeue", "-a"), ("scontrol", "show", "job", job_id)):
        try:
            done = cluster.run(*cmd, check=False)
            parts.append(f"---- {' '.join(cmd)}\n{done.stdout}{done.stderr}")
        except subprocess.TimeoutExpired:
            parts.append(f"---- {' '.join(cmd)}: timed out")
    for daemon_log in sorted((cluster.folder / "log").glob("*.log")):
        if daemon_log.stat().st_size:
            parts.append(f"---- {daemon_log.name}\n{_tail(daemon_log, 30)}")
    parts.append(f"---- {out_file}\n{_tail(out_file, 60)}")
    return "\n".join(parts)


def metric_iterations(path: Path) -> list[int]:
    """The iterations in a metrics file, in file order (a line still being written is left out)."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")]
    return [json.loads(line)["iteration"] for line in lines]


def checkpoint_iteration(folder: Path) -> int | None:
    """The iteration of the newest complete checkpoint in `folder`, None if there is none."""
    try:
        return latest_iteration(folder)
    except ValueError:
        return None


def free_port() -> int:
    """A TCP port free right now (for torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_environment(cluster: Cluster, corpus_cache: Path) -> dict:
    """The script's variables for a tiny CPU job of 2 ranks on the embedded corpus."""
    env = dict(cluster.env)
    for name in ("OUT_DIR", "DATA_PATH", "REPO_DIR"):  # the script's defaults, as submitted
        env.pop(name, None)
    env.update(
        VENV_DIR=sys.prefix,  # the environment running the tests (.venv, or CI's .venv312)
        GPUS_PER_NODE="2",  # torchrun --nproc-per-node 2; no CUDA, so the ranks use gloo
        RDZV_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
        MODEL_ARGS="--num-layers 2 --hidden-size 64 --num-attention-heads 4 "
        "--group-query-attention --num-query-groups 2 --position-embedding-type rope "
        "--normalization RMSNorm --swiglu --disable-bias-linear",
        HDP_ARGS="--seq-length 2048 --hdp-capacity 1024 --hdp-global-batch-tokens 8192",
        TRAIN_ARGS=f"--train-iters {TRAIN_ITERS} --lr 3e-3 --min-lr 3e-4 "
        "--lr-decay-style cosine --lr-warmup-iters 3 --log-interval 1 --eval-interval 1000 "
        f"--eval-iters 1 --save-interval {SAVE_INTERVAL} --no-progress-bar "
        f"--data-cache-path {corpus_cache}",
    )
    return env


def test_the_sbatch_script_trains_is_requeued_and_resumes(slurm, corpus_cache, tmp_path):
    job_name = f"hdp-slurm-test-{uuid.uuid4().hex[:8]}"
    runs = REPO / "runs"
    runs_existed = runs.exists()
    out_pattern = tmp_path / "%x-%j.out"
    cpus = 2 if (os.cpu_count() or 1) >= 2 else 1
    # command-line options override the script's #SBATCH lines: 1 node, not 2; 2 CPUs, not 32;
    # no GPUs (--gpus-per-node=8 is refused by a cluster without GRES)
    submit = [
        "sbatch",
        "--parsable",
        f"--job-name={job_name}",
        "--nodes=1",
        "--ntasks-per-node=1",
        f"--cpus-per-task={cpus}",
        "--gpus-per-node=0",
        "--time=00:15:00",
        f"--output={out_pattern}",
        str(SBATCH),
    ]
    env = job_environment(slurm, corpus_cache)
    submitted = subprocess.run(
        submit, env=env, cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert submitted.returncode == 0, f"sbatch failed: {submitted.stderr}"
    job_id = submitted.stdout.strip().split(";")[0]
    out_dir = runs / f"{job_name}-{job_id}"  # the script's default: $REPO_DIR/runs/$NAME-$ID
    ckpt, metrics = out_dir / "checkpoints", out_dir / "metrics.jsonl"
    out_file = tmp_path / f"{job_name}-{job_id}.out"

    def diagnose():
        return diagnostics(slurm, job_id, out_file)

    def state():
        return slurm.job(job_id).get("JobState")

    started = time.monotonic()
    try:
        # Run 1: trains until its first checkpoint, then is requeued (and held, so that its
        # files can be read before run 2 starts): SLURM signals every process of the job.
        def first_checkpoint():
            if state() in ("FAILED", "COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                raise AssertionError(f"run 1 ended before its first checkpoint\n{diagnose()}")
            return checkpoint_iteration(ckpt)

        wait_for(first_checkpoint, 240, "run 1's first checkpoint", diagnose)
        assert state() == "RUNNING", f"run 1 is no longer running\n{diagnose()}"
        requeued = slurm.run("scontrol", "requeuehold", job_id, check=False)
        assert requeued.returncode == 0, f"{requeued.stderr}\n{diagnose()}"

        def pending_again():
            job = slurm.job(job_id)
            return job.get("JobState") == "PENDING" and job.get("Restarts") == "1"

        wait_for(
            pending_again,
            90,
            "run 1 to stop and the job to be pending again",
            diagnose,
        )
        run1 = metric_iterations(metrics)
        last = run1[-1] if run1 else None
        assert last is not None and SAVE_INTERVAL <= last < TRAIN_ITERS, (run1, diagnose())
        assert run1 == list(range(1, last + 1)), run1
        # the ranks saved the step they were on when SIGTERM came
        assert checkpoint_iteration(ckpt) == last, (checkpoint_iteration(ckpt), last, diagnose())
        run1_out = out_file.read_text()
        log.info("run 1 stopped at iteration %d after %.0f s", last, time.monotonic() - started)

        # Run 2: the same job id, so the same OUT_DIR; --hdp-load-if-exists resumes from it.
        released = slurm.run("scontrol", "release", job_id, check=False)
        assert released.returncode == 0, f"{released.stderr}\n{diagnose()}"
        wait_for(
            lambda: state() in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"),
            300,
            "run 2 to finish",
            diagnose,
        )
        job = slurm.job(job_id)
        assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), (
            diagnose()
        )
        out = out_file.read_text()
        assert out.startswith(run1_out), "run 2 erased run 1's output (--open-mode=append)"
        loaded = re.findall(r"loaded checkpoint (\S+) \(iteration (\d+)\)", out[len(run1_out) :])
        assert loaded == [(str(iteration_dir(ckpt, last)), str(last))], (loaded, diagnose())
        # run 2 continued from run 1's checkpoint: no iteration repeated, none skipped
        steps = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [s["iteration"] for s in steps] == list(range(1, TRAIN_ITERS + 1)), diagnose()
        assert checkpoint_iteration(ckpt) == TRAIN_ITERS
        losses = [s["loss"] for s in steps]
        assert all(math.isfinite(x) for x in losses), losses
        assert sum(losses[-5:]) / 5 < losses[0], losses  # it learns
        assert sorted(p.name for p in runs.glob(f"{job_name}-*")) == [out_dir.name]
        log.info("submit, requeue and resume took %.0f s", time.monotonic() - started)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
        if not runs_existed:
            with contextlib.suppress(OSError):
                runs.rmdir()  # only if empty: another run may have started meanwhile
