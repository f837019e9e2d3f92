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
    return [*SHARED, "--data-path", str(prefix), "--global-batch-size", "3", "--no-progress-bar"]


def _close(got, want, rel):
    assert len(got) == len(want) > 0, (got, want)
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=rel), (got, want)


def test_dynamic_loss_scale_on_rings_equals_one_rank(flags):
    """From a scale of 2**24 the float16 gradients overflow: the step is skipped (its norm is
    None) and the scale halves (--hysteresis 1); after two clean steps (--loss-scale-window
    2) it doubles (on two ranks with rings).

    Whether float16 overflows at a scale near the edge depends on the partial sums each
    layout's matmuls and reductions form: measured here, one rank and PP 2 x a pool of 2
    overflow at 2**23 where the two rings do not. So one rank and the pipeline are compared
    with the rings up to the first differing overflow decision (at least the first step,
    which overflows in every layout): scales, skips, losses within float16 rounding."""
    dynamic = ["--fp16", "--initial-loss-scale", str(2**24), "--loss-scale-window", "2"]
    dynamic += ["--hysteresis", "1", "--train-iters", "6"]
    rings = run_pretrain(2, [*flags, *dynamic, "--hdp-capacity", "256"])
    single = run_pretrain(1, [*flags, *dynamic, "--hdp-capacity", "512"])
    assert max(r["max_ranks_per_sequence"] for r in rings) == 2  # rings ran
    scales = [(r["loss_scale"], r["skipped"]) for r in rings]
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
    for other in (single, pipelined):
        _agree_until_an_overflow_decision_differs(rings, other)


def _agree_until_an_overflow_decision_differs(run, other):
    """The same scales, skips, losses (1e-4) and gradient norms (1e-3) up to the first step
    whose overflow decision differs (whose loss, computed before it, agrees too); the first
    step (an overflow at 2**24 in every layout) always."""
    same = 0
    while same < len(run) and (run[same]["loss_scale"], run[same]["skipped"]) == (
        other[same]["loss_scale"],
        other[same]["skipped"],
    ):
        same += 1
    assert same >= 1, (run, other)
    shared = min(same + 1, len(run))
    _close([r["loss"] for r in run[:shared]], [r["loss"] for r in other[:shared]], rel=1e-4)
    for a, b in zip(run[:same], other[:same]):
        assert (a["grad_norm"] is None) == (b["grad_norm"] is None)
        if a["grad_norm"] is not None:
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)


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
