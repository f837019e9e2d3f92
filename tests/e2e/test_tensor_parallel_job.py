"""The training job with tensor-parallel replicas: same losses as TP 1, exact resume, torchrun."""

import subprocess

import pytest
import torch

from megatron_hdp.checkpoint_files import latest_iteration
from tests.e2e.harness import REPO, corpus_args, run_pretrain, saved_model, torchrun_command

TP2 = ["--tensor-model-parallel-size", "2"]


def job_args(cache, *, iters=4, extra=()):
    schedule = ["--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--min-lr", "1e-4"]
    return corpus_args(cache, iters=iters, lr="3e-3", extra=[*schedule, *extra])


def test_tp2_replicas_train_like_tp1_and_resume_exactly(corpus_cache, tmp_path):
    """TP=2 x pool 2 (4 ranks) gives the losses of TP=1 x pool 2; stop at 2 + resume = 1-4.

    Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP (257 ->
    512 with TP 2), and padded rows take part in the softmax, so the TP=1 run pads to 512 too.
    """
    tp1 = run_pretrain(2, job_args(corpus_cache, extra=["--make-vocab-size-divisible-by", "256"]))
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    tp2 = run_pretrain(4, job_args(corpus_cache, extra=[*TP2, "--save", str(straight_dir)]))
    assert [s["units"] for s in tp2] == [s["units"] for s in tp1]
    assert [s["loss"] for s in tp2] == pytest.approx([s["loss"] for s in tp1], rel=1e-5)
    extra = [*TP2, "--save", str(resumed_dir)]
    first = run_pretrain(4, job_args(corpus_cache, extra=[*extra, "--exit-interval", "2"]))
    second = run_pretrain(4, job_args(corpus_cache, extra=[*extra, "--load", str(resumed_dir)]))
    assert [s["iteration"] for s in first + second] == [1, 2, 3, 4]
    assert [s["loss"] for s in first + second] == pytest.approx([s["loss"] for s in tp2], rel=1e-6)
    a, b = saved_model(straight_dir / "iter_0000004"), saved_model(resumed_dir / "iter_0000004")
    assert a.keys() == b.keys()
    for key, value in a.items():  # both TP shards, as global tensors
        torch.testing.assert_close(b[key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_sequence_parallel_gives_the_same_losses(corpus_cache):
    plain = run_pretrain(4, job_args(corpus_cache, iters=2, extra=TP2))
    sp = run_pretrain(4, job_args(corpus_cache, iters=2, extra=[*TP2, "--sequence-parallel"]))
    assert [s["loss"] for s in sp] == pytest.approx([s["loss"] for s in plain], rel=1e-5)


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_a_tp2_checkpoint_resumes_at_tp1_with_the_losses_of_tp1(
    corpus_cache, tmp_path, distributed_optimizer
):
    """Saved at TP 2 x pool 2 after step 2, resumed at TP 1 x pool 2 (Megatron reshards the
    model and the optimizer on load): steps 3-4 give the losses of an uninterrupted TP 1 run
    of the same batches from the same weights (the layouts are exact, so TP 1 reaches the
    TP 2 run's state). The vocabulary pads to 512 in both layouts."""
    pad = ["--make-vocab-size-divisible-by", "256"]
    extra = [*pad]
    if distributed_optimizer:
        extra += ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]
    ckpt = tmp_path / "ckpt"
    reference = run_pretrain(2, job_args(corpus_cache, extra=extra))
    first = run_pretrain(
        4,
        job_args(
            corpus_cache,
            extra=[*extra, "--tensor-model-parallel-size", "2", "--save", str(ckpt)]
            + ["--exit-interval", "2", "--make-vocab-size-divisible-by", "128"],
        ),
    )
    second = run_pretrain(2, job_args(corpus_cache, extra=[*extra, "--load", str(ckpt)]))
    assert [s["iteration"] for s in first + second] == [1, 2, 3, 4]
    assert [s["loss"] for s in first + second] == pytest.approx(
        [s["loss"] for s in reference], rel=1e-5
    )


def test_a_dp_reshardable_optimizer_at_another_tp_size_is_refused_by_name(
    corpus_cache, tmp_path, monkeypatch, capsys
):
    import pretrain_hdp

    ckpt = tmp_path / "ckpt"
    extra = ["--use-distributed-optimizer", "--save", str(ckpt), "--exit-interval", "1"]
    run_pretrain(4, job_args(corpus_cache, iters=2, extra=[*TP2, *extra]))
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["--use-distributed-optimizer", "--load", str(ckpt), "--make-vocab-size-divisible-by"]
    with pytest.raises(SystemExit) as exit_info:
        pretrain_hdp.main(job_args(corpus_cache, iters=2, extra=[*argv, "256"]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "saved dp_reshardable" in err and "--dist-ckpt-optim-fully-reshardable" in err


def test_tp2_through_torchrun(corpus_cache, tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = torchrun_command(4, job_args(corpus_cache, iters=2, extra=[*TP2, "--save", str(ckpt)]))
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("iter 2/2") == 1  # one rank logs
    assert latest_iteration(ckpt) == 2
    assert (ckpt / "iter_0000002" / "metadata.json").exists()  # dist_checkpointing's
