"""A rank's CPU memory for data (USS) with a JSONL source: in-process loader vs data service.

Every rank of a job opens its data spec's sources (`data.training_data.build_training_data`).
With the in-process loader a JSONL source tokenized on open is held whole by every rank
(4 bytes per token) and one tokenized on read holds its lengths index (32 bytes per
document); with `--hdp-data-service ray` a rank holds the lengths only (8 bytes per
document, `data.lengths_only`) and the source loaders hold the tokens. This writes a
JSONL file of `--megabytes` of text, builds its lengths index once (as the cluster does),
then, for each mode, opens the data in a fresh Python process and measures that process's
unique set size (USS, psutil) before and after, with the data held. Writes the deltas
and their ratio as JSON, with versions.

    PYTHONPATH=$PWD python scripts/bench/bench_rank_data_memory.py \\
        --out results/rank_data_memory.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path

#: The modes measured: (name, JSONL `tokenize`, the rank holds lengths only).
MODES = (
    ("in_process_on_open", "on_open", False),
    ("in_process_on_read", "on_read", False),
    ("data_service", "on_open", True),
)


def write_jsonl(path: Path, megabytes: float, seed: int = 0) -> int:
    """A JSONL file of about `megabytes` of text in documents of 200 to 8,000 bytes."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = ["ring", "pack", "zigzag", "rank", "token", "batch", "plan", "loader", "shard"]
    target, written, docs = int(megabytes * 1e6), 0, 0
    with open(path, "w") as out:
        while written < target:
            n = int(rng.integers(30, 1200))
            text = " ".join(words[int(i)] for i in rng.integers(0, len(words), n))
            line = json.dumps({"text": text}) + "\n"
            out.write(line)
            written += len(line)
            docs += 1
    return docs


def _config(folder: Path, tokenize: str, lengths_only: bool):
    from megatron_hdp.data.spec import parse_spec
    from megatron_hdp.data.training_data import DataConfig

    spec = parse_spec(
        {"sources": [{"name": "web", "jsonl": "web.jsonl", "tokenize": tokenize}]}, base=folder
    )
    return DataConfig(
        blend=[], split=[1.0], seq_length=4096, seed=1, tokens_per_batch=65536, spec=spec,
        cache_dir=str(folder), lengths_only=lengths_only,
    )  # fmt: skip


def uss() -> int:
    """This process's unique set size in bytes."""
    import psutil

    return int(psutil.Process().memory_full_info().uss)


def measure(folder: Path, tokenize: str, lengths_only: bool) -> dict:
    """In this process: USS before and after opening the data (call in a fresh process)."""
    from megatron_hdp.data.training_data import build_training_data

    cfg = _config(folder, tokenize, lengths_only)
    small = folder / "warm"  # the code paths run once on a tiny copy, so imports are paid
    small.mkdir(exist_ok=True)
    with open(folder / "web.jsonl") as src, open(small / "web.jsonl", "w") as out:
        out.writelines(next(src) for _ in range(3))
    warm = _config(small, tokenize, False).spec
    build_training_data(dataclasses.replace(cfg, spec=warm, seq_length=8, tokens_per_batch=8))
    gc.collect()
    before = uss()
    data = build_training_data(cfg)
    gc.collect()
    after = uss()
    lengths = data.datasets[0].sequence_lengths
    return {
        "uss_before": before,
        "uss_after": after,
        "data_bytes": after - before,
        "documents": len(lengths),
        "tokens": int(sum(int(n) for n in lengths)),
    }


def run_modes(folder: Path, modes) -> list[dict]:
    """`measure` each `(tokenize, lengths_only)` in order, in one fresh Python process.

    Measure a mode that holds little before one that holds much: each measures the growth
    from where the last left off, and freed memory a process keeps would count again.
    """
    wanted = [f"{tokenize}:{int(lean)}" for tokenize, lean in modes]
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(folder), *wanted],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"measuring {wanted}: {done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(folder: Path, megabytes: float) -> dict:
    """Write the file, build its lengths index, measure every mode (fresh processes)."""
    from megatron_hdp.data.sources import lengths_index
    from megatron_hdp.data.tokenizers import build_tokenizer

    docs = write_jsonl(folder / "web.jsonl", megabytes)
    lengths_index(
        [str(folder / "web.jsonl")], json_key="text", tokenizer=build_tokenizer("ByteLevel"),
        cache_dir=folder,
    )  # fmt: skip
    rows = {name: run_modes(folder, [(tokenize, lean)])[0] for name, tokenize, lean in MODES}
    service = rows["data_service"]["data_bytes"]
    return {
        "jsonl_megabytes": megabytes,
        "documents": docs,
        "modes": rows,
        "ratio_service_to_on_open": service / rows["in_process_on_open"]["data_bytes"],
        "ratio_service_to_on_read": service / rows["in_process_on_read"]["data_bytes"],
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        folder, modes = Path(sys.argv[2]), [m.split(":") for m in sys.argv[3:]]
        rows = [measure(folder, tokenize, bool(int(lean))) for tokenize, lean in modes]
        print(json.dumps(rows), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--megabytes", type=float, default=32.0)
    args = parser.parse_args()
    from megatron_hdp.provenance import environment

    with tempfile.TemporaryDirectory() as folder:
        result = compare(Path(folder), args.megabytes)
    result["environment"] = environment()  # git revision, versions, platform
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as out:
        json.dump(result, out, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1))


if __name__ == "__main__":
    main()
