"""Megatron indexed datasets (`.bin`/`.idx`): atomic writing, checked reading, stdlib cache.

Host layer: the formats are Megatron-Core's own (`IndexedDatasetBuilder`,
`IndexedDataset`), so files written here load in any Megatron data pipeline and the other
way round. What this module adds:

- `write_indexed_dataset`: both files appear together or not at all (built under temporary
  names in the target folder, synced, then renamed; if the second rename fails the first is
  undone). Any failure (bad input, full disk, unwritable folder, interrupt) removes the
  temporaries and leaves an existing dataset byte-identical; write errors are `OSError`s
  naming the target file, not the temporary.
- `open_indexed_dataset`: a missing, truncated or garbage file is a `ValueError` naming the
  path, checked before Megatron maps it, instead of an `AssertionError` or a crash later.
  The `.bin` must be exactly as long as the index says (sum of lengths times the index's
  token size), so a `.bin` of another token dtype or another dataset is refused too.
- `ensure_stdlib_corpus`: the demo corpus (the interpreter's standard library cut at
  top-level definitions, byte-level tokens) built once into a cache folder, safely when
  several ranks ask at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from megatron_hdp.data.corpus import stdlib_corpus_documents, stdlib_fingerprint
from megatron_hdp.data.tokenizers import ByteTokenizer
from megatron_hdp.megatron.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

logger = logging.getLogger(__name__)

_INDEX_HEADER = b"MMIDIDX\x00\x00"  # Megatron's .idx magic (9 bytes), then version 1
_INDEX_PREAMBLE = 9 + 8 + 1 + 8 + 8  # header, version, dtype code, sequence and doc counts
_UINT16_VOCAB_LIMIT = 65500  # Megatron's DType.optimal_dtype threshold
_TOKEN_TYPE_BY_SIZE = {1: "uint8", 2: "uint16", 4: "int32", 8: "int64"}  # for the hints


def _dtype_for(vocab_size: int) -> type[np.number]:
    """Token storage type: uint16 below Megatron's threshold, int32 above."""
    return np.uint16 if vocab_size < _UINT16_VOCAB_LIMIT else np.int32


def _paths(prefix: str | os.PathLike[str]) -> tuple[str, str]:
    prefix = os.fspath(prefix)
    return prefix + ".bin", prefix + ".idx"


@contextlib.contextmanager
def _naming(path: str) -> Iterator[None]:
    """Re-raise an `OSError` of the block as one whose `filename` is `path`.

    Write errors happen on temporary files; the user should see the file they asked for.
    """
    try:
        yield
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), path) from exc


def _install(moves: Sequence[tuple[str, str]]) -> None:
    """Rename finished temporary files over their targets: all of them, or none.

    Each existing target is first hard-linked (where the file system has no hard links:
    renamed) to a backup next to its temporary. If any step fails, the targets already
    replaced are restored from their backups, or removed if they are new, so a new `.bin`
    never stands next to an old `.idx`.

    Args:
        moves: `(temporary, target)` pairs, in the same folder each.

    Raises:
        OSError: Naming the target that could not be backed up or replaced.
    """
    backups: dict[str, str] = {}
    replaced: list[str] = []
    try:
        for tmp, target in moves:
            if os.path.islink(target) or os.path.isfile(target):
                backup = tmp + ".old"
                with _naming(target):
                    try:
                        os.link(target, backup, follow_symlinks=False)
                    except OSError:  # no hard links here (some FUSE/network mounts)
                        os.replace(target, backup)
                backups[target] = backup
        for tmp, target in moves:
            with _naming(target):
                os.replace(tmp, target)
            replaced.append(target)
    except BaseException:
        for _, target in reversed(moves):
            backup = backups.pop(target, None)
            try:
                if backup is not None:
                    os.replace(backup, target)
                    with contextlib.suppress(FileNotFoundError):  # same file: rename no-op
                        os.remove(backup)
                elif target in replaced:
                    os.remove(target)
            except OSError as exc:
                logger.error("cannot restore %s (previous version in %s): %s", target, backup, exc)
        raise
    finally:
        for backup in backups.values():
            with contextlib.suppress(OSError):
                os.remove(backup)


