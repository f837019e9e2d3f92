"""pretrain_hdp.py on preprocessed data: blends, data order across resume, bad input, launch."""

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_hdp.checkpoint_files import latest_iteration
from megatron_hdp.data import preprocess
from megatron_hdp.data.indexed import open_indexed_dataset
from tests.e2e.harness import SMALL_MODEL, run_pretrain, tiny_engine, torchrun_command

REPO = Path(__file__).resolve().parents[2]


def write_jsonl(path: Path, num_docs: int, seed: int) -> list[str]:
    """Code-like documents of very different lengths (a model can learn their patterns)."""
    rng = random.Random(seed)
    texts = []
    for i in range(num_docs):
        lines = rng.choice([1, 2, 4, 30, 90])
        texts.append("".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(lines)))
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    prefixes = []
    for name, num_docs, seed in (("a", 60, 1), ("b", 40, 2)):
        write_jsonl(folder / f"{name}.jsonl", num_docs, seed)
        prefix = folder / name
        assert (
            preprocess.main(
                ["--input", str(folder / f"{name}.jsonl"), "--output-prefix", str(prefix)]
            )
            == 0
        )
        prefixes.append(str(prefix))
    return prefixes


def data_args(data_path, *, iters, extra=()):
    return [
        *SMALL_MODEL,
        "--seq-length",
        "256",
        "--hdp-capacity",
        "128",
        "--train-iters",
        str(iters),
        "--lr",
        "3e-3",
        "--lr-decay-style",
        "constant",
        "--data-path",
        *data_path,
        "--split",
        "100,0,0",
        "--seed",
        "11",
        *extra,
    ]


@pytest.mark.parametrize("world_size, capacity", [(1, 256), (2, 128), (4, 64)])
def test_trains_on_a_preprocessed_dataset(datasets, world_size, capacity):
    steps = run_pretrain(
        world_size,
        data_args(
            [datasets[0]],
            iters=8,
            extra=["--hdp-global-batch-tokens", "1024", "--hdp-capacity", str(capacity)],
        ),
    )
    losses = [s["loss"] for s in steps]
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.1, losses


def test_weighted_blend_takes_token_shares(datasets):
    steps = run_pretrain(
        2,
        data_args(
            ["0.25", datasets[0], "0.75", datasets[1]],
            iters=4,
            extra=["--hdp-global-batch-tokens", "2048"],
        ),
    )
    tokens = [0, 0]
    for step in steps:
        for dataset, _, _, length in step["units"]:
            tokens[dataset] += length
    assert abs(tokens[1] / sum(tokens) - 0.75) < 256 / sum(tokens)  # within one sequence


