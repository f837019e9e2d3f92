"""Document sources for preprocessing (pure layer).

Every source is an iterator of `(name, text)` pairs, `text` being the document's raw bytes
(UTF-8 for JSONL), so byte-level tokenization sees exactly what is on disk:

- `jsonl_documents`: one document per line of JSONL files (Megatron's `--json-keys` format).
- `directory_documents`: one document per text/code file under a folder.
- `stdlib_documents`: the embedded default corpus, the running interpreter's standard
  library, one document per top-level package or module. Its lengths are heavy-tailed
  (a one-line module next to the multi-megabyte `test` package), the mix HDP is built for.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
import sysconfig
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
_STDLIB_FORMAT = "stdlib-documents-v1"  # bump when the document layout changes


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
    if isinstance(paths, str | Path):
        paths = [paths]
    for path in paths:
        try:
            stream = open(path, "rb")
        except OSError as exc:
            raise ValueError(f"cannot read JSONL file {str(path)!r}: {exc.strerror}") from exc
        with stream:
            for lineno, raw in enumerate(stream, start=1):
                if not raw.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as exc:
                    raise ValueError(f"{where}: not valid UTF-8 ({exc.reason})") from exc
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{where}: not valid JSON ({exc.msg})") from exc
                if not isinstance(record, dict):
                    raise ValueError(
                        f"{where}: expected a JSON object, got {type(record).__name__}"
                    )
                if json_key not in record:
                    raise ValueError(f"{where}: no key {json_key!r}")
                text = record[json_key]
                if not isinstance(text, str):
                    raise ValueError(
                        f"{where}: value of {json_key!r} is {type(text).__name__}, not a string"
                    )
                yield where, text.encode("utf-8")


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


def stdlib_documents() -> Iterator[Document]:
    """The embedded default corpus: the standard library, one document per top-level name.

    A package's document is its `.py` files concatenated in sorted relative-path order, each
    prefixed by a line `# file: <path relative to the stdlib folder>`; a module's document
    is its file's bytes alone. Documents come sorted by name.

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


def stdlib_fingerprint() -> str:
    """A short hash naming the stdlib corpus: Python version plus every file's path and size.

    Returns:
        16 hex characters; changes when the interpreter or any corpus file's size changes.
    """
    root = stdlib_root()
    digest = hashlib.sha256()
    digest.update(f"{_STDLIB_FORMAT}\n{sys.implementation.name}\n".encode())
    digest.update(f"{platform.python_version()}\n".encode())
    entries = sorted(
        (rel, (root / rel).stat().st_size) for _, files in _stdlib_layout(root) for rel in files
    )
    for rel, size in entries:
        digest.update(f"{rel}\0{size}\n".encode())
    return digest.hexdigest()[:16]
