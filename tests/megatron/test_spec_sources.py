"""A data spec's sources opened for training: JSONL tokens, streams per bucket, empty streams."""

import json

import numpy as np
import pytest

from megatron_hdp.data.indexed import write_indexed_dataset
from megatron_hdp.data.spec import parse_spec
from megatron_hdp.data.training_data import DataConfig, build_training_data

TEXTS = ["short one", "a longer document " * 20, "mid " * 30, "é ü"]


def _spec(tmp_path, **top):
    with open(tmp_path / "docs.jsonl", "w") as out:
        for text in TEXTS:
            out.write(json.dumps({"body": text}) + "\n")
    docs = [np.append(np.arange(n) % 250, 256).astype(np.int32) for n in (40, 300, 900, 7)]
    write_indexed_dataset(tmp_path / "idx", docs, vocab_size=257)
    raw = {
        "sources": [
            {"name": "docs", "jsonl": "docs.jsonl", "json_key": "body"},
            {"name": "idx", "path": "idx"},
        ],
        "length_buckets": [{"name": "short", "max_tokens": 64}, {"name": "long"}],
        **top,
    }
    return parse_spec(raw, base=tmp_path)


def _config(spec, tmp_path) -> DataConfig:
    return DataConfig(
        blend=[], split=[1.0], seq_length=512, seed=1, tokens_per_batch=1024, spec=spec,
        cache_dir=str(tmp_path),
    )  # fmt: skip


def test_spec_sources_read_jsonl_bytes_and_map_streams_to_sources(tmp_path):
    data = build_training_data(_config(_spec(tmp_path), tmp_path))
    jsonl = data.datasets[0]
    for doc, text in enumerate(TEXTS):
        want = [*text.encode(), 256]  # byte-level tokens, then the end-of-document token
        assert jsonl.get(doc, 0, len(want)).tolist() == want
    assert data.train.sources == [0, 0, 1, 1]
    lengths = {(u.dataset, u.length) for _ in range(6) for u in data.train.next_batch()}
    assert {d for d, _ in lengths} == {0, 1}
    assert max(n for d, n in lengths if d == 1) == 512  # the 900-token document is cut


def test_a_weight_on_a_stream_without_sequences_is_named(tmp_path):
    spec = _spec(tmp_path, schedule=[{"until_step": 9, "weights": {"docs/long": 1, "idx": 1}}])
    # With --seq-length 40 every unit fits the short bucket, so docs/long is empty.
    config = _config(spec, tmp_path)
    config = DataConfig(**{**config.__dict__, "seq_length": 40})
    with pytest.raises(ValueError, match="select docs/long with no training sequence"):
        build_training_data(config)
