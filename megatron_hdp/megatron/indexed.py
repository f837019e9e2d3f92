"""Megatron indexed datasets (`.bin`/`.idx`): atomic writing, checked reading, stdlib cache.

Host layer: the formats are Megatron-Core's own (`IndexedDatasetBuilder`,
`IndexedDataset`), so files written here load in any Megatron data pipeline and the other
way round. What this module adds:

- `write_indexed_dataset`: both files appear together or not at all (built under temporary
  names in the target folder, then renamed); a failure leaves an existing dataset intact.
- `open_indexed_dataset`: a missing, truncated or garbage file is a `ValueError` naming the
  path, checked before Megatron maps it, instead of an `AssertionError` or a crash later.
- `ensure_stdlib_corpus`: the demo corpus (the interpreter's standard library, byte-level
  tokens) built once into a cache folder, safely when several ranks ask at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

with warnings.catch_warnings():
    # Importing megatron.core warns four times that Transformer Engine / Apex are missing;
    # irrelevant to data files, and noise in front of the preprocessing tool's one-line errors.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex", category=UserWarning)
    from megatron.core.datasets.indexed_dataset import (
        DType,
        IndexedDataset,
        IndexedDatasetBuilder,
    )

from megatron_hdp.data.corpus import stdlib_documents, stdlib_fingerprint
from megatron_hdp.data.tokenizers import ByteTokenizer

logger = logging.getLogger(__name__)

_INDEX_HEADER = b"MMIDIDX\x00\x00"  # Megatron's .idx magic (9 bytes), then version 1
_INDEX_PREAMBLE = 9 + 8 + 1 + 8 + 8  # header, version, dtype code, sequence and doc counts
_UINT16_VOCAB_LIMIT = 65500  # Megatron's DType.optimal_dtype threshold


def _dtype_for(vocab_size: int) -> type[np.number]:
    """Token storage type: uint16 below Megatron's threshold, int32 above."""
    return np.uint16 if vocab_size < _UINT16_VOCAB_LIMIT else np.int32


def _paths(prefix: str | os.PathLike[str]) -> tuple[str, str]:
    prefix = os.fspath(prefix)
    return prefix + ".bin", prefix + ".idx"


