"""What a simulation will hold in memory and how long it will take, before any work (pure).

The advisor's work grows with three numbers the user controls: the pieces of the lengths
file (each length cut into `--seq-length` pieces, all held by the sampler), the sequences
of one global batch (the job's batch, by default one context per replica: grows with
`--gpus`) and the pool of ranks (`--gpus` / (TP x PP)). `estimate` turns them into bytes
and seconds with the rough per-item rates below, and `check` refuses, in one line naming
the value, an estimate beyond the memory this process can use (`available_memory`).

Rates measured on the development machine (2 cores of an AMD EPYC VM, shared; the
advisor on a lengths file of log-normal lengths, LLaMA-like small model):
- a piece: 32 bytes (`cut`, the sampler's table and epoch permutation, max RSS of 10^7
  pieces), 0.45 us;
- a sequence of a simulated batch: about 1 KB per system (plans, timelines, the figures),
  0.08-0.3 ms per system and step (14,704 sequences on 64 ranks: the static mesh 1.2 s,
  HDP + balance 3.5 s, Megatron's dynamic CP 4.7 s);
- a pool rank: about 24 KB (192 MB peak at 8,192 ranks), 2 ms per step for Megatron's
  dynamic CP (15.6 s at 8,192 ranks with 113 sequences: the re-implementation's per-rank
  timeline; Megatron-Core's own, up to 1,024 ranks, 4.5 ms), 0.1 ms for the others.
They are estimates within a factor of a few, enough to refuse what cannot fit.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_hdp.offload.host_budget import available_memory_bytes

#: Longest sequence a lengths file may give (2^40 tokens, about 1.1 x 10^12).
MAX_LENGTH = 2**40
#: Bytes and seconds per piece of the lengths file (held by the sampler).
BYTES_PER_PIECE = 40
SECONDS_PER_PIECE = 5e-7
#: Bytes per sequence of a simulated batch and system; seconds per system and step.
BYTES_PER_SEQUENCE = 1000
SECONDS_PER_SEQUENCE = {"megatron_dcp": 3e-4, "hdp_balance": 2.5e-4, "hdp_offload_balance": 2.5e-4}
SECONDS_PER_SEQUENCE_DEFAULT = 1e-4
#: Bytes per pool rank; seconds per rank, system and step.
BYTES_PER_RANK = 25_000
SECONDS_PER_RANK = {"megatron_dcp": 2e-3}
SECONDS_PER_RANK_DEFAULT = 1e-4
#: Share of the available memory a simulation may take.
MEMORY_SHARE = 0.8


@dataclass(frozen=True)
class Estimate:
    """What the simulation will hold and take (rough, see the module docstring)."""

    pieces: int
    sequences_per_batch: float
    pool_size: int
    steps: int
    systems: int
    piece_bytes: float
    sequence_bytes: float
    rank_bytes: float
    seconds: float

    @property
    def memory_bytes(self) -> float:
        """All three parts together."""
        return self.piece_bytes + self.sequence_bytes + self.rank_bytes

    def text(self) -> str:
        """'about 1.2 GB of memory and 40 s' for the log line."""
        return f"about {gb(self.memory_bytes)} of memory and {duration(self.seconds)}"


def gb(nbytes: float) -> str:
    """Bytes as GB with one decimal (at least 0.1 GB)."""
    return f"{max(nbytes, 1e8) / 1e9:,.1f} GB"


def duration(seconds: float) -> str:
    """Seconds as '12 s', '4.5 min' or '3.2 h'."""
    if seconds < 120:
        return f"{max(seconds, 1):.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:,.1f} h"


def count_pieces(lengths: np.ndarray, seq_length: int) -> tuple[int, int]:
    """Pieces of `seq_length` tokens the lengths are cut into, and the tokens (exact)."""
    lengths = np.asarray(lengths, dtype=np.int64)  # each <= MAX_LENGTH: sums fit below
    pieces = -(-lengths // int(seq_length))
    return int(pieces.sum(dtype=np.uint64)), int(lengths.sum(dtype=np.uint64))


def estimate(
    *,
    pieces: int,
    mean_length: float,
    tokens_per_batch: int | None,
    units_per_batch: int | None,
    pool_size: int,
    steps: int,
    systems: list[str],
) -> Estimate:
    """Memory and time of simulating `steps` batches of `systems` on `pool_size` ranks.

    Batches of `tokens_per_batch` tokens (or `units_per_batch` sequences) of sequences of
    `mean_length` tokens on average, drawn from `pieces` held pieces.
    """
    if units_per_batch is not None:
        sequences = float(units_per_batch)
    else:
        sequences = float(tokens_per_batch) / max(1.0, mean_length)
    seq_seconds = sum(SECONDS_PER_SEQUENCE.get(s, SECONDS_PER_SEQUENCE_DEFAULT) for s in systems)
    rank_seconds = sum(SECONDS_PER_RANK.get(s, SECONDS_PER_RANK_DEFAULT) for s in systems)
    return Estimate(
        pieces=pieces,
        sequences_per_batch=sequences,
        pool_size=pool_size,
        steps=steps,
        systems=len(systems),
        piece_bytes=pieces * BYTES_PER_PIECE,
        sequence_bytes=steps * len(systems) * sequences * BYTES_PER_SEQUENCE,
        rank_bytes=pool_size * BYTES_PER_RANK,
        seconds=pieces * SECONDS_PER_PIECE
        + steps * (sequences * seq_seconds + pool_size * rank_seconds),
    )


def available_memory() -> tuple[float, str]:
    """Bytes this process may still allocate, and where the figure comes from.

    The least of MemAvailable (/proc/meminfo), the cgroup's memory.max less its
    memory.current (cgroup v2), and the address-space limit (ulimit -v) less this
    process's size; infinity with 'unknown' where none can be read.
    """
    found = []
    available = available_memory_bytes()
    if available is not None:
        found.append((float(available), "MemAvailable"))
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append((float(int(limit) - used), "the cgroup's memory.max"))
    except (OSError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        size = _own_size()
        found.append((float(soft - size), "ulimit -v"))
    if not found:
        return float("inf"), "unknown"
    return min(found)


def _own_size() -> int:
    """This process's virtual size in bytes (VmSize), 0 if unknown."""
    try:
        for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def check(est: Estimate, names: dict[str, str]) -> None:
    """ValueError in one line if `est` needs more than MEMORY_SHARE of the available memory.

    `names` holds, per part ('pieces', 'sequences', 'ranks'), the input it comes from; the
    largest part's is named, with the estimate and the limit.
    """
    available, source = available_memory()
    limit = MEMORY_SHARE * available
    if est.memory_bytes <= limit:
        return
    parts = {"pieces": est.piece_bytes, "sequences": est.sequence_bytes, "ranks": est.rank_bytes}
    worst = max(parts, key=parts.get)
    raise ValueError(
        f"{names[worst]}: the simulation would need {est.text()}, more than the "
        f"{gb(limit)} it may take here ({MEMORY_SHARE:.0%} of {gb(available)}, {source})"
    )


