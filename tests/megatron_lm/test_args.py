"""`--hdp` in Megatron-LM's own parser: what it implies, and every refusal, by name.

Parsed by Megatron-LM's real `parse_args` and checked by the hooked `validate_args`, as in
`initialize_megatron` before any process group exists.
"""

from __future__ import annotations

import pytest

from megatron_hdp.megatron_lm.args import REFUSED_HDP_FLAGS
from tests.megatron_lm.harness import MEGATRON_CPU, SHARED

BASE = [*SHARED, *MEGATRON_CPU, "--train-iters", "2", "--eval-interval", "10"]


def _parse_and_validate(monkeypatch, argv, world_size=2):
    from megatron.training import arguments

    from megatron_hdp.megatron_lm.hooks import _checked_validate_args, with_hdp_args

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *argv])
    args = arguments.parse_args(with_hdp_args(None))
    _checked_validate_args(arguments.validate_args)(args, {"tokenizer_type": "GPT2BPETokenizer"})
    return args


def test_hdp_sets_what_it_needs(trees, monkeypatch, tmp_path):
    args = _parse_and_validate(
        monkeypatch, [*BASE, "--hdp", "--save", str(tmp_path), "--save-interval", "1"]
    )
    assert args.hdp and args.hdp_checked
    assert args.dataloader_type == "external" and args.calculate_per_token_loss
    assert args.dataloader_save == str(tmp_path)  # checkpoints carry the data position
    assert args.hdp_attention_backend == "torch"  # "auto" resolved for this CPU
    assert args.micro_batch_size == 1  # HDP packs its own micro-batches


def test_without_hdp_nothing_changes(trees, monkeypatch):
    args = _parse_and_validate(monkeypatch, BASE)
    assert not args.hdp and not getattr(args, "hdp_checked", False)
    assert args.dataloader_type == "single" and not args.calculate_per_token_loss


REFUSED = {
    **{flag: [flag, "1"] for flag, _ in REFUSED_HDP_FLAGS.values()},
    "--hdp-static-baseline": ["--hdp-static-baseline"],
    "--hdp-offload": ["--hdp-offload"],
    "--hdp-validate-only": ["--hdp-validate-only"],
    "--hdp-overwrite-checkpoints": ["--hdp-overwrite-checkpoints"],
    "--mock-data": ["--mock-data", "--hdp-data-spec", "spec.yaml"],  # two data sources
    "--rotary-seq-len-interpolation-factor": ["--rotary-seq-len-interpolation-factor", "2"],
    "--global-batch-size": ["--global-batch-size", "3"],  # Megatron-LM's counter: DP 2 | B
    "--train-samples": ["--hdp-global-batch-tokens", "2048", "--train-samples", "8"],
    "--inprocess-restart": ["--inprocess-restart"],
    "--tokenizer-type": ["--tokenizer-type", "SFTTokenizer"],
    "--dataloader-type": ["--dataloader-type", "single"],
    # Mixture-of-experts settings HDP cannot make exact (or has not wired), each with experts.
    "--moe-grouped-gemm": ["--num-experts", "4", "--moe-grouped-gemm"],
    "--moe-expert-capacity-factor": ["--num-experts", "4", "--moe-expert-capacity-factor", "1"],
    "--moe-token-dispatcher-type flex": [
        *["--num-experts", "4", "--moe-token-dispatcher-type", "flex"],
    ],
    "--moe-input-jitter-eps": ["--num-experts", "4", "--moe-input-jitter-eps", "0.01"],
    "--moe-router-load-balancing-type global_aux_loss": [
        *["--num-experts", "4", "--moe-router-load-balancing-type", "global_aux_loss"],
    ],
    "--overlap-moe-expert-parallel-comm": [
        *["--num-experts", "4", "--overlap-moe-expert-parallel-comm"],
    ],
    # An expert grid over TP ranks and replicas at once (TP 1, expert TP 2, EP 2).
    "--expert-model-parallel-size": [
        *["--num-experts", "4", "--expert-model-parallel-size", "2"],
        *["--expert-tensor-parallel-size", "2"],
    ],
    # Experts across replicas with Megatron's default dispatcher (allgather).
    "--moe-token-dispatcher-type allgather": [
        *["--num-experts", "4", "--expert-model-parallel-size", "2"],
    ],
    "--spec": ["--spec", "my.module", "spec"],
    "--cache-mla-latents": ["--cache-mla-latents"],  # Megatron-Core refuses it in training
    "--hdp-global-batch-tokens": ["--hdp-global-batch-tokens", "2048", "--global-batch-size", "8"],
    "--seq-length": ["--hdp-capacity", "100"],  # 512 tokens > 2 ranks x 100
    "--hdp-global-batch-tokens 300": ["--hdp-global-batch-tokens", "300"],  # < --seq-length
    "--split": ["--split", "1,1,1,1"],  # Megatron-Core asserts 3 weights at most, after start-up
}


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_with_hdp_a_flag_it_cannot_honour_is_refused_by_name(trees, monkeypatch, capsys, flag):
    with pytest.raises(SystemExit) as stop:
        _parse_and_validate(monkeypatch, [*BASE, "--hdp", *REFUSED[flag]])
    assert stop.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("pretrain_gpt.py: error: ") and flag in message, message


