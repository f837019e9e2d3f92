"""A resume checks the data by content: the same files at another path are the same data,
other files with the same document lengths are not (the reliability sweep's S3, S4, S10).

A real 2-rank run saves after 2 steps on two datasets written here; each case resumes
from it (validation only: everything is decided before the process group).
"""

import os
import shutil

import pytest
import torch.distributed as dist

from megatron_hdp.data.fingerprint import dataset_fingerprint
from megatron_hdp.data.indexed import write_indexed_dataset
from megatron_hdp.data.tokenizers import ByteTokenizer
from tests.e2e.harness import SMALL_MODEL, run_pretrain


def documents(seed):
    tok = ByteTokenizer()
    texts = [f"def f{i}_{seed}(x):\n    return x * {i + seed}\n" * (1 + i % 5) for i in range(60)]
    return [tok.encode(t) + [tok.eod] for t in texts]


def job(a, b, *extra):
    return [
        *SMALL_MODEL,
        *("--seq-length", "256", "--hdp-capacity", "128", "--lr", "3e-3"),
        *("--train-iters", "4", "--lr-decay-iters", "2", "--split", "100,0,0"),
        *("--data-path", "0.5", str(a), "0.5", str(b)),
        *extra,
    ]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(data folder, checkpoint folder) of a 2-step run on datasets a and b."""
    root = tmp_path_factory.mktemp("fingerprint")
    (root / "data").mkdir()
    write_indexed_dataset(root / "data" / "a", documents(0), vocab_size=257)
    write_indexed_dataset(root / "data" / "b", documents(1), vocab_size=257)
    a, b = root / "data" / "a", root / "data" / "b"
    cwd = os.getcwd()
    os.chdir(root)  # the run names its data by relative paths
    try:
        argv = job("data/a", "data/b", "--train-iters", "2", "--save", str(root / "ckpt"))
        run_pretrain(2, argv)
    finally:
        os.chdir(cwd)
    return root, a, b


def resume(argv, monkeypatch, capsys):
    import pretrain_hdp

    monkeypatch.setenv("WORLD_SIZE", "2")
    try:
        out = pretrain_hdp.main([*argv, "--hdp-validate-only"])
    except SystemExit as exit_info:
        assert not dist.is_initialized()
        return exit_info.code, capsys.readouterr().err
    return out, capsys.readouterr().err


def test_the_same_files_by_absolute_path_from_another_directory_resume(saved, monkeypatch, capsys):
    root, a, b = saved
    code, err = resume(job(a, b, "--load", str(root / "ckpt")), monkeypatch, capsys)
    assert code == [] and err == "", err


def test_a_moved_copy_of_the_same_data_resumes(saved, tmp_path, monkeypatch, capsys):
    root, a, b = saved
    moved = tmp_path / "fast-fs"
    shutil.copytree(a.parent, moved)
    code, err = resume(
        job(moved / "a", moved / "b", "--load", str(root / "ckpt")), monkeypatch, capsys
    )
    assert code == [] and err == "", err


def test_a_dataset_rewritten_in_place_with_the_same_lengths_is_refused_naming_both(
    saved, tmp_path, monkeypatch, capsys
):
    root, a, b = saved
    copy = tmp_path / "data"
    shutil.copytree(a.parent, copy)
    before = dataset_fingerprint(copy / "b")
    data = bytearray((copy / "b.bin").read_bytes())
    data[: len(data)] = bytes((x + 1) % 250 for x in data)  # other tokens, same lengths
    (copy / "b.bin").write_bytes(bytes(data))
    after = dataset_fingerprint(copy / "b")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / "ckpt", ckpt)
    code, err = resume(job(copy / "a", copy / "b", "--load", str(ckpt)), monkeypatch, capsys)
    assert code == 2
    assert f"the dataset {copy / 'b'} is not the checkpoint's data/b" in err
    assert f"fingerprint {after}, the checkpoint's {before}" in err


def test_another_dataset_in_place_of_one_is_refused(saved, monkeypatch, capsys):
    root, a, b = saved
    code, err = resume(job(a, a, "--load", str(root / "ckpt")), monkeypatch, capsys)
    assert code == 2 and f"the dataset {a} is not the checkpoint's data/b" in err
