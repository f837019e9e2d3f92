"""Megatron-LM's `pretrain_gpt.py --hdp --softmax-type learnable` (gpt-oss's attention sinks).

Megatron-LM builds its `TransformerConfig` with `softmax_type="learnable"` (a flag of both
core_v0.16.1 and core_v0.19.0, generated from the config dataclass); HDP's core attention
holds the `softmax_offset` parameter and adds the sink after the ring's merge. On two ranks
with rings the drop-in gives the losses and gradient norms of `pretrain_hdp.py` on one rank
with the same flags (whose sinks are stock Megatron-Core's on the model,
`tests/megatron/test_model_equivalence.py`).
"""

from __future__ import annotations

import pytest

from tests.e2e.harness import run_pretrain
from tests.megatron_lm.harness import MEGATRON_CPU, SHARED, run_megatron_lm


def test_learnable_sinks_on_rings_equal_one_rank(trees, data):
    _, patched = trees
    flags = [*SHARED, "--data-path", data, "--train-iters", "3", "--global-batch-size", "6"]
    flags += ["--softmax-type", "learnable", "--eval-iters", "0", "--eval-interval", "1000"]
    ran = run_megatron_lm(
        patched / "pretrain_gpt.py", 2, [*flags, *MEGATRON_CPU, "--hdp", "--hdp-capacity", "256"]
    )
    reference = run_pretrain(1, [*flags, "--hdp-capacity", "512", "--no-progress-bar"])
    assert [i for i, _, _ in ran["train"]] == [1, 2, 3]
    assert [r[1] for r in ran["train"]] == pytest.approx([r["loss"] for r in reference], rel=1e-5)
    assert [r[2] for r in ran["train"]] == pytest.approx(
        [r["grad_norm"] for r in reference], rel=1e-5
    )
    # The 512-token documents ran on rings of both ranks (HDP's own count of the steps).
    assert max(max(s["lengths"]) for s in ran["steps"]) > 256