def test_every_refusal_of_one_launch_comes_in_one_message(trees, monkeypatch, capsys):
    """A recipe with several flags HDP cannot run is fixed in one round, not one per flag."""
    flags = [*REFUSED["--inprocess-restart"], *REFUSED["--mock-data"]]
    flags += REFUSED["--dataloader-type"]
    with pytest.raises(SystemExit) as stop:
        _parse_and_validate(monkeypatch, [*BASE, "--hdp", *flags])
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    message = lines[-1]
    assert message.startswith("pretrain_gpt.py: error: 3 problems with this launch: (1) ")
    for flag in ("--inprocess-restart", "--mock-data", "--dataloader-type"):
        assert flag in message, message


def test_moe_settings_hdp_runs_pass_the_checks(trees, monkeypatch):
    """Experts on the TP ranks of a replica, with every loss and the expert bias."""
    from megatron.training import arguments

    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)  # asked with TP > 1
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    moe = ["--num-experts", "4", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]
    moe += ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"]
    moe += ["--moe-token-dispatcher-type", "alltoall"]
    moe += ["--moe-shared-expert-intermediate-size", "64"]
    moe += ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    moe += ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
    args = _parse_and_validate(monkeypatch, [*BASE, "--hdp", *moe], world_size=4)
    assert args.hdp_checked and args.num_experts == 4


def test_expert_parallelism_refusal_names_the_expert_tp_size_to_give(trees, monkeypatch, capsys):
    """TP 2 and EP 2 without --expert-tensor-parallel-size (Megatron-LM's default: TP)."""
    from megatron.training import arguments

    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)  # asked with TP > 1
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    flags = ["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    flags += ["--expert-model-parallel-size", "2"]
    with pytest.raises(SystemExit):
        _parse_and_validate(monkeypatch, [*BASE, "--hdp", *flags], world_size=4)
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "give --expert-tensor-parallel-size 1" in message, message


def test_flags_the_plan_replaces_are_reported_once(trees, monkeypatch, caplog):
    """--micro-batch-size and the CP communication flags: accepted, logged as replaced."""
    import logging

    flags = ["--micro-batch-size", "2", "--cp-comm-type", "a2a"]
    flags += ["--attention-backend", "flash", "--log-throughput"]
    with caplog.at_level(logging.WARNING, logger="megatron_hdp"):
        _parse_and_validate(monkeypatch, [*BASE, "--hdp", *flags])
    notes = [r.getMessage() for r in caplog.records if "has no effect with --hdp" in r.getMessage()]
    assert len(notes) == 3, notes
    said = [r.getMessage() for r in caplog.records]
    assert not any("--log-throughput" in m for m in said), said  # counted as trained (hooks)
    assert notes[0].startswith("--micro-batch-size 2 has no effect with --hdp")
    assert notes[1].startswith("--cp-comm-type a2a has no effect with --hdp")
    assert notes[2].startswith("--attention-backend flash has no effect with --hdp")


@pytest.mark.parametrize("extra", [["--hdp-capacity", "256"], ["--hdp-placement", "greedy"]])
def test_an_hdp_flag_without_hdp_is_refused(trees, monkeypatch, capsys, extra):
    with pytest.raises(SystemExit):
        _parse_and_validate(monkeypatch, [*BASE, *extra])
    assert f"{extra[0]} has no effect without --hdp" in capsys.readouterr().err


def test_the_data_vocabulary_is_the_one_megatron_lm_built(trees, data, monkeypatch):
    """NullTokenizer: the data's vocabulary under --hdp is Megatron-LM's own tokenizer's.

    The documents hold ids 0..256 (end-of-document 256). Megatron-LM reads them with the
    `--vocab-size` of its release (256 with megatron-core 0.16, 257 with 0.19, MEGATRON_CPU's
    last flag); HDP's data reader alone counts `--vocab-size 257` as 258 ids, which 0.19's
    tokenizer (and so its embedding) does not have.
    """
    from megatron.training import global_vars

    from megatron_hdp.data.training_data import build_training_data
    from megatron_hdp.megatron_lm.args import global_batch
    from megatron_hdp.megatron_lm.data import megatron_lm_data_config

    args = _parse_and_validate(monkeypatch, [*BASE, "--hdp", "--data-path", data])
    monkeypatch.setattr(global_vars, "_GLOBAL_TOKENIZER", None)
    global_vars._build_tokenizer(args)  # as Megatron-LM's start-up does (sets the padding)
    got = build_training_data(megatron_lm_data_config(args, *global_batch(args)))
    assert got.vocab_size == global_vars.get_tokenizer().vocab_size == 257
    assert got.cfg.tokenizer.eod == 256
    assert args.padded_vocab_size == 384


def test_nvidias_quoted_split_is_read_as_megatron_lm_reads_it(trees, data, monkeypatch):
    """`--split "'99,1,0'"` (Llama-3 recipes: quotes inside the value), as stock takes it.

    The drop-in's data layer gets the split Megatron-Core's own parser finds.
    """
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    from megatron_hdp.data.training_data import build_training_data
    from megatron_hdp.megatron.config import batch_data_config

    argv = [*BASE, "--hdp", "--data-path", data, "--split", "'99,1,0'"]
    args = _parse_and_validate(monkeypatch, argv)
    assert args.split == "'99,1,0'"
    assert parse_and_normalize_split(args.split) == pytest.approx([0.99, 0.01, 0.0])
    reader = build_training_data(batch_data_config(args, tokens_per_batch=None, units_per_batch=8))
    assert reader.cfg.split == [99.0, 1.0, 0.0]
    assert sorted(set(reader.valid_units[0].doc.tolist())) == [198, 199]  # 1 % of 200


GPU_FLAGS = {
    "--transformer-impl transformer_engine": ["--transformer-impl", "transformer_engine"],
    "--fp8-format": ["--fp8-format", "hybrid", "--bf16"],
    "--tp-comm-overlap": ["--tp-comm-overlap", "--tensor-model-parallel-size", "2"],
    "--use-megatron-fsdp": ["--use-megatron-fsdp"],
}


def _parsed(monkeypatch, argv, world_size=2):
    """Megatron-LM's parsed arguments, before any check (as `check_args` gets them)."""
    from megatron.training import arguments

    from megatron_hdp.megatron_lm.hooks import with_hdp_args

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *argv])
    return arguments.parse_args(with_hdp_args(None))


