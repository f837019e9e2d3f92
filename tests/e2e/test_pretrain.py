"""pretrain_hdp.py end to end on CPU: training, equivalence of placements, resume, data order."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_hdp.sharding import rank_token_counts
from tests.e2e.harness import (
    REPO,
    SMALL_MODEL,
    run_pretrain,
    run_pretrain_logged,
    saved_tensors,
)


def default_corpus_args(cache, *, capacity, iters=6, extra=()):
    return [
        *SMALL_MODEL,
        "--seq-length",
        "512",
        "--hdp-capacity",
        str(capacity),
        "--train-iters",
        str(iters),
        "--lr",
        "3e-3",
        "--lr-decay-style",
        "constant",
        "--hdp-global-batch-tokens",
        "2048",
        "--data-cache-path",
        str(cache),
        "--seed",
        "5",
        *extra,
    ]


def assert_loss_goes_down(steps):
    losses = [s["loss"] for s in steps]
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.1, losses


def check_summary(log: str, records: list[dict], world_size: int) -> None:
    """The summary's tokens/s and ranks per sequence, recomputed from the metrics file."""
    assert f"run summary: 6 steps (iterations 1-6) on a pool of {world_size} ranks" in log
    logged = re.search(r"throughput +([\d,]+) tokens/s", log)
    assert logged, log[-2000:]
    expected = sum(r["tokens"] for r in records) / sum(r["seconds"] for r in records)
    assert abs(float(logged.group(1).replace(",", "")) - expected) <= 0.5 + 1e-9
    ranks = sum(r["mean_ranks_per_sequence"] * r["num_sequences"] for r in records)
    mean = ranks / sum(r["num_sequences"] for r in records)
    widest = max(r["max_ranks_per_sequence"] for r in records)
    assert f"ranks/seq    mean {mean:.2f}, max {widest}" in log
    assert "predicted by the cost model" in log


def check_timeline(path, step: dict, world_size: int) -> None:
    """One entry per rank; each rank ran (and timed) exactly the micro-batches it holds."""
    record = json.loads(path.read_text())
    assert record["iteration"] == step["iteration"]
    assert [lane["rank"] for lane in record["ranks"]] == list(range(world_size))
    planned = {}
    for lane in record["ranks"]:
        rank, items = lane["rank"], lane["micro_batches"]
        holds = [
            rank_token_counts(m["lengths"], len(m["ring"]))[m["ring"].index(rank)] > 0
            for m in items
        ]
        timed = [m for m in items if "measured_start" in m]
        assert len(timed) == sum(holds) == lane["measured_count"] == lane["planned_count"]
        assert [("measured_start" in m) for m in items] == holds
        assert [m["order"] for m in items] == sorted(m["order"] for m in items)
        end = 0.0
        for m in timed:  # one after another, inside the rank's compute time
            assert end <= m["measured_start"] <= m["measured_end"]
            end = m["measured_end"]
        assert end <= lane["measured_compute_s"]
        for m in items:
            planned[m["order"]] = m["lengths"]
    # Every sequence of the step's batch is in exactly one micro-batch.
    lengths = sorted(n for lens in planned.values() for n in lens)
    assert lengths == sorted(u[3] for u in step["units"])
    static = record["static"]
    assert static is not None and len(static["ranks"]) == world_size