def test_bpe_tokenized_data_trains_and_a_tokenizer_mismatch_is_refused(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", 40, 3)
    tokenizer = tmp_path / "tokenizer.json"
    assert (
        preprocess.main(
            [
                "--input",
                str(tmp_path / "c.jsonl"),
                "--output-prefix",
                str(tmp_path / "c"),
                "--train-bpe-vocab-size",
                "400",
                "--tokenizer-model",
                str(tokenizer),
            ]
        )
        == 0
    )
    bpe = [
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(tokenizer),
        "--hdp-global-batch-tokens",
        "1024",
        "--hdp-capacity",
        "256",
    ]
    steps = run_pretrain(1, data_args([str(tmp_path / "c")], iters=3, extra=bpe))
    assert len(steps) == 3
    with pytest.raises(AssertionError, match="outside the tokenizer's vocabulary of 257"):
        run_pretrain(
            2,
            data_args([str(tmp_path / "c")], iters=1, extra=["--hdp-global-batch-tokens", "1024"]),
        )


def all_units(prefix, seq_length):
    """Every (doc, start, length) of a dataset, computed from the raw index."""
    dataset = open_indexed_dataset(prefix)  # keep it alive: its lengths live in its mmap
    lengths = dataset.sequence_lengths.tolist()
    units = set()
    for doc, n in enumerate(lengths):
        for start in range(0, n - 1, seq_length):
            units.add((0, doc, start, min(seq_length, n - 1 - start)))
    return units


def test_every_document_once_per_epoch_across_stop_and_resume(datasets, tmp_path):
    expected = all_units(datasets[0], 256)
    batch = 7  # samples of --seq-length 256 tokens: steps of whole sequences up to 1792 tokens
    tokens = sum(u[3] for u in expected)
    steps_per_epoch = -(-tokens // (batch * 256 - 255))  # each step holds more than this
    stop = steps_per_epoch // 2
    ckpt = str(tmp_path / "ckpt")
    common = ["--global-batch-size", str(batch)]
    first = run_pretrain(2, data_args([datasets[0]], iters=stop, extra=[*common, "--save", ckpt]))
    second = run_pretrain(
        2,
        data_args(
            [datasets[0]],
            iters=steps_per_epoch + 1,
            extra=[*common, "--load", ckpt, "--save", ckpt],
        ),
    )
    consumed = [tuple(u) for s in first + second for u in s["units"]]
    epoch = consumed[: len(expected)]
    assert len(epoch) == len(set(epoch)) == len(expected)
    assert set(epoch) == expected
    assert set(consumed[len(expected) :]) <= expected  # the next epoch has begun


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda d, t: data_args([str(t / "missing")], iters=1), "missing"),
        (
            lambda d, t: data_args([d[0]], iters=1, extra=["--no-such-flag"]),
            "unknown arguments: --no-such-flag",
        ),
        (
            lambda d, t: data_args([d[0]], iters=1, extra=["--recompute-activations"]),
            "--recompute-activations is not supported here",
        ),
        (
            lambda d, t: data_args(
                [d[0]], iters=1, extra=["--virtual-pipeline-model-parallel-size", "2"]
            ),
            "--virtual-pipeline-model-parallel-size is not supported here: Megatron-LM's flag "
            "for virtual pipeline stages is --num-layers-per-virtual-pipeline-stage",
        ),
        (
            lambda d, t: data_args(
                [d[0]], iters=1, extra=["--num-layers-per-virtual-pipeline-stage", "1"]
            ),
            "--num-layers-per-virtual-pipeline-stage 1: needs --pipeline-model-parallel-size > 1 "
            "(got 1)",
        ),
        (
            lambda d, t: data_args([d[0]], iters=1, extra=["--hdp-global-batch-tokens", "100"]),
            "--hdp-global-batch-tokens 100 is smaller than one sequence (--seq-length 256)",
        ),
        (
            lambda d, t: data_args([d[0]], iters=1, extra=["--hdp-capacity", "64"]),
            "capacity 64 x 2 replicas = 128 tokens is too small for --seq-length 256",
        ),
        (lambda d, t: data_args([d[0]], iters=1, extra=["--load", str(t)]), "no checkpoint in"),
        (
            lambda d, t: data_args([d[0]], iters=1, extra=["--tensor-model-parallel-size", "3"]),
            "--tensor-model-parallel-size 3 does not divide the 2 ranks",
        ),
    ],
)
def test_bad_input_exits_with_a_clear_message(
    datasets, tmp_path, monkeypatch, capsys, make_args, message
):
    import pretrain_hdp

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_info:
        pretrain_hdp.main(make_args(datasets, tmp_path))
    assert exit_info.value.code != 0
    assert message in capsys.readouterr().err
    assert not dist.is_initialized()


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_index_exits_with_a_clear_message(datasets, tmp_path, monkeypatch, capsys, damage):
    import pretrain_hdp

    prefix = tmp_path / "broken"
    for suffix in (".bin", ".idx"):
        (tmp_path / f"broken{suffix}").write_bytes(Path(datasets[0] + suffix).read_bytes())
    idx = tmp_path / "broken.idx"
    data = idx.read_bytes()
    idx.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"garbage" * 9)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_info:
        pretrain_hdp.main(data_args([str(prefix)], iters=1))
    assert exit_info.value.code != 0
    assert "broken.idx" in capsys.readouterr().err


