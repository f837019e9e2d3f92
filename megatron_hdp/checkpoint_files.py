"""Checkpoint folder layout and the tracker file (pure: paths and small JSON only).

Kept apart from the writer (`megatron_hdp/megatron/checkpoint.py`) so that argument
validation can inspect a `--load` folder before any process group or model exists.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
META = "meta.json"


def iteration_dir(root: str | Path, iteration: int) -> Path:
    """The folder of one checkpoint."""
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str | Path) -> int:
    """The iteration the tracker names; ValueError if there is no complete checkpoint."""
    root = Path(root)
    tracker = root / TRACKER
    if not tracker.exists():
        raise ValueError(f"no checkpoint in {root}: {TRACKER} is missing")
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker} does not hold an iteration number: {text!r}")
    iteration = int(text)
    folder = iteration_dir(root, iteration)
    if not (folder / "common.pt").exists() or not (folder / META).exists():
        raise ValueError(f"{tracker} names iteration {iteration}, but {folder} is incomplete")
    return iteration


def read_meta(root: str | Path) -> dict:
    """The small description of the latest checkpoint (world size, optimizer kind)."""
    return json.loads((iteration_dir(root, latest_iteration(root)) / META).read_text())


def fsync_path(path: str | Path) -> None:
    """Flush a file or folder to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
