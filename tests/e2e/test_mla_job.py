"""pretrain_hdp.py with multi-latent attention: a ring of 3 ranks gives one rank's losses.

YaRN RoPE with mscale (Megatron-Core's MLA defaults otherwise), q/k head dim 16 (8 + 8
decoupled RoPE channels) and v head dim 8; the kernel pads v for aten's CPU flash kernel.
"""

import pytest

from tests.e2e.harness import run_pretrain

MLA_MODEL = [
    "--num-layers", "2",
    "--hidden-size", "32",
    "--num-attention-heads", "4",
    "--multi-latent-attention",
    "--q-lora-rank", "16",
    "--kv-lora-rank", "16",
    "--qk-head-dim", "8",
    "--qk-pos-emb-head-dim", "8",
    "--v-head-dim", "8",
    "--rope-type", "yarn",
    "--rotary-scaling-factor", "4",
    "--mscale-all-dim", "0.5",
    "--qk-layernorm",
    "--normalization", "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
    "--no-progress-bar",
    "--log-interval", "1",
    "--eval-interval", "1000",
    "--eval-iters", "1",
]  # fmt: skip


def _args(cache, capacity):
    return [
        *MLA_MODEL,
        "--seq-length", "512",
        "--hdp-capacity", str(capacity),
        "--train-iters", "2",
        "--lr", "3e-3",
        "--hdp-global-batch-tokens", "1024",
        "--data-cache-path", str(cache),
        "--seed", "5",
    ]  # fmt: skip


def test_mla_job_on_rings_gives_one_ranks_losses(corpus_cache):
    rings = run_pretrain(3, _args(corpus_cache, capacity=192))
    single = run_pretrain(1, _args(corpus_cache, capacity=512))
    assert [s["units"] for s in rings] == [s["units"] for s in single]
    assert [s["loss"] for s in rings] == pytest.approx([s["loss"] for s in single], rel=1e-5)
    assert [s["grad_norm"] for s in rings] == pytest.approx(
        [s["grad_norm"] for s in single], rel=1e-5
    )
