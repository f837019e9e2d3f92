"""Megatron-LM's own `pretrain_gpt.py` with `--hdp`, on 2 and 4 CPU ranks.

The tree is the one for the installed megatron-core (`conftest.py`): core_v0.16.1 with
0.16.x, core_v0.19.0 with 0.19.x; the same tests, the same expectations, for both.

The patched script (and the unmodified one through the launcher) trains with HDP through
Megatron-LM's `pretrain()`: its losses and gradient norms equal `pretrain_hdp.py`'s on the
same data, seed and layout; `--save` / `--load` resume exactly; without `--hdp` it is stock.
"""

from __future__ import annotations

import pytest

from tests.e2e.harness import run_pretrain
from tests.megatron_lm.harness import (
    MEGATRON_CPU,
    SHARED,
    pretrain_hdp_validation,
    run_megatron_lm,
)


def _close(got, want, rel=1e-6):
    assert len(got) == len(want) > 0, (got, want)
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=rel), (got, want)


def test_hdp_losses_equal_pretrain_hdp(trees, data):
    """Two ranks, capacity 256 (rings of 2 for documents over 256 tokens), 3 steps."""
    _, patched = trees
    flags = [*SHARED, "--data-path", data, "--train-iters", "3", "--global-batch-size", "8"]
    flags += ["--hdp-capacity", "256", "--eval-interval", "3", "--eval-iters", "2"]
    ran = run_megatron_lm(patched / "pretrain_gpt.py", 2, [*flags, *MEGATRON_CPU, "--hdp"])
    reference = run_pretrain(2, [*flags, "--no-progress-bar"])
    assert max(r["max_ranks_per_sequence"] for r in reference) == 2  # rings ran
    assert [i for i, _, _ in ran["train"]] == [1, 2, 3]
    _close([loss for _, loss, _ in ran["train"]], [r["loss"] for r in reference])
    _close([norm for _, _, norm in ran["train"]], [r["grad_norm"] for r in reference])
    # Evaluation at iteration 3 and after training: the same validation batches both times.
    valid = pretrain_hdp_validation(2, [*flags, "--no-progress-bar"])
    assert len(valid) == 1 and len(ran["valid"]) == 2
    assert ran["valid"] == pytest.approx(valid * 2, abs=6e-5)  # logged with 4 decimals


def test_dropout_losses_equal_pretrain_hdp(trees, data):
    """Attention and hidden dropout 0.1 (Megatron-LM's defaults) on two ranks with rings:
    the keyed masks of pretrain_hdp.py (itself equal to one rank, tests/e2e/test_dropout.py)."""
    _, patched = trees
    flags = [*SHARED, "--data-path", data, "--train-iters", "2", "--global-batch-size", "8"]
    flags += ["--hdp-capacity", "256", "--eval-interval", "1000", "--eval-iters", "0"]
    dropout = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
    ran = run_megatron_lm(
        patched / "pretrain_gpt.py", 2, [*flags, *MEGATRON_CPU, "--hdp", *dropout]
    )
    reference = run_pretrain(2, [*flags, *dropout, "--no-progress-bar"])
    plain = run_pretrain(2, [*flags, "--no-progress-bar"])
    assert max(r["max_ranks_per_sequence"] for r in reference) == 2  # rings ran
    assert [i for i, _, _ in ran["train"]] == [1, 2]
    _close([loss for _, loss, _ in ran["train"]], [r["loss"] for r in reference])
    _close([norm for _, _, norm in ran["train"]], [r["grad_norm"] for r in reference])
    assert abs(plain[0]["loss"] - reference[0]["loss"]) > 1e-4  # the dropout is there


def test_launcher_runs_the_unmodified_script_with_hdp(trees, data):
    """`python -m megatron_hdp.megatron_lm pretrain_gpt.py --hdp`: the same losses, no edit.

    With a token budget (--hdp-global-batch-tokens) and Megatron-LM's CP flag, which --hdp
    folds into the pool (DP 1 x CP 2 = a pool of 2).
    """
    stock, _ = trees
    flags = [*SHARED, "--data-path", data, "--train-iters", "2", "--hdp-capacity", "256"]
    flags += ["--hdp-global-batch-tokens", "2048", "--context-parallel-size", "2"]
    flags += ["--eval-iters", "0", "--eval-interval", "1000"]
    ran = run_megatron_lm(
        stock / "pretrain_gpt.py", 2, [*flags, *MEGATRON_CPU, "--hdp"], launcher=True
    )
    reference = run_pretrain(2, [*flags, "--no-progress-bar"])
    assert [i for i, _, _ in ran["train"]] == [1, 2]
    _close([loss for _, loss, _ in ran["train"]], [r["loss"] for r in reference])
    _close([norm for _, _, norm in ran["train"]], [r["grad_norm"] for r in reference])


