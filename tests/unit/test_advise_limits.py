"""The advisor's inputs bounded before any work (reliability audit 2026-11-27, A05, A12b,
A13, A21-A23): one line, exit 2, naming the value, the estimate and the limit; --out
checked for writing before anything is simulated; the estimate logged before long work."""

import logging
import os
import resource
import subprocess
import sys
import time

import pytest

import megatron_hdp.advise.__main__ as advise_main
from megatron_hdp.advise.__main__ import main
from tests.unit.scripts_loader import REPO

AM = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "1024", "--hdp-capacity", "512", "--no-progress-bar",
]  # fmt: skip


def lengths_file(tmp_path, text="100\n3000\n700\n"):
    path = tmp_path / "lengths.txt"
    path.write_text(text)
    return str(path)


def advise_limited(tmp_path, *flags, memory_gb=3, timeout=90):
    """The advisor in a subprocess under `ulimit -v memory_gb` (old behaviour fails fast)."""

    def limit():
        cap = memory_gb * 2**30
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env["OPENBLAS_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "megatron_hdp.advise", "--out", str(tmp_path / "out"), *flags]
    t0 = time.perf_counter()
    out = subprocess.run(
        [*cmd, *AM], capture_output=True, text=True, timeout=timeout, preexec_fn=limit, env=env
    )
    return out.returncode, out.stderr, time.perf_counter() - t0


def one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("python -m megatron_hdp.advise: error")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a05_gpus_whose_batch_cannot_fit_is_refused_at_once(tmp_path):
    """--gpus 10000000: a default batch of 10^10 tokens; was silent for minutes."""
    rc, err, seconds = advise_limited(
        tmp_path, "--gpus", "10000000", "--lengths-file", lengths_file(tmp_path)
    )
    line = one_line(err)
    assert rc == 2 and "--gpus 10000000" in line and "GB" in line, err
    assert "more than the" in line and "ulimit -v" in line  # the estimate and the limit
    assert seconds < 60 and not (tmp_path / "out").exists()


def test_a12b_a_length_cut_into_a_billion_pieces_is_refused_without_allocating(tmp_path):
    """10^12 tokens at --seq-length 1024: 976,562,500 pieces (was OOM-killed at 22 GB)."""
    path = lengths_file(tmp_path, "100\n1000000000000\n")
    rc, err, seconds = advise_limited(tmp_path, "--gpus", "8", "--lengths-file", path, memory_gb=2)
    line = one_line(err)
    assert rc == 2, err
    assert f"--lengths-file {path}: 976,562,501 pieces of --seq-length 1024" in line
    assert "1,000,000,000,000 tokens" in line and "GB of memory" in line
    assert seconds < 60 and not (tmp_path / "out").exists()


def test_a13_a_23_digit_length_is_refused_in_one_line(tmp_path, capsys):
    """Was `OverflowError: Python int too large to convert to C long` (lengths.py:50)."""
    path = lengths_file(tmp_path, "100\n99999999999999999999999\n")
    argv = ["--gpus", "8", "--lengths-file", path, "--out", str(tmp_path / "out"), *AM]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path} line 2: 99999999999999999999999 tokens" in err, err
    assert "2^40" in err


@pytest.mark.parametrize(
    "value, shown",
    [("1099511627777", "1099511627777 tokens"), ("9" * 5000, "(5000 digits)")],  # 2^40 + 1
)
def test_a_length_above_2_to_the_40_is_refused_naming_the_line(tmp_path, value, shown):
    """Read only (the old reader accepted 2^40 + 1, and the advisor then cut it)."""
    from megatron_hdp.advise.lengths import read_lengths_file

    path = lengths_file(tmp_path, f"100\n{value}\n")
    with pytest.raises(ValueError, match=r"line 2: .*2\^40") as err:
        read_lengths_file(path)
    assert shown in str(err.value)
    path = lengths_file(tmp_path, f"1\n{2**40}\n0001\n")  # 2^40 itself is read
    assert read_lengths_file(path).tolist() == [1, 2**40, 1]


@pytest.fixture
def no_simulation(monkeypatch):
    """Fail the test if the advisor gets as far as simulating."""

    def simulate(*args, **kwargs):
        raise AssertionError("simulated before checking --out")

    monkeypatch.setattr(advise_main, "simulate_job", simulate)


@pytest.mark.parametrize(
    "out, flags, named",
    [
        ("FILE/sub", [], "cannot write there (Not a directory)"),  # A21: a file on the way
        ("/proc/adv", [], "cannot write there"),  # A23
        ("/proc", ["--overwrite"], "cannot write there"),  # A22: a read-only folder
        ("JSONDIR", ["--overwrite"], "advise.json there is a folder"),
    ],
)
def test_a21_a23_out_not_writable_is_refused_before_simulating(
    tmp_path, capsys, no_simulation, out, flags, named
):
    (tmp_path / "file").write_text("x")
    (tmp_path / "jsondir" / "advise.json").mkdir(parents=True)
    out = out.replace("FILE", str(tmp_path / "file")).replace("JSONDIR", str(tmp_path / "jsondir"))
    argv = ["--gpus", "8", "--lengths-file", lengths_file(tmp_path), "--out", out, *flags, *AM]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {out}: " in err and named in err, err
    assert (tmp_path / "file").read_text() == "x"


def test_out_probe_leaves_nothing_behind(tmp_path, capsys, monkeypatch, no_simulation):
    """A refusal after the --out check (here: the memory budget) leaves no folder behind."""
    import megatron_hdp.advise.budget as budget

    monkeypatch.setattr(budget, "available_memory", lambda: (1e9, "a test's 1 GB"))
    out = tmp_path / "new" / "deeper"
    path = lengths_file(tmp_path, "100\n1000000000000\n")
    assert main(["--gpus", "8", "--lengths-file", path, "--out", str(out), *AM]) == 2
    err = capsys.readouterr().err
    assert "976,562,501 pieces" in err and "more than the 0.8 GB" in err, err
    assert not (tmp_path / "new").exists()


def test_the_estimate_is_logged_before_the_batches_are_read(tmp_path, monkeypatch, caplog):
    """Progress from the first second, also with --no-progress-bar."""

    def load(*args, **kwargs):
        raise AssertionError("stop")

    monkeypatch.setattr(advise_main, "load_batches", load)
    argv = ["--gpus", "64", "--lengths-file", lengths_file(tmp_path), "--out", str(tmp_path / "o")]
    with caplog.at_level(logging.INFO, logger="megatron_hdp.advise"), pytest.raises(AssertionError):
        main([*argv, *AM])
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("simulating 3 batches x 6 systems on 64 GPUs (a pool of 64 ranks")
    assert "by the estimate about" in line and "GB of memory and" in line


def test_an_existing_output_this_user_cannot_write_is_refused(
    tmp_path, capsys, monkeypatch, no_simulation
):
    """--overwrite over an advise.json the user may not replace (root passes chmod, so the
    permission check is what is stubbed)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "advise.json").write_text("{}")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and p != out / "advise.json")
    argv = ["--gpus", "8", "--lengths-file", lengths_file(tmp_path), "--out", str(out)]
    assert main([*argv, "--overwrite", *AM]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "advise.json there is not writable" in err, err
    assert (out / "advise.json").read_text() == "{}"