def work_estimate(
    job, *, steps: int, systems: list[str], lengths, lengths_file=None, mix: str | None = None
) -> Estimate:
    """The estimate for this job's batches, and its check against the machine (`check`).

    Mean sequence length: the lengths file's mean piece; a mix's, from one small batch of
    it; the job's own data's is not known before reading it, and is taken as half of
    --seq-length (the sampler cuts documents at --seq-length).
    """
    a = job.args
    pieces, mean = 0, a.seq_length / 2
    names = {"ranks": f"--gpus {job.gpus}: a pool of {job.pool_size:,} ranks"}
    if lengths is not None:
        pieces, tokens = count_pieces(lengths, a.seq_length)
        mean = tokens / pieces
        longest = int(np.max(lengths))
        names["pieces"] = (
            f"--lengths-file {lengths_file}: {pieces:,} pieces of --seq-length {a.seq_length} "
            f"(its longest length, {longest:,} tokens, is {-(-longest // a.seq_length):,} "
            "of them)"
        )
    elif mix is not None:
        from megatron_hdp.advise.lengths import batches_from_mix

        small = min(job.tokens_per_batch, 64 * job.context)
        (sample,) = batches_from_mix(mix, seed=a.seed, context=job.context, tokens=small, steps=1)
        mean = sum(sample) / max(1, len(sample))
    est = estimate(
        pieces=pieces,
        mean_length=mean,
        tokens_per_batch=job.tokens_per_batch,
        units_per_batch=job.units_per_batch,
        pool_size=job.pool_size,
        steps=steps,
        systems=systems,
    )
    per_batch = f"about {est.sequences_per_batch:,.0f} sequences per batch"
    if a.hdp_global_batch_tokens is None and a.global_batch_size is None:
        names["sequences"] = (
            f"--gpus {job.gpus}: its default batch of {job.tokens_per_batch:,} tokens (one "
            f"--seq-length per replica) holds {per_batch}"
        )
    elif a.hdp_global_batch_tokens is not None:
        names["sequences"] = f"--hdp-global-batch-tokens {a.hdp_global_batch_tokens}: {per_batch}"
    else:
        names["sequences"] = (
            f"--global-batch-size {a.global_batch_size} (x --seq-length {a.seq_length} tokens): "
            f"{per_batch}"
        )
    check(est, names)
    return est
