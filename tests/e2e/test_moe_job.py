"""The training job with an MoE model: experts split over the TP ranks of each replica.

TP=2 x pool 2 with EP=2 (4 ranks, sequence parallelism as Megatron requires for MoE with
TP) gives the losses and load-balancing losses of TP=1 x pool 2 (the same experts, built
by global index), resumes exactly, and bad MoE set-ups stop before any process group.
"""

import pytest
import torch

from tests.e2e.harness import corpus_args, run_pretrain, saved_model

MOE = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "64",
    "--moe-aux-loss-coeff",
    "0.01",
]
EP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
EP2 += ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]


def job_args(cache, *, iters=4, extra=()):
    return corpus_args(cache, iters=iters, lr="3e-3", extra=[*MOE, *extra])


def test_moe_with_ep2_trains_like_one_rank_per_replica_and_resumes_exactly(corpus_cache, tmp_path):
    pad = ["--make-vocab-size-divisible-by", "256"]  # TP 2 pads 257 to 512; so does TP 1 here
    tp1 = run_pretrain(2, job_args(corpus_cache, extra=pad))
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    ep2 = run_pretrain(4, job_args(corpus_cache, extra=[*EP2, "--save", str(straight_dir)]))
    assert all(s["moe_aux_loss"] > 0 for s in tp1)
    assert [s["loss"] for s in ep2] == pytest.approx([s["loss"] for s in tp1], rel=1e-5)
    assert [s["moe_aux_loss"] for s in ep2] == pytest.approx(
        [s["moe_aux_loss"] for s in tp1], rel=1e-5
    )
    extra = [*EP2, "--save", str(resumed_dir)]
    first = run_pretrain(4, job_args(corpus_cache, extra=[*extra, "--exit-interval", "2"]))
    second = run_pretrain(4, job_args(corpus_cache, extra=[*extra, "--load", str(resumed_dir)]))
    assert [s["iteration"] for s in first + second] == [1, 2, 3, 4]
    assert [s["loss"] for s in first + second] == pytest.approx([s["loss"] for s in ep2], rel=1e-6)
    a = saved_model(straight_dir / "iter_0000004")  # every expert, of both EP ranks
    b = saved_model(resumed_dir / "iter_0000004")
    assert any("experts" in key for key in a) and sorted(a) == sorted(b)
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.parametrize(
    "world, extra, message",
    [
        (4, ["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 must divide"),
        (
            4,
            ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "4"],
            "--expert-model-parallel-size 4 must divide --tensor-model-parallel-size 2: experts "
            "are parallel inside one replica (EP folded onto its TP ranks), because replicas "
            "run different numbers of micro-batches",
        ),
        (2, ["--moe-router-topk", "5"], "--moe-router-topk 5 must lie in [1, --num-experts=4]"),
        (4, ["--tensor-model-parallel-size", "2"], "needs sequence parallelism"),
    ],
    ids=["ep-without-tp", "ep-above-tp", "topk-above-experts", "tp-without-sp"],
)
def test_bad_moe_set_ups_stop_before_start_up(
    corpus_cache, monkeypatch, capsys, world, extra, message
):
    import pretrain_hdp

    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as exit_info:
        pretrain_hdp.main([*job_args(corpus_cache, iters=1), *extra, "--hdp-validate-only"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


def with_biases(argv: list[str]) -> list[str]:
    """`argv` without --disable-bias-linear: Megatron's default linear biases."""
    return [a for a in argv if a != "--disable-bias-linear"]


def test_moe_with_megatron_default_biases_trains_alike_on_one_and_two_ranks(corpus_cache):
    argv = with_biases(job_args(corpus_cache, iters=3, extra=["--hdp-capacity", "512"]))
    one, two = run_pretrain(1, argv), run_pretrain(2, argv)
    assert [s["iteration"] for s in two] == [1, 2, 3]
    assert [s["loss"] for s in two] == pytest.approx([s["loss"] for s in one], rel=1e-5)
    assert [s["moe_aux_loss"] for s in two] == pytest.approx(
        [s["moe_aux_loss"] for s in one], rel=1e-5
    )


def test_moe_biases_with_experts_split_over_tp_ranks_are_refused_by_name(
    corpus_cache, monkeypatch, capsys
):
    import pretrain_hdp

    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--hdp-validate-only"]
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as exit_info:
        pretrain_hdp.main([*with_biases(job_args(corpus_cache, iters=1)), *tp2])
    assert exit_info.value.code == 2
    assert (
        "an MoE model with linear biases (Megatron's default) needs each expert whole on one "
        "rank, but --tensor-model-parallel-size 2 / --expert-model-parallel-size 1 splits it "
        "over 2: set --expert-model-parallel-size 2, or --disable-bias-linear"
    ) in capsys.readouterr().err
