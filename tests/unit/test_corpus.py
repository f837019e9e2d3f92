"""Document sources: JSONL lines, directory files, the embedded stdlib corpus."""

import importlib
import inspect
import json
import os
import re
import statistics
import sysconfig
from pathlib import Path

import pytest

from megatron_hdp.data import corpus
from megatron_hdp.data.corpus import (
    definition_pieces,
    directory_documents,
    jsonl_documents,
    stdlib_corpus_documents,
    stdlib_documents,
    stdlib_fingerprint,
)

# ---------------------------------------------------------------- JSONL


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_one_document_per_line_across_files(tmp_path):
    a = write_lines(
        tmp_path / "a.jsonl",
        [json.dumps({"text": "first", "id": 1}), "", "   ", json.dumps({"text": "é ✓"})],
    )
    b = write_lines(
        tmp_path / "b.jsonl", [json.dumps({"text": ""}), json.dumps({"text": "last\nline"})]
    )
    docs = list(jsonl_documents([a, str(b)]))
    assert docs == [
        (f"{a}:1", b"first"),
        (f"{a}:4", "é ✓".encode()),
        (f"{b}:1", b""),
        (f"{b}:2", b"last\nline"),
    ]


def test_jsonl_single_path_and_custom_key(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [json.dumps({"content": "x", "text": 3})])
    assert list(jsonl_documents(a, json_key="content")) == [(f"{a}:1", b"x")]


@pytest.mark.parametrize(
    ("bad_line", "why"),
    [
        ('{"text": "unterminated', "not valid JSON"),
        ('["text"]', "expected a JSON object"),
        ('"just a string"', "expected a JSON object"),
        ('{"body": "no text key"}', "no key 'text'"),
        ('{"text": 42}', "not a string"),
        ('{"text": null}', "not a string"),
    ],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path, bad_line, why):
    path = write_lines(
        tmp_path / "data.jsonl",
        [json.dumps({"text": "ok"}), "", bad_line, json.dumps({"text": "never"})],
    )
    docs = jsonl_documents(path)
    assert next(docs) == (f"{path}:1", b"ok")
    with pytest.raises(ValueError, match=f"{path}:3: .*{why}"):
        next(docs)


def test_jsonl_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=f"{path}:2: not valid UTF-8"):
        list(jsonl_documents(path))


def test_jsonl_missing_file_names_it(tmp_path):
    with pytest.raises(ValueError, match="missing.jsonl"):
        list(jsonl_documents(tmp_path / "missing.jsonl"))


# ---------------------------------------------------------------- directories


def make_tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def test_directory_documents_sorted_and_filtered(tmp_path):
    make_tree(
        tmp_path,
        {
            "z.py": b"z",
            "a/b.md": b"# b",
            "a/c/d.rs": b"fn main() {}",
            "a.txt": b"text",
            "image.png": b"\x89PNG",
            "notes": b"no extension",
            ".hidden/x.py": b"hidden folder",
            ".secret.py": b"hidden file",
            "pkg/__pycache__/m.py": b"cache",
            "pkg/m.py": b"m",
        },
    )
    docs = list(directory_documents(tmp_path))
    assert docs == [  # plain string order of the POSIX paths: "." sorts before "/"
        ("a.txt", b"text"),
        ("a/b.md", b"# b"),
        ("a/c/d.rs", b"fn main() {}"),
        ("pkg/m.py", b"m"),
        ("z.py", b"z"),
    ]
    assert [n for n, _ in directory_documents(tmp_path, extensions=["py", ".png"])] == [
        "image.png",
        "pkg/m.py",
        "z.py",
    ]


