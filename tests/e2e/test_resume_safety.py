"""Resume and checkpoint-folder safety through pretrain_hdp.main: nothing silently changes."""

import json
import math
import shutil

import pytest
import torch.distributed as dist

from megatron_hdp.checkpoint_digests import DIGESTS
from megatron_hdp.checkpoint_files import iteration_dir, latest_iteration
from tests.e2e.harness import corpus_args, run_pretrain, tiny_engine

LR, MIN_LR = 3e-3, 3e-4


def job_args(cache, *, iters, extra=()):
    schedule = ["--min-lr", str(MIN_LR), "--lr-decay-style", "cosine"]
    return corpus_args(cache, iters=iters, lr=LR, extra=[*schedule, *extra])


def cosine_lr(step, decay_steps):
    """Megatron's cosine decay without warm-up, written out."""
    ratio = min(step, decay_steps) / decay_steps
    return MIN_LR + 0.5 * (LR - MIN_LR) * (math.cos(math.pi * ratio) + 1)


@pytest.fixture(scope="module")
def four_steps(corpus_cache, tmp_path_factory):
    """A checkpoint folder of a finished 4-step run."""
    folder = tmp_path_factory.mktemp("run") / "ckpt"
    run_pretrain(2, job_args(corpus_cache, iters=4, extra=["--save", str(folder)]))
    return folder


@pytest.fixture
def checkpoint(four_steps, tmp_path):
    """A private copy of the 4-step checkpoint folder."""
    copy = tmp_path / "ckpt"
    shutil.copytree(four_steps, copy)
    return copy


def exit_of(argv, monkeypatch, capsys):
    """Exit status and stderr of pretrain_hdp.main on 2 ranks' worth of validation."""
    import pretrain_hdp

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_info:
        pretrain_hdp.main(argv)
    assert not dist.is_initialized()
    return exit_info.value.code, capsys.readouterr().err


def test_a_longer_run_with_the_old_schedule_is_refused_by_name(
    corpus_cache, checkpoint, monkeypatch, capsys
):
    argv = job_args(corpus_cache, iters=8, extra=["--load", str(checkpoint)])
    code, err = exit_of(argv, monkeypatch, capsys)
    assert code == 2
    assert "--lr-decay-iters (default: --train-iters) 8 (checkpoint: 4)" in err
    assert "--override-opt_param-scheduler" in err and "--use-checkpoint-opt_param-scheduler" in err
    argv = job_args(
        corpus_cache, iters=8, extra=["--load", str(checkpoint), "--lr-decay-iters", "4"]
    )
    argv[argv.index("--lr") + 1] = "1e-3"
    code, err = exit_of(argv, monkeypatch, capsys)
    assert code == 2 and "--lr 0.001 (checkpoint: 0.003)" in err


def test_override_takes_the_new_schedule(corpus_cache, checkpoint):
    extra = ["--load", str(checkpoint), "--save", str(checkpoint), "--override-opt_param-scheduler"]
    steps = run_pretrain(2, job_args(corpus_cache, iters=8, extra=extra))
    assert [s["iteration"] for s in steps] == [5, 6, 7, 8]
    assert [s["lr"] for s in steps] == pytest.approx([cosine_lr(n, 8) for n in range(5, 9)])


def test_use_checkpoint_keeps_the_old_schedule(corpus_cache, checkpoint):
    extra = ["--load", str(checkpoint), "--use-checkpoint-opt_param-scheduler"]
    steps = run_pretrain(2, job_args(corpus_cache, iters=6, extra=extra))
    assert [s["lr"] for s in steps] == pytest.approx([MIN_LR, MIN_LR])  # decayed at step 4


@pytest.mark.parametrize(
    "iters, status, message", [(4, 0, "training is complete"), (3, 2, "raise")]
)
def test_a_resume_at_or_past_the_end_says_so(
    corpus_cache, checkpoint, monkeypatch, capsys, iters, status, message
):
    argv = job_args(corpus_cache, iters=iters, extra=["--load", str(checkpoint)])
    code, err = exit_of(argv, monkeypatch, capsys)
    assert code == status
    assert f"the checkpoint is at iteration 4 and --train-iters is {iters}" in err
    assert message in err


def test_a_fresh_run_into_another_runs_folder_is_refused(
    corpus_cache, checkpoint, monkeypatch, capsys
):
    before = sorted(p.name for p in checkpoint.iterdir())
    code, err = exit_of(
        job_args(corpus_cache, iters=2, extra=["--save", str(checkpoint)]), monkeypatch, capsys
    )
    assert code == 2
    assert f"--save {checkpoint} already holds checkpoints of another run" in err
    assert "latest iteration 4" in err and "--hdp-overwrite-checkpoints" in err
    assert sorted(p.name for p in checkpoint.iterdir()) == before
    assert latest_iteration(checkpoint) == 4


