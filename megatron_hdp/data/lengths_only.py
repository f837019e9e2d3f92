"""What a rank holds of a source when the Ray data service reads its tokens: the lengths.

The sampler, the planner and the resume checks need each source's document lengths (and
their digest, `sources.lengths_digest`), never its tokens: with `--hdp-data-service ray`
the tokens of training and evaluation batches come from the source loaders. So a rank
opens no document and tokenizes nothing (host layer; no Ray import, no communication):

- a JSONL source (tokenized on open or on read): the `lengths` column of its cached
  lengths index (`sources.lengths_index`); where no index is cached yet, `build(source)`
  makes it (the Ray service builds it once, in the cluster: `service.indexer`), else this
  process builds it, one document at a time;
- an indexed dataset or the embedded corpus: the lengths in its memory-mapped `.idx`
  (shared between the node's processes; the `.bin` is mapped, never read); a synthetic
  source: its lengths, drawn from its seed.

`LengthsOnly.get` raises: a token read on a rank that holds lengths only is a bug that
must not pass silently.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from megatron_hdp.data.sources import cached_lengths, lengths_index, open_source
from megatron_hdp.data.spec import SourceSpec
from megatron_hdp.data.tokenizers import build_tokenizer


class LengthsOnly:
    """A source's document lengths, in the reader shape the sampler reads; no tokens.

    Args:
        name: The source, for the message of a read.
        lengths: Tokens of each document (end-of-document token included).
        owner: What `lengths` is a view of, kept open (an indexed dataset: its mapped
            index, shared between processes, is not copied).
    """

    def __init__(self, name: str, lengths, owner=None) -> None:
        self.name, self._owner = name, owner
        lengths = np.asarray(lengths)
        if lengths.dtype.kind not in "iu":
            lengths = lengths.astype(np.int64)
        self.sequence_lengths = lengths

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Never: this rank holds lengths only (RuntimeError naming the source)."""
        raise RuntimeError(
            f"data source {self.name!r}: this rank holds document lengths only (with "
            f"--hdp-data-service ray the source loaders read tokens); document {doc} was read"
        )


def open_lengths(
    source: SourceSpec,
    *,
    tokenizer_type: str,
    tokenizer_model: str | None,
    cache_dir,
    tokenizer=None,
    build: Callable | None = None,
) -> LengthsOnly:
    """The document lengths of `source`, without holding (or, for JSONL, making) tokens.

    `build(source)`: the lengths of a JSONL source that has no cached lengths index yet
    (None: build the index here). Raises ValueError naming the source, as `open_source`.
    """
    if source.kind != "jsonl":
        reader = open_source(
            source, tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model,
            cache_dir=cache_dir, tokenizer=tokenizer,
        )  # fmt: skip
        return LengthsOnly(source.name, reader.sequence_lengths, owner=reader)
    if tokenizer is None:
        tokenizer = build_tokenizer(tokenizer_type, tokenizer_model=tokenizer_model)
    try:
        lengths = cached_lengths(
            source.jsonl, json_key=source.json_key, tokenizer=tokenizer, cache_dir=cache_dir
        )
        if lengths is None and build is not None:
            lengths = build(source)
        if lengths is None:
            lengths = lengths_index(
                source.jsonl, json_key=source.json_key, tokenizer=tokenizer, cache_dir=cache_dir
            )["lengths"]
    except ValueError as err:
        raise ValueError(f"data spec source {source.name!r}: {err}") from err
    return LengthsOnly(source.name, lengths)
