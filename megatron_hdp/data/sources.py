"""Readers of a data spec's sources: one object per source with lengths and token ranges.

Every reader has what the sampler and `batching.IndexedTokens` need, the interface of
Megatron's `IndexedDataset`: `sequence_lengths` (tokens of each document, end-of-document
token included) and `get(doc, offset, length)`. The in-process loader and the Ray
service's source-loader actors open sources through `open_source`, so both read the same
tokens.

- `JsonlTokens`: raw JSONL tokenized when opened (optionally only a range of documents).
- `JsonlOnRead`: raw JSONL with a lengths index built once (cached under the cache folder,
  keyed by the files' fingerprint, the JSON key and the tokenizer); each read parses and
  tokenizes one document. It holds byte offsets and lengths, never tokens.
- `SyntheticTokens`: deterministic documents whose reads cost the CPU time and latency per
  token the spec declares (for tests and benchmarks of the data service).

`token_partition` splits a source into the contiguous, token-balanced document ranges
that the Ray service's loaders each own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from pathlib import Path

import numpy as np

from megatron_hdp.data.corpus import jsonl_spans, jsonl_text
from megatron_hdp.data.spec import SYNTHETIC_COSTS, SourceSpec
from megatron_hdp.data.tokenizers import build_tokenizer, document_ids

logger = logging.getLogger(__name__)


class JsonlTokens:
    """Raw JSONL text tokenized once when opened, held in memory as one token array.

    Each non-blank line is a document; its tokens are followed by the tokenizer's
    end-of-document token, as our preprocessing writes them. With `docs=(first, end)` only
    those documents are tokenized and held (a Ray loader's part): `sequence_lengths` are
    theirs, and `get` takes the source's document numbers.
    """

    def __init__(self, files, *, json_key: str, tokenizer, docs=None) -> None:
        start = time.perf_counter()
        first, end = docs if docs is not None else (0, None)
        pieces, lengths = [], []
        for k, (_, _, _, _, text) in enumerate(jsonl_spans(list(files), json_key=json_key)):
            if end is not None and k >= end:
                break
            if k >= first:
                pieces.append(document_ids(text, tokenizer))
                lengths.append(len(pieces[-1]))
        if not pieces:
            raise ValueError(f"JSONL source {list(files)} holds no document")
        self.first = first
        self.tokens = np.concatenate(pieces)
        self.sequence_lengths = np.asarray(lengths, dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(self.sequence_lengths)])
        logger.info(
            "tokenized %d JSONL documents (%d tokens) in %.1f s",
            len(lengths),
            len(self.tokens),
            time.perf_counter() - start,
        )

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of document `doc`."""
        doc -= self.first
        if not 0 <= doc < len(self.sequence_lengths):
            raise IndexError(f"document {doc + self.first} is not held by this reader")
        begin = int(self._offsets[doc]) + offset
        end = int(self._offsets[doc + 1]) if length is None else begin + length
        return self.tokens[begin:end]


def tokenizer_key(tokenizer) -> str | None:
    """What names a tokenizer in the lengths-index cache (None: not cacheable).

    Byte-level: its name; a Hugging Face tokenizer: a hash of its `tokenizer.json`.
    """
    if getattr(tokenizer, "name", None) == "ByteLevel":
        return "ByteLevel"
    path = getattr(tokenizer, "path", None)
    if path is not None and Path(path).is_file():
        return "hf-" + hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    return None


def _build_index(files, json_key: str, tokenizer) -> dict[str, np.ndarray]:
    """One pass over the files: each document's file, byte span and token count."""
    rows = [
        (index, begin, end, len(document_ids(text, tokenizer)))
        for index, begin, end, _, text in jsonl_spans(list(files), json_key=json_key)
    ]
    if not rows:
        raise ValueError(f"JSONL source {list(files)} holds no document")
    table = np.asarray(rows, dtype=np.int64)
    return {"files": table[:, 0], "begin": table[:, 1], "end": table[:, 2], "lengths": table[:, 3]}


def _index_path(files, json_key: str, tokenizer, cache_dir) -> Path | None:
    """Where the lengths index of these files is cached (None: not cacheable)."""
    from megatron_hdp.data.fingerprint import dataset_fingerprint

    key = tokenizer_key(tokenizer)
    if key is None or cache_dir is None:
        return None
    fingerprint = dataset_fingerprint("jsonl:" + ",".join(str(f) for f in files))
    name = hashlib.sha256(json_key.encode()).hexdigest()[:8]
    return Path(cache_dir) / "lengths" / f"{fingerprint.split(':')[1]}-{name}-{key}.npz"


def cached_lengths(files, *, json_key: str, tokenizer, cache_dir) -> np.ndarray | None:
    """The document lengths of a cached lengths index (None: none is cached).

    Reads the index's `lengths` column alone; no document is opened.
    """
    path = _index_path(files, json_key, tokenizer, cache_dir)
    if path is None or not path.is_file():
        return None
    with np.load(path) as cached:
        return cached["lengths"]


def lengths_index(files, *, json_key: str, tokenizer, cache_dir) -> dict[str, np.ndarray]:
    """The lengths index of raw JSONL files, built once and cached.

    Cached as `<cache_dir>/lengths/<fingerprint>-<json key>-<tokenizer>.npz`: the key is
    the files' content fingerprint (`fingerprint.dataset_fingerprint`), so edited files get
    a new index. Written atomically (a temporary file renamed), so ranks and loaders that
    build it at once never read half of one. A tokenizer without a cache key
    (`tokenizer_key`) builds it in memory every time.
    """
    path = _index_path(files, json_key, tokenizer, cache_dir)
    if path is None:
        return _build_index(files, json_key, tokenizer)
    if path.is_file():
        with np.load(path) as cached:
            return {k: cached[k] for k in cached.files}
    start = time.perf_counter()
    index = _build_index(files, json_key, tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.stem}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp.npz")
    np.savez(temporary, **index)
    os.replace(temporary, path)
    logger.info(
        "indexed %d JSONL documents in %.1f s (cached as %s)",
        len(index["lengths"]),
        time.perf_counter() - start,
        path,
    )
    return index


class JsonlOnRead:
    """Raw JSONL tokenized one document at a time, when read.

    Holds each document's byte span and token count (the lengths index, 32 bytes per
    document), never tokens: every `get` reads the document's line, parses it and
    tokenizes it, the per-read cost a loader pays. The tokens are `JsonlTokens`'.
    """

    def __init__(self, files, *, json_key: str, tokenizer, cache_dir) -> None:
        self.files, self.json_key, self.tokenizer = [str(f) for f in files], json_key, tokenizer
        index = lengths_index(files, json_key=json_key, tokenizer=tokenizer, cache_dir=cache_dir)
        self._file, self._begin, self._end = index["files"], index["begin"], index["end"]
        self.sequence_lengths = index["lengths"]
        self._handles: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def _line(self, doc: int) -> bytes:
        index = int(self._file[doc])
        if index not in self._handles:
            self._handles[index] = os.open(self.files[index], os.O_RDONLY)
        size = int(self._end[doc] - self._begin[doc])
        return os.pread(self._handles[index], size, int(self._begin[doc]))

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of document `doc`, tokenized now."""
        where = f"{self.files[int(self._file[doc])]} (document {doc})"
        ids = document_ids(jsonl_text(self._line(doc), where, self.json_key), self.tokenizer)
        if len(ids) != self.sequence_lengths[doc]:
            raise ValueError(
                f"{where}: {len(ids)} tokens, but its lengths index says "
                f"{self.sequence_lengths[doc]} (the file changed after it was indexed)"
            )
        return ids[offset:] if length is None else ids[offset : offset + length]

    def __del__(self) -> None:
        for handle in getattr(self, "_handles", {}).values():
            os.close(handle)


class SyntheticTokens:
    """Deterministic synthetic documents with a declared cost per token read.

    Document lengths are drawn once from `seed` (uniform in `[min_tokens, max_tokens]`);
    document `d`'s tokens are drawn from `(seed, d)` in `[0, vocab - 1)`, and end with the
    end-of-document id `vocab - 1`. Each `get` spends `cpu_us_per_token` microseconds of
    CPU (a busy loop on this thread's CPU clock) and then waits `latency_us_per_token`
    microseconds per token returned: a stand-in for decoding or tokenizing, for tests and
    benchmarks of the data service only.
    """

    def __init__(self, params: dict) -> None:
        self.params = dict(params)
        rng = np.random.default_rng(int(params["seed"]))
        self.sequence_lengths = rng.integers(
            int(params["min_tokens"]), int(params["max_tokens"]) + 1, int(params["documents"])
        ).astype(np.int64)
        self.eod = int(params["vocab"]) - 1

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def document(self, doc: int) -> np.ndarray:
        """All tokens of document `doc` (no cost charged)."""
        rng = np.random.default_rng([int(self.params["seed"]), int(doc)])
        ids = rng.integers(0, self.eod, int(self.sequence_lengths[doc]) - 1).astype(np.int32)
        return np.append(ids, np.int32(self.eod))

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of document `doc`, after their declared cost."""
        ids = self.document(doc)
        ids = ids[offset:] if length is None else ids[offset : offset + length]
        cpu_s = self.params["cpu_us_per_token"] * 1e-6 * len(ids)
        if cpu_s > 0:
            until = time.thread_time() + cpu_s
            while time.thread_time() < until:
                pass
        wait_s = self.params["latency_us_per_token"] * 1e-6 * len(ids)
        if wait_s > 0:
            time.sleep(wait_s)
        return ids


def token_partition(lengths, parts: int) -> np.ndarray:
    """`parts + 1` document boundaries splitting a source into token-balanced ranges.

    Range `k` is documents `[bounds[k], bounds[k + 1])`: contiguous, each non-empty when
    the source has at least `parts` documents (else there are fewer ranges), and cut where
    the running token count crosses `k / parts` of the total.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    parts = max(1, min(int(parts), len(lengths)))
    cumulative = np.cumsum(lengths)
    targets = cumulative[-1] * np.arange(1, parts) / parts
    cuts = np.searchsorted(cumulative, targets, side="left") + 1
    bounds = [0]
    for k, cut in enumerate(cuts, start=1):  # strictly increasing, room left for the rest
        bounds.append(int(min(max(cut, bounds[-1] + 1), len(lengths) - (parts - k))))
    bounds.append(len(lengths))
    return np.asarray(bounds, dtype=np.int64)


def source_location(source: SourceSpec, cache_dir) -> str:
    """The name a checkpoint records for a source: its prefix, files or builtin name."""
    if source.kind == "indexed":
        return source.path
    if source.kind == "jsonl":
        return "jsonl:" + ",".join(source.jsonl)
    if source.kind == "synthetic":
        content = {k: v for k, v in source.synthetic if k not in SYNTHETIC_COSTS}
        return "synthetic:" + json.dumps(content, sort_keys=True)
    from megatron_hdp.data.indexed import ensure_stdlib_corpus

    return ensure_stdlib_corpus(cache_dir)


def open_source(
    source: SourceSpec,
    *,
    tokenizer_type: str,
    tokenizer_model: str | None,
    cache_dir,
    tokenizer=None,
    docs=None,
):
    """Open one source for reading (an indexed dataset, JSONL or synthetic reader).

    The reader is an `IndexedDataset`, `JsonlTokens`, `JsonlOnRead` or `SyntheticTokens`.
    JSONL text is tokenized with `tokenizer` if given (an object with `encode` and `eod`),
    else with the one `build_tokenizer(tokenizer_type, tokenizer_model=...)` builds.
    `docs=(first, end)`: a JSONL source tokenized when opened tokenizes only those
    documents (a Ray loader's part); other readers hold no tokens and ignore it.

    Raises:
        ValueError: Naming the source, for missing or unreadable files.
    """
    try:
        if source.kind == "synthetic":
            return SyntheticTokens(source.synthetic_params)
        if source.kind == "jsonl":
            if tokenizer is None:
                tokenizer = build_tokenizer(tokenizer_type, tokenizer_model=tokenizer_model)
            if source.tokenize == "on_read":
                return JsonlOnRead(
                    source.jsonl, json_key=source.json_key, tokenizer=tokenizer, cache_dir=cache_dir
                )
            return JsonlTokens(
                source.jsonl, json_key=source.json_key, tokenizer=tokenizer, docs=docs
            )
        # imported here: it brings torch, which synthetic and JSONL loaders never need
        from megatron_hdp.data.indexed import open_indexed_dataset

        return open_indexed_dataset(source_location(source, cache_dir))
    except ValueError as err:
        raise ValueError(f"data spec source {source.name!r}: {err}") from err


def blend_sources(prefixes) -> list[SourceSpec]:
    """A `--data-path` blend (or the embedded corpus) as sources, one per dataset prefix."""
    return [SourceSpec(f"dataset{k}", 1.0, path=prefix) for k, prefix in enumerate(prefixes)]


def lengths_digest(reader) -> str:
    """A short hash of a reader's document lengths: equal sources, equal digests."""
    lengths = np.ascontiguousarray(np.asarray(reader.sequence_lengths, dtype=np.int64))
    return hashlib.sha256(lengths.tobytes()).hexdigest()[:16]
