"""Megatron-LM's `pretrain_gpt.py --hdp` with the model flags of NVIDIA's recipes.

`--fp16` with Megatron's dynamic loss scaling (GPT-3 175B), `--kv-channels` other than
hidden / heads and `--qk-layernorm` (DeepSeek-V3), `--rotary-percent 0.5` (GPT 15B): on two
ranks with rings, the losses and gradient norms of a one-rank run of the same flags.
That HDP's RoPE and query/key norms are Megatron-Core's own is checked against the stock
model in `tests/megatron/test_model_equivalence.py`.
"""

from __future__ import annotations

import pytest

from tests.e2e.harness import run_pretrain
from tests.megatron_lm.harness import MEGATRON_CPU, SHARED, run_megatron_lm

QUIET = ["--eval-iters", "0", "--eval-interval", "1000"]


def _close(got, want, rel):
    assert len(got) == len(want) > 0, (got, want)
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=rel), (got, want)


def test_fp16_dynamic_loss_scale_on_rings_equals_one_rank(trees, data):
    """--fp16: Megatron-LM's mixed-precision optimizer with its dynamic loss scaler.

    HDP back-propagates the per-token loss sum times the scale (`--calculate-per-token-loss`,
    as Megatron's own schedule), so float16 gradients overflow above a scale of about 2**12
    here: the first step at 2**12 overflows, is skipped and halves the scale (--hysteresis
    1); two clean steps (--loss-scale-window 2) double it, and so on. Two ranks with rings
    (capacity 256), and PP 2 x a pool of 2 on four, skip the same steps with the same scales
    as one rank, and their losses and gradient norms agree within float16 rounding (they
    sum in another order).
    """
    _, patched = trees
    flags = [*SHARED, "--data-path", data, "--train-iters", "6", "--global-batch-size", "4"]
    flags += ["--fp16", "--initial-loss-scale", "4096", "--min-loss-scale", "1"]
    flags += ["--loss-scale-window", "3", "--hysteresis", "1", *QUIET, *MEGATRON_CPU, "--hdp"]
    script = patched / "pretrain_gpt.py"
    rings = run_megatron_lm(script, 2, [*flags, "--hdp-capacity", "256"])
    single = run_megatron_lm(script, 1, [*flags, "--hdp-capacity", "512"])
    # (scale after the step, skipped) at each iteration, as Megatron-LM's training_log has it.
    scales = [(scale, skipped) for _, scale, skipped in rings["loss_scale"]]
    assert scales == [(s, k) for _, s, k in single["loss_scale"]]
    assert [i for i, _, _ in rings["train"]] == [1, 2, 3, 4, 5, 6]
    assert scales[0] == (2048.0, 1), scales  # 4096 overflowed: skipped, halved
    assert (4096.0, 0) in scales, scales  # grown back after two clean steps
    assert sum(k for _, k in scales) < len(scales), scales  # not every step skipped
    # (the scale each iteration logs is the one after its step)
    for (scale, _), (after, skipped) in zip(scales, scales[1:]):
        if skipped:
            assert after == scale / 2, scales
    # PP 2 x pool 2: Megatron-Core's 1F1B scales the loss itself (its backward_step).
    pipelined = run_megatron_lm(
        script,
        4,
        [*flags, "--hdp-capacity", "256", "--pipeline-model-parallel-size", "2"],
        timeout_s=240,
    )
    assert [(s, k) for _, s, k in pipelined["loss_scale"]] == scales
    for run in (rings, pipelined):
        _close([r[1] for r in run["train"]], [r[1] for r in single["train"]], rel=1e-4)
        norms = [(a[2], b[2]) for a, b in zip(run["train"], single["train"], strict=True)]
        assert [a is None for a, _ in norms] == [k == 1 for _, k in scales], norms
        assert [b is None for _, b in norms] == [k == 1 for _, k in scales], norms
        got = [a for a, _ in norms if a is not None]
        _close(got, [b for _, b in norms if b is not None], 1e-3)


