"""Megatron indexed datasets: round trips, corruption, atomic writes, the stdlib cache."""

import builtins
import errno
import io
import os
import threading
import time

import numpy as np
import pytest

from megatron_hdp.data import indexed
from megatron_hdp.data.corpus import stdlib_corpus_documents
from megatron_hdp.data.indexed import (
    ensure_stdlib_corpus,
    open_indexed_dataset,
    write_indexed_dataset,
)
from megatron_hdp.data.tokenizers import ByteTokenizer

DOCS = [[1, 2, 3], [256], list(range(200)), [7] * 1000, [0, 255, 256, 0]]


def listing(folder):
    return sorted(p.name for p in folder.iterdir())


def read_all(prefix):
    ds = open_indexed_dataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds


@pytest.fixture
def written(tmp_path):
    prefix = tmp_path / "data"
    assert write_indexed_dataset(prefix, DOCS, vocab_size=257) == len(DOCS)
    return prefix


def test_write_then_read_back(written):
    tokens, ds = read_all(written)
    assert tokens == DOCS
    assert ds.sequence_lengths.tolist() == [len(d) for d in DOCS]
    assert ds.document_indices.tolist() == list(range(len(DOCS) + 1))
    assert ds.index.dtype == np.uint16
    assert os.path.getsize(f"{written}.bin") == 2 * sum(len(d) for d in DOCS)
    assert listing(written.parent) == ["data.bin", "data.idx"]


def test_empty_documents_are_skipped_and_arrays_accepted(tmp_path):
    docs = [[], np.array([5, 6], dtype=np.int64), (), (9,), np.array([], dtype=np.int32)]
    assert write_indexed_dataset(tmp_path / "d", iter(docs), vocab_size=10) == 2
    assert read_all(tmp_path / "d")[0] == [[5, 6], [9]]


def test_large_vocab_uses_int32(tmp_path):
    docs = [[0, 65535, 70000], [99_999]]
    write_indexed_dataset(tmp_path / "big", docs, vocab_size=100_000)
    tokens, ds = read_all(tmp_path / "big")
    assert tokens == docs and ds.index.dtype == np.int32


@pytest.mark.parametrize(
    ("docs", "match"),
    [
        ([[1, 2], [3, 257]], "257 is outside"),
        ([[1, -1]], "-1 is outside"),
        ([[[1, 2]]], "flat sequence"),
        ([[1.5]], "integer"),
        ([[], []], "no non-empty document"),
        ([], "no non-empty document"),
    ],
)
def test_bad_documents_raise_and_write_nothing(tmp_path, docs, match):
    with pytest.raises(ValueError, match=match):
        write_indexed_dataset(tmp_path / "d", docs, vocab_size=257)
    assert listing(tmp_path) == []


def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        write_indexed_dataset(tmp_path / "no" / "d", DOCS, vocab_size=257)


def test_failing_writer_keeps_previous_dataset(written):
    before = {name: (written.parent / name).read_bytes() for name in listing(written.parent)}

    def docs():
        yield [1, 2, 3]
        yield list(range(100))
        raise RuntimeError("tokenizer crashed")

    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        write_indexed_dataset(written, docs(), vocab_size=257)
    after = {name: (written.parent / name).read_bytes() for name in listing(written.parent)}
    assert after == before  # no temporaries, old files byte-identical
    assert read_all(written)[0] == DOCS


def test_rewrite_replaces_both_files(written):
    write_indexed_dataset(written, [[4, 4]], vocab_size=257)
    assert read_all(written)[0] == [[4, 4]]
    assert listing(written.parent) == ["data.bin", "data.idx"]