def write_indexed_dataset(
    prefix: str | os.PathLike[str],
    token_documents: Iterable[Sequence[int]],
    *,
    vocab_size: int,
    extra_files: Sequence[tuple[str, str]] = (),
) -> int:
    """Write token documents as a Megatron indexed dataset `prefix.bin` / `prefix.idx`.

    Each non-empty document becomes one sequence and one document of the dataset. Files are
    built under hidden temporary names in the prefix's folder, synced to disk, and renamed
    over the targets only once complete (see `_install`: all or none). On any exception,
    `KeyboardInterrupt` included, the temporaries are removed and existing files are left
    byte-identical.

    Args:
        prefix: Output path without extension; its folder must exist.
        token_documents: Token ids per document (lists, tuples or 1-D integer arrays).
        vocab_size: Tokenizer vocabulary size; picks the storage type (numpy.uint16 below
            65500, numpy.int32 otherwise) and bounds the ids.
        extra_files: `(finished temporary file, target path)` pairs renamed into place in
            the same all-or-none step as the two dataset files, e.g. the tokenizer trained
            for this dataset. The caller removes its temporaries if this raises.

    Returns:
        The number of documents written.

    Raises:
        ValueError: If the folder is missing, a token id is outside `[0, vocab_size)`, a
            document is not a flat integer sequence, or there is no non-empty document.
        OSError: If a file cannot be written or renamed (full disk, unwritable folder);
            `filename` is the target (`prefix.bin`, `prefix.idx` or an `extra_files`
            target), never a temporary. Errors of `token_documents` pass through as raised.
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
        with _naming(bin_path):
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
            with _naming(bin_path):
                builder.add_item(torch.from_numpy(np.ascontiguousarray(tokens, dtype=dtype)))
            builder.end_document()
            count += 1
        if count == 0:
            raise ValueError(f"no non-empty document to write to {os.fspath(prefix)!r}")
        with _naming(bin_path):  # a full disk may only show when the buffers reach it
            builder.data_file.flush()
            os.fsync(builder.data_file.fileno())
            builder.data_file.close()
        with _naming(idx_path):
            builder.finalize(tmp_idx)
            with open(tmp_idx, "rb") as written:
                os.fsync(written.fileno())
        _install([(tmp_bin, bin_path), (tmp_idx, idx_path), *extra_files])
    except BaseException:
        if builder is not None:
            with contextlib.suppress(OSError):  # flushing may fail again on a full disk
                builder.data_file.close()
        for tmp in (tmp_bin, tmp_idx):
            with contextlib.suppress(OSError):
                os.remove(tmp)
        raise
    logger.debug("wrote %d documents (%s) to %s.{bin,idx}", count, dtype.__name__, prefix)
    return count


def _size_mismatch(
    idx_path: str, bin_path: str, code: int, documents: int, tokens: int, have: int
) -> str:
    """The message for a `.bin` of `have` bytes next to an index of `tokens` tokens."""
    dtype = DType.dtype_from_code(code)
    needed = tokens * DType.size(code)
    width = have // tokens if tokens and have % tokens == 0 else 0
    if width in _TOKEN_TYPE_BY_SIZE and width != DType.size(code):
        cause = (
            f"it looks written with {width}-byte ({_TOKEN_TYPE_BY_SIZE[width]}) tokens: another "
            "token dtype (tokenizer vocabulary size)"
        )
    elif have < needed:
        cause = "it is truncated or holds fewer documents than the index"
    else:
        cause = "it holds more data than the index: another dataset or document count"
    return (
        f"data file {bin_path!r} has {have} bytes but its index {idx_path!r} declares "
        f"{documents} documents of {tokens} {dtype.__name__} tokens ({needed} bytes): {cause}; "
        "the two files are not a pair (write both again)"
    )


def _check_files(idx_path: str, bin_path: str) -> None:
    """Validate a `.idx` file and its `.bin` size before Megatron maps them.

    Megatron trusts the index: a truncated or garbage `.idx` surfaces as an `AssertionError`,
    a numpy error or a half-built object, and a `.bin` of the wrong size (another token
    dtype, another dataset) only when a sequence is read, or never: it trains on garbage.
    A Megatron `.bin` is exactly the concatenation of the sequences, so its size must equal
    the sum of the lengths times the index's token size.
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
    if have == 0:
        raise ValueError(f"data file {bin_path!r} is empty")
    if have != needed:
        tokens = needed // itemsize
        raise ValueError(_size_mismatch(idx_path, bin_path, code, documents - 1, tokens, have))


def open_indexed_dataset(prefix: str | os.PathLike[str]) -> IndexedDataset:
    """Open `prefix.bin` / `prefix.idx` as a Megatron `IndexedDataset` (memory-mapped).

    Args:
        prefix: Dataset path without extension.

    Returns:
        The dataset; `ds[i]` is sequence `i`'s tokens, `ds.sequence_lengths` their lengths.

    Raises:
        ValueError: Naming the path, if a file is missing or empty, the index is corrupt or
            truncated, or the `.bin` size is not exactly what the index says (naming both
            files, their sizes, the index's token dtype and the likely cause).
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


_PROGRESS_EVERY_S = 5.0  # seconds between progress lines while the corpus is built


def _stdlib_token_documents(stats: dict[str, int]) -> Iterator[np.ndarray]:
    """`stdlib_corpus_documents()` as byte tokens plus eod (ids of `ByteTokenizer.encode`).

    Counts documents and tokens into `stats`; logs progress every few seconds.
    """
    eod = ByteTokenizer.eod
    start = last = time.perf_counter()
    for name, text in stdlib_corpus_documents():
        tokens = np.empty(len(text) + 1, dtype=np.uint16)
        tokens[:-1] = np.frombuffer(text, dtype=np.uint8)
        tokens[-1] = eod
        stats["documents"] += 1
        stats["tokens"] += tokens.size
        now = time.perf_counter()
        if now - last >= _PROGRESS_EVERY_S:
            last = now
            logger.info(
                "stdlib corpus: %d documents, %.1f M tokens (at %s), %.1f s",
                stats["documents"],
                stats["tokens"] / 1e6,
                name,
                now - start,
            )
        yield tokens


def ensure_stdlib_corpus(cache_dir: str | os.PathLike[str]) -> str:
    """Build (once) and return the byte-level stdlib corpus in `cache_dir`.

    The prefix is `<cache_dir>/stdlib-<stdlib_fingerprint()>-byte`: every document of
    `stdlib_corpus_documents()` tokenized with `ByteTokenizer` and followed by its eod
    token (about 5 s on one core for CPython 3.11's 31 MB of `.py` files). A
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
                logger.debug("stdlib corpus: reusing %s (%d documents)", prefix, len(dataset))
                del dataset
                return prefix
        logger.info("stdlib corpus: building %s (once; later runs reuse it)", prefix)
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
