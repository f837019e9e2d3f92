"""Document sources for preprocessing (pure layer).

Every source is an iterator of `(name, text)` pairs, `text` being the document's raw bytes
(UTF-8 for JSONL), so byte-level tokenization sees exactly what is on disk:

- `jsonl_documents`: one document per line of JSONL files (Megatron's `--json-keys` format).
- `directory_documents`: one document per text/code file under a folder.
- `stdlib_corpus_documents`: the embedded default corpus, the running interpreter's
  standard library cut at top-level definitions: one document per top-level function or
  class and one per module preamble. Its lengths span short to very long with a heavy tail
  (14,335 documents on CPython 3.11: median 499 bytes, a tenth over 4.8 KB, 330 over 16 KB,
  the longest 757 KB), the mix HDP is built for: most sequences are packed whole on one
  rank, a few need a ring.
- `stdlib_documents`: the same files, one document per top-level package or module
  (lengths from a few bytes to the 17 MB `test` package); the simulator's stdlib-like mix.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import platform
import sys
import sysconfig
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

Document = tuple[str, bytes]
"""A document: `(name, text)`."""

DEFAULT_EXTENSIONS: tuple[str, ...] = (
    ".py",
    ".txt",
    ".md",
    ".c",
    ".h",
    ".rs",
    ".go",
    ".js",
    ".ts",
    ".java",
    ".json",
    ".yaml",
    ".toml",
    ".rst",
)
"""File name endings `directory_documents` picks by default."""

_STDLIB_SKIP = frozenset({"site-packages", "lib-dynload", "__pycache__"})
_STDLIB_FORMAT = "stdlib-definitions-v2"  # bump when the corpus' document layout changes
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_DEFINITION_LINE = (b"@", b"def ", b"async ", b"class ")  # how a definition's first line starts


def jsonl_documents(
    paths: str | Path | Iterable[str | Path], *, json_key: str = "text"
) -> Iterator[Document]:
    """One document per non-blank line of each JSONL file, in file then line order.

    Args:
        paths: One JSONL file or several.
        json_key: The key holding each document's text.

    Yields:
        `("<file>:<line>", text encoded as UTF-8)`.

    Raises:
        ValueError: Naming file and line, for a line that is not valid UTF-8 or JSON, is not
            an object, or lacks a string under `json_key`; naming the file if it cannot be
            read.
    """
    for _, _, _, where, text in jsonl_spans(paths, json_key=json_key):
        yield where, text


def jsonl_text(raw: bytes, where: str, json_key: str) -> bytes:
    """The UTF-8 text under `json_key` of one JSONL line `raw` (found at `where`).

    Raises:
        ValueError: Naming `where`, as `jsonl_documents` says.
    """
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: not valid UTF-8 ({exc.reason})") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if json_key not in record:
        raise ValueError(f"{where}: no key {json_key!r}")
    text = record[json_key]
    if not isinstance(text, str):
        raise ValueError(f"{where}: value of {json_key!r} is {type(text).__name__}, not a string")
    return text.encode("utf-8")


def jsonl_spans(
    paths: str | Path | Iterable[str | Path], *, json_key: str = "text"
) -> Iterator[tuple[int, int, int, str, bytes]]:
    """`jsonl_documents` with where each document's line lies in its file.

    Yields:
        `(file index, first byte, byte after the line, "<file>:<line>", text)`.
    """
    if isinstance(paths, str | Path):
        paths = [paths]
    for index, path in enumerate(paths):
        try:
            stream = open(path, "rb")
        except OSError as exc:
            raise ValueError(f"cannot read JSONL file {str(path)!r}: {exc.strerror}") from exc
        with stream:
            position = 0
            for lineno, raw in enumerate(stream, start=1):
                start, position = position, position + len(raw)
                if not raw.strip():
                    continue
                where = f"{path}:{lineno}"
                yield index, start, position, where, jsonl_text(raw, where, json_key)


def _visible_walk(root: Path) -> Iterator[tuple[str, list[str]]]:
    """`os.walk` below `root` without hidden folders and `__pycache__`: (folder, file names)."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        yield folder, files