def test_a_resume_into_another_runs_folder_is_refused(
    corpus_cache, checkpoint, tmp_path, monkeypatch, capsys
):
    other = tmp_path / "other"
    run_pretrain(2, job_args(corpus_cache, iters=1, extra=["--save", str(other)]))
    argv = job_args(
        corpus_cache,
        iters=6,
        extra=["--load", str(checkpoint), "--save", str(other), "--lr-decay-iters", "4"],
    )
    code, err = exit_of(argv, monkeypatch, capsys)
    assert code == 2 and f"resumes --load {checkpoint}" in err
    assert latest_iteration(other) == 1


def test_overwrite_flag_replaces_the_old_run(corpus_cache, checkpoint):
    old_run = json.loads((iteration_dir(checkpoint, 4) / "meta.json").read_text())["run_id"]
    extra = ["--save", str(checkpoint), "--hdp-overwrite-checkpoints"]
    run_pretrain(2, job_args(corpus_cache, iters=2, extra=extra))
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "iter_0000002",
        "latest_checkpointed_iteration.txt",
    ]
    meta = json.loads((iteration_dir(checkpoint, 2) / "meta.json").read_text())
    assert meta["run_id"] != old_run


def test_overwrite_flag_keeps_the_old_run_until_its_own_first_checkpoint_is_published(
    corpus_cache, checkpoint, monkeypatch
):
    """A crash in the new run's first save (here: its shards cannot be written) leaves the
    old run's checkpoints and tracker as they were; the reliability sweep's T3 lost them."""
    from megatron_hdp.megatron import dist_checkpoint

    before = sorted(p.name for p in checkpoint.iterdir())

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dist_checkpoint, "write", disk_full)  # the forked ranks inherit it
    extra = ["--save", str(checkpoint), "--hdp-overwrite-checkpoints"]
    with pytest.raises(AssertionError, match="could not save iteration 2"):
        run_pretrain(2, job_args(corpus_cache, iters=2, extra=extra))
    # Only the failed save's `.partial` folder is new (the next save clears it).
    after = sorted(p.name for p in checkpoint.iterdir() if not p.name.endswith(".partial"))
    assert after == before
    assert latest_iteration(checkpoint) == 4


def test_a_resume_with_another_model_is_refused_before_start_up(
    corpus_cache, checkpoint, monkeypatch, capsys
):
    argv = job_args(
        corpus_cache, iters=6, extra=["--load", str(checkpoint), "--lr-decay-iters", "4"]
    )
    argv[argv.index("--hidden-size") + 1] = "64"
    code, err = exit_of(argv, monkeypatch, capsys)
    assert code == 2 and "--hidden-size: 32 -> 64" in err


def test_the_checked_schedule_is_the_one_the_engine_saves(corpus_cache, four_steps):
    """schedule_of(flags), which the start-up check compares, equals the real scheduler's."""
    from megatron_hdp.megatron.arguments import build_parser
    from megatron_hdp.megatron.resume_checks import schedule_of

    saved = json.loads((iteration_dir(four_steps, 4) / "meta.json").read_text())["schedule"]
    args = build_parser().parse_args(job_args(corpus_cache, iters=4))
    assert {k: v for k, v in saved.items() if k != "num_steps"} == schedule_of(args)
    assert saved["num_steps"] == 4


def _body_save_backwards(rank, world_size, folder):
    from megatron_hdp.megatron import checkpoint

    with tiny_engine() as engine:
        for iteration in (3, 2):
            state = checkpoint.TrainingState(iteration=iteration, data_state={})
            try:
                checkpoint.save_checkpoint(folder, engine, state, group=dist.group.WORLD)
            except (ValueError, RuntimeError) as err:  # rank 0's reason, on every rank
                return str(err)
        return None


def test_the_tracker_never_moves_backwards(tmp_path):
    from tests.dist import run_ranks

    results = run_ranks(_body_save_backwards, 2, str(tmp_path), timeout_s=60)
    assert "would move its latest checkpoint backwards" in results[0]
    assert results[1] == results[0]  # the same line on rank 1, which did not wait for it
    assert latest_iteration(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000003",
        "latest_checkpointed_iteration.txt",
    ]