@pytest.mark.parametrize(
    "world_size, layout",
    [(2, []), (4, ["--pipeline-model-parallel-size", "2"])],
    ids=["pool2", "pp2"],
)
def test_save_and_load_resume_exactly(trees, data, tmp_path, world_size, layout):
    """Four steps in one go equal two steps, --save, then --load and two more (data too).

    (Megatron-LM checks that the resumed run has the same --train-iters: the first one stops
    at --exit-interval.) With PP the data position lies in the first stage's folder.
    """
    _, patched = trees
    script = patched / "pretrain_gpt.py"
    flags = [*SHARED, *MEGATRON_CPU, *layout, "--data-path", data, "--global-batch-size", "6"]
    flags += ["--hdp-capacity", "256", "--eval-iters", "0", "--eval-interval", "1000", "--hdp"]
    flags += ["--train-iters", "4"]
    save = str(tmp_path / "ckpt")
    stop = ["--exit-interval", "2", "--save", save, "--save-interval", "2"]

    def run(argv):
        return run_megatron_lm(script, world_size, argv, timeout_s=240)

    whole = run(flags)
    first = run([*flags, *stop])
    # On CPU Megatron-LM saves no CUDA RNG state to load (nothing here draws from it).
    resumed = run([*flags, "--load", save, "--no-load-rng"])
    assert [i for i, _, _ in first["train"]] == [1, 2]
    assert [i for i, _, _ in resumed["train"]] == [3, 4]
    _close([r[1] for r in first["train"] + resumed["train"]], [r[1] for r in whole["train"]])
    _close([r[2] for r in first["train"] + resumed["train"]], [r[2] for r in whole["train"]])


def test_without_hdp_the_job_is_stock(trees, data):
    """No --hdp: the patched script and the launcher log the unpatched script's losses."""
    stock, patched = trees
    flags = [*SHARED, *MEGATRON_CPU, "--data-path", data, "--train-iters", "2"]
    flags += ["--global-batch-size", "4", "--eval-iters", "0", "--eval-interval", "1000"]
    want = run_megatron_lm(stock / "pretrain_gpt.py", 2, flags)["train"]
    assert [i for i, _, _ in want] == [1, 2]
    assert run_megatron_lm(patched / "pretrain_gpt.py", 2, flags)["train"] == want
    assert run_megatron_lm(stock / "pretrain_gpt.py", 2, flags, launcher=True)["train"] == want


@pytest.mark.parametrize(
    "layout",
    [
        [
            *["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"],
            *["--hdp-placement", "greedy", "--hdp-check-plans", "--hdp-prefetch-depth", "0"],
        ],
        ["--pipeline-model-parallel-size", "2"],
    ],
    ids=["tp2", "pp2"],
)
def test_tp2_and_pp2_losses_equal_pretrain_hdp(trees, data, layout):
    """Four ranks: TP 2 or PP 2 per replica, a pool of 2 replicas."""
    _, patched = trees
    flags = [*SHARED, *layout, "--data-path", data, "--train-iters", "2"]
    flags += ["--global-batch-size", "6", "--hdp-capacity", "256"]
    flags += ["--eval-iters", "0", "--eval-interval", "1000"]
    ran = run_megatron_lm(
        patched / "pretrain_gpt.py", 4, [*flags, *MEGATRON_CPU, "--hdp"], timeout_s=240
    )
    reference = run_pretrain(4, [*flags, "--no-progress-bar"], timeout_s=240)
    assert [i for i, _, _ in ran["train"]] == [1, 2]
    _close([loss for _, loss, _ in ran["train"]], [r["loss"] for r in reference])
    _close([norm for _, _, norm in ran["train"]], [r["grad_norm"] for r in reference])


