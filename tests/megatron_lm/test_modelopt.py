"""ModelOpt's flags under `--hdp` (gpt-oss's recipe passes them: `--enable-gpt-oss`,
`--export-force-local-attention`).

Megatron-LM reads them only when it builds ModelOpt's model (`args.modelopt_enabled`: a
`--load` checkpoint with ModelOpt state, or `--export-kd-teacher-load`); otherwise they do
nothing, with or without `--hdp`. HDP builds Megatron-LM's GPT model, so it refuses the two
ways into ModelOpt's: the teacher flag at start-up, a ModelOpt checkpoint where Megatron-LM
detects it (at model building).
"""

from __future__ import annotations

import sys

import pytest

from tests.megatron_lm.test_args import BASE


def _parse(monkeypatch, argv):
    from megatron.post_training.arguments import add_modelopt_args
    from megatron.training import arguments

    from megatron_hdp.megatron_lm.hooks import _checked_validate_args, with_hdp_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    args = arguments.parse_args(with_hdp_args(add_modelopt_args))
    _checked_validate_args(arguments.validate_args)(args, {"tokenizer_type": "GPT2BPETokenizer"})
    return args


def test_gpt_oss_flags_pass_and_a_distillation_teacher_is_refused(trees, monkeypatch, capsys):
    gpt_oss = ["--enable-gpt-oss", "--export-force-local-attention"]
    args = _parse(monkeypatch, [*BASE, "--hdp", *gpt_oss])
    assert args.hdp_checked and args.enable_gpt_oss and not getattr(args, "modelopt_enabled", 0)
    with pytest.raises(SystemExit) as stop:
        _parse(monkeypatch, [*BASE, "--hdp", *gpt_oss, "--export-kd-teacher-load", "/teacher"])
    assert stop.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--export-kd-teacher-load: ModelOpt distillation" in message, message


def test_a_modelopt_checkpoint_is_refused_when_the_model_is_built(trees, monkeypatch):
    import megatron.training

    from megatron_hdp.megatron_lm.hooks import hdp_model_provider

    args = _parse(monkeypatch, [*BASE, "--hdp", "--enable-gpt-oss"])
    args.load, args.modelopt_enabled = "/ckpt/modelopt", True  # as Megatron-LM sets it
    monkeypatch.setattr(megatron.training, "get_args", lambda: args)
    with pytest.raises(ValueError, match="--load /ckpt/modelopt is a ModelOpt checkpoint"):
        hdp_model_provider()
