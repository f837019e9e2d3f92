"""Sources with a per-read cost and the loaders' partitions (no Ray).

- JSONL tokenized at read time gives, document by document, the tokens of the line's text
  encoded by the tokenizer itself (byte-level and a local Hugging Face tokenizer.json),
  from a lengths index built once and cached; an edited file gets a new index.
- A JSONL source tokenized when opened can hold only a range of its documents.
- Synthetic documents are deterministic, charge their declared CPU cost, and their
  fingerprint follows their content parameters, not their costs.
- `token_partition` cuts contiguous, non-empty ranges within one document of an even
  token split.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from megatron_hdp.data import sources
from megatron_hdp.data.fingerprint import dataset_fingerprint
from megatron_hdp.data.sources import (
    JsonlOnRead,
    JsonlTokens,
    SyntheticTokens,
    open_source,
    source_location,
    token_partition,
)
from megatron_hdp.data.spec import parse_spec
from megatron_hdp.data.tokenizers import ByteTokenizer, train_bpe

TEXTS = ["héllo wörld", "", "a" * 300, "ring pack zigzag rank " * 7, "x"]


def _write(path, texts, *, blank_every=2):
    with open(path, "w", encoding="utf-8") as out:
        for k, text in enumerate(texts):
            out.write(json.dumps({"text": text, "n": k}) + "\n")
            if k % blank_every == 0:
                out.write("\n")  # blank lines are not documents
    return path


def _expected(texts, tokenizer):
    """The reference: each text encoded by the tokenizer itself, then its EOD."""
    return [np.asarray([*tokenizer.encode(t), tokenizer.eod], dtype=np.int64) for t in texts]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_bpe([t for t in TEXTS if t] * 20, vocab_size=280, path=path)


@pytest.mark.parametrize("which", ["byte", "bpe"])
def test_jsonl_on_read_tokenizes_each_document_as_the_tokenizer_does(tmp_path, bpe, which):
    tokenizer = ByteTokenizer() if which == "byte" else bpe
    files = [_write(tmp_path / "a.jsonl", TEXTS[:3]), _write(tmp_path / "b.jsonl", TEXTS[3:])]
    reader = JsonlOnRead(files, json_key="text", tokenizer=tokenizer, cache_dir=tmp_path / "c")
    expected = _expected(TEXTS, tokenizer)
    assert reader.sequence_lengths.tolist() == [len(e) for e in expected]
    for doc in reversed(range(len(TEXTS))):  # any order: each read stands alone
        assert reader.get(doc).tolist() == expected[doc].tolist()
        n = len(expected[doc])
        assert reader.get(doc, 1, n - 1).tolist() == expected[doc][1:].tolist()
    whole = JsonlTokens(files, json_key="text", tokenizer=tokenizer)
    assert [whole.get(d).tolist() for d in range(len(TEXTS))] == [e.tolist() for e in expected]


def test_the_lengths_index_is_built_once_and_follows_the_file(tmp_path, monkeypatch):
    path = _write(tmp_path / "a.jsonl", TEXTS)
    cache = tmp_path / "cache"
    JsonlOnRead([path], json_key="text", tokenizer=ByteTokenizer(), cache_dir=cache)
    assert len(list((cache / "lengths").glob("*.npz"))) == 1
    built = []
    real = sources._build_index
    monkeypatch.setattr(sources, "_build_index", lambda *a: built.append(1) or real(*a))
    again = JsonlOnRead([path], json_key="text", tokenizer=ByteTokenizer(), cache_dir=cache)
    assert built == [] and again.get(3).tolist() == _expected(TEXTS, ByteTokenizer())[3].tolist()
    _write(path, [*TEXTS, "one more"])  # edited: a new fingerprint, a new index
    edited = JsonlOnRead([path], json_key="text", tokenizer=ByteTokenizer(), cache_dir=cache)
    assert built == [1] and len(edited) == len(TEXTS) + 1


def test_a_file_changed_under_its_index_is_refused_by_name(tmp_path):
    path = _write(tmp_path / "a.jsonl", ["abc", "def"], blank_every=9)
    reader = JsonlOnRead([path], json_key="text", tokenizer=ByteTokenizer(), cache_dir=None)
    old = path.read_text()
    new = old.replace('"abc", "n": 0', '"abcd", "n":0')  # same bytes per line, 1 token more
    assert len(new) == len(old) and new != old
    path.write_text(new)
    with pytest.raises(ValueError, match="a.jsonl.*lengths index"):
        reader.get(0)


def test_jsonl_tokenized_on_open_can_hold_only_a_range(tmp_path):
    path = _write(tmp_path / "a.jsonl", TEXTS)
    part = JsonlTokens([path], json_key="text", tokenizer=ByteTokenizer(), docs=(1, 4))
    expected = _expected(TEXTS, ByteTokenizer())
    assert part.sequence_lengths.tolist() == [len(e) for e in expected[1:4]]
    assert [part.get(d).tolist() for d in (1, 2, 3)] == [e.tolist() for e in expected[1:4]]
    with pytest.raises(IndexError, match="document 4"):
        part.get(4)


def _synthetic_spec(**fields):
    raw = {"sources": [{"name": "syn", "synthetic": fields}]}
    return parse_spec(raw).sources[0]


def test_synthetic_documents_are_deterministic_and_charge_their_cpu_cost():
    source = _synthetic_spec(documents=20, min_tokens=5, max_tokens=50, seed=3, vocab=100)
    a = open_source(source, tokenizer_type="ByteLevel", tokenizer_model=None, cache_dir=None)
    b = SyntheticTokens(source.synthetic_params)
    assert len(a) == 20 and 5 <= a.sequence_lengths.min() and a.sequence_lengths.max() <= 50
    for doc in range(20):
        tokens = a.get(doc)
        assert tokens.tolist() == b.get(doc).tolist()
        assert len(tokens) == a.sequence_lengths[doc] and tokens[-1] == 99
        assert tokens[:-1].max(initial=0) < 99
    assert a.get(7, 2, 3).tolist() == b.get(7)[2:5].tolist()
    costly = SyntheticTokens({**source.synthetic_params, "cpu_us_per_token": 2000.0})
    start = time.thread_time()
    costly.get(0, 0, 5)  # 5 tokens at 2 ms each
    assert time.thread_time() - start >= 0.010


def test_synthetic_fingerprint_follows_content_not_cost():
    def where(**fields):
        return dataset_fingerprint(source_location(_synthetic_spec(**fields), None))

    assert where(seed=1) == where(seed=1, cpu_us_per_token=5.0, latency_us_per_token=1.0)
    assert where(seed=1) != where(seed=2)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"documents": 0}, "documents >= 1"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens <= max_tokens"),
        ({"cpu_us_per_token": -1}, "cpu_us_per_token must be finite and >= 0, got -1"),
        ({"speed": 1}, r"unknown keys \['speed'\]"),
        ({"seed": 1.5}, "seed must be an integer >= 0, got 1.5"),
    ],
)
def test_bad_synthetic_fields_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        _synthetic_spec(**fields)


def test_tokenize_mode_is_checked_and_defaults_to_on_open():
    base = {"name": "d", "jsonl": "d.jsonl"}
    assert parse_spec({"sources": [base]}).sources[0].tokenize == "on_open"
    assert parse_spec({"sources": [{**base, "tokenize": "on_read"}]}).sources[0].tokenize == (
        "on_read"
    )
    with pytest.raises(ValueError, match="tokenize must be one of .* got 'lazy'"):
        parse_spec({"sources": [{**base, "tokenize": "lazy"}]})
    with pytest.raises(ValueError, match="tokenize and json_key are for jsonl"):
        parse_spec({"sources": [{"name": "i", "path": "x", "tokenize": "on_read"}]})


@pytest.mark.parametrize("parts", [1, 2, 3, 5, 40])
def test_token_partition_cuts_contiguous_balanced_ranges(parts):
    lengths = np.random.default_rng(parts).integers(1, 500, 37)
    bounds = token_partition(lengths, parts)
    assert bounds[0] == 0 and bounds[-1] == 37 and len(bounds) == min(parts, 37) + 1
    assert np.all(np.diff(bounds) >= 1)
    share = lengths.sum() / (len(bounds) - 1)
    for k in range(len(bounds) - 1):
        tokens = lengths[bounds[k] : bounds[k + 1]].sum()
        if parts <= 5:  # an even split, within one document either side
            assert abs(tokens - share) <= 2 * lengths.max()


def test_a_ranks_requests_go_to_the_loader_that_owns_their_document():
    from megatron_hdp.data.service.client import RayDataService

    service = RayDataService.__new__(RayDataService)  # no Ray: only the routing
    service.bounds = [np.asarray([0, 4, 9, 12]), np.asarray([0, 5])]
    requests = [[(0, 0, 3), (11, 2, 5), (4, 0, 1), (3, 1, 1), (8, 0, 2)], [(4, 0, 2)]]
    assert service._shares(requests) == {
        (0, 0): [(0, 0, 3), (3, 1, 1)],
        (0, 2): [(11, 2, 5)],
        (0, 1): [(4, 0, 1), (8, 0, 2)],
        (1, 0): [(4, 0, 2)],
    }


def test_a_synthetic_vocab_beyond_the_byte_tokenizer_is_refused_at_start(tmp_path):
    import argparse

    from megatron_hdp.megatron.validation import _check_data_spec

    spec = tmp_path / "spec.json"
    args = argparse.Namespace(
        hdp_data_spec=str(spec), data_path=None, train_iters=5,
        tokenizer_type="ByteLevel", data_cache_path=str(tmp_path),
    )  # fmt: skip
    for vocab in (257, 300):
        spec.write_text(json.dumps({"sources": [{"name": "s", "synthetic": {"vocab": vocab}}]}))
        if vocab == 257:
            _check_data_spec(args)
        else:
            with pytest.raises(ValueError, match="source 's': synthetic vocab 300 .* \\(257\\)"):
                _check_data_spec(args)