def test_data_spec_and_distributed_optimizer(trees, data, tmp_path):
    """--hdp-data-spec instead of --data-path; Megatron's distributed optimizer with its
    gradient reduce-scatter overlapped (--overlap-grad-reduce, a Megatron-LM flag only)."""
    import json

    _, patched = trees
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"sources": [{"name": "docs", "path": data, "weight": 1.0}]}))
    flags = [*SHARED, "--hdp-data-spec", str(spec), "--train-iters", "2"]
    flags += ["--global-batch-size", "6", "--hdp-capacity", "256", "--use-distributed-optimizer"]
    flags += ["--eval-iters", "0", "--eval-interval", "1000"]
    overlap = ["--overlap-grad-reduce"]
    ran = run_megatron_lm(
        patched / "pretrain_gpt.py", 2, [*flags, *MEGATRON_CPU, *overlap, "--hdp"]
    )
    reference = run_pretrain(2, [*flags, "--no-progress-bar"])
    assert [i for i, _, _ in ran["train"]] == [1, 2]
    _close([loss for _, loss, _ in ran["train"]], [r["loss"] for r in reference])
    _close([norm for _, _, norm in ran["train"]], [r["grad_norm"] for r in reference])


def test_bf16_losses_close_to_pretrain_hdp(trees, data):
    """--bf16: Megatron-LM's Float16Module and mixed-precision optimizer against
    pretrain_hdp.py's bf16 parameters with fp32 gradients: the same steps within bf16
    rounding (the two round in different places; measured 1e-5 relative)."""
    _, patched = trees
    flags = [*SHARED, "--data-path", data, "--train-iters", "2", "--global-batch-size", "6"]
    flags += ["--hdp-capacity", "256", "--bf16", "--eval-iters", "0", "--eval-interval", "1000"]
    ran = run_megatron_lm(patched / "pretrain_gpt.py", 2, [*flags, *MEGATRON_CPU, "--hdp"])
    reference = run_pretrain(2, [*flags, "--no-progress-bar"])
    _close([loss for _, loss, _ in ran["train"]], [r["loss"] for r in reference], rel=1e-4)


def test_a_rank_without_micro_batches(trees, data):
    """A budget of 600 tokens (one or two documents per step) and greedy placement: a rank of
    the pool idles in some step; its zero report keeps Megatron-LM's loss all-reduce in step."""
    _, patched = trees
    flags = [*SHARED, "--data-path", data, "--train-iters", "3"]
    flags += [
        "--hdp-global-batch-tokens",
        "600",
        "--hdp-capacity",
        "512",
        "--hdp-placement",
        "greedy",
    ]
    flags += ["--eval-iters", "0", "--eval-interval", "1000"]
    ran = run_megatron_lm(patched / "pretrain_gpt.py", 2, [*flags, *MEGATRON_CPU, "--hdp"])
    reference = run_pretrain(2, [*flags, "--no-progress-bar"])
    assert min(r["micro_batches_per_rank_min"] for r in reference) == 0
    _close([loss for _, loss, _ in ran["train"]], [r["loss"] for r in reference])
    _close([norm for _, _, norm in ran["train"]], [r["grad_norm"] for r in reference])


def test_overlap_param_gather_with_a_rank_without_micro_batches(trees, data):
    """--use-distributed-optimizer --overlap-param-gather (8 of NVIDIA's 17 setups): from the
    second step on, Megatron-Core all-gathers the updated parameters in the next forward's
    pre-hooks. This budget idles a pool rank in every step (test_a_rank_without_micro_batches);
    in step 2 it runs them too (no hang: a timeout fails the test), and the losses equal the
    run without the overlap."""
    _, patched = trees
    flags = [*SHARED, "--data-path", data, "--train-iters", "2", "--hdp-capacity", "512"]
    flags += ["--hdp-global-batch-tokens", "600", "--hdp-placement", "greedy"]
    flags += ["--eval-iters", "0", "--eval-interval", "1000", *MEGATRON_CPU, "--hdp"]
    flags += ["--use-distributed-optimizer", "--overlap-grad-reduce"]
    script = patched / "pretrain_gpt.py"
    plain = run_megatron_lm(script, 2, flags)
    overlapped = run_megatron_lm(script, 2, [*flags, "--overlap-param-gather"], timeout_s=90)
    assert [i for i, _, _ in overlapped["train"]] == [1, 2]
    _close([r[1] for r in overlapped["train"]], [r[1] for r in plain["train"]])
    _close([r[2] for r in overlapped["train"]], [r[2] for r in plain["train"]])