@pytest.mark.parametrize("world_size, capacity", [(1, 512), (2, 256), (4, 128)])
def test_trains_on_the_default_corpus(corpus_cache, tmp_path, world_size, capacity):
    """Also: the metrics file, the end-of-run summary, the timelines and the pictures."""
    metrics, log = tmp_path / "metrics.jsonl", tmp_path / "rank0.log"
    argv = default_corpus_args(
        corpus_cache,
        capacity=capacity,
        extra=["--hdp-metrics-file", str(metrics), "--hdp-timeline-interval", "3"],
    )
    steps = run_pretrain_logged(world_size, argv, log)
    assert len(steps) == 6
    assert_loss_goes_down(steps)
    assert all(s["tokens"] <= 2048 for s in steps)

    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [s["iteration"] for s in steps] == list(range(1, 7))
    # The ring bytes measured over every rank are what the formula predicts for the plan.
    assert [r["attention_bytes"] for r in records] == [
        r["attention_bytes_predicted"] for r in records
    ]
    if world_size == 4:  # sequences of up to 512 tokens need rings of up to 4 ranks
        assert sum(r["attention_bytes"] for r in records) > 0
        assert all(r["static_cp_size"] == 4 for r in records)
    check_summary(log.read_text(), records, world_size)

    timelines = sorted((tmp_path / "timelines").glob("step-*.json"))
    assert [p.name for p in timelines] == ["step-000003.json", "step-000006.json"]
    for path in timelines:
        check_timeline(path, steps[int(path.stem.split("-")[1]) - 1], world_size)

    if world_size == 4:
        done = subprocess.run(
            [sys.executable, "-m", "megatron_hdp.plot", str(tmp_path)],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        for name in ("curves.png", "timeline-step-000006.png"):
            png = tmp_path / "pictures" / name
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert 10_000 < png.stat().st_size < 200_000


def test_hdp_static_mesh_and_one_rank_give_the_same_losses(corpus_cache):
    hdp = run_pretrain(4, default_corpus_args(corpus_cache, capacity=128, iters=4))
    static = run_pretrain(
        4,
        default_corpus_args(
            corpus_cache, capacity=128, iters=4, extra=["--no-hdp", "--context-parallel-size", "4"]
        ),
    )
    single = run_pretrain(1, default_corpus_args(corpus_cache, capacity=512, iters=4))
    for a, b, c in zip(hdp, static, single, strict=True):
        assert a["units"] == b["units"] == c["units"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["loss"] == pytest.approx(c["loss"], rel=1e-5)


def test_overlapped_gradient_reduce_gives_the_same_losses(corpus_cache):
    """pretrain_hdp.py with --overlap-grad-reduce (several buckets) on the default corpus:
    the losses of the run without it."""
    args = default_corpus_args(corpus_cache, capacity=128, iters=4)
    plain = run_pretrain(4, args)
    overlapped = run_pretrain(4, args + ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"])
    assert [s["loss"] for s in overlapped] == pytest.approx([s["loss"] for s in plain], rel=1e-5)
    assert [s["grad_norm"] for s in overlapped] == pytest.approx(
        [s["grad_norm"] for s in plain], rel=1e-5
    )


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_resume_equals_uninterrupted(corpus_cache, tmp_path, distributed_optimizer):
    """Stop at step 3 (--exit-interval), resume to 5: same losses and parameters as 1-5."""
    extra = ["--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--min-lr", "1e-4"]
    if distributed_optimizer:
        extra.append("--use-distributed-optimizer")
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"

    def run(iters_extra):
        return run_pretrain(
            2, default_corpus_args(corpus_cache, capacity=256, iters=5, extra=extra + iters_extra)
        )

    straight = run(["--save", str(straight_dir)])
    first = run(["--save", str(resumed_dir), "--exit-interval", "3"])
    second = run(["--load", str(resumed_dir), "--save", str(resumed_dir)])
    assert [s["iteration"] for s in first + second] == [1, 2, 3, 4, 5]
    assert [s["loss"] for s in first + second] == pytest.approx(
        [s["loss"] for s in straight], rel=1e-6
    )
    assert [s["lr"] for s in first + second] == pytest.approx([s["lr"] for s in straight])
    a = saved_tensors(straight_dir / "iter_0000005")  # model and optimizer state
    b = saved_tensors(resumed_dir / "iter_0000005")
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    for name, value in a.items():
        if distributed_optimizer and name.startswith("optimizer."):
            continue  # flat bucket buffers whose padding is uninitialised memory
        torch.testing.assert_close(b[name], value, rtol=1e-6, atol=1e-7, msg=name)


#: 16-bit runs: bfloat16, and float16 with a dynamic loss scale that overflows at step 1
#: (halved), then grows after two clean steps (--loss-scale-window 2), across the resume.
SIXTEEN_BIT = {
    "bf16": ["--bf16"],
    "fp16": ["--fp16", "--initial-loss-scale", str(2**24), "--loss-scale-window", "2"]
    + ["--hysteresis", "1"],
}


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["optimizer", "distopt"])
@pytest.mark.parametrize("dtype", sorted(SIXTEEN_BIT))
def test_a_16_bit_run_resumes_exactly(corpus_cache, tmp_path, dtype, distributed_optimizer):
    """--bf16 / --fp16 (float32 norms, Megatron's mixed-precision optimizer): 4 steps saved
    at 2, resumed from the step-2 checkpoint for 2 more, on 2 ranks with rings: the losses,
    gradient norms, loss scales and the saved model and optimizer state of step 4 are the
    uninterrupted run's. The optimizer state is filed by Megatron-LM's keys, every model
    parameter's Adam moments and float32 main weight under its own name."""
    extra = [*SIXTEEN_BIT[dtype], "--save-interval", "2"]
    if distributed_optimizer:
        extra.append("--use-distributed-optimizer")
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"

    def run(more):
        args = default_corpus_args(corpus_cache, capacity=256, iters=4, extra=extra + more)
        return run_pretrain(2, args)

    straight = run(["--save", str(straight_dir)])
    resumed_dir.mkdir()
    shutil.copytree(straight_dir / "iter_0000002", resumed_dir / "iter_0000002")
    (resumed_dir / "latest_checkpointed_iteration.txt").write_text("2")
    second = run(["--load", str(resumed_dir), "--save", str(resumed_dir)])
    assert max(s["max_ranks_per_sequence"] for s in straight) == 2  # rings ran
    assert [s["iteration"] for s in second] == [3, 4]
    for key in ("loss", "grad_norm", "loss_scale", "skipped", "lr"):
        assert [s.get(key) for s in second] == [s.get(key) for s in straight[2:]], key
    if dtype == "fp16":  # the scaler's state came back: scale and clean-step count
        scales = [s["loss_scale"] for s in straight]
        assert scales[0] == 2.0**23 and len(set(scales)) > 1, scales
    a = saved_tensors(straight_dir / "iter_0000004")
    b = saved_tensors(resumed_dir / "iter_0000004")
    assert a.keys() == b.keys()
    norms = [k for k in a if not k.startswith("optimizer.") and "layernorm" in k]
    assert norms and all(a[k].dtype == torch.float32 for k in norms), norms  # not cast
    for name, value in a.items():
        if distributed_optimizer and name.startswith("optimizer."):
            continue  # flat bucket buffers whose padding is uninitialised memory
        torch.testing.assert_close(b[name], value, rtol=0, atol=0, msg=name)
    if not distributed_optimizer:
        weights = [k for k in a if not k.startswith("optimizer.") and "_extra_state" not in k]
        for kind in ("exp_avg", "exp_avg_sq", "fp32_param"):
            assert {f"optimizer.state.{kind}.{k}" for k in weights} <= a.keys(), kind
            for k in weights:
                assert a[f"optimizer.state.{kind}.{k}"].dtype == torch.float32, (kind, k)


def test_offloading_run_gives_the_same_losses(corpus_cache, tmp_path):
    """--hdp-offload on this machine's calibrated profile: the planner offloads where 1K
    sequences would otherwise take the whole pool of 4 (C = 256) one after another; bytes
    move to host memory, the losses stay those of the run without it, and every log
    interval and the summary say how many rings offloaded."""
    extra = [
        "--num-layers",
        "6",
        "--hidden-size",
        "128",
        "--seq-length",
        "1024",
        "--hdp-global-batch-tokens",
        "4096",
        "--hdp-device-profile",
        str(REPO / "results" / "cpu_profile.json"),
        "--hdp-host-memory-gb",
        "1",
        "--seed",
        "15",
    ]
    plain = run_pretrain(4, default_corpus_args(corpus_cache, capacity=256, iters=2, extra=extra))
    log = tmp_path / "offload.log"
    offloaded = run_pretrain_logged(
        4,
        default_corpus_args(corpus_cache, capacity=256, iters=2, extra=[*extra, "--hdp-offload"]),
        log,
    )
    assert offloaded[-1]["offloaded_bytes"] > 0 and plain[-1]["offloaded_bytes"] == 0
    assert "offload_rings" not in plain[0]
    assert any(s["offload_rings"] > 0 for s in offloaded), offloaded
    for s in offloaded:  # measured bytes exactly where the plan offloads
        assert (s["offload_bytes"] > 0) == (s["offload_rings"] > 0), s
    assert [s["loss"] for s in offloaded] == pytest.approx([s["loss"] for s in plain], rel=1e-5)
    text = log.read_text()
    assert "--hdp-offload: each step the planner offloads a long sequence's ring only" in text
    rings = sum(s["offload_rings"] for s in offloaded)
    total = sum(s["offload_rings_total"] for s in offloaded)
    assert f"iter 2 | offloaded {offloaded[-1]['offload_rings']} of " in text, text[-3000:]
    assert f"  offloading   offloaded {rings} of {total} rings in 2 steps, " in text
    assert "never offloaded" not in text


def test_a_run_that_never_offloads_says_so(corpus_cache, tmp_path):
    """--hdp-offload where no ring can shrink: the run ends with one line saying offloading
    never happened, and why."""
    log = tmp_path / "never.log"
    # 512-token sequences at C = 256: rings of 2, which never shrink.
    argv = default_corpus_args(
        corpus_cache, capacity=256, iters=2, extra=["--hdp-offload", "--hdp-device-profile", "cpu"]
    )
    records = run_pretrain_logged(2, argv, log)
    assert all(r["offload_rings"] == 0 and r["offload_bytes"] == 0 for r in records)
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    total = sum(r["offload_rings_total"] for r in records)
    reason = records[-1]["offload_reason"]
    assert reason.startswith("no ring can shrink") or total == 0, records
    assert lines[-1] == f"--hdp-offload never offloaded in 2 steps ({total} rings): {reason}"
    # No --hdp-host-memory-gb: the pool is half the available memory over the local ranks
    # (LOCAL_WORLD_SIZE: 1 for these forked ranks; the smallest any rank saw), logged once.
    pool = re.search(
        r"each process holds a host pool of ([\d.]+) GiB for offloaded activations, allocated "
        r"once \(not pinned on CPU\) \(default: 50% of the ([\d.]+) GiB available on this "
        r"machine, shared by (\d+) local process",
        log.read_text(),
    )
    assert pool, log.read_text()[-3000:]
    share = float(pool.group(2)) / 2 / int(pool.group(3))
    assert float(pool.group(1)) == pytest.approx(share, abs=0.06)


def test_a_distributed_optimizer_checkpoint_resumes_at_another_pool_size(corpus_cache, tmp_path):
    """Saved by a pool of 2 with the distributed optimizer (dp_reshardable, Megatron-LM's
    default) after step 3, resumed by a pool of 3 (Megatron reshards the optimizer state
    over the pool on load): steps 4-5 give the losses of an uninterrupted pool-2 run (HDP is
    exact at any pool size)."""
    extra = ["--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--min-lr", "1e-4"]
    extra.append("--use-distributed-optimizer")
    ckpt = tmp_path / "ckpt"

    def run(ranks, more):
        args = default_corpus_args(corpus_cache, capacity=256, iters=5, extra=extra + more)
        return run_pretrain(ranks, args)

    reference = run(2, [])
    first = run(2, ["--save", str(ckpt), "--exit-interval", "3"])
    second = run(3, ["--load", str(ckpt)])
    assert [s["iteration"] for s in first + second] == [1, 2, 3, 4, 5]
    assert [s["loss"] for s in first + second] == pytest.approx(
        [s["loss"] for s in reference], rel=1e-5
    )


def test_an_async_saved_checkpoint_resumes_exactly(corpus_cache, tmp_path):
    """--async-save: the sharded writes run in the background; the job publishes the last
    checkpoint before it exits, and resuming it gives the uninterrupted run's losses."""
    extra = ["--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--min-lr", "1e-4"]
    ckpt = tmp_path / "ckpt"

    def run(more):
        args = default_corpus_args(corpus_cache, capacity=256, iters=5, extra=extra + more)
        return run_pretrain(2, args)

    reference = run([])
    first = run(
        ["--save", str(ckpt), "--save-interval", "1", "--exit-interval", "3", "--async-save"]
    )
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == [f"iter_000000{i}" for i in (1, 2, 3)]
    second = run(["--load", str(ckpt)])
    assert [s["iteration"] for s in first + second] == [1, 2, 3, 4, 5]
    assert [s["loss"] for s in first + second] == pytest.approx(
        [s["loss"] for s in reference], rel=1e-6
    )
