"""A cheap content fingerprint of an indexed dataset (pure: stdlib only).

A checkpoint stores one per dataset, so that a resume can tell the same data at another
path (a requeue from another working directory, a copy on a faster filesystem: accepted)
from other data with the same document lengths (a corpus re-preprocessed in place:
refused). The fingerprint hashes the whole `.idx` (the lengths and offsets; small) and a
fixed sample of the `.bin`: its size, its first and last page and `SAMPLED_PAGES` pages
spread evenly between them. Any change of tokens that touches a sampled page, or any
change of lengths, changes it; reading it costs a few hundred kilobytes whatever the
dataset's size.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

PAGE = 4096
#: Pages of the `.bin` read between its first and last.
SAMPLED_PAGES = 62
#: How the name of synthetic data starts (`megatron_lm.mock_data.mock_prefix`).
MOCK = "mock:"


def _bin_offsets(size: int) -> list[int]:
    """The page offsets sampled from a `.bin` of `size` bytes (first, spread, last)."""
    if size <= PAGE * (SAMPLED_PAGES + 2):
        return list(range(0, size, PAGE))
    last = size - PAGE
    return [round(i * last / (SAMPLED_PAGES + 1)) for i in range(SAMPLED_PAGES + 2)]


def _sample(path: Path, digest) -> None:
    """Feed `path`'s size and sampled pages into `digest`."""
    size = path.stat().st_size
    digest.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        for offset in _bin_offsets(size):
            f.seek(offset)
            digest.update(f.read(PAGE))


def dataset_fingerprint(prefix: str | os.PathLike) -> str:
    """`sha256:<hex>` of a dataset: the `.idx` and a sample of the `.bin` of `prefix`.

    A data spec's JSONL source (`jsonl:<file>,<file>`, as checkpoints name it) is
    fingerprinted by a sample of each file; a synthetic source (`synthetic:<parameters>`)
    by its content parameters, and the drop-in's `--mock-data` (`mock:<definition>`) by its
    definition, which fixes every token.
    """
    prefix = str(prefix)
    digest = hashlib.sha256()
    if prefix.startswith(("synthetic:", MOCK)):  # content a function of the name
        digest.update(prefix.encode())
        return "sha256:" + digest.hexdigest()[:32]
    if prefix.startswith("jsonl:"):
        for name in prefix.removeprefix("jsonl:").split(","):
            _sample(Path(name), digest)
        return "sha256:" + digest.hexdigest()[:32]
    index = Path(prefix + ".idx").read_bytes()
    digest.update(len(index).to_bytes(8, "little"))
    digest.update(index)
    _sample(Path(prefix + ".bin"), digest)
    return "sha256:" + digest.hexdigest()[:32]
