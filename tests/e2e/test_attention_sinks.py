"""pretrain_hdp.py --softmax-type learnable: rings give one rank's losses, and resume exactly.

The sink (`attention.sinks`) enters every query row once, after the ring's merge, so 2 ranks
with rings (capacity 256: the 512-token sequences ring over both) train as 1 rank; the
`softmax_offset` parameters are in the checkpoint under Megatron's keys (split by head) and
come back on `--load`, also into a TP 2 replica (each TP rank takes its heads' logits).
Stock Megatron-Core's meaning of the flag is checked on the model
(`tests/megatron/test_model_equivalence.py::test_attention_sinks_match_stock_megatron`).
"""

import pytest

from tests.e2e.harness import SMALL_MODEL, run_pretrain, saved_tensors

LEARNABLE = ["--softmax-type", "learnable"]


def args(cache, *, capacity, extra=()):
    return [
        *SMALL_MODEL,
        *["--seq-length", "512", "--hdp-capacity", str(capacity), "--train-iters", "3"],
        *["--lr", "3e-3", "--lr-decay-style", "constant", "--hdp-global-batch-tokens", "2048"],
        *["--data-cache-path", str(cache), "--seed", "5"],
        # TP 2 pads the vocabulary to a multiple of 256: every run pads alike.
        *["--make-vocab-size-divisible-by", "256"],
        *extra,
    ]


def test_learnable_sinks_on_rings_equal_one_rank_and_resume_exactly(corpus_cache, tmp_path):
    ckpt = tmp_path / "ckpt"
    single = run_pretrain(1, args(corpus_cache, capacity=512, extra=LEARNABLE))
    save = [*LEARNABLE, "--save", str(ckpt), "--exit-interval", "2"]
    first = run_pretrain(2, args(corpus_cache, capacity=256, extra=save))
    tp2 = [*LEARNABLE, "--load", str(ckpt), "--tensor-model-parallel-size", "2"]
    second = run_pretrain(2, args(corpus_cache, capacity=512, extra=tp2))
    plain = run_pretrain(1, args(corpus_cache, capacity=512))
    rings = first + second
    assert [s["iteration"] for s in rings] == [1, 2, 3]
    assert max(s["max_ranks_per_sequence"] for s in first) == 2  # rings ran
    assert [s["units"] for s in rings] == [s["units"] for s in single]
    assert [s["loss"] for s in rings] == pytest.approx([s["loss"] for s in single], rel=1e-5)
    assert [s["grad_norm"] for s in rings] == pytest.approx(
        [s["grad_norm"] for s in single], rel=1e-5
    )
    # The sinks are there: without them the first step's loss (same batch) moves.
    assert abs(plain[0]["loss"] - single[0]["loss"]) > 1e-4
    # Megatron's key and shape (layers x heads), trained, with its Adam state, in the checkpoint.
    saved = saved_tensors(ckpt / "iter_0000002")
    key = "decoder.layers.self_attention.core_attention.softmax_offset"
    assert tuple(saved[key].shape) == (2, 4)
    assert (
        f"optimizer.state.exp_avg.{key}" in saved and f"optimizer.state.exp_avg_sq.{key}" in saved
    )
