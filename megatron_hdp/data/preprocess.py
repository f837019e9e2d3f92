"""Turn JSONL files or a folder of text/code files into a Megatron `.bin`/`.idx` dataset.

Usage::

    python -m megatron_hdp.data.preprocess --input data.jsonl --output-prefix out/data
    python -m megatron_hdp.data.preprocess --input src/ --output-prefix out/code
        --train-bpe-vocab-size 8192 --tokenizer-model out/tokenizer.json   (one command)

Every document ends with the tokenizer's end-of-document token unless `--no-append-eod`.
Any failure (bad input, a full disk, an unwritable folder, Ctrl-C or SIGTERM) exits non-zero
with a one-line message naming the file and leaves no partial or temporary file: the outputs
(PREFIX.bin, PREFIX.idx and a trained tokenizer.json) are replaced together or not at all.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megatron_hdp.data.corpus import (
    DEFAULT_EXTENSIONS,
    Document,
    directory_documents,
    jsonl_documents,
)
from megatron_hdp.data.indexed import write_indexed_dataset
from megatron_hdp.data.tokenizers import (
    TOKENIZER_TYPES,
    ByteTokenizer,
    HFTokenizer,
    build_tokenizer,
    document_ids,
    train_bpe,
)

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (every flag documented in `--help`)."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_hdp.data.preprocess",
        description=(
            "Tokenize JSONL files (one document per line) or a folder of text/code files "
            "(one document per file) into a Megatron indexed dataset PREFIX.bin / PREFIX.idx."
        ),
    )
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="JSONL files, or exactly one directory of text/code files",
    )
    parser.add_argument(
        "--json-key",
        "--json-keys",
        dest="json_key",
        default="text",
        help="JSONL key holding each document's text (default: %(default)s); --json-keys is "
        "Megatron's spelling and takes one key here",
    )
    parser.add_argument(
        "--output-prefix",
        required=True,
        metavar="PREFIX",
        help="write PREFIX.bin and PREFIX.idx (the folder must exist)",
    )
    parser.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default=None,
        help=(
            "ByteLevel (bytes + one end-of-document id, vocabulary 257) or "
            "HuggingFaceTokenizer (a tokenizer.json). Default: ByteLevel, or "
            "HuggingFaceTokenizer with --train-bpe-vocab-size"
        ),
    )
    parser.add_argument(
        "--tokenizer-model",
        metavar="PATH",
        default=None,
        help=(
            "tokenizer.json with an <|endoftext|> token; required for HuggingFaceTokenizer, "
            "and where the trained tokenizer is saved with --train-bpe-vocab-size"
        ),
    )
    parser.add_argument(
        "--train-bpe-vocab-size",
        type=int,
        metavar="N",
        default=None,
        help=(
            "first train a byte-level BPE of N tokens (N >= 258) on the input, save it to "
            "--tokenizer-model, then tokenize with it"
        ),
    )
    parser.add_argument(
        "--no-append-eod",
        dest="append_eod",
        action="store_false",
        help="do not end every document with the end-of-document token (appending is the "
        "default here; Megatron's preprocess_data.py needs --append-eod for it)",
    )
    parser.add_argument(
        "--append-eod",
        dest="append_eod",
        action="store_true",
        help="end every document with the end-of-document token (the default; accepted for "
        "Megatron's spelling)",
    )
    parser.add_argument(
        "--extensions",
        nargs="+",
        default=list(DEFAULT_EXTENSIONS),
        metavar="EXT",
        help="file endings to read from a directory input (default: %(default)s)",
    )
    parser.add_argument(
        "--log-interval",
        type=int,
        default=1000,
        metavar="DOCS",
        help="log progress every DOCS documents (default: %(default)s)",
    )
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject bad flag combinations before any work (`parser.error` exits with status 2)."""
    inputs = [Path(p) for p in args.input]
    for path in inputs:
        if not path.exists():
            parser.error(f"input {str(path)!r} does not exist")
    args.directory = None
    if any(p.is_dir() for p in inputs):
        if len(inputs) != 1:
            parser.error("a directory --input must be the only input")
        args.directory = inputs[0]
    if args.train_bpe_vocab_size is not None:
        if args.tokenizer_type == "ByteLevel":
            parser.error("--train-bpe-vocab-size trains a HuggingFaceTokenizer, not ByteLevel")
        args.tokenizer_type = "HuggingFaceTokenizer"
        if args.tokenizer_model is None:
            parser.error("--train-bpe-vocab-size needs --tokenizer-model PATH to save it to")
        if args.train_bpe_vocab_size < 258:
            parser.error(f"--train-bpe-vocab-size must be >= 258, got {args.train_bpe_vocab_size}")
        if not Path(args.tokenizer_model).resolve().parent.is_dir():
            parser.error(f"folder of --tokenizer-model {args.tokenizer_model!r} does not exist")
    elif args.tokenizer_type is None:
        args.tokenizer_type = "ByteLevel"
    if args.tokenizer_type == "HuggingFaceTokenizer" and args.tokenizer_model is None:
        parser.error("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH")
    if not Path(args.output_prefix).resolve().parent.is_dir():
        parser.error(f"folder of --output-prefix {args.output_prefix!r} does not exist")
    if args.log_interval < 1:
        parser.error(f"--log-interval must be >= 1, got {args.log_interval}")


