"""The training job with pipelined replicas: the losses of PP 1, exact resume, static mesh."""

import subprocess

import pytest
import torch

from megatron_hdp.checkpoint_files import latest_iteration
from tests.e2e.harness import REPO, corpus_args, run_pretrain, saved_model, torchrun_command

PP2 = ["--pipeline-model-parallel-size", "2"]


def job_args(cache, *, iters=4, extra=()):
    schedule = ["--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--min-lr", "1e-4"]
    return corpus_args(cache, iters=iters, lr="3e-3", extra=[*schedule, *extra])


def test_pp2_pipelines_train_like_pp1_and_resume_exactly(corpus_cache, tmp_path):
    """PP=2 x pool 2 (4 ranks, PP-Balance) gives the losses of PP=1 x pool 2 (DP-Balance) on
    the same batches; stop at 2 + resume = 1-4, every stage's shard restored."""
    pp1 = run_pretrain(2, job_args(corpus_cache))
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    pp2 = run_pretrain(4, job_args(corpus_cache, extra=[*PP2, "--save", str(straight_dir)]))
    assert [s["units"] for s in pp2] == [s["units"] for s in pp1]
    assert [s["loss"] for s in pp2] == pytest.approx([s["loss"] for s in pp1], rel=1e-5)
    assert any(s["max_ranks_per_sequence"] > 1 for s in pp2)  # rings span pipelines
    extra = [*PP2, "--save", str(resumed_dir)]
    first = run_pretrain(4, job_args(corpus_cache, extra=[*extra, "--exit-interval", "2"]))
    second = run_pretrain(4, job_args(corpus_cache, extra=[*extra, "--load", str(resumed_dir)]))
    assert [s["iteration"] for s in first + second] == [1, 2, 3, 4]
    assert [s["loss"] for s in first + second] == pytest.approx([s["loss"] for s in pp2], rel=1e-6)
    a, b = saved_model(straight_dir / "iter_0000004"), saved_model(resumed_dir / "iter_0000004")
    assert a.keys() == b.keys()
    for key, value in a.items():  # both stages' layers, as global tensors
        torch.testing.assert_close(b[key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert latest_iteration(resumed_dir) == 4


def test_static_mesh_with_pipelines_gives_the_static_losses(corpus_cache):
    """The baseline: DP 1 x CP 2 of two pipelines (every pack is a ring over both)."""
    static = ["--no-hdp", "--context-parallel-size", "2"]
    pp1 = run_pretrain(2, job_args(corpus_cache, iters=2, extra=static))
    pp2 = run_pretrain(4, job_args(corpus_cache, iters=2, extra=[*static, *PP2]))
    assert [s["loss"] for s in pp2] == pytest.approx([s["loss"] for s in pp1], rel=1e-5)


def test_a_pp2_checkpoint_resumes_at_pp1_with_another_pool_size(corpus_cache, tmp_path):
    """Saved at PP 2 x pool 2 after step 2, resumed at PP 1 x pool 3 (Megatron reshards the
    layers over the stages on load): steps 3-4 give the losses of an uninterrupted PP 1
    x pool 2 run from the same weights (the layouts are exact, so it reaches the same state)."""
    ckpt = tmp_path / "ckpt"
    reference = run_pretrain(2, job_args(corpus_cache))
    first = run_pretrain(
        4, job_args(corpus_cache, extra=[*PP2, "--save", str(ckpt), "--exit-interval", "2"])
    )
    second = run_pretrain(3, job_args(corpus_cache, extra=["--load", str(ckpt)]))
    assert [s["iteration"] for s in first + second] == [1, 2, 3, 4]
    assert [s["loss"] for s in first + second] == pytest.approx(
        [s["loss"] for s in reference], rel=1e-5
    )


def test_pp2_through_torchrun(corpus_cache, tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = torchrun_command(4, job_args(corpus_cache, iters=2, extra=[*PP2, "--save", str(ckpt)]))
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("iter 2/2") == 1  # one rank logs
    assert latest_iteration(ckpt) == 2
    assert (ckpt / "iter_0000002" / "metadata.json").exists()  # dist_checkpointing's
