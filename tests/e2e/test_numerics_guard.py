"""Non-finite losses and gradients: detected on every rank, never applied, never saved."""

import math

import pytest
import torch

from megatron_hdp.checkpoint_files import latest_iteration
from tests.e2e.harness import corpus_args, run_pretrain, saved_model


def job_args(cache, *, lr="1e6", iters=6, extra=()):
    fixed = ["--lr-decay-style", "constant", "--clip-grad", "0"]
    return corpus_args(cache, iters=iters, lr=lr, extra=[*fixed, *extra])


def saved_parameters(folder):
    return saved_model(folder / f"iter_{latest_iteration(folder):07d}")


def assert_finite(state):
    for name, value in state.items():
        if torch.is_tensor(value) and value.is_floating_point():
            assert torch.isfinite(value).all(), name


def test_a_diverging_run_stops_naming_the_iteration_and_keeps_a_finite_checkpoint(
    corpus_cache, tmp_path
):
    """--lr 1e6 diverges at step 2: the job stops there and the latest checkpoint is step 1."""
    ckpt = tmp_path / "ckpt"
    with pytest.raises(AssertionError) as failure:
        run_pretrain(2, job_args(corpus_cache, extra=["--save", str(ckpt), "--save-interval", "1"]))
    report = str(failure.value)
    assert "SystemExit: 1" in report
    assert "iteration 2: the loss is" in report and "not finite" in report
    assert "the update was not applied" in report
    assert f"The latest checkpoint is iteration 1 in {ckpt}" in report
    assert latest_iteration(ckpt) == 1
    assert_finite(saved_parameters(ckpt))


def test_without_the_check_a_non_finite_model_is_never_saved(corpus_cache, tmp_path):
    """With --no-check-for-nan-in-loss-and-grad the NaN update happens, but the save refuses."""
    ckpt = tmp_path / "ckpt"
    extra = ["--no-check-for-nan-in-loss-and-grad", "--save", str(ckpt), "--save-interval", "1"]
    with pytest.raises(AssertionError) as failure:
        run_pretrain(2, job_args(corpus_cache, extra=extra))
    assert "refusing to save iteration 2" in str(failure.value)
    assert latest_iteration(ckpt) == 1
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "iter_0000001",
        "latest_checkpointed_iteration.txt",
    ]
    assert_finite(saved_parameters(ckpt))


@pytest.fixture
def poisoned_step_2_on_rank_1(monkeypatch):
    """Rank 1's token losses are NaN in step 2 only (a transient fault on one replica)."""
    import torch.distributed as dist

    from megatron_hdp.megatron import step as step_module
    from megatron_hdp.megatron import trainer as trainer_module

    real_losses, real_step = step_module._token_losses, step_module.train_step
    steps = {"count": 0}

    def counting_step(*args, **kwargs):
        steps["count"] += 1
        return real_step(*args, **kwargs)

    def poisoned(engine, batch, runtime, global_tokens):
        losses, aux = real_losses(engine, batch, runtime, global_tokens)
        if steps["count"] == 2 and dist.get_rank() == 1:
            return losses * float("nan"), aux
        return losses, aux

    monkeypatch.setattr(step_module, "_token_losses", poisoned)
    monkeypatch.setattr(trainer_module, "train_step", counting_step)


def test_a_skipped_step_applies_no_update_on_any_rank(corpus_cache, poisoned_step_2_on_rank_1):
    """Rank 1 alone sees a NaN loss in step 2: every rank skips that update, then trains on."""
    extra = ["--hdp-skip-nonfinite-steps", "1", "--lr-warmup-iters", "3"]
    steps = run_pretrain(2, job_args(corpus_cache, lr="3e-3", iters=5, extra=extra))
    assert [s["skipped"] for s in steps] == [False, True, False, False, False]
    assert math.isnan(steps[1]["loss"])
    assert all(math.isfinite(s["loss"]) for s in steps[2:])
    # The schedule did not advance in the skipped step: warm-up lr = 3e-3 * n / 3 after n updates.
    assert [s["lr"] for s in steps] == pytest.approx([1e-3, 1e-3, 2e-3, 3e-3, 3e-3])


def test_skipping_is_bounded(corpus_cache, tmp_path):
    """--hdp-skip-nonfinite-steps 2 on a diverged model: two skips, then the job stops."""
    with pytest.raises(AssertionError) as failure:
        run_pretrain(2, job_args(corpus_cache, extra=["--hdp-skip-nonfinite-steps", "2"]))
    assert "iteration 4: the loss is" in str(failure.value)
    assert "(2 may be skipped in a row)" in str(failure.value)
