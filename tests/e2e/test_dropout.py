"""pretrain_hdp.py with attention and hidden dropout 0.1: every layout gives 1 rank's losses.

The masks are keyed by token identity (`attention.dropout`), so 2 ranks with rings (capacity
256: the 512-token sequences ring over both), tensor + sequence parallelism and two pipeline
stages draw the masks of the single process, and the losses and gradient norms agree.
"""

import pytest

from tests.e2e.harness import SMALL_MODEL, run_pretrain

DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]


def args(cache, *, capacity, extra=()):
    return [
        *SMALL_MODEL,
        "--seq-length",
        "512",
        "--hdp-capacity",
        str(capacity),
        "--train-iters",
        "3",
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
        # TP 2 pads the vocabulary to a multiple of 256: every run pads alike.
        "--make-vocab-size-divisible-by",
        "256",
        *extra,
    ]


def test_dropout_losses_equal_one_rank_with_rings_sequence_and_pipeline_parallelism(
    corpus_cache,
):
    single = run_pretrain(1, args(corpus_cache, capacity=512, extra=DROPOUT))
    rings = run_pretrain(2, args(corpus_cache, capacity=256, extra=DROPOUT))
    sp = run_pretrain(
        2,
        args(
            corpus_cache,
            capacity=512,
            extra=[*DROPOUT, "--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ),
    )
    pp = run_pretrain(
        2,
        args(corpus_cache, capacity=512, extra=[*DROPOUT, "--pipeline-model-parallel-size", "2"]),
    )
    plain = run_pretrain(1, args(corpus_cache, capacity=512))
    for run in (rings, sp, pp):
        assert [s["units"] for s in run] == [s["units"] for s in single]
        assert [s["loss"] for s in run] == pytest.approx([s["loss"] for s in single], rel=1e-5)
        assert [s["grad_norm"] for s in run] == pytest.approx(
            [s["grad_norm"] for s in single], rel=1e-5
        )
    # The dropout is there: without it the first step's loss (same weights, same batch) moves.
    assert abs(plain[0]["loss"] - single[0]["loss"]) > 1e-3


def test_dropout_run_resumes_exactly(corpus_cache, tmp_path):
    """Stop after step 2, resume: step 3 draws the uninterrupted run's masks of iteration 3."""
    ckpt = tmp_path / "ckpt"
    straight = run_pretrain(2, args(corpus_cache, capacity=256, extra=DROPOUT))
    first = run_pretrain(
        2,
        args(
            corpus_cache,
            capacity=256,
            extra=[*DROPOUT, "--save", str(ckpt), "--exit-interval", "2"],
        ),
    )
    second = run_pretrain(
        2, args(corpus_cache, capacity=256, extra=[*DROPOUT, "--load", str(ckpt)])
    )
    assert [s["iteration"] for s in first + second] == [1, 2, 3]
    assert [s["loss"] for s in first + second] == pytest.approx(
        [s["loss"] for s in straight], rel=1e-6
    )
