"""The preprocessing CLI: JSONL and directory inputs, ByteLevel and a trained BPE, errors."""

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_hdp.data.tokenizers import HFTokenizer
from megatron_hdp.megatron.indexed import open_indexed_dataset
from megatron_hdp.megatron.preprocess import build_parser, main

TEXTS_A = ["hello world", "naïve café ✓", ""]
TEXTS_B = ["def f(x):\n    return x\n"]


def read_tokens(prefix):
    ds = open_indexed_dataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def write_jsonl(path: Path, texts, key="text") -> Path:
    path.write_text(
        "".join(json.dumps({key: t, "meta": i}) + "\n" for i, t in enumerate(texts)),
        encoding="utf-8",
    )
    return path


def listing(folder: Path):
    return sorted(p.name for p in folder.iterdir())


def generated_texts(seed: int, num_docs: int) -> list[str]:
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("etaoinshrdlu") for _ in range(rng.randint(2, 6))) for _ in range(60)
    ]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 30))) for _ in range(num_docs)]


@pytest.fixture
def jsonl_inputs(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    return [write_jsonl(src / "a.jsonl", TEXTS_A), write_jsonl(src / "b.jsonl", TEXTS_B)]


def test_jsonl_byte_level(tmp_path, jsonl_inputs, caplog):
    out = tmp_path / "out"
    out.mkdir()
    caplog.set_level(logging.INFO, logger="megatron_hdp")
    argv = [
        "--input",
        *map(str, jsonl_inputs),
        "--output-prefix",
        str(out / "ds"),
        "--log-interval",
        "2",
    ]
    assert main(argv) == 0
    expected = [list(t.encode("utf-8")) + [256] for t in TEXTS_A + TEXTS_B]
    assert read_tokens(out / "ds") == expected
    assert listing(out) == ["ds.bin", "ds.idx"]
    final = caplog.records[-1].getMessage()
    assert f"wrote 4 documents, {sum(map(len, expected))} tokens" in final
    assert any("2 documents" in r.getMessage() for r in caplog.records)  # --log-interval 2


def test_jsonl_custom_key_without_eod(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", ["abc", "", "d"], key="content")
    assert (
        main(
            [
                "--input",
                str(path),
                "--json-key",
                "content",
                "--output-prefix",
                str(tmp_path / "ds"),
                "--no-append-eod",
            ]
        )
        == 0
    )
    assert read_tokens(tmp_path / "ds") == [[97, 98, 99], [100]]  # the empty document is skipped


def test_directory_byte_level(tmp_path):
    src = tmp_path / "tree"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "m.py").write_bytes(b"import os\n")
    (src / "README.md").write_bytes(b"# readme\n")
    (src / "blob.bin").write_bytes(b"\x00\x01")
    (src / ".git").mkdir()
    (src / ".git" / "config.toml").write_bytes(b"hidden")
    assert main(["--input", str(src), "--output-prefix", str(tmp_path / "ds")]) == 0
    assert read_tokens(tmp_path / "ds") == [
        list(b"# readme\n") + [256],
        list(b"import os\n") + [256],
    ]
    assert (
        main(["--input", str(src), "--output-prefix", str(tmp_path / "py"), "--extensions", ".py"])
        == 0
    )
    assert read_tokens(tmp_path / "py") == [list(b"import os\n") + [256]]


@pytest.mark.parametrize("kind", ["jsonl", "directory"])
def test_train_bpe_then_tokenize(tmp_path, kind):
    texts = generated_texts(0, 120)
    if kind == "jsonl":
        source = write_jsonl(tmp_path / "train.jsonl", texts)
    else:
        source = tmp_path / "docs"
        source.mkdir()
        for i, text in enumerate(texts):
            (source / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
    model = tmp_path / "tokenizer.json"
    argv = [
        "--input",
        str(source),
        "--output-prefix",
        str(tmp_path / "ds"),
        "--train-bpe-vocab-size",
        "300",
        "--tokenizer-model",
        str(model),
    ]
    assert main(argv) == 0
    tok = HFTokenizer(model)
    assert tok.vocab_size == 300
    docs = read_tokens(tmp_path / "ds")
    assert len(docs) == len(texts)
    for ids, text in zip(docs, texts):
        assert ids[-1] == tok.eod and tok.eod not in ids[:-1]
        assert tok.decode(ids) == text
    assert sum(map(len, docs)) < 0.6 * sum(len(t) + 1 for t in texts)  # BPE merges did happen
    assert open_indexed_dataset(tmp_path / "ds").index.dtype.__name__ == "uint16"

    # the saved tokenizer is then usable directly
    again = tmp_path / "again"
    assert (
        main(
            [
                "--input",
                str(source),
                "--output-prefix",
                str(again),
                "--tokenizer-type",
                "HuggingFaceTokenizer",
                "--tokenizer-model",
                str(model),
            ]
        )
        == 0
    )
    assert read_tokens(again) == docs


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    flags = [a.option_strings[-1] for a in build_parser()._actions]
    assert len(flags) == 11
    for flag in flags:
        assert flag in out


def run_failing(argv, capsys, code):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    if code == 2:  # argparse: usage, then one error line
        assert exc.value.code == 2
        return err.strip().splitlines()[-1]
    assert isinstance(exc.value.code, str) and "\n" not in exc.value.code  # exit status 1
    return exc.value.code


def test_missing_input(tmp_path, capsys):
    msg = run_failing(
        ["--input", str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "ds")],
        capsys,
        2,
    )
    assert "nope.jsonl" in msg and "does not exist" in msg
    assert listing(tmp_path) == []


@pytest.mark.parametrize("train", [False, True])
def test_bad_jsonl_line_leaves_nothing(tmp_path, capsys, train):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "fine too"}\n{"txt": "oops"}\n', encoding="utf-8")
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "ds")]
    if train:
        argv += ["--train-bpe-vocab-size", "300", "--tokenizer-model", str(tmp_path / "tok.json")]
    msg = run_failing(argv, capsys, 1)
    assert f"{src}:3" in msg and "no key 'text'" in msg
    assert listing(tmp_path) == ["in.jsonl"]


