"""Checkpoints cross between stock Megatron-LM and pretrain_hdp.py, in both directions.

Both write Megatron's distributed format (`--ckpt-format torch_dist`). The references are
Megatron-LM's own: its `load_checkpoint` (with its resharding across TP and PP) followed by
its own training loop. pretrain_hdp.py must continue from the same weights to the same
losses, and Megatron-LM must continue from pretrain_hdp.py's checkpoint as from its own.
"""

from __future__ import annotations

import os

import pytest

from tests.e2e.harness import run_pretrain
from tests.megatron_lm.harness import MEGATRON_CPU, SHARED, run_megatron_lm

QUIET = ["--eval-iters", "0", "--eval-interval", "1000"]
#: The pool both sides continue on: HDP over 2 ranks at TP 1, documents over 256 tokens on
#: rings of 2.
HDP = ["--global-batch-size", "6", "--hdp-capacity", "256", *QUIET]


DECAY = ["--lr-decay-style", "linear", "--lr-decay-iters", "4", "--lr-warmup-iters", "1"]
KEEP_SCHEDULE = ["--use-checkpoint-opt_param-scheduler"]


def _close(got, want, rel=1e-5):
    assert len(got) == len(want) > 0, (got, want)
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=rel), (got, want)


def _losses(records):
    return [loss for _, loss, _ in records["train"]]


def _norms(records):
    return [norm for _, _, norm in records["train"]]


@pytest.mark.parametrize(
    "layout",
    [
        # Megatron-LM pads the vocabulary to a multiple of 64 x TP 2 = 128 x TP 1: the same
        # 384 rows at both layouts.
        ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"],
        ["--pipeline-model-parallel-size", "2"],
    ],
    ids=["tp2", "pp2"],
)
def test_a_megatron_lm_checkpoint_continues_in_hdp(trees, data, tmp_path, layout):
    """Stock pretrain_gpt.py at TP 2 or PP 2 trains two steps and saves; pretrain_hdp.py on a
    pool of 2 at TP 1 (`--load --finetune`) takes its first two steps to the losses and
    gradient norms of Megatron-LM's own continuation (its loader, the same HDP batches)."""
    stock, patched = trees
    ckpt = str(tmp_path / "megatron_lm")
    base = [*SHARED, "--data-path", data, "--train-iters", "2"]
    written = run_megatron_lm(
        stock / "pretrain_gpt.py",
        2,
        [
            *base,
            *MEGATRON_CPU,
            *layout,
            "--global-batch-size",
            "4",
            *QUIET,
            "--save",
            ckpt,
            "--save-interval",
            "2",
        ],
    )
    assert [i for i, _, _ in written["train"]] == [1, 2]
    assert os.path.exists(os.path.join(ckpt, "iter_0000002", "metadata.json"))
    cont = [*base, *HDP, "--load", ckpt, "--finetune"]
    want = run_megatron_lm(patched / "pretrain_gpt.py", 2, [*cont, *MEGATRON_CPU, "--hdp"])
    fresh = run_megatron_lm(patched / "pretrain_gpt.py", 2, [*base, *HDP, *MEGATRON_CPU, "--hdp"])
    assert _losses(want)[0] != pytest.approx(_losses(fresh)[0], rel=1e-4)  # it did load
    got = run_pretrain(2, [*cont, "--no-progress-bar"])
    _close([r["loss"] for r in got], _losses(want))
    _close([r["grad_norm"] for r in got], _norms(want))


