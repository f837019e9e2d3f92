"""Megatron-LM's `pretrain_gpt.py --hdp --multi-latent-attention`: pretrain_hdp.py's losses.

Two ranks with rings of 2, MLA with YaRN RoPE and mscale (q/k head dim 16 + 8, v 8): the
drop-in builds Megatron-LM's own MLA config (`core_transformer_config_from_args`) with HDP's
core attention and RoPE at the original positions; pretrain_hdp.py, the reference here, is
itself equal to one rank (tests/e2e/test_mla_job.py) and to stock Megatron-Core MLA
(tests/megatron/test_mla.py).
"""

from __future__ import annotations

import pytest

from tests.e2e.harness import run_pretrain
from tests.megatron_lm.harness import MEGATRON_CPU, SHARED, run_megatron_lm

MLA = [
    "--multi-latent-attention",
    "--q-lora-rank", "16",
    "--kv-lora-rank", "16",
    "--qk-head-dim", "16",
    "--qk-pos-emb-head-dim", "8",
    "--v-head-dim", "8",
    "--rotary-scaling-factor", "4",
    "--mscale-all-dim", "0.5",
]  # fmt: skip


def test_mla_losses_equal_pretrain_hdp(trees, data):
    _, patched = trees
    flags = [*SHARED, *MLA, "--data-path", data, "--train-iters", "2", "--global-batch-size", "8"]
    flags += ["--hdp-capacity", "256", "--eval-interval", "1000", "--eval-iters", "0"]
    ran = run_megatron_lm(patched / "pretrain_gpt.py", 2, [*flags, *MEGATRON_CPU, "--hdp"])
    reference = run_pretrain(2, [*flags, "--no-progress-bar"])
    assert max(r["max_ranks_per_sequence"] for r in reference) == 2  # rings ran
    assert [i for i, _, _ in ran["train"]] == [1, 2]
    got, want = [loss for _, loss, _ in ran["train"]], [r["loss"] for r in reference]
    assert got == pytest.approx(want, rel=1e-6)
    got, want = [norm for _, _, norm in ran["train"]], [r["grad_norm"] for r in reference]
    assert got == pytest.approx(want, rel=1e-6)
