"""The Ray data service on a real local Ray cluster (`ray start --head`, 2 CPUs, 100 MB store).

One curriculum data spec drives every run: an indexed source and a raw JSONL source that
the loaders tokenize, length buckets, and a schedule that trains on the indexed source's
short sequences for 3 steps, then on the JSONL source (two loaders) with a little of the
indexed one. The in-process loader's run is the reference:

- the Ray service gives the same batches and bit-identical losses;
- a source loader killed mid-run is replaced by its shadow, training goes on, and the
  batches are still the reference's: every document exactly once per epoch (checked
  against the JSONL file's own documents);
- a run stopped after 3 steps and resumed gives the reference's last 3 steps;
- a killed planner actor is restarted and training goes on; killed again, every rank
  stops with one line;
- the mix changes at the scheduled step (checked from the units each step trained on).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.harness import SMALL_MODEL, run_pretrain

VENV_BIN = Path(sys.executable).parent
STEPS = 8
SWITCH = 3  # the schedule's first phase ends after this step
SEQ = 512


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A local Ray head started as users start one; stopped (it and its processes) after."""
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    temp = tmp_path_factory.mktemp("ray")
    start = [
        str(VENV_BIN / "ray"), "start", "--head", f"--port={port}", "--num-cpus=2",
        "--object-store-memory=100000000", "--include-dashboard=false",
        "--disable-usage-stats", f"--temp-dir={temp}",
    ]  # fmt: skip
    done = subprocess.run(start, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        yield f"127.0.0.1:{port}"
    finally:
        _stop_cluster(temp, port)


def _stop_cluster(temp: Path, port: int) -> None:
    """Stop this test's Ray head and its processes only (`ray stop` would stop every Ray
    cluster of this user on the machine): those whose command line names its temp folder
    or its port, and their descendants (the raylet's agents and workers)."""
    import psutil

    roots = []
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if str(temp) in line or f"127.0.0.1:{port}" in line or f":{port} " in f"{line} ":
            roots.append(proc)
    procs = {proc.pid: proc for proc in roots}
    for proc in roots:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.update({child.pid: child for child in proc.children(recursive=True)})
    procs.pop(os.getpid(), None)
    for proc in procs.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(list(procs.values()), timeout=15)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory) -> Path:
    """The curriculum spec and its two sources, written by the test."""
    from megatron_hdp.data.indexed import write_indexed_dataset

    folder = tmp_path_factory.mktemp("spec")
    rng = np.random.default_rng(7)
    docs = [rng.integers(0, 256, size=int(n)).astype(np.int32) for n in rng.integers(20, 900, 60)]
    docs = [np.append(d, np.int32(256)) for d in docs]
    write_indexed_dataset(folder / "indexed", docs, vocab_size=257)
    words = ["alpha", "beta", "gamma", "delta", "ring", "pack", "zigzag", "rank"]
    with open(folder / "docs.jsonl", "w") as out:
        for k in range(10):  # about 2,000 tokens: the run trains on 2 epochs of them
            n = int(rng.integers(3, 60))
            text = " ".join(words[int(i)] for i in rng.integers(0, len(words), n))
            out.write(json.dumps({"text": f"doc {k}: {text}"}) + "\n")
    spec = {
        "sources": [
            {"name": "indexed", "path": "indexed", "weight": 1.0},
            {"name": "docs", "jsonl": "docs.jsonl", "weight": 1.0, "loaders": 2},
        ],
        "length_buckets": [{"name": "short", "max_tokens": 256}, {"name": "long"}],
        "schedule": [
            {"until_step": SWITCH, "weights": {"indexed/short": 1.0}},
            {"until_step": 100, "weights": {"docs": 0.9, "indexed": 0.1}},
        ],
    }
    (folder / "spec.json").write_text(json.dumps(spec))
    return folder / "spec.json"


def _args(spec_path, cache, *, extra=()) -> list[str]:
    return [
        *SMALL_MODEL,
        "--seq-length", str(SEQ), "--hdp-capacity", "256", "--hdp-global-batch-tokens", "1024",
        "--train-iters", str(STEPS), "--lr", "1e-3", "--seed", "5",
        "--hdp-data-spec", str(spec_path), "--split", "100,0,0",
        "--data-cache-path", str(cache), *extra,
    ]  # fmt: skip


