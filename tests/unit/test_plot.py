"""`python -m megatron_hdp.plot RUN_DIR`: PNGs of a recorded run, clear failures, lazy import.

The run folder here is written the way the training job writes it: metrics records, and a
timeline built by `report.timeline` from a real balanced plan with measured times.
"""

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_hdp.report.timeline import timeline_record, write_timeline
from megatron_hdp.scheduler import plan_step

REPO = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def plot(*args, code=None):
    cmd = [sys.executable, "-m", "megatron_hdp.plot", *map(str, args)]
    if code is not None:
        cmd = [sys.executable, "-c", code, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk; asserts the PNG signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def write_run(folder: Path, *, steps=8, timeline=True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    records = [
        {
            "iteration": i,
            "loss": 6.0 - 0.3 * i,
            "tokens": 16384,
            "seconds": 0.9 + 0.05 * (i % 3),
            "predicted_step_s": 1.0,
            "static_predicted_step_s": 1.4,
        }
        for i in range(1, steps + 1)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if timeline:
        lengths = [4096, 2500, 1800, 900, 700, 400, 300, 3100, 2000, 300]
        plan = plan_step(lengths, pool_size=4, capacity=1024, policy="balanced")
        static = plan_step(lengths, pool_size=4, capacity=1024, policy="static", cp_size=4)
        measured = {}
        for rank in range(4):
            t, times = 0.0, []
            for mb in plan.for_rank(rank):
                times.append((t, t + 0.8 * mb.predicted_cost))
                t += 0.8 * mb.predicted_cost
            measured[rank] = (t, times)
        record = timeline_record(plan, measured, iteration=steps, static_plan=static, static_cp=4)
        write_timeline(folder / "timelines", record)
    return folder


def test_plot_draws_the_timeline_and_the_curves(tmp_path):
    run = write_run(tmp_path / "run")
    done = plot(run)
    assert done.returncode == 0, done.stderr
    pictures = run / "pictures"
    expected = [pictures / "curves.png", pictures / "timeline-step-000008.png"]
    assert done.stdout.split() == [str(p) for p in expected]
    for path in expected:
        width, height = png_size(path)
        assert width == 1000 and 300 <= height <= 1500, (path, width, height)
        assert 10_000 < path.stat().st_size < 200_000, path


def test_plot_of_a_chosen_step_and_of_a_step_never_recorded(tmp_path):
    run = write_run(tmp_path / "run")
    done = plot(run, "--step", 3)
    assert done.returncode == 2
    assert not (run / "pictures").exists()  # refused before anything is drawn
    assert plot(run, "--step", 8).returncode == 0
    assert done.stderr.strip().splitlines() == [
        f"python -m megatron_hdp.plot: error: no timeline of step 3 in {run / 'timelines'} "
        "(recorded: 8)"
    ]


def test_a_run_without_timelines_still_gets_its_curves(tmp_path):
    run = write_run(tmp_path / "run", timeline=False)
    done = plot(run)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(run / "pictures" / "curves.png")]
    png_size(run / "pictures" / "curves.png")
    assert f"no timeline in {run / 'timelines'}" in done.stderr
    assert "drawing the curves only" in done.stderr


@pytest.mark.parametrize("what", ["missing", "no metrics", "empty metrics", "a file"])
def test_a_bad_run_dir_exits_2_with_one_line_naming_it(tmp_path, what):
    run = tmp_path / "run"
    if what == "no metrics":
        run.mkdir()
    elif what == "empty metrics":
        run.mkdir()
        (run / "metrics.jsonl").write_text("")
    elif what == "a file":
        run.write_text("x")
    done = plot(run)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m megatron_hdp.plot: error: ")
    assert str(run) in lines[0]
    assert not (run / "pictures").exists()


def test_without_matplotlib_the_error_names_it(tmp_path):
    run = write_run(tmp_path / "run", timeline=False)
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'matplotlib' or name.startswith('matplotlib.'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from megatron_hdp.plot.__main__ import main\n"
        "sys.argv[0] = 'plot'\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    done = plot(run, code=code)
    assert done.returncode == 1
    assert "needs matplotlib, which is not installed: pip install matplotlib" in done.stderr


def test_the_library_imports_matplotlib_only_when_drawing():
    code = (
        "import sys, megatron_hdp.plot, megatron_hdp.report.summary\n"
        "print('matplotlib' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert done.stdout.split() == ["False"], done.stderr


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--hdp-timeline-interval", "-1"], "--hdp-timeline-interval must be >= 0, got -1"),
        (
            ["--hdp-timeline-interval", "5"],
            "--hdp-timeline-interval 5 needs --hdp-metrics-file: the timelines are written "
            "next to it",
        ),
    ],
)
def test_bad_timeline_intervals_are_refused_before_start_up(
    tmp_path, monkeypatch, capsys, extra, message
):
    import pretrain_hdp

    argv = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "512", "--hdp-capacity", "256", "--train-iters", "3", "--lr", "1e-3",
        "--data-cache-path", str(tmp_path / "cache"), *extra,
    ]  # fmt: skip
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_info:
        pretrain_hdp.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"pretrain_hdp.py: error: {message}\n"
