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
        missing = DIST_METADATA if folder.is_dir() else "the folder"
        if folder.is_dir() and not any(folder.glob("*.distcp")) and (folder / "common.pt").exists():
            missing = META  # the per-rank format
        raise ValueError(
            f"{tracker} names iteration {iteration}, but {folder} is incomplete "
            f"({folder.name}/{missing} is missing)"
        )
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


#: Below this much free space a failed write is put down to a full disk.
LOW_DISK_BYTES = 256 * 2**20


def hidden_write_causes(folder: str | Path) -> str:
    """What on this machine stops writes into `folder` for reasons an error may not name.

    torch's zip writer turns ENOSPC and EFBIG into `enforce fail at inline_container.cc:
    ... unexpected pos`, which names neither; after a failed save this looks for a full
    disk (less than `LOW_DISK_BYTES` or 1% of it free) and a file-size limit (`ulimit -f`).
    Returns `''`, or `'; probably ...'` to append to the error's line.
    """
    import resource
    import shutil

    notes = []
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        usage = None
    if usage is not None and usage.free < max(LOW_DISK_BYTES, usage.total // 100):
        notes.append(
            f"no space left on the device: {usage.free / 2**20:.0f} MiB free of "
            f"{usage.total / 2**30:.1f} GiB there"
        )
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        notes.append(f"this process may write files of at most {soft} bytes (ulimit -f)")
    return f"; probably {' and '.join(notes)}" if notes else ""