def _ray(address) -> list[str]:
    return ["--hdp-data-service", "ray", "--hdp-ray-address", address]


@pytest.fixture(scope="module")
def reference(spec_path, tmp_path_factory):
    """The in-process loader's run: per-step records of rank 0."""
    return run_pretrain(2, _args(spec_path, tmp_path_factory.mktemp("cache")))


def _losses(steps) -> list[str]:
    return [repr(s["loss"]) for s in steps]


def _units(steps) -> list[list[tuple]]:
    return [[tuple(u) for u in s["units"]] for s in steps]


def test_curriculum_changes_the_mix_at_the_scheduled_step(reference):
    sources = [Counter(u[0] for u in units) for units in _units(reference)]
    assert all(set(c) == {0} for c in sources[:SWITCH]), sources
    later = sum(sources[SWITCH:], Counter())
    assert later[1] > 4 * later[0] > 0, sources  # 0.9 vs 0.1 token shares
    short = [u[3] for units in _units(reference)[:SWITCH] for u in units]
    assert max(short) <= 256, short  # the "short" bucket only


def test_ray_service_gives_the_in_process_batches_and_losses(spec_path, ray_cluster, reference):
    steps = run_pretrain(2, _args(spec_path, spec_path.parent / "c1", extra=_ray(ray_cluster)))
    assert _units(steps) == _units(reference)
    assert _losses(steps) == _losses(reference)
    # the loaders' measurements ride on every logged step's record (--log-interval 1)
    last = steps[-1]["data_service"]
    assert [(r["source"], r["slot"], r["role"]) for r in last] == [
        ("indexed", 0, "loader"), ("docs", 0, "loader"), ("docs", 1, "loader"),
        ("indexed", None, "shadow"), ("docs", None, "shadow"),
    ]  # fmt: skip
    assert all(r["tokens"] > 0 for r in last if r["role"] == "loader")  # both docs parts read
    assert all(r["tokens"] == 0 for r in last if r["role"] == "shadow")
    # the planner's scaling log rides along; fixed loader counts: nothing measured or decided
    assert all(s["data_scaling"] == {"samples": [], "decisions": []} for s in steps)


def test_ranks_hold_lengths_and_evaluation_batches_come_from_the_loaders(spec_path, ray_cluster):
    """With the service a rank holds its sources' lengths only (`LengthsOnly`: a token read
    on a rank fails the run), evaluation included; the JSONL source's lengths index, cached
    nowhere yet, is built once in the cluster. Batches, losses and validation losses are
    the in-process loader's."""
    extra = ["--split", "80,20,0", "--train-iters", "4", "--eval-interval", "2"]
    cache = spec_path.parent / "c6"
    reference = run_pretrain(2, _args(spec_path, spec_path.parent / "c6ref", extra=extra))
    steps = run_pretrain(2, _args(spec_path, cache, extra=[*extra, *_ray(ray_cluster)]))
    assert ["valid_loss" in s for s in reference] == [False, True, False, True]
    assert [repr(s.get("valid_loss")) for s in steps] == [
        repr(s.get("valid_loss")) for s in reference
    ]
    assert _units(steps) == _units(reference) and _losses(steps) == _losses(reference)
    # an on_open JSONL source: only the cluster's indexer writes a lengths index for it
    assert len(list((cache / "lengths").glob("*.npz"))) == 1


KILLER = textwrap.dedent(
    """
    import sys, time, ray
    ray.init(address=sys.argv[1], namespace="megatron_hdp", log_to_driver=False)
    deadline = time.monotonic() + 240
    planner = None
    while planner is None and time.monotonic() < deadline:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith("planner-")]
        if names:
            planner = ray.get_actor(names[0], namespace="megatron_hdp")
        time.sleep(0.1)
    while ray.get(planner.status.remote())["produced"] < 3:
        time.sleep(0.05)
    victim = ray.get(planner.loader_handles.remote())[1][0]
    ray.kill(victim, no_restart=True)
    print("killed", flush=True)
    while time.monotonic() < deadline:
        status = ray.get(planner.status.remote())
        if status["replaced"]:
            print("replaced", status["replaced"], flush=True)
            break
        time.sleep(0.05)
    """
)