def test_gpu_only_flags_are_refused_on_cpu_together(trees, monkeypatch):
    from megatron_hdp.megatron_lm.args import check_args

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    argv = [*BASE, "--hdp"] + [x for flags in GPU_FLAGS.values() for x in flags]
    with pytest.raises(ValueError) as refused:
        check_args(_parsed(monkeypatch, argv, world_size=4))
    message = str(refused.value)
    assert message.startswith("4 problems with this launch"), message
    for flag in GPU_FLAGS:
        assert f"{flag}: " in message and "CUDA GPUs only" in message, (flag, message)


@pytest.mark.parametrize("flag", sorted(GPU_FLAGS))
def test_on_cuda_a_gpu_only_flag_runs_unverified_or_is_refused(trees, monkeypatch, caplog, flag):
    """Faked CUDA: TE, FP8 and Megatron-FSDP are accepted and logged as unverified on GPU;
    --tp-comm-overlap is refused (its userbuffers have a fixed token count)."""
    import logging

    from megatron_hdp.megatron_lm.args import check_args

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    args = _parsed(monkeypatch, [*BASE, "--hdp", *GPU_FLAGS[flag]], world_size=4)
    if flag == "--tp-comm-overlap":
        with pytest.raises(ValueError, match="--tp-comm-overlap: Transformer Engine's userbuffers"):
            check_args(args)
        return
    with caplog.at_level(logging.WARNING, logger="megatron_hdp"):
        check_args(args)
    said = [r.getMessage() for r in caplog.records if "unverified on GPU" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"{flag} with --hdp is accepted"), said


def test_a_ramp_is_read_as_this_megatron_lm_reads_it(trees, monkeypatch, caplog):
    """core_v0.16.1 ramps (and so does HDP); core_v0.19.0's Megatron-LM ignores the flag
    (deprecated), so HDP does too, and says so."""
    import logging

    from megatron_hdp.megatron_lm.args import global_batch, megatron_ramps

    flags = ["--global-batch-size", "6", "--rampup-batch-size", "2", "2", "8"]
    flags += ["--train-samples", "20", "--eval-interval", "10"]  # a ramp needs samples
    with caplog.at_level(logging.WARNING, logger="megatron_hdp"):
        args = _parse_and_validate(monkeypatch, [*SHARED, *MEGATRON_CPU, "--hdp", *flags])
    tokens, ramp = global_batch(args)
    assert tokens == 6 * 512
    ignored = [r.getMessage() for r in caplog.records if "ignores it" in r.getMessage()]
    if megatron_ramps():
        assert ramp.rampup == (2, 2, 8) and not ignored
        assert [ramp.tokens_of_step(i) for i in range(5)] == [1024, 1024, 2048, 3072, 3072]
    else:
        assert args.rampup_batch_size is None and ramp.rampup is None
        assert len(ignored) == 1 and ignored[0].startswith("--rampup-batch-size 2 2 8")


def test_a_ramp_with_train_iters_is_refused_where_megatron_lm_ramps(trees, monkeypatch, capsys):
    """core_v0.16.1 asserts no ramp-up for iteration-based training: one clear line instead."""
    from megatron_hdp.megatron_lm.args import megatron_ramps

    flags = ["--global-batch-size", "6", "--rampup-batch-size", "2", "2", "8"]
    if not megatron_ramps():  # core_v0.19.0 ignores the ramp (test above)
        _parse_and_validate(monkeypatch, [*BASE, "--hdp", *flags])
        return
    with pytest.raises(SystemExit):
        _parse_and_validate(monkeypatch, [*BASE, "--hdp", *flags])
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--rampup-batch-size needs --train-samples, not --train-iters" in message, message