@pytest.mark.parametrize("suffix", [".idx", ".bin"])
def test_missing_file_names_path(written, suffix):
    os.remove(f"{written}{suffix}")
    with pytest.raises(ValueError, match=f"{written}{suffix}".replace(".", r"\.")):
        open_indexed_dataset(written)


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda b: b"", id="empty"),
        pytest.param(lambda b: b[:10], id="header-only"),
        pytest.param(lambda b: b[:40], id="cut-in-lengths"),
        pytest.param(lambda b: b[:-3], id="cut-at-end"),
        pytest.param(lambda b: b + b"\0" * 8, id="trailing-bytes"),
        pytest.param(
            lambda b: bytes(np.random.default_rng(0).integers(0, 256, 300, dtype=np.uint8)),
            id="garbage",
        ),
        pytest.param(lambda b: b"XXXXXXXXX" + b[9:], id="bad-header"),
        pytest.param(lambda b: b[:9] + (2).to_bytes(8, "little") + b[17:], id="bad-version"),
        pytest.param(lambda b: b[:17] + b"\x63" + b[18:], id="bad-dtype"),
        pytest.param(lambda b: b[:18] + (10**12).to_bytes(8, "little") + b[26:], id="huge-count"),
    ],
)
def test_corrupt_index_names_path(written, corrupt):
    idx = written.parent / "data.idx"
    idx.write_bytes(corrupt(idx.read_bytes()))
    with pytest.raises(ValueError, match=r"data\.idx"):
        open_indexed_dataset(written)


def test_inconsistent_index_contents_names_path(written):
    idx = written.parent / "data.idx"
    raw = bytearray(idx.read_bytes())
    n = len(DOCS)
    lengths_at = 34
    raw[lengths_at : lengths_at + 4] = (5).to_bytes(4, "little")  # first length 3 -> 5
    idx.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"data\.idx.*pointers"):
        open_indexed_dataset(written)
    raw = bytearray(idx.read_bytes())
    docs_at = 34 + 12 * n
    raw[docs_at : docs_at + 8] = (1).to_bytes(8, "little")  # document_indices[0] must be 0
    idx.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"data\.idx"):
        open_indexed_dataset(written)


@pytest.mark.parametrize("keep", [0, 1, 200])
def test_truncated_bin_names_path(written, keep):
    bin_path = written.parent / "data.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:keep])
    with pytest.raises(ValueError, match=r"data\.bin"):
        open_indexed_dataset(written)


# ---------------------------------------------------------------- stdlib cache


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    prefix = ensure_stdlib_corpus(cache)
    mtimes = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    return cache, prefix, mtimes


def test_stdlib_corpus_holds_byte_tokens_plus_eod(stdlib_cache):
    cache, prefix, _ = stdlib_cache
    assert os.path.dirname(prefix) == str(cache)
    assert os.path.basename(prefix).startswith("stdlib-") and prefix.endswith("-byte")
    ds = open_indexed_dataset(prefix)
    docs = list(stdlib_corpus_documents())
    assert len(ds) == len(docs)
    assert ds.sequence_lengths.tolist() == [len(text) + 1 for _, text in docs]
    tok = ByteTokenizer()
    for i, (name, text) in enumerate(docs):
        got = ds[i]
        if len(text) < 5000:  # small ones through the tokenizer itself
            assert got.tolist() == tok.encode(text) + [tok.eod], name
        else:
            assert got[-1] == tok.eod and np.array_equal(got[:-1], np.frombuffer(text, np.uint8)), (
                name
            )


def test_stdlib_corpus_is_reused(stdlib_cache):
    cache, prefix, mtimes = stdlib_cache
    assert ensure_stdlib_corpus(cache) == prefix
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == mtimes
    names = set(mtimes)
    assert names == {os.path.basename(prefix) + ext for ext in (".bin", ".idx", ".lock")}


@pytest.fixture
def fake_stdlib(monkeypatch):
    """A tiny stand-in corpus, counting how often it is read."""
    calls = []

    def documents():
        calls.append(threading.get_ident())
        time.sleep(0.05)  # widen the race window
        yield "a", b"abc"
        yield "b", b"\xff\x00"

    monkeypatch.setattr(indexed, "stdlib_corpus_documents", documents)
    monkeypatch.setattr(indexed, "stdlib_fingerprint", lambda: "feedface")
    return calls


