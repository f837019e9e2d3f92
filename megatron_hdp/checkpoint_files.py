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
#: Written last by Megatron's `dist_checkpointing` into a complete checkpoint folder.
DIST_METADATA = "metadata.json"


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
    distributed = (folder / DIST_METADATA).exists()
    legacy = (folder / "common.pt").exists() and (folder / META).exists()
    if not (distributed or legacy):
        raise ValueError(f"{tracker} names iteration {iteration}, but {folder} is incomplete")
    return iteration


def read_meta(root: str | Path) -> dict:
    """The small description of the latest checkpoint (world size, optimizer kind).

    A checkpoint in Megatron's distributed format that holds no `meta.json` was written by
    Megatron-LM itself: its description is then only `{"iteration", "format",
    "megatron_lm": True}`.
    """
    iteration = latest_iteration(root)
    folder = iteration_dir(root, iteration)
    if not (folder / META).exists():
        return {"iteration": iteration, "format": "torch_dist", "megatron_lm": True}
    meta = json.loads((folder / META).read_text())
    meta.setdefault("format", "torch_dist" if (folder / DIST_METADATA).exists() else "torch")
    return meta


def fsync_path(path: str | Path) -> None:
    """Flush a file or folder to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