def directory_documents(
    root: str | Path, *, extensions: Iterable[str] = DEFAULT_EXTENSIONS
) -> Iterator[Document]:
    """One document per matching file under `root`, sorted by relative POSIX path string.

    Hidden folders and files (name starting with ".") and `__pycache__` are skipped.

    Args:
        root: The folder to read.
        extensions: File name endings to include (a leading "." is added if missing).

    Yields:
        `(relative POSIX path, file bytes)`.

    Raises:
        ValueError: If `root` is not a directory or no file matches.
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{str(root)!r} is not a directory")
    endings = tuple(e if e.startswith(".") else f".{e}" for e in extensions)
    if not endings:
        raise ValueError("no file extensions given")
    found: list[str] = []
    for folder, files in _visible_walk(root):
        rel_folder = Path(folder).relative_to(root)
        for name in files:
            if not name.startswith(".") and name.endswith(endings):
                found.append((rel_folder / name).as_posix())
    if not found:
        raise ValueError(f"no file under {str(root)!r} ends with one of {', '.join(endings)}")
    for rel in sorted(found):
        yield rel, (root / rel).read_bytes()


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_layout(root: Path) -> list[tuple[str, list[str]]]:
    """`(document name, relative paths of its .py files)` in document order.

    A top-level package (a folder with `__init__.py`) is one document of all its `.py` files
    in sorted order of their relative POSIX path strings; a top-level module (`<name>.py`)
    is one document alone.
    Folders that are not packages (e.g. `config-3.11-...`), hidden names, `site-packages`,
    `lib-dynload` and `__pycache__` are skipped.
    """
    layout: list[tuple[str, list[str]]] = []
    for entry in os.scandir(root):
        name = entry.name
        if name.startswith(".") or name in _STDLIB_SKIP:
            continue
        if entry.is_dir():
            if not (Path(entry.path) / "__init__.py").is_file():
                continue
            files = [
                (Path(folder).relative_to(root) / f).as_posix()
                for folder, names in _visible_walk(Path(entry.path))
                for f in names
                if f.endswith(".py") and not f.startswith(".")
            ]
            layout.append((name, sorted(files)))
        elif entry.is_file() and name.endswith(".py"):
            layout.append((name[: -len(".py")], [name]))
    layout.sort(key=lambda item: item[0])
    return layout


def _stdlib_files(root: Path) -> list[str]:
    """Relative POSIX paths of every `.py` file of `_stdlib_layout(root)`, sorted as strings."""
    return sorted(rel for _, files in _stdlib_layout(root) for rel in files)


def stdlib_documents() -> Iterator[Document]:
    """The standard library, one document per top-level package or module.

    A package's document is its `.py` files concatenated in sorted relative-path order, each
    prefixed by a line `# file: <path relative to the stdlib folder>`; a module's document
    is its file's bytes alone. Documents come sorted by name. The training corpus is
    `stdlib_corpus_documents`; these package-sized lengths are the simulator's stdlib-like
    mix (`megatron_hdp.sim.distributions.stdlib_like`).

    Yields:
        `(package or module name, text bytes)`.
    """
    root = stdlib_root()
    for name, files in _stdlib_layout(root):
        if len(files) == 1 and files[0] == f"{name}.py":
            yield name, (root / files[0]).read_bytes()
            continue
        parts: list[bytes] = []
        for rel in files:
            parts.append(f"# file: {rel}\n".encode())
            parts.append((root / rel).read_bytes())
        yield name, b"".join(parts)


def definition_pieces(source: bytes) -> list[tuple[int, bytes]]:
    """Cut Python source at its top-level definitions, for documents of code-like lengths.

    A piece starts at each top-level `def`, `async def` or `class` statement (at its first
    decorator line) and runs to the next one; what precedes the first definition (module
    docstring, imports, constants) is a piece of its own. Definitions nested in other
    statements (`if`, `try`, a class body) stay inside their piece. The pieces concatenate
    back to `source` exactly. Source that does not parse (Python 2 test data, deliberate
    syntax errors, null bytes) is one piece; empty source is none.

    Args:
        source: The bytes of one `.py` file.

    Returns:
        `(first line number, bytes)` per piece, in file order; lines are counted like the
        parser does (LF, CRLF and CR each end a line).
    """
    if not source:
        return []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. SyntaxWarning: invalid escape sequence
            tree = ast.parse(source)
    except (SyntaxError, ValueError):  # ValueError: source with null bytes
        return [(1, source)]
    lines = source.splitlines(keepends=True)
    starts = {1}
    for node in tree.body:
        if isinstance(node, _DEFINITIONS):
            starts.add(min([node.lineno, *(d.lineno for d in node.decorator_list)]))
    ordered = sorted(starts)
    if ordered[-1] > len(lines) or any(
        not lines[n - 1].startswith(_DEFINITION_LINE) for n in ordered[1:]
    ):  # the parser counted lines differently from bytes.splitlines: keep the file whole
        return [(1, source)]
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    ends = [*ordered[1:], len(lines) + 1]
    return [(a, source[offsets[a - 1] : offsets[b - 1]]) for a, b in zip(ordered, ends)]


def stdlib_corpus_documents() -> Iterator[Document]:
    """The embedded default corpus: the standard library cut at top-level definitions.

    Every `.py` file of the standard library's top-level packages and modules (the files of
    `stdlib_documents`), in sorted order of their relative POSIX paths, cut by
    `definition_pieces`: one document per top-level function or class (with its
    decorators) and one for the module preamble before the first definition. A file's
    documents concatenate back to the file; empty files give none. Built from the files
    on this machine only, deterministic for a given interpreter installation.

    Yields:
        `("<path relative to the stdlib folder>:<first line>", text bytes)`.
    """
    root = stdlib_root()
    for rel in _stdlib_files(root):
        for line, piece in definition_pieces((root / rel).read_bytes()):
            yield f"{rel}:{line}", piece


def stdlib_fingerprint() -> str:
    """A short hash naming the stdlib corpus, for its cache file name.

    Hashes the corpus layout version, the Python version, and every corpus file's path and
    size.

    Returns:
        16 hex characters; changes when the interpreter, the corpus layout
        (`_STDLIB_FORMAT`) or any corpus file's size changes.
    """
    root = stdlib_root()
    digest = hashlib.sha256()
    digest.update(f"{_STDLIB_FORMAT}\n{sys.implementation.name}\n".encode())
    digest.update(f"{platform.python_version()}\n".encode())
    for rel in _stdlib_files(root):
        digest.update(f"{rel}\0{(root / rel).stat().st_size}\n".encode())
    return digest.hexdigest()[:16]