def write_indexed_dataset(
    prefix: str | os.PathLike[str],
    token_documents: Iterable[Sequence[int]],
    *,
    vocab_size: int,
) -> int:
    """Write token documents as a Megatron indexed dataset `prefix.bin` / `prefix.idx`.

    Each non-empty document becomes one sequence and one document of the dataset. Files are
    built under temporary names in the prefix's folder and renamed over the targets only
    once complete; on any exception the temporaries are removed and existing files are left
    untouched.

    Args:
        prefix: Output path without extension; its folder must exist.
        token_documents: Token ids per document (lists, tuples or 1-D integer arrays).
        vocab_size: Tokenizer vocabulary size; picks the storage type (numpy.uint16 below
            65500, numpy.int32 otherwise) and bounds the ids.

    Returns:
        The number of documents written.

    Raises:
        ValueError: If the folder is missing, a token id is outside `[0, vocab_size)`, a
            document is not a flat integer sequence, or there is no non-empty document.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    bin_path, idx_path = _paths(prefix)
    folder, base = os.path.split(os.path.abspath(os.fspath(prefix)))
    if not os.path.isdir(folder):
        raise ValueError(f"output folder {folder!r} does not exist")
    dtype = _dtype_for(vocab_size)
    tag = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
    tmp_bin = os.path.join(folder, f".{base}.{tag}.tmp.bin")
    tmp_idx = os.path.join(folder, f".{base}.{tag}.tmp.idx")
    builder: IndexedDatasetBuilder | None = None
    try:
        builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
        count = 0
        for position, doc in enumerate(token_documents):
            tokens = np.asarray(doc)
            if tokens.size == 0:
                continue
            if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
                raise ValueError(
                    f"document {position}: expected a flat sequence of integer token ids, "
                    f"got shape {tokens.shape} of {tokens.dtype}"
                )
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high >= vocab_size:
                bad = low if low < 0 else high
                raise ValueError(
                    f"document {position}: token id {bad} is outside [0, {vocab_size})"
                )
            builder.add_item(torch.from_numpy(np.ascontiguousarray(tokens, dtype=dtype)))
            builder.end_document()
            count += 1
        if count == 0:
            raise ValueError(f"no non-empty document to write to {os.fspath(prefix)!r}")
        builder.finalize(tmp_idx)
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
    except BaseException:
        if builder is not None:
            builder.data_file.close()
        for tmp in (tmp_bin, tmp_idx):
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        raise
    logger.debug("wrote %d documents (%s) to %s.{bin,idx}", count, dtype.__name__, prefix)
    return count


def _check_files(idx_path: str, bin_path: str) -> None:
    """Validate a `.idx` file and its `.bin` size before Megatron maps them.

    Megatron trusts the index: a truncated or garbage `.idx` surfaces as an `AssertionError`,
    a numpy error or a half-built object, and a short `.bin` only when a sequence is read.
    """
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as stream:
        head = stream.read(_INDEX_PREAMBLE)
    if len(head) < _INDEX_PREAMBLE:
        raise ValueError(f"index {idx_path!r} is truncated ({size} bytes)")
    if head[:9] != _INDEX_HEADER:
        raise ValueError(f"index {idx_path!r} is not a Megatron index (bad header)")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise ValueError(f"index {idx_path!r} has unsupported version {version}")
    if code not in {d.value for d in DType}:
        raise ValueError(f"index {idx_path!r} has unknown dtype code {code}")
    expected = _INDEX_PREAMBLE + sequences * (4 + 8) + documents * 8
    if documents < 1 or size != expected:
        raise ValueError(
            f"index {idx_path!r} is corrupt or truncated: {size} bytes, expected {expected} "
            f"for {sequences} sequences and {documents} document indices"
        )
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    try:
        lengths = raw[_INDEX_PREAMBLE:].view(np.int32)[:sequences].astype(np.int64)
        pointers = raw[_INDEX_PREAMBLE + 4 * sequences :].view(np.int64)[:sequences]
        doc_idx = raw[_INDEX_PREAMBLE + 12 * sequences :].view(np.int64)[:documents]
        if (
            doc_idx[0] != 0
            or doc_idx[-1] != sequences
            or np.any(np.diff(doc_idx) < 0)
            or np.any(lengths < 0)
        ):
            raise ValueError(f"index {idx_path!r} is corrupt: inconsistent document indices")
        itemsize = DType.size(int(code))
        needed = 0
        if sequences:
            starts = np.concatenate(([0], np.cumsum(lengths[:-1]) * itemsize))
            if not np.array_equal(pointers, starts):
                raise ValueError(f"index {idx_path!r} is corrupt: inconsistent sequence pointers")
            needed = int(pointers[-1]) + int(lengths[-1]) * itemsize
    finally:
        del raw
    have = os.path.getsize(bin_path)
    if needed > have:
        raise ValueError(
            f"data file {bin_path!r} is truncated: {have} bytes, the index needs {needed}"
        )
    if have == 0:
        raise ValueError(f"data file {bin_path!r} is empty")


def open_indexed_dataset(prefix: str | os.PathLike[str]) -> IndexedDataset:
    """Open `prefix.bin` / `prefix.idx` as a Megatron `IndexedDataset` (memory-mapped).

    Args:
        prefix: Dataset path without extension.

    Returns:
        The dataset; `ds[i]` is sequence `i`'s tokens, `ds.sequence_lengths` their lengths.

    Raises:
        ValueError: Naming the path, if a file is missing or empty, the index is corrupt or
            truncated, or the `.bin` file is smaller than the index says.
    """
    bin_path, idx_path = _paths(prefix)
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise ValueError(f"indexed dataset file {path!r} is missing")
    _check_files(idx_path, bin_path)
    try:
        return IndexedDataset(os.fspath(prefix), mmap=True)
    except (AssertionError, ValueError, struct.error, OSError, IndexError) as exc:
        raise ValueError(f"cannot open indexed dataset {idx_path!r}: {exc}") from exc


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created if missing) for the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _stdlib_token_documents(stats: dict[str, int]) -> Iterator[np.ndarray]:
    """`stdlib_documents()` as byte tokens plus eod (same ids as `ByteTokenizer.encode`)."""
    eod = ByteTokenizer.eod
    start = time.perf_counter()
    for name, text in stdlib_documents():
        tokens = np.empty(len(text) + 1, dtype=np.uint16)
        tokens[:-1] = np.frombuffer(text, dtype=np.uint8)
        tokens[-1] = eod
        stats["documents"] += 1
        stats["tokens"] += tokens.size
        if stats["documents"] % 50 == 0:
            logger.info(
                "stdlib corpus: %d documents, %.1f M tokens (at %s), %.1f s",
                stats["documents"],
                stats["tokens"] / 1e6,
                name,
                time.perf_counter() - start,
            )
        yield tokens


def ensure_stdlib_corpus(cache_dir: str | os.PathLike[str]) -> str:
    """Build (once) and return the byte-level stdlib corpus in `cache_dir`.

    The prefix is `<cache_dir>/stdlib-<stdlib_fingerprint()>-byte`: every document of
    `stdlib_documents()` tokenized with `ByteTokenizer` and followed by its eod token. A
    valid existing dataset is reused untouched; a missing or corrupt one is (re)built
    atomically. An exclusive `flock` on `<prefix>.lock` serialises concurrent callers
    (ranks, jobs sharing a cache), so one builds and the others reuse.

    Args:
        cache_dir: Cache folder (created if missing).

    Returns:
        The dataset prefix, for `open_indexed_dataset`.
    """
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    prefix = str(cache / f"stdlib-{stdlib_fingerprint()}-byte")
    with _exclusive_lock(Path(prefix + ".lock")):
        bin_path, idx_path = _paths(prefix)
        if os.path.exists(bin_path) or os.path.exists(idx_path):
            try:
                dataset = open_indexed_dataset(prefix)
            except ValueError as exc:
                logger.warning("stdlib corpus cache is unusable, rebuilding: %s", exc)
            else:
                logger.info("stdlib corpus: reusing %s (%d documents)", prefix, len(dataset))
                del dataset
                return prefix
        logger.info("stdlib corpus: building %s", prefix)
        start = time.perf_counter()
        stats = {"documents": 0, "tokens": 0}
        write_indexed_dataset(
            prefix, _stdlib_token_documents(stats), vocab_size=ByteTokenizer.vocab_size
        )
        logger.info(
            "stdlib corpus: wrote %d documents, %d tokens to %s in %.1f s",
            stats["documents"],
            stats["tokens"],
            prefix,
            time.perf_counter() - start,
        )
    return prefix
