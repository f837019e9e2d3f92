"""Host time of a micro-batch's attention step bookkeeping, before and after `ring_index`.

The bookkeeping is the query/K-V row indices and `cu_seqlens` of every ring step
(`megatron_hdp.attention.ring_index`). Before, `ring._step_blocks` built them as per-row
Python lists inside the first layer's attention, packs included
(`tests/unit/ring_index_reference.py` keeps that code). After, `ring_index` builds them
vectorised with the batch (the prefetch thread), none for packs; the step's thread then only
appends the buffer to the batch's one copy (`after_step_thread_s`: that concatenation).

Two cases, against the goal of 5 ms each: a 64K-token pack of documents, and one rank of a
ring of 8 with 128K tokens per rank (one 1M-token document, and the same tokens as 8
documents). One thread, on the host (`device=cpu`: no copy in either), median of `--repeats`.

Run from the repository root:

    PYTHONPATH=$PWD python scripts/bench/bench_ring_bookkeeping.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megatron_hdp.attention import ring  # noqa: E402
from megatron_hdp.attention.ring_index import ring_index  # noqa: E402
from megatron_hdp.host_copy import pack_int64  # noqa: E402
from megatron_hdp.provenance import environment, git_revision  # noqa: E402
from megatron_hdp.sharding import shard  # noqa: E402
from tests.unit.ring_index_reference import list_step_blocks  # noqa: E402

GOAL_S = 0.005
CPU = torch.device("cpu")


def pack_lengths(tokens: int, seed: int) -> list[int]:
    """Documents of 64 to 4096 tokens (uniform) filling `tokens` exactly."""
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(64, 4096), tokens - sum(lengths)))
    return lengths


def cases(seed: int) -> dict[str, tuple[list[int], int, int]]:
    """name -> (document lengths, ring size, this rank's ring position)."""
    per_rank = 128 * 1024
    return {
        "pack_64k": (pack_lengths(64 * 1024, seed), 1, 0),
        "ring8_128k_per_rank_1_doc": ([8 * per_rank], 8, 3),
        "ring8_128k_per_rank_8_docs": ([per_rank] * 8, 8, 3),
    }


def spec_of(lengths: list[int], k: int, position: int) -> ring.RingAttentionSpec:
    shards = tuple(shard(lengths, k))
    return ring.RingAttentionSpec(
        doc_lengths=tuple(lengths),
        shards=shards,
        position=position,
        active=ring.active_positions(shards),
        comm=None,
        backend=None,
    )


def median_s(fn, repeats: int, warm_up: int = 2) -> float:
    for _ in range(warm_up):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def after(spec: ring.RingAttentionSpec):
    """What the batch does now: build the index (prefetch side) and its host views."""
    index = ring_index(spec.shards, spec.position, spec.active)
    return index, index.on_device(index.buffer)


def run_case(name: str, lengths, k: int, position: int, args) -> dict:
    spec = spec_of(lengths, k, position)
    before_s = median_s(lambda: list_step_blocks(spec, CPU), args.before_repeats, warm_up=1)
    after_s = median_s(lambda: after(spec), args.repeats)
    index, _ = after(spec)
    step_thread_s = median_s(lambda: pack_int64([index.buffer]), args.repeats)
    return {
        "case": name,
        "documents": len(lengths),
        "tokens": sum(lengths),
        "ring_size": k,
        "position": position,
        "local_tokens": spec.shards[position].num_tokens,
        "ring_steps": len(index.steps),
        "index_int64_values": index.buffer.numel(),
        "before_s": before_s,
        "after_s": after_s,
        "after_step_thread_s": step_thread_s,
        "speedup": before_s / after_s,
        "goal_s": GOAL_S,
        "goal_met": after_s < GOAL_S,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=51, help="runs of the new builder (median)")
    p.add_argument("--before-repeats", type=int, default=5, help="runs of the old list code")
    p.add_argument("--seed", type=int, default=0, help="seed of the pack's document lengths")
    p.add_argument("--out", type=Path, default=REPO / "results" / "ring_bookkeeping.json")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.before_repeats < 1:
        p.error("--repeats and --before-repeats must be >= 1")
    torch.set_num_threads(1)
    results = []
    for name, (lengths, k, position) in cases(args.seed).items():
        case = run_case(name, lengths, k, position, args)
        results.append(case)
        print(
            f"{name:28s} before {case['before_s'] * 1e3:8.2f} ms  after "
            f"{case['after_s'] * 1e3:6.2f} ms (step thread {case['after_step_thread_s'] * 1e3:.2f}"
            f" ms)  x{case['speedup']:.0f}",
            flush=True,
        )
    report = {
        "benchmark": "ring_bookkeeping",
        "config": {
            "cases": {n: {"ring_size": k, "position": pos} for n, (_, k, pos) in cases(0).items()},
            "pack": "documents of 64 to 4096 tokens (uniform) filling 65,536",
            "repeats": args.repeats,
            "before_repeats": args.before_repeats,
            "seed": args.seed,
            "threads": torch.get_num_threads(),
            "device": "cpu (host work only, no device copy)",
            "goal_s": GOAL_S,
        },
        "versions": environment(),
        "git_revision": git_revision(REPO),
        "results": results,
        "all_goals_met": all(c["goal_met"] for c in results),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