def test_directory_errors(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        list(directory_documents(tmp_path / "missing"))
    (tmp_path / "file.py").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        list(directory_documents(tmp_path / "file.py"))
    with pytest.raises(ValueError, match="no file"):
        list(directory_documents(tmp_path, extensions=(".go",)))


# ---------------------------------------------------------------- stdlib corpus


def independent_stdlib_listing(root: Path) -> dict[str, list[Path]]:
    """Top-level name -> its .py files in concatenation order, computed without corpus.py."""
    result = {}
    for name in os.listdir(root):
        path = root / name
        if name.startswith(".") or name in ("site-packages", "lib-dynload", "__pycache__"):
            continue
        if path.is_file() and name.endswith(".py"):
            result[name[:-3]] = [path]
        elif path.is_dir() and (path / "__init__.py").exists():
            files = [
                f
                for f in path.rglob("*.py")
                if "__pycache__" not in f.relative_to(root).parts
                and not any(part.startswith(".") for part in f.relative_to(root).parts)
            ]
            result[name] = sorted(files, key=lambda f: f.relative_to(root).as_posix())
    return result


@pytest.fixture(scope="module")
def stdlib_docs():
    return list(stdlib_documents())


@pytest.fixture(scope="module")
def stdlib_listing():
    return independent_stdlib_listing(Path(sysconfig.get_paths()["stdlib"]))


def test_stdlib_one_document_per_top_level_name(stdlib_docs, stdlib_listing):
    names = [name for name, _ in stdlib_docs]
    assert names == sorted(stdlib_listing)
    assert {"os", "json", "email", "asyncio", "test"} <= set(names)


def test_stdlib_documents_are_the_files_concatenated(stdlib_docs, stdlib_listing):
    root = Path(sysconfig.get_paths()["stdlib"])
    by_name = dict(stdlib_docs)
    for name, files in stdlib_listing.items():
        if files == [root / f"{name}.py"]:
            expected = files[0].read_bytes()
        else:
            expected = b"".join(
                f"# file: {f.relative_to(root).as_posix()}\n".encode() + f.read_bytes()
                for f in files
            )
        assert by_name[name] == expected, name


def test_stdlib_package_order_is_sorted_relative_paths(stdlib_docs):
    email = dict(stdlib_docs)["email"]
    headers = [
        line[len(b"# file: ") :].decode()
        for line in email.splitlines()
        if line.startswith(b"# file: email/")
    ]
    assert headers[0] == "email/__init__.py"
    assert "email/mime/text.py" in headers
    assert headers == sorted(headers)


def test_stdlib_lengths_are_heavy_tailed(stdlib_docs):
    lengths = [len(text) for _, text in stdlib_docs]
    assert max(lengths) > 100 * statistics.median(lengths)
    assert dict(stdlib_docs)["test"] == max((t for _, t in stdlib_docs), key=len)


def test_stdlib_fingerprint_is_stable_and_short():
    fp = stdlib_fingerprint()
    assert fp == stdlib_fingerprint()
    assert len(fp) == 16 and int(fp, 16) >= 0


def test_fake_stdlib_layout_and_fingerprint(tmp_path, monkeypatch):
    make_tree(
        tmp_path,
        {
            "zmod.py": b"z = 1\n",
            "amod.py": b"a = 1\ndef f():\n    pass\n",
            "pkg/__init__.py": b"init\n",
            "pkg/sub/x.py": b"x\n",
            "pkg/b.py": b"b\n",
            "pkg/empty.py": b"",
            "pkg/data.txt": b"not python",
            "pkg/__pycache__/b.py": b"cache",
            "notapkg/y.py": b"y\n",
            "site-packages/sp/__init__.py": b"",
            ".hidden/__init__.py": b"",
            "README.txt": b"text",
        },
    )
    monkeypatch.setattr(corpus, "stdlib_root", lambda: tmp_path)
    assert list(stdlib_documents()) == [
        ("amod", b"a = 1\ndef f():\n    pass\n"),
        (
            "pkg",
            b"# file: pkg/__init__.py\ninit\n# file: pkg/b.py\nb\n# file: pkg/empty.py\n"
            b"# file: pkg/sub/x.py\nx\n",
        ),
        ("zmod", b"z = 1\n"),
    ]
    # The training corpus: the same files, sorted by path, cut at top-level definitions;
    # the empty file gives no document.
    assert list(stdlib_corpus_documents()) == [
        ("amod.py:1", b"a = 1\n"),
        ("amod.py:2", b"def f():\n    pass\n"),
        ("pkg/__init__.py:1", b"init\n"),
        ("pkg/b.py:1", b"b\n"),
        ("pkg/sub/x.py:1", b"x\n"),
        ("zmod.py:1", b"z = 1\n"),
    ]
    before = stdlib_fingerprint()
    (tmp_path / "notapkg/y.py").write_bytes(b"changed, not in the corpus")
    (tmp_path / "pkg/b.py").write_bytes(b"c\n")  # same size: same fingerprint (sizes only)
    assert stdlib_fingerprint() == before
    (tmp_path / "pkg/b.py").write_bytes(b"longer\n")
    assert stdlib_fingerprint() != before
    after = stdlib_fingerprint()
    monkeypatch.setattr(corpus, "_STDLIB_FORMAT", "stdlib-documents-v1")  # the old layout
    assert stdlib_fingerprint() != after  # so a cache of the old layout is never reused


# ------------------------------------------------- training corpus: cut at definitions


def test_definition_pieces_cut_at_top_level_definitions():
    source = (
        b'"""Doc."""\n'
        b"import os\n"
        b"\n"
        b"# a comment stays with the piece before\n"
        b"@decorator(\n"
        b"    1)\n"
        b"@other\n"
        b"def f():\n"
        b"    def nested():\n"
        b"        pass\n"
        b'    return """\n'
        b"def in_a_string(): pass\n"
        b'"""\n'
        b"if os.name:\n"
        b"    def conditional(): pass\n"
        b"async def g():\n"
        b"    await h()\n"
        b"class C(Base):\n"
        b"    def method(self): pass\n"
        b"X = 1\n"
    )
    pieces = definition_pieces(source)
    assert [line for line, _ in pieces] == [1, 5, 16, 18]
    assert b"".join(text for _, text in pieces) == source
    assert pieces[0][1].endswith(b"# a comment stays with the piece before\n")
    assert pieces[1][1].startswith(b"@decorator(") and b"in_a_string" in pieces[1][1]
    assert pieces[1][1].endswith(b"    def conditional(): pass\n")
    assert pieces[3][1] == b"class C(Base):\n    def method(self): pass\nX = 1\n"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (b"", []),
        (b"def f(): pass\n", [(1, b"def f(): pass\n")]),  # no preamble
        (b"x = 1", [(1, b"x = 1")]),  # no final newline
        (b"print 'py2'\ndef f(): pass\n", [(1, b"print 'py2'\ndef f(): pass\n")]),  # no parse
        (b"a = 1\x00\ndef f(): pass\n", [(1, b"a = 1\x00\ndef f(): pass\n")]),  # null byte
        (b"a = 1\r\ndef f():\r\n  pass\r\n", [(1, b"a = 1\r\n"), (2, b"def f():\r\n  pass\r\n")]),
        (b"a = 1\rdef f():\r  pass\r", [(1, b"a = 1\r"), (2, b"def f():\r  pass\r")]),
        (b"s = '\\d'\nclass C: pass\n", [(1, b"s = '\\d'\n"), (2, b"class C: pass\n")]),
    ],
)
def test_definition_pieces_edge_cases(source, expected, recwarn):
    assert definition_pieces(source) == expected
    assert not [w for w in recwarn if issubclass(w.category, SyntaxWarning | DeprecationWarning)]


