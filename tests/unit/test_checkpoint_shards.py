"""The torch-free reading of a distributed checkpoint's index, against torch's own reader."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from megatron_hdp.checkpoint_shards import required_sizes, short_shards


@pytest.fixture
def folder(tmp_path):
    """A checkpoint torch wrote in one process: tensors, a nested dict, a plain object."""
    state = {
        "weight": torch.arange(1000, dtype=torch.float32),
        "layer": {"bias": torch.ones(3, 4, dtype=torch.bfloat16)},
        "step": 5,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    return tmp_path


def test_the_sizes_are_those_torchs_reader_gives(folder):
    expected: dict[str, int] = {}
    for info in FileSystemReader(folder).read_metadata().storage_data.values():
        end = info.offset + info.length
        expected[info.relative_path] = max(expected.get(info.relative_path, 0), end)
    assert required_sizes(folder) == expected
    assert all((folder / name).stat().st_size == size for name, size in expected.items())
    assert short_shards(folder) == []


def test_a_shard_cut_short_or_missing_is_named(folder):
    (name, size), *_ = required_sizes(folder).items()
    shard = folder / name
    shard.write_bytes(shard.read_bytes()[:-1])
    assert short_shards(folder) == [(name, size, size - 1)]
    shard.unlink()
    assert short_shards(folder) == [(name, size, None)]


def test_an_index_it_cannot_read_refuses_nothing(folder):
    (folder / ".metadata").write_bytes(b"not a pickle")
    assert required_sizes(folder) is None and short_shards(folder) == []
    (folder / ".metadata").unlink()
    assert required_sizes(folder) is None
