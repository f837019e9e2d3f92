"""Mixture-of-experts through Megatron-LM's `pretrain_gpt.py --hdp`, on 1 and 2 CPU ranks.

The reference is the same flags on one rank (world 1: no pool, no ring, no expert
parallelism): single-process training. Two ranks as a pool of 2 with rings (capacity 256
splits every document over 256 tokens) and as one replica of TP 2 with sequence parallelism
and the experts split over both ranks (EP 2, alltoall) log the same losses and gradient
norms at every step: the load-balancing loss and the z-loss are normalised over the global
batch, and the expert biases move alike (the biases change the routing of step 2 on).
With the MoE flags `pretrain_hdp.py` knows too, both entry points log the same losses.
"""

from __future__ import annotations

import re

import pytest

from tests.e2e.harness import run_pretrain
from tests.megatron_lm.harness import MEGATRON_CPU, SHARED, run_megatron_lm

MOE = [
    "--num-experts", "4",
    "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "64",
    "--moe-aux-loss-coeff", "1e-2",
    "--moe-z-loss-coeff", "1e-3",
    "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "0.1",
    "--moe-router-score-function", "sigmoid",
    "--moe-token-dispatcher-type", "alltoall",
]  # fmt: skip

RUN = ["--train-iters", "3", "--global-batch-size", "8", "--eval-iters", "0"]
RUN += ["--eval-interval", "1000", "--hdp"]


def _close(got, want, rel=1e-6):
    assert len(got) == len(want) > 0, (got, want)
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=rel), (got, want)


@pytest.mark.parametrize(
    "model, layout",
    [
        ([], ["--hdp-capacity", "256"]),
        (
            # A shared expert, and experts in the first layer only (the second is dense).
            ["--moe-shared-expert-intermediate-size", "64", "--moe-layer-freq", "[1,0]"],
            [
                *["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                *["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"],
                *["--make-vocab-size-divisible-by", "64"],
            ],
        ),
        # Pipeline stages of one layer each: each stage's router tracks its own layer.
        ([], ["--pipeline-model-parallel-size", "2"]),
        # The same with the MoE layers recomputed: Megatron's schedule runs each backward
        # (and so each recomputed router) outside its micro-batch's forward.
        (
            [],
            [
                *["--pipeline-model-parallel-size", "2", "--recompute-granularity"],
                *["selective", "--recompute-modules", "moe"],
            ],
        ),
        # Experts across the 2 replicas (TP 1): rings and packs, uneven micro-batch counts,
        # in training and in evaluation (padded alike).
        (
            ["--eval-iters", "1", "--eval-interval", "3"],
            ["--expert-model-parallel-size", "2", "--hdp-capacity", "256"],
        ),
        # The Mixtral recipe's layout, scaled down to 4 ranks: EP 2 over replicas, PP 2.
        (
            [],
            [
                *["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
                *["--use-distributed-optimizer", "--overlap-grad-reduce"],
                *["--overlap-param-gather", "--hdp-capacity", "256"],
            ],
        ),
    ],
    ids=[
        "pool2-rings",
        "tp2-ep2-shared-freq",
        "pp2",
        "pp2-recompute-moe",
        "ep2-across-replicas",
        "ep2-pp2-4ranks",
    ],
)
def test_moe_two_ranks_equal_one_rank(trees, data, capfd, model, layout):
    """Three steps on 2 ranks log the losses and gradient norms of 1 rank.

    Megatron-LM's own log line shows the same MoE losses too (`training_log`, from
    Megatron's MoE loss tracker, printed with 7 digits).
    """
    _, patched = trees
    script = patched / "pretrain_gpt.py"
    flags = [*SHARED, *MEGATRON_CPU, *MOE, *RUN, *model, "--data-path", data]
    capfd.readouterr()
    one = run_megatron_lm(script, 1, flags)  # vocabulary padded to 384 as with TP 2 x 64
    logged_one = _moe_losses(capfd.readouterr().out)
    world = 4 if "--use-distributed-optimizer" in layout else 2  # EP 2 x PP 2
    two = run_megatron_lm(script, world, [*flags, *layout], timeout_s=300)
    logged_two = _moe_losses(capfd.readouterr().out)
    assert [i for i, _, _ in two["train"]] == [1, 2, 3]
    _close([r[1] for r in two["train"]], [r[1] for r in one["train"]])
    _close([r[2] for r in two["train"]], [r[2] for r in one["train"]])
    if "--eval-iters" in model:
        _close(two["valid"], one["valid"])
    for name in ("load_balancing_loss", "z_loss"):
        assert len(logged_one[name]) == 3 and all(v > 0 for v in logged_one[name]), logged_one
        _close(logged_two[name], logged_one[name], rel=2e-6)


def _moe_losses(out: str) -> dict[str, list[float]]:
    """The MoE losses of every iteration line Megatron-LM printed, by name."""
    return {
        name: [float(v) for v in re.findall(rf"\| {name}: (\S+) \|", out)]
        for name in ("load_balancing_loss", "z_loss")
    }


def test_moe_losses_equal_pretrain_hdp(trees, data):
    """The MoE flags both entry points know: `pretrain_hdp.py`'s losses and gradient norms.

    Two ranks, rings of 2, the load-balancing loss on (`pretrain_hdp.py` has no z-loss or
    expert bias).
    """
    _, patched = trees
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64"]
    moe += ["--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall"]
    flags = [*SHARED, *moe, "--data-path", data, "--train-iters", "2"]
    flags += ["--global-batch-size", "8", "--hdp-capacity", "256"]
    ran = run_megatron_lm(
        patched / "pretrain_gpt.py",
        2,
        [*flags, *MEGATRON_CPU, "--eval-iters", "0", "--eval-interval", "1000", "--hdp"],
    )
    reference = run_pretrain(2, [*flags, "--no-progress-bar"])
    assert max(r["max_ranks_per_sequence"] for r in reference) == 2  # rings ran
    _close([r[1] for r in ran["train"]], [r["loss"] for r in reference])
    _close([r[2] for r in ran["train"]], [r["grad_norm"] for r in reference])
