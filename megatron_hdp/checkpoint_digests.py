"""What a checkpoint folder holds, proved by a digest of every file (pure: stdlib only).

At save, once every rank's writes are done and before the folder is published, the files
of the checkpoint are hashed (CRC-32 of the whole file, with its size; the ranks share the
files out and hash in parallel) and rank 0 writes `hdp_digests.json` into the folder:

    {"format": 1, "run_id": ..., "iteration": N,
     "files": {"__0_0.distcp": {"bytes": ..., "crc32": ...}, ".metadata": {...}, ...}}

Before start-up, `digest_problems` checks a `--load` folder against it: a file missing,
cut short, zeroed, flipped or copied in from another checkpoint (of this run or another:
every shard of a model has the same size in every checkpoint, but not the same bytes) is
named with what differs. The check reads every byte once, in threads (`zlib.crc32`
releases the GIL), so it runs at the disk's speed. A folder without the file was written
before digests existed: it still loads, and the log says its content was not verified.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: The digest file inside a checkpoint folder (written last, before the folder is published).
DIGESTS = "hdp_digests.json"
FORMAT = 1
_CHUNK = 8 * 2**20


def file_digest(path: str | Path) -> dict:
    """`{"bytes": size, "crc32": CRC-32 of the whole file}` of one file."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"bytes": size, "crc32": crc}


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def digests(folder: str | Path, names: Iterable[str]) -> dict[str, dict]:
    """The digest of each named file of `folder`, hashed in parallel threads."""
    names = sorted(names)
    folder = Path(folder)
    with ThreadPoolExecutor(_threads()) as pool:
        return dict(zip(names, pool.map(lambda n: file_digest(folder / n), names), strict=True))


def checkpoint_files(folder: str | Path) -> list[str]:
    """The files a checkpoint's digests cover: every regular file but the digests'."""
    return sorted(p.name for p in Path(folder).iterdir() if p.is_file() and p.name != DIGESTS)


def share(names: list[str], rank: int, world: int) -> list[str]:
    """The files `rank` of `world` hashes: every `world`-th of `names`, dealt round."""
    return names[rank::world]


def write_digests(
    folder: str | Path, files: dict[str, dict], *, run_id: str | None, iteration: int
) -> None:
    """Write `hdp_digests.json` into `folder` (fsynced): the folder's proof of content."""
    record = {"format": FORMAT, "run_id": run_id, "iteration": iteration, "files": files}
    path = Path(folder) / DIGESTS
    with open(path, "w") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_digests(folder: str | Path) -> dict | None:
    """The folder's digest record; None if it has none (written before digests existed).

    Raises:
        ValueError: If the record exists but cannot be read (naming the file).
    """
    path = Path(folder) / DIGESTS
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        files = record["files"]
        if not isinstance(files, dict):
            raise TypeError("files is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path.name} is damaged ({type(err).__name__}: {err})") from None
    return record


def digest_problems(
    folder: str | Path,
    record: dict,
    *,
    run_id: str | None = None,
    iteration: int | None = None,
    rank: int = 0,
    world: int = 1,
) -> list[str]:
    """What in `folder` differs from its digest `record`, one phrase each.

    The record's identity comes first, then the files by name. Sizes and presence are
    checked for every file; contents (CRC-32) for this rank's share of them (`share`), so
    that the ranks of one job read the checkpoint once between them. `run_id`/`iteration`:
    what the folder's `meta.json` and name say it is; a record naming another is reported
    too (a digest file copied in with the shards).
    """
    folder = Path(folder)
    identity, problems = [], []
    if run_id is not None and record.get("run_id") not in (None, run_id):
        identity.append(
            f"{DIGESTS} belongs to run {record.get('run_id')}, meta.json to run {run_id}"
        )
    if iteration is not None and record.get("iteration") != iteration:
        identity.append(
            f"{DIGESTS} is of iteration {record.get('iteration')}, the folder of {iteration}"
        )
    files: dict[str, dict] = record["files"]
    present = []
    for name in sorted(files):
        path = folder / name
        want = files[name]
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        have = path.stat().st_size
        if have != want.get("bytes"):
            problems.append(f"{name} holds {have:,} bytes, its digest says {want.get('bytes'):,}")
            continue
        present.append(name)
    mine = share(present, rank, world)
    for name, got in digests(folder, mine).items():
        if got["crc32"] != files[name].get("crc32"):
            problems.append(
                f"{name} does not hold the bytes this checkpoint wrote (CRC-32 "
                f"{got['crc32']:08x}, its digest says {files[name].get('crc32', 0):08x}): "
                "damaged, or copied in from another checkpoint"
            )
    return identity + sorted(problems)