DEFINITION_LINE = re.compile(rb"(@|def |async def |class )")
DEMO_CAPACITY, DEMO_SEQ_LENGTH = 2048, 4096  # scripts/run_cpu.sh: --hdp-capacity, --seq-length


@pytest.fixture(scope="module")
def corpus_docs():
    return list(stdlib_corpus_documents())


@pytest.fixture(scope="module")
def corpus_files(stdlib_listing):
    """Relative path -> bytes of every non-empty corpus file, found without corpus.py."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(f.relative_to(root).as_posix() for fs in stdlib_listing.values() for f in fs)
    return {rel: data for rel in paths if (data := (root / rel).read_bytes())}


def test_corpus_documents_are_the_files_cut_in_order(corpus_docs, corpus_files):
    by_file: dict[str, list[tuple[int, bytes]]] = {}
    for name, text in corpus_docs:
        rel, line = name.rsplit(":", 1)
        by_file.setdefault(rel, []).append((int(line), text))
    assert list(by_file) == list(corpus_files)  # every non-empty file, in sorted path order
    root = Path(sysconfig.get_paths()["stdlib"])
    for rel, pieces in by_file.items():
        data = corpus_files[rel]
        assert b"".join(text for _, text in pieces) == data, rel
        assert sum(len(text) for _, text in pieces) == os.stat(root / rel).st_size, rel
        line_starts = [0]
        for line in data.splitlines(keepends=True):
            line_starts.append(line_starts[-1] + len(line))
        offset = 0
        for k, (line, text) in enumerate(pieces):
            assert text, (rel, line)
            assert line_starts[line - 1] == offset, (rel, line)  # it starts at its line
            assert (line == 1) == (k == 0), (rel, line)
            if k > 0:  # every cut is at a definition (or its first decorator)
                assert DEFINITION_LINE.match(text), (rel, line)
            offset += len(text)


@pytest.mark.parametrize(
    "module", ["textwrap", "shlex", "json.decoder", "string", "graphlib", "dataclasses"]
)
def test_corpus_cuts_at_every_top_level_function_and_class(module, corpus_docs):
    """Reference: where `inspect` says the module's own functions and classes begin."""
    mod = importlib.import_module(module)
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = Path(mod.__file__).relative_to(root).as_posix()
    starts = {
        inspect.getsourcelines(obj)[1]
        for obj in vars(mod).values()
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == mod.__name__
    }
    lines = [int(name.rsplit(":", 1)[1]) for name, _ in corpus_docs if name.startswith(rel + ":")]
    assert len(starts) >= 3
    assert lines == [1, *sorted(starts)]  # the preamble, then one per definition


def test_corpus_lengths_are_heavy_tailed(corpus_docs, corpus_files):
    """Most documents fit one demo rank; a long tail needs rings (and is cut at --seq-length).

    The tail is checked against the files themselves: the largest file without any line
    starting a top-level definition (a regex, not the parser) is one document, longer than
    four demo sequences.
    """
    lengths = sorted(len(text) for _, text in corpus_docs)
    assert len(lengths) > 5 * len(corpus_files)
    median = statistics.median(lengths)
    assert median < DEMO_CAPACITY  # packed: most documents fit one rank
    assert sum(n > DEMO_SEQ_LENGTH for n in lengths) > 100  # ringed: a long tail
    assert lengths[-1] > 4 * DEMO_SEQ_LENGTH and lengths[-1] > 500 * median
    whole = [
        len(data)
        for data in corpus_files.values()
        if not any(DEFINITION_LINE.match(line) for line in data.splitlines())
    ]
    assert max(whole) > 4 * DEMO_SEQ_LENGTH
    assert max(whole) in lengths[-5:]