def test_torchrun_launch(corpus_cache, tmp_path):
    """The real launcher: torchrun with 2 gloo ranks, a metrics file and TensorBoard events."""
    metrics, board = tmp_path / "metrics.jsonl", tmp_path / "tb"
    cmd = torchrun_command(
        2,
        [
            *SMALL_MODEL,
            "--seq-length",
            "512",
            "--hdp-capacity",
            "256",
            "--train-iters",
            "2",
            "--lr",
            "1e-3",
            "--data-cache-path",
            str(corpus_cache),
            "--hdp-metrics-file",
            str(metrics),
            "--tensorboard-dir",
            str(board),
        ],
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "iter 2/2" in done.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(0 <= r["data_wait_s"] < 60 and r["seconds"] > 0 for r in records)
    assert list(board.glob("events.out.tfevents.*"))


def _full_disk(where: str, rank: int, failing_rank: int, checkpoint):
    """Patches that make `failing_rank` hit a full disk at `where`; returns an undo.

    "write": the sharded tensor files (Megatron's writer opens them with `open` in its
    module); "common": rank 0's `common.pt` (torch.save, which reports a full disk as a
    RuntimeError); "meta": our `meta.json`; "tracker": the tracker file.
    """
    import errno

    from megatron.core.dist_checkpointing.strategies import common, filesystem_async

    real_torch, real_write_text = common.torch, Path.write_text
    real_meta = checkpoint._write_text

    def full(path):
        return OSError(errno.ENOSPC, "No space left on device", str(path))

    def failing_open(path, *args, **kwargs):
        if rank == failing_rank:
            raise full(path)
        return open(path, *args, **kwargs)

    def failing_save(obj, path, *args, **kwargs):
        if rank == failing_rank:
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")
        return real_torch.save(obj, path, *args, **kwargs)

    class TorchSavingNothing:
        """torch, as `common.py` (rank 0's common.pt) sees it, with a failing save."""

        save = staticmethod(failing_save)

        def __getattr__(self, name):
            return getattr(real_torch, name)

    def failing_meta(path, text):
        if rank == failing_rank:
            raise full(path)
        return real_meta(path, text)

    def failing_write_text(self, *args, **kwargs):
        if rank == failing_rank and self.name.startswith("latest_checkpointed"):
            raise full(self)
        return real_write_text(self, *args, **kwargs)

    if where == "write":
        filesystem_async.open = failing_open
    elif where == "common":
        common.torch = TorchSavingNothing()
    elif where == "meta":
        checkpoint._write_text = failing_meta
    Path.write_text = failing_write_text

    def undo():
        filesystem_async.__dict__.pop("open", None)
        common.torch, Path.write_text = real_torch, real_write_text
        checkpoint._write_text = real_meta

    return undo


def _body_crash_while_saving(rank, world_size, folder, failing_rank, where):
    from megatron_hdp.errors import CheckpointSaveError
    from megatron_hdp.megatron import checkpoint

    with tiny_engine() as engine:
        group = dist.group.WORLD
        first = checkpoint.TrainingState(iteration=1, data_state={"at": 1})
        checkpoint.save_checkpoint(folder, engine, first, group=group)
        undo = _full_disk(where, rank, failing_rank, checkpoint)
        raised = None
        try:
            checkpoint.save_checkpoint(
                folder,
                engine,
                checkpoint.TrainingState(iteration=2, data_state={}),
                group=group,
            )
        except CheckpointSaveError as err:
            raised = str(err)
        finally:
            undo()
        state, _ = checkpoint.load_checkpoint(folder, engine, group=group)
        names = sorted(p.name for p in Path(folder).iterdir())
        return raised, state.iteration, state.data_state, names


@pytest.mark.parametrize(
    "world_size, failing_rank, where",
    [
        (1, 0, "write"),
        (2, 0, "write"),
        (2, 1, "write"),
        (2, 0, "common"),
        (2, 0, "meta"),
        (2, 0, "tracker"),
    ],
)
def test_crash_while_saving_keeps_the_previous_checkpoint(
    tmp_path, world_size, failing_rank, where
):
    """Every rank stops with the same line naming the failing rank and the cause."""
    from megatron_hdp.megatron.compat import core_version
    from tests.dist import run_ranks

    if where == "common" and core_version() >= (0, 17):
        pytest.skip("from megatron-core 0.17 on the common part is a sharded object (no common.pt)")
    results = run_ranks(
        _body_crash_while_saving, world_size, str(tmp_path), failing_rank, where, timeout_s=60
    )
    messages = {raised for raised, *_ in results}
    assert len(messages) == 1  # every rank learns of the failure, the same way; none hangs
    message = messages.pop()
    assert message.startswith(f"could not save iteration 2 to {tmp_path}: rank {failing_rank}: ")
    assert message.endswith("; the latest checkpoint there is still iteration 1")
    if where == "common":
        assert "RuntimeError: [enforce fail at inline_container.cc:664]" in message
    elif where == "write" and core_version() >= (0, 17):
        # 0.17+'s writer reports a worker's failure by its type alone
        assert "OSError" in message
    else:
        assert "No space left on device (" in message and " MiB free there" in message
    for _, iteration, data_state, names in results:
        assert (iteration, data_state) == (1, {"at": 1})
        assert "iter_0000001" in names and "iter_0000002" not in names
        assert not any(n.endswith(".tmp") for n in names)


def test_a_full_disk_on_save_stops_every_rank_with_the_same_line(
    corpus_cache, tmp_path, monkeypatch
):
    import errno

    from megatron_hdp.megatron import checkpoint
    from tests.e2e.harness import corpus_args

    real_meta = checkpoint._write_text

    def full_at_iteration_2_on_rank_0(path, text):
        if "iter_0000002" in str(path) and os.environ.get("RANK") == "0":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_meta(path, text)

    monkeypatch.setattr(checkpoint, "_write_text", full_at_iteration_2_on_rank_0)  # forked too
    ckpt = tmp_path / "ckpt"
    extra = ["--save", str(ckpt), "--save-interval", "1"]
    with pytest.raises(AssertionError) as failure:
        run_pretrain(2, corpus_args(corpus_cache, iters=3, extra=extra))
    report = str(failure.value)
    line = f"could not save iteration 2 to {ckpt}: rank 0: No space left on device ("
    assert "rank 0 failed" in report and "rank 1 failed" in report
    assert report.count(line) >= 2 and report.count("SystemExit: 1") == 2
    assert "connection closed" not in report.lower()
    assert latest_iteration(ckpt) == 1


def test_a_rank_whose_data_service_fails_stops_every_rank_with_its_line(
    corpus_cache, monkeypatch, capfd
):
    """Rank 1 alone loses its data (as when the Ray planner actor dies under it) while rank 0
    waits in the step's first collective: both stop with rank 1's line, not rank 0 with the
    transport's "connection closed"."""
    from megatron_hdp.errors import DataServiceError
    from megatron_hdp.megatron.trainer import Trainer
    from tests.e2e.harness import corpus_args

    real_step = Trainer.step

    def step(self):
        if self.iteration == 2 and self.rank == 1:
            raise DataServiceError("the planner actor, asked for batch 3: the actor died")
        return real_step(self)

    monkeypatch.setattr(Trainer, "step", step)  # the forked ranks inherit it
    with pytest.raises(AssertionError) as failure:
        run_pretrain(2, corpus_args(corpus_cache, iters=4))
    assert "rank 0 failed" in str(failure.value) and "rank 1 failed" in str(failure.value)
    lines = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
    want = "pretrain_hdp.py: error: rank 1: the planner actor, asked for batch 3: the actor died"
    assert sorted(lines) == [want, want]


def test_a_full_disk_under_the_metrics_file_stops_every_rank_with_one_line(
    corpus_cache, tmp_path, monkeypatch, capfd
):
    """Rank 0 alone writes the metrics file: before, its OSError traceback and rank 1's
    "connection closed"."""
    import builtins
    import errno
    import io

    from tests.e2e.harness import corpus_args

    real_open = builtins.open
    metrics = tmp_path / "m.jsonl"

    def full_disk(file, mode="r", *args, **kwargs):
        if str(file) == str(metrics) and "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_disk)  # the forked ranks inherit it
    monkeypatch.setattr(io, "open", full_disk)
    with pytest.raises(AssertionError):
        run_pretrain(
            2, corpus_args(corpus_cache, iters=2, extra=["--hdp-metrics-file", str(metrics)])
        )
    lines = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
    want = (
        f"pretrain_hdp.py: error: rank 0: cannot write --hdp-metrics-file {metrics}: No space "
        f"left on device ({metrics})"
    )
    assert lines == [want, want]
