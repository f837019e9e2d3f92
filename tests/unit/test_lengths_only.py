"""A rank of a job with the Ray data service holds lengths only (`data.lengths_only`).

The lengths are checked against the files themselves (byte-level: UTF-8 bytes + 1 end of
document) and the in-process readers; the samplers against those of a rank that opens the
data; a JSONL source's index is built by `build` only where none is cached.
"""

import dataclasses
import json

import numpy as np
import pytest

from megatron_hdp.data.indexed import write_indexed_dataset
from megatron_hdp.data.lengths_only import LengthsOnly, open_lengths
from megatron_hdp.data.spec import parse_spec
from megatron_hdp.data.training_data import DataConfig, build_training_data

TEXTS = ["short one", "a longer document " * 20, "mid " * 30, "é ü"]
OPEN = {"tokenizer_type": "ByteLevel", "tokenizer_model": None}


def _spec(tmp_path):
    with open(tmp_path / "docs.jsonl", "w") as out:
        for text in TEXTS:
            out.write(json.dumps({"body": text}) + "\n")
    docs = [np.append(np.arange(n) % 250, 256).astype(np.int32) for n in (40, 300, 900, 7)]
    write_indexed_dataset(tmp_path / "idx", docs, vocab_size=257)
    return parse_spec(
        {
            "sources": [
                {"name": "docs", "jsonl": "docs.jsonl", "json_key": "body"},
                {"name": "read", "jsonl": "docs.jsonl", "json_key": "body", "tokenize": "on_read"},
                {"name": "idx", "path": "idx"},
                {"name": "syn", "synthetic": {"documents": 5, "seed": 2}},
            ],
        },
        base=tmp_path,
    )


def test_a_jsonl_source_gives_its_lengths_from_the_index_built_once(tmp_path):
    spec = _spec(tmp_path)
    calls = []

    def build(source):  # what the Ray service's indexer does, counted
        calls.append(source.name)
        from megatron_hdp.data.sources import lengths_index
        from megatron_hdp.data.tokenizers import build_tokenizer

        tokenizer = build_tokenizer("ByteLevel")
        return lengths_index(
            source.jsonl, json_key=source.json_key, tokenizer=tokenizer, cache_dir=tmp_path
        )["lengths"]

    want = [len(t.encode()) + 1 for t in TEXTS]
    first = open_lengths(spec.sources[0], **OPEN, cache_dir=tmp_path, build=build)
    again = open_lengths(spec.sources[1], **OPEN, cache_dir=tmp_path, build=build)
    assert first.sequence_lengths.tolist() == again.sequence_lengths.tolist() == want
    assert calls == ["docs"]  # the second found the index the first had cached
    with pytest.raises(RuntimeError, match="'read': this rank holds document lengths only"):
        again.get(0, 0, 3)


def test_a_rank_holding_lengths_draws_the_batches_of_a_rank_holding_the_data(tmp_path):
    spec = _spec(tmp_path)
    cfg = DataConfig(
        blend=[], split=[0.75, 0.25], seq_length=512, seed=1, tokens_per_batch=1024, spec=spec,
        cache_dir=str(tmp_path),
    )  # fmt: skip
    full = build_training_data(cfg)
    lean = build_training_data(dataclasses.replace(cfg, lengths_only=True))
    assert all(isinstance(d, LengthsOnly) for d in lean.datasets)
    for mine, theirs in zip(lean.datasets, full.datasets, strict=True):
        assert mine.sequence_lengths.tolist() == list(theirs.sequence_lengths)
    assert lean.fingerprints == full.fingerprints and lean.prefixes == full.prefixes
    for _ in range(4):
        assert lean.train.next_batch() == full.train.next_batch()
    valid_lean, valid_full = lean.fresh_valid_sampler(), full.fresh_valid_sampler()
    assert valid_lean.next_batch() == valid_full.next_batch()
