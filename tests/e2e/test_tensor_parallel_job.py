"""The training job with tensor-parallel replicas: same losses as TP 1, exact resume, torchrun."""

import subprocess

import pytest
import torch

from megatron_hdp.checkpoint_files import latest_iteration
from tests.e2e.harness import REPO, corpus_args, run_pretrain, torchrun_command

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
    for name in ("common.pt", "model_tp1.pt"):  # both TP shards, from the first replica
        a = torch.load(straight_dir / "iter_0000004" / name, weights_only=False)["model"]
        b = torch.load(resumed_dir / "iter_0000004" / name, weights_only=False)["model"]
        for key, value in a.items():
            if torch.is_tensor(value):
                torch.testing.assert_close(b[key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_sequence_parallel_gives_the_same_losses(corpus_cache):
    plain = run_pretrain(4, job_args(corpus_cache, iters=2, extra=TP2))
    sp = run_pretrain(4, job_args(corpus_cache, iters=2, extra=[*TP2, "--sequence-parallel"]))
    assert [s["loss"] for s in sp] == pytest.approx([s["loss"] for s in plain], rel=1e-5)


def test_a_resume_with_another_tp_size_is_refused(corpus_cache, tmp_path, monkeypatch, capsys):
    import pretrain_hdp

    ckpt = tmp_path / "ckpt"
    extra = ["--save", str(ckpt), "--exit-interval", "1"]
    run_pretrain(4, job_args(corpus_cache, iters=2, extra=[*TP2, *extra]))
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as exit_info:
        pretrain_hdp.main(job_args(corpus_cache, iters=2, extra=["--load", str(ckpt)]))
    assert exit_info.value.code == 2
    assert "--tensor-model-parallel-size: 2 -> 1" in capsys.readouterr().err


def test_tp2_through_torchrun(corpus_cache, tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = torchrun_command(4, job_args(corpus_cache, iters=2, extra=[*TP2, "--save", str(ckpt)]))
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("iter 2/2") == 1  # one rank logs
    assert latest_iteration(ckpt) == 2
    assert sorted(p.name for p in (ckpt / "iter_0000002").glob("model_tp*.pt")) == ["model_tp1.pt"]