def test_a_requeued_job_resumes_its_own_folder_and_ends_once_complete(
    corpus_cache, tmp_path, monkeypatch, capsys
):
    """The SLURM script's pattern: --save DIR --hdp-load-if-exists DIR, started again and again."""
    folder = str(tmp_path / "ckpt")
    requeue = ["--save", folder, "--hdp-load-if-exists", folder, "--lr-decay-iters", "4"]
    first = run_pretrain(
        2, job_args(corpus_cache, iters=4, extra=[*requeue, "--exit-interval", "2"])
    )
    second = run_pretrain(2, job_args(corpus_cache, iters=4, extra=requeue))
    assert [s["iteration"] for s in first + second] == [1, 2, 3, 4]
    code, err = exit_of(job_args(corpus_cache, iters=4, extra=requeue), monkeypatch, capsys)
    assert code == 0 and "training is complete" in err
    code, err = exit_of(
        job_args(corpus_cache, iters=4, extra=[*requeue, "--hdp-overwrite-checkpoints"]),
        monkeypatch,
        capsys,
    )
    assert code == 2 and "--hdp-overwrite-checkpoints would delete the checkpoints" in err


def _body_two_runs_one_folder(rank, world_size, folder):
    from megatron_hdp.megatron import checkpoint

    with tiny_engine() as engine:
        outcomes = []
        for run_id, iteration in (("first", 1), ("second", 1), ("first", 2)):
            state = checkpoint.TrainingState(iteration=iteration, data_state={"run": run_id})
            try:
                checkpoint.save_checkpoint(
                    folder, engine, state, group=dist.group.WORLD, meta_extra={"run_id": run_id}
                )
                outcomes.append("saved")
            except (ValueError, RuntimeError) as err:
                outcomes.append(str(err))
        return outcomes


def test_a_second_run_saving_into_the_same_folder_is_refused_at_save(tmp_path):
    """Two jobs started into one empty folder (a double submit): the later saver is refused."""
    from tests.dist import run_ranks

    (outcomes, _) = run_ranks(_body_two_runs_one_folder, 2, str(tmp_path), timeout_s=60)
    assert outcomes[0] == outcomes[2] == "saved"
    assert "holds the checkpoints of another run (run id first" in outcomes[1]
    meta = json.loads((iteration_dir(tmp_path, 2) / "meta.json").read_text())
    assert latest_iteration(tmp_path) == 2 and meta["run_id"] == "first"


def test_a_checkpoint_from_before_tensor_parallelism_still_resumes(
    corpus_cache, checkpoint, monkeypatch, capsys
):
    """meta.json without the TP fields (written before they existed) means TP 1."""
    import pretrain_hdp

    meta_path = iteration_dir(checkpoint, 4) / "meta.json"
    (meta_path.parent / DIGESTS).unlink()  # nor digests: they came later still
    meta = json.loads(meta_path.read_text())
    for key in ("tensor_model_parallel_size", "sequence_parallel"):
        del meta["model"][key]
    meta_path.write_text(json.dumps(meta))
    monkeypatch.setenv("WORLD_SIZE", "2")
    extra = ["--load", str(checkpoint), "--lr-decay-iters", "4", "--hdp-validate-only"]
    assert pretrain_hdp.main(job_args(corpus_cache, iters=6, extra=extra)) == []
    assert capsys.readouterr().err == ""


def test_a_truncated_checkpoint_file_is_refused_before_start_up(
    corpus_cache, checkpoint, monkeypatch, capsys
):
    """Before: the load failed after the process group started, with a traceback.

    Each file cut in half in turn: the largest tensor shard (torch's `.distcp`, both
    megatron-core lines) and, where the release writes one, `common.pt` (0.16).
    """
    folder = iteration_dir(checkpoint, 4)
    shard = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    cases = [(shard, f"{shard.name} holds {size // 2:,} bytes, its digest says {size:,}")]
    if (folder / "common.pt").exists():
        common = (folder / "common.pt").stat().st_size
        says = f"common.pt holds {common // 2:,} bytes, its digest says {common:,}"
        cases.append((folder / "common.pt", says))
    # A checkpoint from before digests: the index and the zip archives say it.
    cases.append(
        (shard, f"{shard.name} holds {size // 2:,} bytes, its index .metadata says {size:,}")
    )
    if (folder / "common.pt").exists():
        cases.append((folder / "common.pt", "common.pt is not a complete torch file"))
    digests = (folder / DIGESTS).read_bytes()
    argv = job_args(corpus_cache, iters=6, extra=["--load", str(checkpoint)])
    for path, says in cases:
        if "its index" in says and (folder / DIGESTS).exists():
            (folder / DIGESTS).unlink()
        whole = path.read_bytes()
        path.write_bytes(whole[: len(whole) // 2])
        code, err = exit_of([*argv, "--lr-decay-iters", "4"], monkeypatch, capsys)
        assert code == 2
        assert f"--load {checkpoint}: iter_0000004/{says}" in err
        path.write_bytes(whole)
    (folder / DIGESTS).write_bytes(digests)
    import pretrain_hdp  # whole again: accepted

    assert pretrain_hdp.main([*argv, "--lr-decay-iters", "4", "--hdp-validate-only"]) == []
