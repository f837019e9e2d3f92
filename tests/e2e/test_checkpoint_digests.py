"""A checkpoint proves what it holds: every damaged, missing or foreign file is refused
before start-up with one line naming it (the reliability sweep's C02, C02b, C05, C06, C07,
C10b, C16 and the silently mixed shards).

One real 2-rank run saves iterations 2 and 4; each case damages a copy of that folder.
"""

import json
import shutil

import pytest
import torch.distributed as dist

from megatron_hdp.checkpoint_digests import DIGESTS, read_digests
from megatron_hdp.checkpoint_files import iteration_dir
from tests.e2e.harness import corpus_args, run_pretrain

ARGS = ["--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-decay-iters", "4"]


@pytest.fixture(scope="module")
def two_saves(corpus_cache, tmp_path_factory):
    """A folder of one 4-step run with checkpoints at iterations 2 and 4."""
    folder = tmp_path_factory.mktemp("digests") / "ckpt"
    extra = [*ARGS, "--save", str(folder), "--save-interval", "2"]
    run_pretrain(2, corpus_args(corpus_cache, iters=4, extra=extra))
    return folder


@pytest.fixture
def checkpoint(two_saves, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(two_saves, copy)
    return copy


def refusal(corpus_cache, checkpoint, monkeypatch, capsys, *, extra=()):
    """Exit status and the one line of a resume from `checkpoint` (validation only)."""
    import pretrain_hdp

    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = corpus_args(corpus_cache, iters=6, extra=[*ARGS, "--load", str(checkpoint), *extra])
    with pytest.raises(SystemExit) as exit_info:
        pretrain_hdp.main(argv)
    assert not dist.is_initialized()
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return exit_info.value.code, err


def largest_shard(folder):
    return max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)


def test_every_file_of_a_saved_checkpoint_has_its_digest(two_saves):
    for iteration in (2, 4):
        folder = iteration_dir(two_saves, iteration)
        record = read_digests(folder)
        assert record["iteration"] == iteration
        assert record["run_id"] == json.loads((folder / "meta.json").read_text())["run_id"]
        files = {p.name for p in folder.iterdir() if p.name != DIGESTS}
        assert set(record["files"]) == files
        assert {f: record["files"][f]["bytes"] for f in files} == {
            f: (folder / f).stat().st_size for f in files
        }


def test_a_shard_copied_in_from_the_same_runs_earlier_checkpoint_is_refused(
    corpus_cache, checkpoint, monkeypatch, capsys
):
    """Same size, other bytes: the size check of before passed it (3e-4 loss difference)."""
    shard = largest_shard(iteration_dir(checkpoint, 4))
    earlier = iteration_dir(checkpoint, 2) / shard.name
    assert earlier.stat().st_size == shard.stat().st_size
    shutil.copy(earlier, shard)
    code, err = refusal(corpus_cache, checkpoint, monkeypatch, capsys)
    assert code == 2
    assert f"iter_0000004/{shard.name} does not hold the bytes this checkpoint wrote" in err
    assert "copied in from another checkpoint" in err


@pytest.mark.parametrize("damage", ["zeroed", "flipped"])
def test_a_zeroed_or_flipped_shard_is_refused(
    corpus_cache, checkpoint, monkeypatch, capsys, damage
):
    shard = largest_shard(iteration_dir(checkpoint, 4))
    data = bytearray(shard.read_bytes())
    if damage == "zeroed":
        data = bytearray(len(data))
    else:  # 4 KB in the middle, every bit flipped
        middle = len(data) // 2
        data[middle : middle + 4096] = bytes(b ^ 0xFF for b in data[middle : middle + 4096])
    shard.write_bytes(bytes(data))
    code, err = refusal(corpus_cache, checkpoint, monkeypatch, capsys)
    assert code == 2 and f"iter_0000004/{shard.name} does not hold the bytes" in err


@pytest.mark.parametrize(
    "name, says",
    [
        (".metadata", ".metadata does not hold the bytes"),
        ("metadata.json", "metadata.json does not hold the bytes"),
        (DIGESTS, f"{DIGESTS} is damaged"),
    ],
)
def test_a_garbled_index_metadata_or_digest_file_is_named(
    corpus_cache, checkpoint, monkeypatch, capsys, name, says
):
    path = iteration_dir(checkpoint, 4) / name
    path.write_bytes(b"{not what it was" + path.read_bytes()[16:])
    code, err = refusal(corpus_cache, checkpoint, monkeypatch, capsys)
    assert code == 2 and f"iter_0000004/{says}" in err, err


def test_every_missing_file_is_named(corpus_cache, two_saves, tmp_path, monkeypatch, capsys):
    """Each file this release wrote (the index, metadata.json, common.pt where 0.16 writes
    it, every shard), removed in turn from a fresh copy: one line naming it."""
    names = sorted(set(read_digests(iteration_dir(two_saves, 4))["files"]) - {"meta.json"})
    assert {".metadata", "metadata.json"} <= set(names) and any(".distcp" in n for n in names)
    for number, name in enumerate(names):
        copy = tmp_path / f"copy{number}"
        shutil.copytree(two_saves, copy)
        (iteration_dir(copy, 4) / name).unlink()
        code, err = refusal(corpus_cache, copy, monkeypatch, capsys)
        assert code == 2 and f"iter_0000004/{name} is missing" in err, (name, err)


@pytest.mark.parametrize(
    "name, damage, says",
    [
        (".metadata", "remove", ".metadata (the index of its shards) is missing"),
        (".metadata", "garble", ".metadata (the index of its shards) cannot be read"),
        ("metadata.json", "garble", "metadata.json is damaged"),
        # 0.16 (common.pt present): named by the structural check; 0.19: by the tracker's
        ("metadata.json", "remove", "metadata.json is missing"),
    ],
)
def test_without_digests_the_structure_is_still_checked(
    corpus_cache, checkpoint, monkeypatch, capsys, name, damage, says
):
    """Checkpoints written before digests (and stock Megatron-LM's): C05, C06, C10b, C16."""
    folder = iteration_dir(checkpoint, 4)
    (folder / DIGESTS).unlink()
    path = folder / name
    if damage == "remove":
        path.unlink()
    else:
        path.write_bytes(b"\x80\x04garbled" + path.read_bytes()[9:])
    code, err = refusal(corpus_cache, checkpoint, monkeypatch, capsys)
    assert code == 2 and f"iter_0000004/{says}" in err, err


def test_digests_of_another_iteration_copied_in_are_refused(
    corpus_cache, checkpoint, monkeypatch, capsys
):
    folder = iteration_dir(checkpoint, 4)
    shutil.copy(iteration_dir(checkpoint, 2) / DIGESTS, folder / DIGESTS)
    code, err = refusal(corpus_cache, checkpoint, monkeypatch, capsys)
    assert code == 2 and f"iter_0000004/{DIGESTS} is of iteration 2, the folder of 4" in err


def test_a_checkpoint_from_before_digests_still_loads_and_says_so(
    corpus_cache, checkpoint, tmp_path
):
    """Resumed for real: validation passes, and the log says the content was not verified."""
    (iteration_dir(checkpoint, 4) / DIGESTS).unlink()
    log = tmp_path / "resume.log"
    from tests.e2e.harness import run_pretrain_logged

    extra = [*ARGS, "--load", str(checkpoint)]
    records = run_pretrain_logged(2, corpus_args(corpus_cache, iters=5, extra=extra), log)
    assert [r["iteration"] for r in records] == [5]
    assert "was written before checkpoints carried digests: its content was not verified" in (
        log.read_text()
    )
