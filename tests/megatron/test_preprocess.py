"""The preprocessing CLI: JSONL and directory inputs, ByteLevel and a trained BPE, errors."""

import ctypes
import errno
import json
import logging
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_hdp.data.indexed import open_indexed_dataset
from megatron_hdp.data.preprocess import build_parser, main
from megatron_hdp.data.tokenizers import HFTokenizer

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
            "megatron_hdp.data.preprocess",
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
    prog = "python -m megatron_hdp.data.preprocess"
    assert proc.stderr.strip().splitlines() == [
        f"{prog}: error: {bad}:1: expected a JSON object, got list"
    ]
    assert listing(tmp_path) == ["bad.jsonl"]


# ------------------------------------------- failures through the real CLI leave nothing

PROG = "python -m megatron_hdp.data.preprocess"
REPO = Path(__file__).resolve().parents[2]
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, PR_CAPBSET_DROP = 1, 2, 24


def cli(argv, **kwargs):
    """`python -m megatron_hdp.data.preprocess ARGV` in a fresh process, no progress logs."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    command = [sys.executable, "-m", "megatron_hdp.data.preprocess", *map(str, argv)]
    command += ["--log-interval", "1000000"]
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
        **kwargs,
    )


def run_cli(argv, **kwargs):
    proc = cli(argv, **kwargs)
    _, err = proc.communicate(timeout=180)
    return proc.returncode, err


def snapshot(folder: Path):
    """Every file below `folder` (hidden ones included) with its bytes."""
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


@pytest.fixture
def previous(tmp_path):
    """An older dataset (and tokenizer) at the output paths, which a failed run must keep."""
    out = tmp_path / "out"
    out.mkdir()
    src = write_jsonl(tmp_path / "old.jsonl", generated_texts(7, 40))
    argv = ["--input", str(src), "--output-prefix", str(out / "ds")]
    argv += ["--train-bpe-vocab-size", "280", "--tokenizer-model", str(out / "tok.json")]
    assert main(argv) == 0
    assert listing(out) == ["ds.bin", "ds.idx", "tok.json"]
    return out


def limit_file_size(limit):
    """preexec_fn: files cannot grow past `limit` bytes, and writing past it fails (EFBIG)
    instead of killing the process: what a full disk looks like to the writer."""

    def preexec():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    return preexec


@pytest.mark.parametrize("fails", ["ds.bin", "ds.idx", "tok.json"])
def test_full_disk_exits_with_one_line_and_leaves_nothing(tmp_path, previous, fails):
    limit = 64 * 1024
    if fails == "ds.bin":  # 200 documents of 1000 bytes: 400 kB of uint16 tokens
        texts = ["x" * 1000] * 200
    elif fails == "ds.idx":  # 6000 one-token documents: 12 kB of tokens, a 120 kB index
        texts = [""] * 6000
    else:  # a BPE tokenizer.json is about 8 kB
        texts, limit = generated_texts(1, 300), 2048
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    argv = ["--input", src, "--output-prefix", previous / "ds"]
    if fails == "tok.json":
        argv += ["--train-bpe-vocab-size", "300", "--tokenizer-model", previous / "tok.json"]
    before = snapshot(previous)
    code, err = run_cli(argv, preexec_fn=limit_file_size(limit))
    assert code == 1, err
    assert err.strip().splitlines() == [
        f"{PROG}: error: cannot write {str(previous / fails)!r}: File too large"
    ]
    assert snapshot(previous) == before  # old files byte-identical, no temporary left


def drop_root_file_access():
    """preexec_fn: root loses the capabilities that let it write into a 0o555 folder."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.fixture
def read_only(tmp_path):
    """A folder holding an older file, that the CLI's process cannot write into."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    (folder / "keep.txt").write_text("older file")
    folder.chmod(0o555)
    probe = [sys.executable, "-c", f"open({str(folder / 'probe')!r}, 'x')"]
    try:
        writable = subprocess.run(probe, preexec_fn=drop_root_file_access).returncode == 0
    except OSError as exc:  # no CAP_SETPCAP to drop capabilities with
        pytest.skip(f"cannot make a folder unwritable here: {exc}")
    if writable:
        pytest.skip("cannot make a folder unwritable here")
    yield folder
    folder.chmod(0o755)


@pytest.mark.parametrize("unwritable", ["dataset", "tokenizer"])
def test_unwritable_folder_exits_with_one_line_and_leaves_nothing(
    tmp_path, jsonl_inputs, read_only, unwritable
):
    out = tmp_path / "out"
    out.mkdir()
    if unwritable == "dataset":
        argv = ["--input", jsonl_inputs[0], "--output-prefix", read_only / "ds"]
        target = read_only / "ds.bin"
    else:
        src = write_jsonl(tmp_path / "train.jsonl", generated_texts(2, 60))
        argv = ["--input", src, "--output-prefix", out / "ds", "--train-bpe-vocab-size", "300"]
        argv += ["--tokenizer-model", read_only / "tok.json"]
        target = read_only / "tok.json"
    code, err = run_cli(argv, preexec_fn=drop_root_file_access)
    assert code == 1, err
    assert err.strip().splitlines() == [
        f"{PROG}: error: cannot write {str(target)!r}: Permission denied"
    ]
    assert listing(read_only) == ["keep.txt"] and listing(out) == []


def test_bad_line_mid_way_exits_with_one_line_and_leaves_nothing(tmp_path, previous):
    src = write_jsonl(tmp_path / "in.jsonl", generated_texts(3, 3000))
    with src.open("a") as stream:
        stream.write('{"text": "cut off\n{"text": "after"}\n')
    before = snapshot(previous)
    code, err = run_cli(["--input", src, "--output-prefix", previous / "ds"])
    assert code == 1
    assert err.strip().splitlines() == [
        f"{PROG}: error: {src}:3001: not valid JSON (Invalid control character at)"
    ]
    assert snapshot(previous) == before


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_exits_with_one_line_and_leaves_nothing(tmp_path, previous, signum):
    """Interrupted while the temporary .bin is half written: the input is a pipe that stalls."""
    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    before = snapshot(previous)
    # a shell without job control starts background jobs with SIGINT ignored: undo that
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = cli(["--input", fifo, "--output-prefix", previous / "ds"], preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 120
        while True:  # wait until the CLI opens the pipe: its temporary .bin exists by then
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            try:
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as exc:
                assert exc.errno == errno.ENXIO  # no reader yet
                time.sleep(0.05)
        os.write(writer, b'{"text": "first document"}\n' * 100)
        assert [p.name for p in previous.glob(".ds.*.tmp.bin")]  # mid-write
        time.sleep(0.5)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
        os.close(writer)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum
    outputs = ", ".join(str(previous / f"ds.{ext}") for ext in ("bin", "idx"))
    name = signal.Signals(signum).name
    assert err.strip().splitlines() == [
        f"{PROG}: interrupted by {name}; {outputs} left as they were"
    ]
    assert snapshot(previous) == before
