"""Every bad flag is caught before any process group, fast, with one line and status 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.e2e.harness import corpus_args, torchrun_command

REPO = Path(__file__).resolve().parents[2]


def job_args(cache, extra=()):
    return corpus_args(cache, iters=3, extra=extra)


def _file(tmp: Path, name="a-file", text="x") -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


def _spec(tmp: Path, sources=None, **top) -> list[str]:
    """`--hdp-data-spec` of a spec file with the embedded corpus as its default source."""
    spec = {"sources": sources or [{"name": "lib", "builtin": "stdlib"}], **top}
    return ["--hdp-data-spec", _file(tmp, "spec.json", json.dumps(spec))]


BAD = [
    (["--lr", "nan"], "--lr nan: must be a finite number"),
    (["--min-lr", "inf"], "--min-lr inf: must be a finite number"),
    (["--clip-grad", "-1"], "--clip-grad must be >= 0, got -1.0"),
    (["--adam-beta2", "1"], "--adam-beta2 must lie in [0, 1), got 1.0"),
    (["--hidden-dropout", "nan"], "--hidden-dropout nan: must be a finite number"),
    (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by must be > 0, got 0"),
    (["--num-query-groups", "0"], "--num-query-groups must be > 0, got 0"),
    (["--init-method-std", "0"], "--init-method-std must be > 0, got 0.0"),
    (["--hdp-host-memory-gb", "nan"], "--hdp-host-memory-gb nan: must be a finite number"),
    (
        ["--hdp-offload", "--hdp-host-memory-gb", "1e6"],
        "--hdp-host-memory-gb 1e+06: 1 process on this machine would take 931322.6 GiB",
    ),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be > 0"),
    (["--hdp-stall-report-seconds", "900"], "--hdp-stall-report-seconds 900.0 must be below"),
    (["--lr-warmup-iters", "3"], "--lr-warmup-iters 3 must be below --train-iters 3"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--train-samples", "10"], "give --train-iters or --train-samples (one of them)"),
    (
        ["--rampup-batch-size", "2", "2", "8"],
        "--rampup-batch-size count samples of --seq-length tokens: give --global-batch-size",
    ),
    (
        ["--lr-warmup-samples", "8"],
        "--lr-decay-samples / --lr-warmup-samples go with --train-samples",
    ),
    (["--hdp-prefetch-depth", "-1"], "--hdp-prefetch-depth must be >= 0, got -1"),
    (["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (["--tensor-model-parallel-size", "4"], "--tensor-model-parallel-size 4 does not divide"),
    (
        ["--pipeline-model-parallel-size", "4"],
        "--tensor-model-parallel-size 1 x --pipeline-model-parallel-size 4 = 4 does not divide "
        "the 2 ranks",
    ),
    (
        ["--pipeline-model-parallel-size", "2"] + ["--num-layers", "3"],
        "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2",
    ),
    (
        ["--pipeline-model-parallel-size", "2"] + ["--num-layers", "1"],
        "--pipeline-model-parallel-size 2 needs at least one layer per stage; the model has "
        "only 1 layers",
    ),
    (
        ["--pipeline-model-parallel-size", "2"] + ["--hdp-placement", "greedy"],
        "--hdp-placement greedy with --pipeline-model-parallel-size 2",
    ),
    (
        ["--pipeline-model-parallel-size", "2"] + ["--num-experts", "4"],
        "--num-experts with --pipeline-model-parallel-size 2 needs --moe-token-dispatcher-type "
        "alltoall",
    ),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be > 0, got 0"),
    (["--pipeline-model-parallel-size", "-1"], "--pipeline-model-parallel-size must be > 0"),
    (["--expert-model-parallel-size", "0"], "--expert-model-parallel-size must be > 0, got 0"),
    (["--num-experts", "0"], "--num-experts must be > 0, got 0"),
    (["--num-experts", "4", "--moe-ffn-hidden-size", "0"], "--moe-ffn-hidden-size must be > 0"),
    (["--num-experts", "4", "--moe-ffn-hidden-size", "-8"], "must be > 0, got -8"),
    (["--num-experts", "4", "--moe-router-topk", "0"], "--moe-router-topk must be > 0, got 0"),
    (
        ["--num-experts", "4", "--moe-aux-loss-coeff", "-0.01"],
        "--moe-aux-loss-coeff must be >= 0, got -0.01",
    ),
    (["--moe-aux-loss-coeff", "0.01"], "--moe-aux-loss-coeff 0.01 needs --num-experts"),
    (["--moe-ffn-hidden-size", "64"], "--moe-ffn-hidden-size 64 needs --num-experts"),
    (
        ["--moe-token-dispatcher-type", "alltoall"],
        "--moe-token-dispatcher-type alltoall needs --num-experts",
    ),
    (
        ["--num-experts", "100000000", "--moe-router-topk", "1"],
        "error: the model (--num-layers 2, --hidden-size 32, --num-experts 100000000, "
        "--make-vocab-size-divisible-by 128) holds at least ",
    ),
    (["--hidden-size", "1048576"], "(--num-layers 2, --hidden-size 1048576, "),
    (
        ["--make-vocab-size-divisible-by", "1000000000"],
        "--make-vocab-size-divisible-by 1000000000)",
    ),
    (["--distributed-timeout-minutes", "1e30"], "--distributed-timeout-minutes 1e+30: too long"),
    (["--hdp-prefetch-depth", "65"], "--hdp-prefetch-depth 65: at most 64 batches ahead"),
    (["--seed", str(2**63)], "--seed 9223372036854775808: must be below 2**63"),
    (
        ["--hdp-global-batch-tokens", "1000000000"],
        # (the corpus is this interpreter's standard library: its size depends on the version)
        "--hdp-global-batch-tokens 1000000000: a global batch of more than the ",
    ),
    (["--data-path", "nan", "/data/a", "1", "/data/b"], "weights must be finite and positive"),
    (["--data-path", "/nowhere/data"], "--data-path /nowhere/data.idx: no such file"),
    (
        ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
        "not both",
    ),
    (
        ["--no-check-for-nan-in-loss-and-grad", "--hdp-skip-nonfinite-steps", "2"],
        "--hdp-skip-nonfinite-steps needs --check-for-nan-in-loss-and-grad",
    ),
    (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 needs --bf16"),
    (
        ["--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"],
        "give --accumulate-allreduce-grads-in-fp32 or --grad-reduce-in-bf16, not both",
    ),
    (["--ddp-bucket-size", "1000"], "--ddp-bucket-size 1000 needs --overlap-grad-reduce"),
    (["--fp16", "--bf16"], "give --fp16 or --bf16, not both"),
    (
        ["--fp16", "--hdp-skip-nonfinite-steps", "1"],
        "--hdp-skip-nonfinite-steps with --fp16: the loss scaler skips",
    ),
    (["--fp16", "--min-loss-scale", "0"], "--min-loss-scale 0.0 must lie in (0,"),
    (["--kv-channels", "0"], "--kv-channels must be > 0, got 0"),
    (
        ["--position-embedding-type", "rope", "--rotary-percent", "0.01"],
        "--rotary-percent 0.01 of head dim",
    ),
    (["--rotary-percent", "1.5"], "--rotary-percent must lie in (0, 1], got 1.5"),
    (
        ["--overlap-grad-reduce", "--ddp-bucket-size", "0"],
        "--ddp-bucket-size must be > 0, got 0",
    ),
    (lambda t: ["--save", _file(t)], "is a file, not a folder"),
    (lambda t: ["--tensorboard-dir", _file(t)], "is a file, not a folder"),
    (
        lambda t: ["--hdp-metrics-file", str(Path(_file(t)) / "sub" / "m.jsonl")],
        "is a file, so the folder cannot be made",
    ),
    (lambda t: ["--hdp-metrics-file", str(t)], "--hdp-metrics-file {t}: not a regular file"),
    (
        lambda t: ["--hdp-device-profile", _file(t, "p.json", '{"name": 1}')],
        "not a device profile JSON",
    ),
    (lambda t: ["--load", _file(t)], "is a file, not a checkpoint folder"),
    (
        lambda t: _spec(t, schedule=[{"until_step": 9, "weights": {"web": 1.0}}]),
        "schedule[0] names 'web', which is no source or stream of this spec (known: lib)",
    ),
    (
        lambda t: _spec(t, [{"name": "code", "path": "nowhere/code"}]),
        "--hdp-data-spec source 'code': {t}/nowhere/code.idx: no such file",
    ),
    (
        lambda t: _spec(t, [{"name": "lib", "builtin": "stdlib", "weight": -1}]),
        "source 'lib' weight must be finite and >= 0, got -1",
    ),
    (
        lambda t: _spec(t, schedule=[{"until_step": 9, "weights": {"lib": float("nan")}}]),
        "schedule[0] weight of 'lib' must be finite and >= 0, got nan",
    ),
    (
        lambda t: _spec(t, schedule=[{"until_step": 9, "weights": {"lib": 0}}]),
        "schedule[0]: the weights are all zero",
    ),
    (
        lambda t: _spec(t, schedule=[{"until_step": 2, "weights": {"lib": 1}}]),
        "the schedule ends at step 2, but --train-iters is 3",
    ),
    (lambda t: _spec(t) + ["--data-path", "/data/a"], "give --hdp-data-spec or --data-path"),
    (
        lambda t: _spec(t, [{"name": "lib", "builtin": "stdlib", "loaders": 100000}]),
        "source 'lib': loaders must be an integer from 1 to 64 (Ray actors per source) or "
        "{min, max}, got 100000",
    ),
    (
        ["--hdp-data-service", "ray", "--hdp-ray-address", "127.0.0.1:1"],
        "--hdp-ray-address 127.0.0.1:1: no Ray cluster answers there (Connection refused)",
    ),
    (["--hdp-data-service", "ray", "--hdp-ray-address", "head"], "is not HOST:PORT"),
    (["--hdp-ray-address", "10.0.0.1:6379"], "--hdp-ray-address needs --hdp-data-service ray"),
    (
        lambda t: (
            ["--data-path", str(t / "x"), "--tokenizer-type", "HuggingFaceTokenizer"]
            + ["--tokenizer-model", str(t / "tok.json")]
        ),
        "tok.json: no such file",
    ),
]


@pytest.mark.parametrize("extra, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_flags_exit_2_with_one_line_before_start_up(
    tmp_path, monkeypatch, capsys, extra, message
):
    import pretrain_hdp

    if callable(extra):
        extra = extra(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_info:
        pretrain_hdp.main(job_args(tmp_path / "cache", extra))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message.replace("{t}", str(tmp_path)) in err
    assert err.count("\n") == 1 and err.startswith("pretrain_hdp.py: error: ")
    assert not dist.is_initialized()


def test_offload_pools_of_all_local_ranks_must_fit_available_memory_in_validate_only(
    tmp_path, monkeypatch, capsys
):
    """4 local ranks of 8 GB on a machine with 23 GiB available (the reliability sweep)."""
    import pretrain_hdp
    from megatron_hdp.megatron import validation

    monkeypatch.setattr(validation, "available_memory_bytes", lambda: 23 * 2**30)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    flags = ["--hdp-offload", "--hdp-host-memory-gb", "8", "--hdp-validate-only"]
    with pytest.raises(SystemExit) as exit_info:
        pretrain_hdp.main(job_args(tmp_path / "cache", flags))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--hdp-host-memory-gb 8: 4 processes on this machine would take 29.8 GiB" in err
    assert not dist.is_initialized()


def test_validation_fails_before_torch_or_megatron_is_imported(tmp_path):
    code = (
        "import sys, pretrain_hdp\n"
        "try:\n"
        f"    pretrain_hdp.main({job_args(tmp_path, ['--lr', 'nan'])!r})\n"
        "except SystemExit as e:\n"
        "    print(e.code, 'torch' in sys.modules, 'megatron.core' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert done.stdout.split() == ["2", "False", "False"], done.stderr


def test_the_cpu_launcher_exits_2_with_one_line(tmp_path):
    env = {**os.environ, "NPROC": "2", "OUT": str(tmp_path / "run"), "VENV_DIR": sys.prefix}
    done = subprocess.run(
        ["bash", "scripts/run_cpu.sh", "--make-vocab-size-divisible-by", "0"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr == (
        "pretrain_hdp.py: error: --make-vocab-size-divisible-by must be > 0, got 0\n"
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--data-path", "{tmp}/ds"], "--data-path {tmp}/ds.idx: no such file"),
        (["--hdp-data-spec={tmp}/s.json"], "data spec '{tmp}/s.json' cannot be read"),
    ],
)
def test_the_cpu_launcher_s_data_spec_gives_way_to_the_user_s_data(tmp_path, flags, message):
    """run_cpu.sh draws the demo corpus by a spec unless the flags name other data."""
    env = {**os.environ, "NPROC": "2", "OUT": str(tmp_path / "run")}
    done = subprocess.run(
        ["bash", "scripts/run_cpu.sh", *(f.format(tmp=tmp_path) for f in flags)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith(f"pretrain_hdp.py: error: {message.format(tmp=tmp_path)}")
    assert "not both" not in done.stderr


def test_under_torchrun_the_message_comes_first_and_once(tmp_path):
    cmd = torchrun_command(2, job_args(tmp_path, ["--lr", "nan"]))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[0] == "pretrain_hdp.py: error: --lr nan: must be a finite number"
    assert done.stderr.count("must be a finite number") == 1


def test_other_ranks_leave_a_failure_to_local_rank_0(tmp_path, monkeypatch, capsys):
    """torchrun stops the other workers at the first failure and prints a SIGTERM notice; a
    silent rank that failed first would put that notice above the message (seen once in CI)."""
    import pretrain_hdp

    slept = []
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(pretrain_hdp.time, "sleep", slept.append)
    with pytest.raises(SystemExit) as failed:
        pretrain_hdp.main(job_args(tmp_path, ["--lr", "nan"]))
    assert failed.value.code == 2 and slept == [pretrain_hdp.OTHER_RANKS_WAIT_S]
    with pytest.raises(SystemExit) as done:  # nothing to train: no failure, no wait
        pretrain_hdp._say(pretrain_hdp.build_parser(), 0, "already at --train-iters")
    assert done.value.code == 0 and slept == [pretrain_hdp.OTHER_RANKS_WAIT_S]
    assert capsys.readouterr().err == ""


def test_a_gradient_flag_that_changes_nothing_is_reported(tmp_path):
    """--accumulate-allreduce-grads-in-fp32 is Megatron-LM's spelling of what happens anyway
    (fp32 parameters; bf16 without --grad-reduce-in-bf16): accepted, and said so."""
    from megatron_hdp.megatron.arguments import build_parser
    from megatron_hdp.megatron.config import optim_config
    from megatron_hdp.megatron.validation import flag_notes

    def parse(*extra):
        return build_parser().parse_args(job_args(tmp_path / "cache", list(extra)))

    assert flag_notes(parse()) == []
    for extra, why in ((["--bf16"], "--bf16"), ([], "float32 parameters")):
        args = parse("--accumulate-allreduce-grads-in-fp32", *extra)
        (note,) = flag_notes(args)
        assert note.startswith("--accumulate-allreduce-grads-in-fp32:") and why in note
        assert optim_config(args).grad_reduce_in_fp32
    assert optim_config(parse("--bf16")).grad_reduce_in_fp32  # Megatron-LM's bf16 default
    assert not optim_config(parse("--bf16", "--grad-reduce-in-bf16")).grad_reduce_in_fp32
    overlap = optim_config(parse("--overlap-grad-reduce", "--ddp-bucket-size", "5000"))
    assert overlap.overlap_grad_reduce and overlap.ddp_bucket_size == 5000
    assert not optim_config(parse()).overlap_grad_reduce


def test_every_problem_of_one_launch_comes_in_one_message(tmp_path, monkeypatch, capsys):
    """Three unrelated mistakes: one line naming all three (fixed in one round)."""
    import pretrain_hdp

    monkeypatch.setenv("WORLD_SIZE", "2")
    extra = ["--clip-grad", "-1", "--micro-batch-size", "2", "--save-interval", "5"]
    with pytest.raises(SystemExit) as exit_info:
        pretrain_hdp.main(job_args(tmp_path / "cache", extra))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("pretrain_hdp.py: error: 3 problems with this launch: (1) "), err
    for said in (
        "--clip-grad must be >= 0",
        "--micro-batch-size 2",
        "--save-interval needs --save",
    ):
        assert said in err, err
    assert not dist.is_initialized()


def test_every_refused_flag_comes_in_one_message(tmp_path, capsys):
    import pretrain_hdp

    extra = ["--fp8-format", "hybrid", "--optimizer", "sgd", "--no-such-flag"]
    with pytest.raises(SystemExit) as exit_info:
        pretrain_hdp.main(job_args(tmp_path / "cache", extra))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "3 problems with this launch" in err, err
    for said in ("--fp8-format is not supported", "--optimizer is not supported", "--no-such-flag"):
        assert said in err, err
    assert "hybrid" not in err.split("--no-such-flag")[0].split("unknown arguments")[-1]
