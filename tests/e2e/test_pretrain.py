"""pretrain_hdp.py end to end on CPU: training, equivalence of placements, resume, data order."""

import pytest
import torch

from tests.e2e.harness import SMALL_MODEL, run_pretrain


def default_corpus_args(cache, *, capacity, iters=6, extra=()):
    return [
        *SMALL_MODEL,
        "--seq-length",
        "512",
        "--hdp-capacity",
        str(capacity),
        "--train-iters",
        str(iters),
        "--lr",
        "3e-3",
        "--lr-decay-style",
        "constant",
        "--hdp-global-batch-tokens",
        "2048",
        "--data-cache-path",
        str(cache),
        "--seed",
        "5",
        *extra,
    ]


def assert_loss_goes_down(steps):
    losses = [s["loss"] for s in steps]
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.1, losses


@pytest.mark.parametrize("world_size, capacity", [(1, 512), (2, 256), (4, 128)])
def test_trains_on_the_default_corpus(corpus_cache, world_size, capacity):
    steps = run_pretrain(world_size, default_corpus_args(corpus_cache, capacity=capacity))
    assert len(steps) == 6
    assert_loss_goes_down(steps)
    assert all(s["tokens"] <= 2048 for s in steps)


def test_hdp_static_mesh_and_one_rank_give_the_same_losses(corpus_cache):
    hdp = run_pretrain(4, default_corpus_args(corpus_cache, capacity=128, iters=4))
    static = run_pretrain(
        4,
        default_corpus_args(
            corpus_cache, capacity=128, iters=4, extra=["--no-hdp", "--context-parallel-size", "4"]
        ),
    )
    single = run_pretrain(1, default_corpus_args(corpus_cache, capacity=512, iters=4))
    for a, b, c in zip(hdp, static, single, strict=True):
        assert a["units"] == b["units"] == c["units"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["loss"] == pytest.approx(c["loss"], rel=1e-5)


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_resume_equals_uninterrupted(corpus_cache, tmp_path, distributed_optimizer):
    """Stop at step 3 (--exit-interval), resume to 5: same losses and parameters as 1-5."""
    extra = ["--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--min-lr", "1e-4"]
    if distributed_optimizer:
        extra.append("--use-distributed-optimizer")
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"

    def run(iters_extra):
        return run_pretrain(
            2, default_corpus_args(corpus_cache, capacity=256, iters=5, extra=extra + iters_extra)
        )

    straight = run(["--save", str(straight_dir)])
    first = run(["--save", str(resumed_dir), "--exit-interval", "3"])
    second = run(["--load", str(resumed_dir), "--save", str(resumed_dir)])
    assert [s["iteration"] for s in first + second] == [1, 2, 3, 4, 5]
    assert [s["loss"] for s in first + second] == pytest.approx(
        [s["loss"] for s in straight], rel=1e-6
    )
    assert [s["lr"] for s in first + second] == pytest.approx([s["lr"] for s in straight])
    a = torch.load(straight_dir / "iter_0000005" / "common.pt", weights_only=False)["model"]
    b = torch.load(resumed_dir / "iter_0000005" / "common.pt", weights_only=False)["model"]
    for name, value in a.items():
        if torch.is_tensor(value):
            torch.testing.assert_close(b[name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_offloading_run_gives_the_same_losses(corpus_cache):
    """--hdp-offload gives long sequences fewer ranks and moves activations to host
    memory; the losses stay those of the run without it."""
    extra = [
        "--num-layers",
        "4",
        "--hidden-size",
        "128",
        "--seq-length",
        "2048",
        "--hdp-global-batch-tokens",
        "8192",
        "--hdp-device-profile",
        "cpu",
    ]
    plain = run_pretrain(4, default_corpus_args(corpus_cache, capacity=512, iters=2, extra=extra))
    offloaded = run_pretrain(
        4,
        default_corpus_args(corpus_cache, capacity=512, iters=2, extra=[*extra, "--hdp-offload"]),
    )
    assert offloaded[-1]["offloaded_bytes"] > 0 and plain[-1]["offloaded_bytes"] == 0
    assert [s["loss"] for s in offloaded] == pytest.approx([s["loss"] for s in plain], rel=1e-5)
