"""Tokenizers for HDP training data (pure layer: no torch.distributed, no Megatron).

Two tokenizers share one small interface (`name`, `vocab_size`, `eod`, `encode`,
`decode`), the names matching Megatron's `--tokenizer-type` values:

- `ByteTokenizer` ("ByteLevel"): token ids are the UTF-8 bytes, plus one end-of-document id.
  Needs no file and no download; the default for the demo corpus.
- `HFTokenizer` ("HuggingFaceTokenizer"): a Hugging Face `tokenizers.Tokenizer` loaded from
  a local `tokenizer.json`, e.g. one made by `train_bpe`.

The `tokenizers` package is imported lazily, inside the functions that need it.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

EOD_TOKEN = "<|endoftext|>"
"""The special end-of-document token of `HFTokenizer` (and of `train_bpe` output)."""

TOKENIZER_TYPES = ("ByteLevel", "HuggingFaceTokenizer")
"""The values `build_tokenizer` accepts."""

_MIN_BPE_VOCAB = 258  # 256 byte symbols + the end-of-document token + at least one merge


class ByteTokenizer:
    """Byte-level tokenizer: ids 0..255 are the bytes of the UTF-8 text, 256 ends a document."""

    name = "ByteLevel"
    vocab_size = 257
    eod = 256

    def encode(self, text: str | bytes) -> list[int]:
        """Token ids of `text`.

        Args:
            text: A string (encoded as UTF-8) or raw bytes (taken as they are).

        Returns:
            One id per byte; never contains `eod`.
        """
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return list(data)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids, skipping `eod`; invalid UTF-8 becomes U+FFFD.

        Args:
            ids: Token ids in `[0, vocab_size)`.

        Returns:
            The decoded string.

        Raises:
            ValueError: If an id is outside `[0, vocab_size)`.
        """
        data = bytearray()
        for i in ids:
            i = int(i)
            if i == self.eod:
                continue
            if not 0 <= i < 256:
                raise ValueError(f"token id {i} is outside the byte vocabulary [0, 257)")
            data.append(i)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` loaded from a local `tokenizer.json`.

    Attributes:
        path: The file it was loaded from.
        vocab_size: Vocabulary size, added (special) tokens included.
        eod: The id of the special token `<|endoftext|>`.
    """

    name = "HuggingFaceTokenizer"

    def __init__(self, path: str | Path) -> None:
        """Load the tokenizer.

        Args:
            path: Path to a `tokenizer.json`.

        Raises:
            ValueError: Naming the file, if it is missing, is not a valid tokenizer, or has no
                `<|endoftext|>` token.
        """
        from tokenizers import Tokenizer

        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"tokenizer model {str(self.path)!r} does not exist")
        try:
            self._tokenizer: Any = Tokenizer.from_file(str(self.path))
        except Exception as exc:  # tokenizers raises a bare Exception for every failure
            raise ValueError(
                f"tokenizer model {str(self.path)!r} is not a valid tokenizer.json: {exc}"
            ) from exc
        eod = self._tokenizer.token_to_id(EOD_TOKEN)
        if eod is None:
            raise ValueError(f"tokenizer model {str(self.path)!r} has no {EOD_TOKEN} special token")
        self.eod: int = int(eod)
        self.vocab_size: int = int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str | bytes) -> list[int]:
        """Token ids of `text` (no special tokens added).

        Args:
            text: A string, or UTF-8 bytes (invalid sequences become U+FFFD).

        Returns:
            The token ids.
        """
        if not isinstance(text, str):
            text = bytes(text).decode("utf-8", errors="replace")
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, skipping special tokens such as `eod`.

        Args:
            ids: Token ids.

        Returns:
            The decoded string.
        """
        return str(self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True))

    def __repr__(self) -> str:
        return f"HFTokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"


def train_bpe(texts: Iterable[str], *, vocab_size: int, path: str | Path) -> HFTokenizer:
    """Train a byte-level BPE tokenizer locally and save it as a `tokenizer.json`.

    ByteLevel pre-tokenizer and decoder (every byte is in the initial alphabet, so any text
    round-trips), special token `<|endoftext|>`. The file is written atomically: to a
    temporary file in the same folder, synced, then renamed over `path`; on any failure the
    temporary is removed and an existing `path` is left as it was.

    Args:
        texts: Training text, one string per document.
        vocab_size: Target vocabulary size, special token included. The result can be
            smaller when the text has too few distinct pairs to merge (logged as a warning).
        path: Where to save the tokenizer; its folder must exist.

    Returns:
        The trained tokenizer, loaded back from `path`.

    Raises:
        ValueError: If `vocab_size < 258` or `texts` holds no (non-empty) text.
        OSError: If the file cannot be written (full disk, unwritable folder); its
            `filename` is `path`, not the temporary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < _MIN_BPE_VOCAB:
        raise ValueError(
            f"vocab_size must be >= {_MIN_BPE_VOCAB} (256 bytes, {EOD_TOKEN}, one merge), "
            f"got {vocab_size}"
        )
    path = Path(path)
    seen = {"docs": 0, "chars": 0}

    def counted() -> Iterable[str]:
        for text in texts:
            if text:
                seen["docs"] += 1
                seen["chars"] += len(text)
                yield text

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(counted(), trainer=trainer)
    if seen["docs"] == 0:
        raise ValueError("train_bpe got no text to train on")
    got = tokenizer.get_vocab_size(with_added_tokens=True)
    if got < vocab_size:
        logger.warning(
            "BPE vocabulary has %d tokens, fewer than the %d requested (too little text)",
            got,
            vocab_size,
        )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as stream:  # not save(): its errors are no OSError
            stream.write(tokenizer.to_str(pretty=True))
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    logger.info(
        "trained byte-level BPE: %d tokens from %d documents (%d characters) -> %s",
        got,
        seen["docs"],
        seen["chars"],
        path,
    )
    return HFTokenizer(path)


def build_tokenizer(
    tokenizer_type: str, *, tokenizer_model: str | Path | None = None
) -> ByteTokenizer | HFTokenizer:
    """Build a tokenizer by its Megatron `--tokenizer-type` name.

    Args:
        tokenizer_type: "ByteLevel" or "HuggingFaceTokenizer".
        tokenizer_model: Path to the `tokenizer.json` (HuggingFaceTokenizer only).

    Returns:
        The tokenizer.

    Raises:
        ValueError: For an unknown type, or HuggingFaceTokenizer without `tokenizer_model`
            (or with a bad one, see `HFTokenizer`).
    """
    if tokenizer_type == "ByteLevel":
        return ByteTokenizer()
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ValueError("tokenizer type HuggingFaceTokenizer needs a tokenizer model path")
        return HFTokenizer(tokenizer_model)
    raise ValueError(
        f"unknown tokenizer type {tokenizer_type!r}; supported: {', '.join(TOKENIZER_TYPES)}"
    )


def document_ids(text: bytes, tokenizer, *, append_eod: bool = True):
    """A document's token ids as int32, plus the end-of-document id (as preprocessing writes)."""
    import numpy as np

    if isinstance(tokenizer, ByteTokenizer):
        ids = np.frombuffer(text, dtype=np.uint8).astype(np.int32)  # == encode(text)
    else:
        ids = np.asarray(tokenizer.encode(text), dtype=np.int32)
    return np.append(ids, np.int32(tokenizer.eod)) if append_eod else ids
