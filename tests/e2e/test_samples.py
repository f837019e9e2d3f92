"""pretrain_hdp.py counts Megatron-LM's samples of --seq-length tokens.

--global-batch-size with --rampup-batch-size, --train-samples and --lr-*-samples: each
step trains whole sequences up to its ramped batch size x --seq-length tokens, the run has
Megatron-LM's number of steps, the learning rate follows the samples consumed (written
out by hand from Megatron-Core's linear schedule), and a resume is exact.
"""

import numpy as np
import pytest

from tests.e2e.harness import corpus_args, run_pretrain

LR, MIN_LR, WARMUP = 1e-3, 1e-4, 2
#: --global-batch-size 4 --rampup-batch-size 2 2 4: one increment after 4 samples; consumed
#: 0 -> 2, 2 -> 2, 4 -> 4 (not past 4), 8 -> 4. --train-samples 18: the ramp's 3 steps
#: consume 8, then (18 - 8) // 4 = 2 steps (Megatron-LM's update_train_iters).
SIZES = [2, 2, 4, 4, 4]


def samples_args(cache, extra=()):
    argv = corpus_args(cache, iters=1, lr=str(LR))
    for flag in ("--train-iters", "--hdp-global-batch-tokens"):
        at = argv.index(flag)
        del argv[at : at + 2]
    return [
        *argv,
        *["--global-batch-size", "4", "--rampup-batch-size", "2", "2", "4"],
        *["--train-samples", "18", "--lr-warmup-samples", str(WARMUP)],
        *["--lr-decay-style", "linear", "--min-lr", str(MIN_LR)],
        *extra,
    ]


def megatron_lr(consumed):
    """Megatron-Core's OptimizerParamScheduler.get_lr, linear, init 0, decay over 18."""
    if consumed <= WARMUP:
        return LR * consumed / WARMUP
    ratio = min(1.0, (consumed - WARMUP) / (18 - WARMUP))
    return MIN_LR + (1.0 - ratio) * (LR - MIN_LR)


def test_steps_tokens_and_learning_rate_follow_the_samples(corpus_cache, tmp_path):
    steps = run_pretrain(2, samples_args(corpus_cache))
    assert [s["iteration"] for s in steps] == list(range(1, len(SIZES) + 1))
    for step, samples in zip(steps, SIZES, strict=True):
        trained = sum(u[3] for u in step["units"])
        assert samples * 512 - 512 < trained <= samples * 512, (step["iteration"], trained)
    consumed = np.cumsum(SIZES)
    assert [s["lr"] for s in steps] == pytest.approx([megatron_lr(c) for c in consumed])

    ckpt = str(tmp_path / "ckpt")
    first = run_pretrain(2, samples_args(corpus_cache, ["--save", ckpt, "--exit-interval", "2"]))
    second = run_pretrain(2, samples_args(corpus_cache, ["--load", ckpt, "--save", ckpt]))
    resumed = first + second
    assert [s["iteration"] for s in resumed] == [1, 2, 3, 4, 5]
    assert [s["loss"] for s in resumed] == pytest.approx([s["loss"] for s in steps], rel=1e-6)
    assert [s["lr"] for s in resumed] == pytest.approx([s["lr"] for s in steps])
    assert [s["units"] for s in resumed] == [s["units"] for s in steps]