def _documents(args: argparse.Namespace) -> Iterator[Document]:
    if args.directory is not None:
        return directory_documents(args.directory, extensions=args.extensions)
    return jsonl_documents(args.input, json_key=args.json_key)


def _token_documents(
    args: argparse.Namespace, tokenizer: ByteTokenizer | HFTokenizer, stats: dict[str, int]
) -> Iterator[np.ndarray]:
    """Tokenize every input document (plus eod), counting and reporting progress."""
    start = time.perf_counter()
    bar = tqdm(desc="tokenizing", unit=" docs", file=sys.stderr, disable=not sys.stderr.isatty())
    with bar:
        for _, text in _documents(args):
            ids = document_ids(text, tokenizer, append_eod=args.append_eod)
            if ids.size == 0:
                continue
            stats["documents"] += 1
            stats["tokens"] += int(ids.size)
            bar.update(1)
            if stats["documents"] % args.log_interval == 0:
                logger.info(
                    "%d documents, %d tokens, %.1f s",
                    stats["documents"],
                    stats["tokens"],
                    time.perf_counter() - start,
                )
            yield ids


def _os_error_message(exc: OSError, outputs: set[str]) -> str:
    """One line for an `OSError`: which file could not be written (or read), and why."""
    if exc.filename is None:
        return str(exc)
    verb = "cannot write" if os.fspath(exc.filename) in outputs else "cannot read"
    return f"{verb} {os.fspath(exc.filename)!r}: {exc.strerror or exc}"


def _raise_interrupt(signum: int, frame: object) -> None:
    """SIGTERM handler: unwind like Ctrl-C, so the temporary files are removed."""
    raise KeyboardInterrupt(signum)


def main(argv: list[str] | None = None) -> int:
    """Run the tool.

    Args:
        argv: Arguments without the program name (default: `sys.argv[1:]`).

    Returns:
        0 on success.

    Raises:
        SystemExit: With status 2 for bad flags (usage plus one line); status 1 with a
            one-line message for bad input data or a file that cannot be written (full
            disk, unwritable folder); 128 + the signal number when interrupted. In every
            case no partial or temporary file is left and existing outputs are unchanged.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    outputs = {f"{args.output_prefix}.bin", f"{args.output_prefix}.idx"}
    trained: str | None = None  # the trained tokenizer's temporary file, until installed
    try:
        extra_files: list[tuple[str, str]] = []
        if args.train_bpe_vocab_size is not None:
            target = Path(args.tokenizer_model)
            outputs.add(str(target))
            tag = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
            trained = str(target.with_name(f".{target.name}.{tag}.tmp"))
            texts = (text.decode("utf-8", errors="replace") for _, text in _documents(args))
            try:
                tokenizer = train_bpe(texts, vocab_size=args.train_bpe_vocab_size, path=trained)
            except OSError as exc:
                if exc.filename != trained:
                    raise
                raise OSError(exc.errno, exc.strerror, str(target)) from exc
            extra_files.append((trained, str(target)))  # installed with the dataset
        else:
            try:
                tokenizer = build_tokenizer(
                    args.tokenizer_type, tokenizer_model=args.tokenizer_model
                )
            except ValueError as exc:
                parser.error(str(exc))
        stats = {"documents": 0, "tokens": 0}
        start = time.perf_counter()
        write_indexed_dataset(
            args.output_prefix,
            _token_documents(args, tokenizer, stats),
            vocab_size=tokenizer.vocab_size,
            extra_files=extra_files,
        )
    except ValueError as exc:
        raise SystemExit(f"{parser.prog}: error: {exc}") from exc
    except OSError as exc:
        raise SystemExit(f"{parser.prog}: error: {_os_error_message(exc, outputs)}") from exc
    except KeyboardInterrupt as exc:
        signum = exc.args[0] if exc.args and isinstance(exc.args[0], int) else signal.SIGINT
        parser.exit(
            128 + signum,
            f"{parser.prog}: interrupted by {signal.Signals(signum).name}; "
            f"{', '.join(sorted(outputs))} left as they were\n",
        )
    finally:
        if trained is not None:
            Path(trained).unlink(missing_ok=True)
    logger.info(
        "wrote %d documents, %d tokens (%s, vocabulary %d) to %s.{bin,idx} in %.1f s",
        stats["documents"],
        stats["tokens"],
        tokenizer.name,
        tokenizer.vocab_size,
        args.output_prefix,
        time.perf_counter() - start,
    )
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _raise_interrupt)
    sys.exit(main())
