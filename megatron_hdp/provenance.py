"""Provenance for benchmark results: versions, git revision, machine."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path


def git_revision(repo: Path | None = None) -> str:
    """The checked-out commit (with "+dirty" if the tree has changes), or "unknown"."""
    cwd = repo or Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """Library versions and the machine, for a benchmark's JSON."""
    import torch

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "megatron_core": _version("megatron-core"),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "git_revision": git_revision(),
    }
