"""pretrain_hdp.py --fp16: Megatron's mixed-precision optimizer and loss scaler.

The loss HDP back-propagates is the global token mean (each rank's token-loss sum over the
global loss-token count) times the optimizer's loss scale, so the scale means what it means
in stock Megatron-LM; the optimizer divides it out, skips a step whose gradients overflow
and updates a dynamic scale. Two ranks with rings equal one rank.
"""

from __future__ import annotations

import pytest

from tests.e2e.harness import run_pretrain
from tests.megatron_lm.harness import SHARED, write_documents


@pytest.fixture(scope="module")
def flags(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("fp16") / "docs"
    write_documents(prefix)
    return [*SHARED, "--data-path", str(prefix), "--global-batch-size", "4", "--no-progress-bar"]


def _close(got, want, rel):
    assert len(got) == len(want) > 0, (got, want)
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=rel), (got, want)


def test_dynamic_loss_scale_on_rings_equals_one_rank(flags):
    """From a scale of 2**24 the float16 gradients overflow: the step is skipped (its norm is
    None) and the scale halves (--hysteresis 1); after two clean steps (--loss-scale-window
    2) it doubles. Two ranks with rings, and PP 2 x a pool of 2 on four, skip the same
    steps with the same scales as one rank, with the same losses and gradient norms within
    float16 rounding."""
    dynamic = ["--fp16", "--initial-loss-scale", str(2**24), "--loss-scale-window", "2"]
    dynamic += ["--hysteresis", "1", "--train-iters", "6"]
    rings = run_pretrain(2, [*flags, *dynamic, "--hdp-capacity", "256"])
    single = run_pretrain(1, [*flags, *dynamic, "--hdp-capacity", "512"])
    assert max(r["max_ranks_per_sequence"] for r in rings) == 2  # rings ran
    scales = [(r["loss_scale"], r["skipped"]) for r in rings]
    assert scales == [(r["loss_scale"], r["skipped"]) for r in single]
    assert scales[0] == (2.0**23, True), scales  # overflowed at 2**24: skipped, halved
    assert [r["grad_norm"] is None for r in rings] == [k for _, k in scales]
    assert not all(k for _, k in scales), scales
    # (the scale each record holds is the one after its step)
    for (scale, _), (after, skipped) in zip(scales, scales[1:]):
        if skipped:
            assert after == scale / 2, scales
    assert any(b > a for (a, _), (b, _) in zip(scales, scales[1:])), scales  # grew
    # PP 2 x pool 2: the scaled loss goes through Megatron-Core's 1F1B.
    pipelined = run_pretrain(
        4, [*flags, *dynamic, "--hdp-capacity", "256", "--pipeline-model-parallel-size", "2"]
    )
    assert [(r["loss_scale"], r["skipped"]) for r in pipelined] == scales
    for run in (rings, pipelined):
        _close([r["loss"] for r in run], [r["loss"] for r in single], rel=1e-4)
        norms = [(a["grad_norm"], b["grad_norm"]) for a, b in zip(run, single, strict=True)]
        got = [a for a, _ in norms if a is not None]
        _close(got, [b for _, b in norms if b is not None], 1e-3)


def test_constant_loss_scale_is_divided_out_of_the_gradients(flags):
    """--fp16 --loss-scale 1024 on two ranks with rings: the losses and gradient norms of
    float32 training within float16 rounding (a scale not divided out would be 1024 times
    off in the norm)."""
    run = [*flags, "--train-iters", "2", "--hdp-capacity", "256"]
    half = run_pretrain(2, [*run, "--fp16", "--loss-scale", "1024"])
    full = run_pretrain(2, run)
    assert [(r["loss_scale"], r["skipped"]) for r in half] == [(1024.0, False)] * 2
    _close([r["loss"] for r in half], [r["loss"] for r in full], rel=2e-3)
    _close([r["grad_norm"] for r in half], [r["grad_norm"] for r in full], rel=2e-2)
