"""Readers of a data spec's sources: one object per source with lengths and token ranges.

Every reader has what the sampler and `batching.IndexedTokens` need, the interface of
Megatron's `IndexedDataset`: `sequence_lengths` (tokens of each document, end-of-document
token included) and `get(doc, offset, length)`. The in-process loader and the Ray
service's source-loader actors open sources through `open_source`, so both read the same
tokens.
"""

from __future__ import annotations

import hashlib
import logging
import time

import numpy as np

from megatron_hdp.data.corpus import jsonl_documents
from megatron_hdp.data.spec import SourceSpec
from megatron_hdp.data.tokenizers import build_tokenizer, document_ids

logger = logging.getLogger(__name__)


class JsonlTokens:
    """Raw JSONL text tokenized once when opened, held in memory as one token array.

    Each non-blank line is a document; its tokens are followed by the tokenizer's
    end-of-document token, as our preprocessing writes them.
    """

    def __init__(self, files, *, json_key: str, tokenizer) -> None:
        start = time.perf_counter()
        pieces, lengths = [], []
        for _, text in jsonl_documents(list(files), json_key=json_key):
            pieces.append(document_ids(text, tokenizer))
            lengths.append(len(pieces[-1]))
        if not pieces:
            raise ValueError(f"JSONL source {list(files)} holds no document")
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
        begin = int(self._offsets[doc]) + offset
        end = int(self._offsets[doc + 1]) if length is None else begin + length
        return self.tokens[begin:end]


def source_location(source: SourceSpec, cache_dir) -> str:
    """The name a checkpoint records for a source: its prefix, files or builtin name."""
    if source.kind == "indexed":
        return source.path
    if source.kind == "jsonl":
        return "jsonl:" + ",".join(source.jsonl)
    from megatron_hdp.data.indexed import ensure_stdlib_corpus

    return ensure_stdlib_corpus(cache_dir)


def open_source(
    source: SourceSpec,
    *,
    tokenizer_type: str,
    tokenizer_model: str | None,
    cache_dir,
    tokenizer=None,
):
    """Open one source for reading (an `IndexedDataset` or a `JsonlTokens`).

    JSONL text is tokenized with `tokenizer` if given (an object with `encode` and `eod`),
    else with the one `build_tokenizer(tokenizer_type, tokenizer_model=...)` builds.

    Raises:
        ValueError: Naming the source, for missing or unreadable files.
    """
    from megatron_hdp.data.indexed import open_indexed_dataset

    try:
        if source.kind == "jsonl":
            if tokenizer is None:
                tokenizer = build_tokenizer(tokenizer_type, tokenizer_model=tokenizer_model)
            return JsonlTokens(source.jsonl, json_key=source.json_key, tokenizer=tokenizer)
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