def _jsonl_units(path: Path) -> Counter:
    """Every (doc, start, length) unit of the JSONL source, from the file itself."""
    units = Counter()
    with open(path, "rb") as f:
        for doc, line in enumerate(x for x in f if x.strip()):
            inputs = len(json.loads(line)["text"].encode()) + 1 - 1  # + eod, - the last label
            for start in range(0, inputs, SEQ):
                units[(doc, start, min(SEQ, inputs - start))] += 1
    return units


def test_a_killed_source_loader_is_replaced_and_no_document_is_lost(
    spec_path, ray_cluster, reference
):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    killer = subprocess.Popen(
        [sys.executable, "-c", KILLER, ray_cluster],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        steps = run_pretrain(
            2,
            _args(spec_path, spec_path.parent / "c2", extra=_ray(ray_cluster)),
        )
        out, _ = killer.communicate(timeout=60)
    finally:
        killer.kill()
    assert "killed" in out and "replaced" in out, out
    assert _units(steps) == _units(reference)
    assert _losses(steps) == _losses(reference)
    # Every JSONL document once per epoch: the units drawn, epoch by epoch, are the file's.
    drawn = [u[1:] for units in _units(steps) for u in units if u[0] == 1]
    expected = _jsonl_units(spec_path.parent / "docs.jsonl")
    per_epoch = sum(expected.values())
    assert len(drawn) > per_epoch, "the run should finish an epoch of the JSONL source"
    for first in range(0, len(drawn), per_epoch):
        epoch = Counter(drawn[first : first + per_epoch])
        assert max(epoch.values()) == 1
        assert set(epoch) <= set(expected)
        if first + per_epoch <= len(drawn):
            assert epoch == expected


def test_stop_and_resume_on_the_service_is_identical(spec_path, ray_cluster, reference):
    save = spec_path.parent / "ckpt"
    shutil.rmtree(save, ignore_errors=True)
    cache = spec_path.parent / "c3"
    extra = [*_ray(ray_cluster), "--save", str(save), "--save-interval", "3"]
    first = run_pretrain(2, _args(spec_path, cache, extra=[*extra, "--exit-interval", "3"]))
    second = run_pretrain(2, _args(spec_path, cache, extra=[*extra, "--load", str(save)]))
    assert [s["iteration"] for s in second] == list(range(4, STEPS + 1))
    assert _losses(first + second) == _losses(reference)
    assert _units(first + second) == _units(reference)


KILL_PLANNER = textwrap.dedent(
    """
    import pathlib, sys, time, ray
    ray.init(address=sys.argv[1], namespace="megatron_hdp", log_to_driver=False)
    deadline = time.monotonic() + 240
    planner = None
    while planner is None and time.monotonic() < deadline:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith("planner-")]
        if names:
            planner = ray.get_actor(names[0], namespace="megatron_hdp")
        time.sleep(0.1)
    tracker = pathlib.Path(sys.argv[2]) / "latest_checkpointed_iteration.txt"
    def saved():
        return int(tracker.read_text() or 0) if tracker.exists() else 0
    while saved() < 2:  # mid-run
        time.sleep(0.05)
    ray.kill(planner, no_restart=False)  # a crash: Ray restarts it
    print("killed at", saved(), flush=True)
    status = {}
    while time.monotonic() < deadline:
        try:
            status = ray.get(planner.status.remote())
        except ray.exceptions.RayActorError:
            pass
        if status.get("restarted") and saved() >= 5:  # training went on after the restart
            break
        time.sleep(0.1)
    print("restarted", status, "saved", saved(), flush=True)
    ray.kill(planner, no_restart=False)  # its one restart is spent
    print("killed again", flush=True)
    """
)


def test_a_killed_planner_actor_is_restarted_and_a_second_death_stops_every_rank_with_one_line(
    spec_path, ray_cluster, tmp_path, capfd
):
    """Before: one planner death stopped every rank. Now Ray restarts it and training goes
    on (the restarted planner resumes from the ranks' sampler state; bit-identical batches:
    `test_ray_partitioned_fetch.py`); a second death stops every rank with one line."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    ckpt = tmp_path / "ckpt"
    killer = subprocess.Popen(
        [sys.executable, "-c", KILL_PLANNER, ray_cluster, str(ckpt)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    extra = [*_ray(ray_cluster), "--save", str(ckpt), "--save-interval", "1"]
    extra += ["--train-iters", "100"]  # the whole schedule: running when the planner dies
    try:
        with pytest.raises(AssertionError) as failure:
            run_pretrain(2, _args(spec_path, spec_path.parent / "c4", extra=extra))
        out, _ = killer.communicate(timeout=60)
    finally:
        killer.kill()
    assert "killed at" in out and "'restarted': True" in out and "killed again" in out, out
    first_kill = int(out.split("killed at", 1)[1].split()[0])
    assert "rank 0 failed" in str(failure.value) and "rank 1 failed" in str(failure.value)
    lines = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 2 and lines[0] == lines[1], lines
    assert lines[0].startswith("pretrain_hdp.py: error: rank ")
    # Its loaders die with it: a rank learns it reading tokens or asking for the next batch.
    assert "the data service's planner actor, asked " in lines[0]
    assert "the actor died (ActorDiedError: The actor died unexpectedly" in lines[0]
    assert "Ray restarts it at most 1 time(s) and it is not coming back" in lines[0]
    latest = int(lines[0].split("The latest checkpoint is iteration ")[1].split()[0])
    assert latest >= max(5, first_kill + 3) and str(ckpt) in lines[0]  # went on after the first


def test_a_dead_ray_head_ends_the_ranks_with_one_line_from_the_job(spec_path, tmp_path, capfd):
    """Ray ends each rank from inside its core worker when the head dies (no Python runs):
    before, the job stopped with no line of its own. A head of its own, killed (SIGKILL, as
    a lost node) once iteration 2 is saved."""
    import psutil  # Ray's own dependency

    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    temp = Path(tempfile.mkdtemp(prefix="rayh"))  # short: Ray's socket paths must fit 107 bytes
    start = [
        str(VENV_BIN / "ray"), "start", "--head", f"--port={port}", "--num-cpus=2",
        "--object-store-memory=100000000", "--include-dashboard=false",
        "--disable-usage-stats", f"--temp-dir={temp}",
    ]  # fmt: skip
    done = subprocess.run(start, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    ckpt = tmp_path / "ckpt"

    def head_processes():
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if str(temp) in " ".join(proc.info["cmdline"] or []):
                    found.append(proc)
        return found

    def kill_head_after_iteration_2():
        tracker = ckpt / "latest_checkpointed_iteration.txt"
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            if tracker.exists() and int(tracker.read_text() or 0) >= 2:
                break
            time.sleep(0.05)
        for proc in head_processes():
            with contextlib.suppress(psutil.Error):
                proc.kill()

    killer = threading.Thread(target=kill_head_after_iteration_2, daemon=True)
    killer.start()
    extra = [*_ray(f"127.0.0.1:{port}"), "--save", str(ckpt), "--save-interval", "1"]
    extra += ["--train-iters", "100"]
    try:
        with pytest.raises(AssertionError) as failure:
            run_pretrain(2, _args(spec_path, spec_path.parent / "c5", extra=extra))
    finally:
        killer.join(timeout=1)
        for proc in head_processes():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        shutil.rmtree(temp, ignore_errors=True)
    assert "died with exit code 1" in str(failure.value)  # Ray's own exit, as before
    lines = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
    assert lines, "no line from the job"
    assert len(set(lines)) == 1, lines
    assert lines[0].startswith(
        f"pretrain_hdp.py: error: the Ray cluster at 127.0.0.1:{port} went away (its head or "
        "this node's raylet stopped) and Ray ended the job's ranks. The latest checkpoint is "
        "iteration "
    )
    assert lines[0].endswith(f" in {ckpt}.")