def test_a_megatron_lm_checkpoint_of_another_shape_is_refused_by_name(
    trees, data, tmp_path, monkeypatch, capsys
):
    """Before any process group: the shape stock Megatron-LM stored in its `args` is checked
    against this run's model, and the difference is named by flag."""
    import torch.distributed as dist

    import pretrain_hdp

    stock, _ = trees
    ckpt = str(tmp_path / "megatron_lm")
    base = [*SHARED, "--data-path", data, "--train-iters", "1", "--global-batch-size", "2"]
    run_megatron_lm(
        stock / "pretrain_gpt.py",
        2,
        [*base, *MEGATRON_CPU, *QUIET, "--save", ckpt, "--save-interval", "1"],
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    wider = [*base, "--hdp-capacity", "256", *QUIET, "--load", ckpt, "--finetune"]
    with pytest.raises(SystemExit) as exit_info:
        pretrain_hdp.main([*wider, "--ffn-hidden-size", "192", "--no-progress-bar"])
    assert exit_info.value.code != 0
    assert "--ffn-hidden-size: 128 -> 192" in capsys.readouterr().err
    assert not dist.is_initialized()


def test_an_hdp_checkpoint_resumes_in_megatron_lm(trees, data, tmp_path):
    """pretrain_hdp.py trains two steps and saves; Megatron-LM's pretrain_gpt.py --hdp
    resumes it in full (model, optimizer, schedule, data position) and its steps 3 and 4
    equal pretrain_hdp.py's four uninterrupted steps.

    The learning rate decays linearly over the four steps, so the schedule's position must cross
    over in Megatron-LM's units (samples, not iterations). Megatron-LM keeps the
    checkpoint's schedule (--use-checkpoint-opt_param-scheduler): pretrain_hdp.py's weight
    decay and decay lengths are its own defaults, not Megatron-LM's."""
    _, patched = trees
    ckpt = str(tmp_path / "hdp")
    base = [*SHARED, "--data-path", data, "--train-iters", "4", *HDP, *DECAY]
    whole = run_pretrain(2, [*base, "--no-progress-bar"])
    first = run_pretrain(
        2,
        [
            *base,
            "--no-progress-bar",
            "--exit-interval",
            "2",
            "--save",
            ckpt,
            "--save-interval",
            "2",
        ],
    )
    assert len(first) == 2
    resumed = run_megatron_lm(
        patched / "pretrain_gpt.py",
        2,
        [*base, *MEGATRON_CPU, "--hdp", "--load", ckpt, "--no-load-rng", *KEEP_SCHEDULE],
    )
    assert [i for i, _, _ in resumed["train"]] == [3, 4]
    _close(_losses(resumed), [r["loss"] for r in whole[2:]])
    _close(_norms(resumed), [r["grad_norm"] for r in whole[2:]])


def test_a_bf16_hdp_checkpoint_resumes_in_megatron_lm(trees, data, tmp_path):
    """--bf16: pretrain_hdp.py (float32 norms, Megatron's mixed-precision optimizer) trains
    two steps and saves; pretrain_gpt.py --hdp --bf16 resumes it in full, the optimizer's
    Adam moments and float32 main weights included (Megatron-LM asks for a main weight
    of every parameter, the norms' too), and takes steps 3 and 4 to pretrain_hdp.py's
    uninterrupted losses and gradient norms within bfloat16 rounding (its Float16Module
    computes the norms in bfloat16)."""
    _, patched = trees
    ckpt = str(tmp_path / "hdp")
    base = [*SHARED, "--data-path", data, "--train-iters", "4", *HDP, *DECAY, "--bf16"]
    whole = run_pretrain(2, [*base, "--no-progress-bar", "--save", ckpt, "--save-interval", "2"])
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as tracker:
        tracker.write("2")  # resume from step 2
    resumed = run_megatron_lm(
        patched / "pretrain_gpt.py",
        2,
        [*base, *MEGATRON_CPU, "--hdp", "--load", ckpt, "--no-load-rng", *KEEP_SCHEDULE],
    )
    assert [i for i, _, _ in resumed["train"]] == [3, 4]
    _close(_losses(resumed), [r["loss"] for r in whole[2:]], rel=1e-4)
    _close(_norms(resumed), [r["grad_norm"] for r in whole[2:]], rel=1e-2)


def test_stock_megatron_lm_loads_hdp_weights_as_its_own(trees, data, tmp_path):
    """Two equal trainings, one saved by pretrain_hdp.py and one by Megatron-LM (--hdp, the
    same losses): stock pretrain_gpt.py without --hdp, at TP 2, continues from either with
    `--finetune` to the same losses: it reads pretrain_hdp.py's weights as its own."""
    stock, patched = trees
    ours, theirs = str(tmp_path / "hdp"), str(tmp_path / "megatron_lm")
    base = [*SHARED, "--data-path", data, "--train-iters", "2", *HDP]
    saved = run_pretrain(2, [*base, "--no-progress-bar", "--save", ours, "--save-interval", "2"])
    twin = run_megatron_lm(
        patched / "pretrain_gpt.py",
        2,
        [*base, *MEGATRON_CPU, "--hdp", "--save", theirs, "--save-interval", "2"],
    )
    _close(_losses(twin), [r["loss"] for r in saved], rel=1e-6)
    cont = [*SHARED, "--data-path", data, "--train-iters", "2", "--global-batch-size", "4"]
    cont += [*MEGATRON_CPU, *QUIET, "--finetune"]
    cont += ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
    from_theirs = run_megatron_lm(stock / "pretrain_gpt.py", 2, [*cont, "--load", theirs])
    from_ours = run_megatron_lm(stock / "pretrain_gpt.py", 2, [*cont, "--load", ours])
    _close(_losses(from_ours), _losses(from_theirs), rel=1e-6)
    _close(_norms(from_ours), _norms(from_theirs), rel=1e-5)