def test_concurrent_callers_build_once(tmp_path, fake_stdlib):
    results, errors = [], []

    def call():
        try:
            results.append(ensure_stdlib_corpus(tmp_path / "cache"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert len(fake_stdlib) == 1
    assert results == [str(tmp_path / "cache" / "stdlib-feedface-byte")] * 4
    assert read_all(results[0])[0] == [[97, 98, 99, 256], [255, 0, 256]]


def test_corrupt_cache_is_rebuilt(tmp_path, fake_stdlib):
    prefix = ensure_stdlib_corpus(tmp_path)
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(20)
    assert ensure_stdlib_corpus(tmp_path) == prefix
    assert len(fake_stdlib) == 2
    assert read_all(prefix)[0] == [[97, 98, 99, 256], [255, 0, 256]]


# ------------------------------------------------- .idx / .bin consistency, failed writes


def mixed_pair(tmp_path, idx_docs, idx_vocab, bin_docs, bin_vocab):
    """`mixed.idx` from one dataset next to `mixed.bin` from another."""
    write_indexed_dataset(tmp_path / "idx_src", idx_docs, vocab_size=idx_vocab)
    write_indexed_dataset(tmp_path / "bin_src", bin_docs, vocab_size=bin_vocab)
    os.replace(tmp_path / "idx_src.idx", tmp_path / "mixed.idx")
    os.replace(tmp_path / "bin_src.bin", tmp_path / "mixed.bin")
    return tmp_path / "mixed"


@pytest.mark.parametrize(
    ("idx_vocab", "bin_vocab", "declared", "looks_like"),
    [
        (257, 100_000, "uint16", "4-byte (int32)"),  # would read two garbage ids per token
        (100_000, 257, "int32", "2-byte (uint16)"),
    ],
)
def test_bin_of_another_token_dtype_is_refused(
    tmp_path, idx_vocab, bin_vocab, declared, looks_like
):
    prefix = mixed_pair(tmp_path, DOCS, idx_vocab, DOCS, bin_vocab)
    tokens = sum(map(len, DOCS))
    have = os.path.getsize(f"{prefix}.bin")
    with pytest.raises(ValueError) as info:
        open_indexed_dataset(prefix)
    msg = str(info.value)
    for needle in (
        f"{prefix}.bin",
        f"{prefix}.idx",
        f"has {have} bytes",
        f"{len(DOCS)} documents of {tokens} {declared} tokens",
        looks_like,
        "another token dtype",
        "not a pair",
    ):
        assert needle in msg


def test_bin_with_an_extra_document_is_refused(tmp_path):
    prefix = mixed_pair(tmp_path, DOCS, 257, [*DOCS, [5, 6, 7]], 257)
    with pytest.raises(ValueError) as info:
        open_indexed_dataset(prefix)
    msg = str(info.value)
    tokens = sum(map(len, DOCS))
    assert f"{prefix}.bin' has {2 * tokens + 6} bytes" in msg
    assert f"{prefix}.idx' declares {len(DOCS)} documents of {tokens} uint16 tokens" in msg
    assert f"({2 * tokens} bytes)" in msg and "another dataset or document count" in msg


def test_bin_with_a_missing_document_is_refused(tmp_path):
    prefix = mixed_pair(tmp_path, DOCS, 257, DOCS[:-1], 257)
    with pytest.raises(ValueError, match=r"mixed\.bin.*fewer documents than the index"):
        open_indexed_dataset(prefix)


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(params=["previous", "fresh"])
def target(request, tmp_path):
    """A prefix with an older dataset in place, or none."""
    prefix = tmp_path / "data"
    if request.param == "previous":
        write_indexed_dataset(prefix, DOCS, vocab_size=257)
    return prefix


def no_hard_links(*args, **kwargs):
    raise OSError(errno.EPERM, "Operation not permitted")  # e.g. some FUSE mounts


def fail_renames_onto(monkeypatch, suffix):
    """`os.replace` of a new file onto `*suffix` fails (an I/O error); restoring still works."""
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith(suffix) and not str(src).endswith(".old"):
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("hard_links", [True, False], ids=["links", "no-links"])
def test_failed_idx_rename_restores_the_previous_pair(target, monkeypatch, hard_links):
    """The new .bin is already in place when the .idx rename fails: it is undone."""
    before = snapshot(target.parent)
    fail_renames_onto(monkeypatch, ".idx")
    if not hard_links:
        monkeypatch.setattr(os, "link", no_hard_links)
    with pytest.raises(OSError) as info:
        write_indexed_dataset(target, [[4, 4]], vocab_size=257)
    assert snapshot(target.parent) == before  # old pair byte-identical, no temporaries
    assert info.value.filename == f"{target}.idx"
    monkeypatch.undo()
    write_indexed_dataset(target, [[4, 4]], vocab_size=257)
    assert read_all(target)[0] == [[4, 4]]
    assert listing(target.parent) == ["data.bin", "data.idx"]


@pytest.mark.parametrize("hard_links", [True, False], ids=["links", "no-links"])
def test_extra_files_are_installed_with_the_pair(target, monkeypatch, hard_links):
    """A tokenizer installed with its dataset: if its rename fails, the dataset is undone too."""
    folder = target.parent
    tokenizer = folder / "tok.json"
    if (folder / "data.bin").exists():
        tokenizer.write_text("old tokenizer")
    before = snapshot(folder)
    new_tokenizer = folder / ".tok.json.new"
    new_tokenizer.write_text("new tokenizer")
    extra_files = [(str(new_tokenizer), str(tokenizer))]
    fail_renames_onto(monkeypatch, ".json")
    if not hard_links:
        monkeypatch.setattr(os, "link", no_hard_links)
    with pytest.raises(OSError) as info:
        write_indexed_dataset(target, [[4, 4]], vocab_size=257, extra_files=extra_files)
    assert info.value.filename == str(tokenizer)
    assert new_tokenizer.read_text() == "new tokenizer"  # the caller's temporary: not touched
    new_tokenizer.unlink()
    assert snapshot(folder) == before
    monkeypatch.undo()
    new_tokenizer.write_text("new tokenizer")
    write_indexed_dataset(target, [[4, 4]], vocab_size=257, extra_files=extra_files)
    assert read_all(target)[0] == [[4, 4]] and tokenizer.read_text() == "new tokenizer"
    assert listing(folder) == ["data.bin", "data.idx", "tok.json"]


def test_rewrite_without_hard_links(written, monkeypatch):
    monkeypatch.setattr(os, "link", no_hard_links)
    write_indexed_dataset(written, [[4, 4]], vocab_size=257)
    assert read_all(written)[0] == [[4, 4]]
    assert listing(written.parent) == ["data.bin", "data.idx"]


class FullDiskFile(io.FileIO):
    """A file on a disk that fills up after `room` bytes (writes then fail with ENOSPC)."""

    room = 3000

    def write(self, data):
        if self.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


@pytest.mark.parametrize("fails", ["bin", "idx"])
def test_full_disk_names_the_target_and_leaves_nothing(target, monkeypatch, fails):
    """Buffered writes fail again on close; the temporaries still go, the error names the file."""
    real_open = builtins.open

    def full_disk_open(path, mode="r", *args, **kwargs):
        name = os.fspath(path) if isinstance(path, str | os.PathLike) else ""
        if "w" in mode and os.path.basename(name).startswith(".data.") and name.endswith(fails):
            return io.BufferedWriter(FullDiskFile(name, "w"), buffer_size=1024)
        return real_open(path, mode, *args, **kwargs)

    # The builtin, not `indexed_dataset.open`: megatron-core 0.17+ opens through `maybe_msc`.
    monkeypatch.setattr(builtins, "open", full_disk_open)
    before = snapshot(target.parent)
    docs = [list(range(256))] * 20 if fails == "bin" else [[1]] * 300
    with pytest.raises(OSError) as info:
        write_indexed_dataset(target, docs, vocab_size=257)
    assert snapshot(target.parent) == before
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == f"{target}.{fails}"