def test_fp16_loss_scale_is_divided_out_of_the_gradients(trees, data):
    """--fp16 --loss-scale 16 (Megatron's constant scaler) on two ranks with rings: the
    gradient norms and losses of float32 training, within float16 rounding. A scale not
    applied in HDP's backward, or applied twice, would be off by 16 in the norm. (The scale
    multiplies the per-token loss sum, not the mean: larger ones overflow this rank's
    float16 gradient norm, which Megatron's --check-for-nan-in-loss-and-grad computes.)"""
    _, patched = trees
    flags = [*SHARED, "--data-path", data, "--train-iters", "2", "--global-batch-size", "4"]
    flags += [*QUIET, *MEGATRON_CPU, "--hdp", "--hdp-capacity", "256"]
    script = patched / "pretrain_gpt.py"
    half = run_megatron_lm(script, 2, [*flags, "--fp16", "--loss-scale", "16"])
    full = run_megatron_lm(script, 2, flags)
    assert [r[1:] for r in half["loss_scale"]] == [(16.0, 0), (16.0, 0)]
    _close([r[1] for r in half["train"]], [r[1] for r in full["train"]], rel=2e-3)
    _close([r[2] for r in half["train"]], [r[2] for r in full["train"]], rel=2e-2)


def test_fp16_loss_scaler_resumes_from_a_checkpoint(trees, data, tmp_path):
    """--save after step 2 (--exit-interval) and --load to 5: the same scales, skipped
    steps and losses as 1-5 in one go (Megatron-LM's checkpoint holds the scaler's state:
    its scale and its count of clean steps)."""
    _, patched = trees
    flags = [*SHARED, "--data-path", data, "--train-iters", "5", "--global-batch-size", "4"]
    flags += ["--fp16", "--initial-loss-scale", "4096", "--min-loss-scale", "1"]
    flags += ["--loss-scale-window", "3", "--hysteresis", "1", *QUIET, *MEGATRON_CPU, "--hdp"]
    flags += ["--hdp-capacity", "256"]
    script, save = patched / "pretrain_gpt.py", str(tmp_path / "ckpt")
    straight = run_megatron_lm(script, 2, flags)
    first = run_megatron_lm(
        script, 2, [*flags, "--exit-interval", "2", "--save", save, "--save-interval", "2"]
    )
    second = run_megatron_lm(script, 2, [*flags, "--load", save, "--no-load-rng"])
    assert [r[0] for r in first["train"] + second["train"]] == [1, 2, 3, 4, 5]
    scales = [r[1:] for r in straight["loss_scale"]]
    assert [r[1:] for r in first["loss_scale"] + second["loss_scale"]] == scales
    # Step 1 overflows (4096 -> 2048), steps 2 and 3 are clean but short of the window of
    # 3: step 3 logs 2048. A scaler restarted at step 3 (from --initial-loss-scale 4096, no
    # clean steps counted) would log 4096 there.
    assert scales[:3] == [(2048.0, 1), (2048.0, 0), (2048.0, 0)], scales
    got = [r[1] for r in first["train"] + second["train"]]
    _close(got, [r[1] for r in straight["train"]], rel=1e-6)


def test_head_size_rotary_share_and_qk_norm_on_rings_equal_one_rank(trees, data):
    """--kv-channels 32 (hidden 64 / 4 heads would be 16), --rotary-percent 0.5,
    --rotary-interleaved and --qk-layernorm (DeepSeek-V3's and GPT 15B's flags), and
    --softmax-type learnable (gpt-oss's attention sinks: Megatron-LM's TransformerConfig
    reaches HDP's core attention): the drop-in on two ranks with rings gives the losses and
    gradient norms of pretrain_hdp.py on one rank with the same flags (whose sinks are stock
    Megatron-Core's, tests/megatron/test_model_equivalence.py; without them the first loss
    moves by 3e-4 and the gradient norms by about 2%, relative)."""
    _, patched = trees
    flags = [*SHARED, "--data-path", data, "--train-iters", "3", "--global-batch-size", "6"]
    flags += ["--kv-channels", "32", "--rotary-percent", "0.5", "--rotary-interleaved"]
    flags += ["--qk-layernorm", "--softmax-type", "learnable", *QUIET]
    ran = run_megatron_lm(
        patched / "pretrain_gpt.py", 2, [*flags, *MEGATRON_CPU, "--hdp", "--hdp-capacity", "256"]
    )
    reference = run_pretrain(1, [*flags, "--hdp-capacity", "512", "--no-progress-bar"])
    rings = run_pretrain(2, [*flags, "--hdp-capacity", "256", "--no-progress-bar"])
    assert max(r["max_ranks_per_sequence"] for r in rings) == 2  # rings ran
    assert [i for i, _, _ in ran["train"]] == [1, 2, 3]
    _close([r[1] for r in ran["train"]], [r["loss"] for r in reference], rel=1e-5)
    _close([r[2] for r in ran["train"]], [r["grad_norm"] for r in reference], rel=1e-5)
    _close([r["loss"] for r in rings], [r["loss"] for r in reference], rel=1e-5)
