"""Megatron-LM's `pretrain_gpt.py --hdp` with sliding-window attention (`--window-size`).

Two ranks with rings of 2 (capacity 256, documents up to 700 tokens) train with
`--window-size 24,0 --window-attn-skip-freq 2` (layer 1 windowed, layer 2 full, Megatron-Core's
rule) to the losses and gradient norms of `pretrain_hdp.py` on one rank with the same flags.
"""

from __future__ import annotations

import pytest

from tests.e2e.harness import run_pretrain
from tests.megatron_lm.harness import MEGATRON_CPU, SHARED, run_megatron_lm

WINDOW = ["--window-size", "24,0", "--window-attn-skip-freq", "2"]


def test_window_losses_equal_one_rank(trees, data):
    _, patched = trees
    flags = [*SHARED, "--data-path", data, "--train-iters", "2", "--global-batch-size", "8"]
    flags += ["--eval-interval", "1000", "--eval-iters", "0"]
    ran = run_megatron_lm(
        patched / "pretrain_gpt.py",
        2,
        [*flags, *WINDOW, *MEGATRON_CPU, "--hdp", "--hdp-capacity", "256"],
    )
    one = [*flags, "--no-progress-bar", "--hdp-capacity", "1024"]
    single = run_pretrain(1, [*one, *WINDOW])
    plain = run_pretrain(1, one)
    assert [i for i, _, _ in ran["train"]] == [1, 2]
    for got, want in zip(ran["train"], single, strict=True):
        assert got[1] == pytest.approx(want["loss"], rel=1e-6)
        assert got[2] == pytest.approx(want["grad_norm"], rel=1e-6)
    assert max(abs(p["loss"] - s["loss"]) for p, s in zip(plain, single)) > 1e-4


def test_window_flags_megatron_core_cannot_take_are_refused_together(trees, monkeypatch, capsys):
    from tests.megatron_lm.test_args import BASE, _parse_and_validate

    args = _parse_and_validate(monkeypatch, [*BASE, "--hdp", *WINDOW])
    assert args.window_size == (24, 0) and args.window_attn_skip_freq == 2
    bad = ["--window-size", "4,2", "--window-attn-skip-freq", "[1,0,1]"]
    with pytest.raises(SystemExit) as stop:
        _parse_and_validate(monkeypatch, [*BASE, "--hdp", *bad, "--attention-dropout", "0.1"])
    assert stop.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    for said in (
        "--window-size 4,2: HDP attention is causal, the right window must be 0",
        "--window-attn-skip-freq [1, 0, 1]: needs one 1 (window) or 0 (full) per layer, 2 layers",
    ):
        assert said in message, message
