"""Multi-token prediction through Megatron-LM's own `pretrain_gpt.py --hdp`.

`--mtp-num-layers 2 --mtp-loss-scaling-factor 0.3` on two ranks with rings: the losses and
gradient norms (which hold the MTP layers' gradients and the MTP losses' share of every
other gradient) equal `pretrain_hdp.py`'s with the same flags, whose MTP training equals
stock Megatron-Core's on one process (`tests/megatron/test_mtp.py`).
"""

from __future__ import annotations

import pytest

from tests.e2e.harness import run_pretrain
from tests.megatron_lm.harness import MEGATRON_CPU, SHARED, run_megatron_lm

MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]


def test_mtp_losses_and_grad_norms_equal_pretrain_hdp(trees, data):
    _, patched = trees
    flags = [*SHARED, "--data-path", data, "--train-iters", "2", "--global-batch-size", "8"]
    flags += ["--hdp-capacity", "256", "--eval-interval", "1000", "--eval-iters", "0"]
    ran = run_megatron_lm(patched / "pretrain_gpt.py", 2, [*flags, *MEGATRON_CPU, "--hdp", *MTP])
    reference = run_pretrain(2, [*flags, *MTP, "--no-progress-bar"])
    plain = run_pretrain(2, [*flags, "--no-progress-bar"])
    assert max(r["max_ranks_per_sequence"] for r in reference) == 2  # rings ran
    assert [i for i, _, _ in ran["train"]] == [1, 2]
    for (_, loss, norm), want in zip(ran["train"], reference, strict=True):
        assert loss == pytest.approx(want["loss"], rel=1e-6)
        assert norm == pytest.approx(want["grad_norm"], rel=1e-6)
    # The MTP losses reach the gradients: the first step's norm differs from the plain model's
    # (same main-model weights; its main loss is the same number).
    assert reference[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6)
    assert abs(reference[0]["grad_norm"] - plain[0]["grad_norm"]) > 1e-4 * plain[0]["grad_norm"]


def test_mtp_flags_pass_the_checks_and_reach_the_model_config(trees, monkeypatch):
    from megatron_hdp.megatron_lm.model import gpt_config
    from tests.megatron_lm.test_args import BASE, _parse_and_validate

    args = _parse_and_validate(monkeypatch, [*BASE, "--hdp", *MTP])
    cfg = gpt_config(args, vocab_size=256)
    assert (cfg.mtp_num_layers, cfg.mtp_loss_scaling_factor) == (2, 0.3)


def test_mtp_with_pipeline_stages_is_refused_by_name(trees, monkeypatch, capsys):
    from tests.megatron_lm.test_args import BASE, _parse_and_validate

    argv = [*BASE, "--hdp", *MTP, "--pipeline-model-parallel-size", "2"]
    with pytest.raises(SystemExit):
        _parse_and_validate(monkeypatch, argv, world_size=4)
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--mtp-num-layers 2 with --pipeline-model-parallel-size 2" in message, message


def test_a_shared_mtp_layer_is_refused_where_megatron_lm_has_it(trees, monkeypatch, capsys):
    """`--mtp-use-repeated-layer` (core_v0.19.0): one layer for every depth, untested here."""
    from megatron_hdp.megatron_lm.args import _REFUSED_MEGATRON
    from tests.megatron_lm.test_args import BASE, _parse_and_validate, _parsed

    if "mtp_use_repeated_layer" not in _parsed(monkeypatch, [*BASE, "--hdp"]):
        assert "mtp_use_repeated_layer" in {dest for dest, _, _ in _REFUSED_MEGATRON}
        return  # core_v0.16.1 has no such flag: nothing to refuse
    with pytest.raises(SystemExit):
        _parse_and_validate(monkeypatch, [*BASE, "--hdp", *MTP, "--mtp-use-repeated-layer"])
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--mtp-use-repeated-layer" in message, message