def test_bad_input_keeps_previous_output(tmp_path, jsonl_inputs, capsys):
    prefix = tmp_path / "ds"
    assert main(["--input", str(jsonl_inputs[0]), "--output-prefix", str(prefix)]) == 0
    before = read_tokens(prefix)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\nnot json\n')
    msg = run_failing(
        ["--input", str(jsonl_inputs[0]), str(bad), "--output-prefix", str(prefix)], capsys, 1
    )
    assert f"{bad}:2" in msg
    assert read_tokens(prefix) == before
    assert listing(tmp_path) == ["bad.jsonl", "ds.bin", "ds.idx", "src"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--tokenizer-type", "GPT2BPETokenizer"], "invalid choice: 'GPT2BPETokenizer'"),
        (["--tokenizer-type", "HuggingFaceTokenizer"], "needs --tokenizer-model"),
        (
            ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "MISSING/tok.json"],
            "tok.json",
        ),
        (["--train-bpe-vocab-size", "300"], "needs --tokenizer-model"),
        (["--train-bpe-vocab-size", "100", "--tokenizer-model", "t.json"], ">= 258"),
        (
            [
                "--train-bpe-vocab-size",
                "300",
                "--tokenizer-type",
                "ByteLevel",
                "--tokenizer-model",
                "t.json",
            ],
            "ByteLevel",
        ),
        (["--log-interval", "0"], "--log-interval"),
    ],
)
def test_bad_tokenizer_flags(tmp_path, jsonl_inputs, capsys, extra, needle):
    argv = ["--input", str(jsonl_inputs[0]), "--output-prefix", str(tmp_path / "ds"), *extra]
    msg = run_failing(argv, capsys, 2)
    assert needle in msg
    assert listing(tmp_path) == ["src"]


def test_directory_must_be_the_only_input(tmp_path, jsonl_inputs, capsys):
    msg = run_failing(
        [
            "--input",
            str(tmp_path / "src"),
            str(jsonl_inputs[0]),
            "--output-prefix",
            str(tmp_path / "ds"),
        ],
        capsys,
        2,
    )
    assert "directory" in msg
    msg = run_failing(
        [
            "--input",
            str(tmp_path / "src"),
            "--output-prefix",
            str(tmp_path / "ds"),
            "--extensions",
            ".go",
        ],
        capsys,
        1,
    )
    assert "no file" in msg
    assert listing(tmp_path) == ["src"]


def test_output_folder_must_exist(tmp_path, jsonl_inputs, capsys):
    msg = run_failing(
        ["--input", str(jsonl_inputs[0]), "--output-prefix", str(tmp_path / "no" / "ds")], capsys, 2
    )
    assert "--output-prefix" in msg


def test_module_entry_point_one_line_error(tmp_path):
    """`python -m` runs main; a data error is exactly one stderr line and exit status 1."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2]\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # a user's default
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_hdp.megatron.preprocess",
            "--input",
            str(bad),
            "--output-prefix",
            str(tmp_path / "ds"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 1
    prog = "python -m megatron_hdp.megatron.preprocess"
    assert proc.stderr.strip().splitlines() == [
        f"{prog}: error: {bad}:1: expected a JSON object, got list"
    ]
    assert listing(tmp_path) == ["bad.jsonl"]
