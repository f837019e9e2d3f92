"""The global batches the advisor simulates: sequence lengths only, never tokens.

Three sources, each giving `steps` global batches (lists of training-sequence lengths):

- `read_lengths_file` + `batches_from_lengths` (pure): a text file, one sequence length
  per line (`#` comments and blank lines allowed); a length above `--seq-length` is cut
  into pieces of `--seq-length` tokens, as the job cuts documents. Global batches are
  drawn from it by the job's own sampler (`data.sampler.TokenBudgetSampler`: seeded
  epochs, whole sequences while the token budget holds, or `--global-batch-size`).
- `batches_from_mix` (pure): one of the simulator's built-in mixes
  (`sim.distributions.GENERATORS`), seeded exactly as `python -m megatron_hdp.sim` seeds
  them, so the advisor reproduces the simulator's batches.
- `batches_from_job_data`: the job's `--data-path` / `--hdp-data-spec` (or its default
  corpus) through the project's data layer (`data.training_data.build_training_data`,
  lengths from the index), the training sampler the job itself would run. This imports
  the data layer (torch, Megatron-Core's indexed dataset), lazily.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from megatron_hdp.advise.budget import MAX_LENGTH
from megatron_hdp.data.sampler import DatasetUnits, TokenBudgetSampler


def read_lengths_file(path: str | Path) -> np.ndarray:
    """Sequence lengths from a text file; ValueError naming the file, line and value.

    Each length is a whole number from 1 to `budget.MAX_LENGTH` (2^40) tokens; what its
    pieces cost is checked against the machine later (`budget`), once --seq-length is known.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ValueError(f"--lengths-file {path}: cannot read ({err.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"--lengths-file {path}: not a text file") from None
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        item = line.split("#", 1)[0].strip()
        if not item:
            continue
        if not (item.isascii() and item.isdigit()) or not item.strip("0"):
            raise ValueError(
                f"--lengths-file {path} line {number}: {item!r} is not a positive whole number"
            )
        if len(item.lstrip("0")) > 13 or int(item) > MAX_LENGTH:  # 2^40 has 13 digits
            shown = item if len(item) <= 30 else f"{item[:12]}... ({len(item)} digits)"
            raise ValueError(
                f"--lengths-file {path} line {number}: {shown} tokens is more than the "
                f"advisor simulates ({MAX_LENGTH:,} = 2^40 tokens per sequence)"
            )
        out.append(int(item))
    if not out:
        raise ValueError(f"--lengths-file {path}: no sequence lengths in it")
    return np.asarray(out, dtype=np.int64)


def cut(lengths, seq_length: int) -> np.ndarray:
    """Each length above `seq_length` cut into `seq_length`-token pieces, the rest last."""
    lengths = np.asarray(lengths, dtype=np.int64)
    full, rest = lengths // seq_length, lengths % seq_length
    count = full + (rest > 0)
    out = np.full(int(count.sum()), seq_length, dtype=np.int64)
    last = np.cumsum(count) - 1
    out[last[rest > 0]] = rest[rest > 0]
    return out


def _sample(units: DatasetUnits, args: argparse.Namespace, tokens, count, steps):
    sampler = TokenBudgetSampler(
        [units], [1.0], seed=args.seed, tokens_per_batch=tokens, units_per_batch=count
    )
    return [[u.length for u in sampler.next_batch()] for _ in range(steps)]


def batches_from_lengths(
    lengths: np.ndarray,
    args: argparse.Namespace,
    *,
    tokens: int | None,
    units: int | None,
    steps: int,
) -> list[list[int]]:
    """`steps` global batches drawn from `lengths` by the job's sampler (cut to seq-length)."""
    seqs = cut(lengths, args.seq_length)
    ids = np.arange(len(seqs), dtype=np.int64)
    table = DatasetUnits(doc=ids, start=np.zeros_like(ids), length=seqs)
    return _sample(table, args, tokens, units, steps)


def batches_from_mix(
    name: str, *, seed: int, context: int, tokens: int, steps: int
) -> list[list[int]]:
    """The simulator's batches of mix `name` (`sim.__main__.batch`, same seeds)."""
    from megatron_hdp.sim.__main__ import batch
    from megatron_hdp.sim.distributions import GENERATORS

    index = list(GENERATORS).index(name)
    return [batch(name, seed, index, context, step, tokens) for step in range(steps)]


def batches_from_job_data(args: argparse.Namespace, gpus: int, steps: int) -> list[list[int]]:
    """The job's first `steps` training batches, from its data flags (lengths only).

    ValueError for unreadable data, as `pretrain_hdp.py` reports it.
    """
    from megatron_hdp.data.training_data import build_training_data
    from megatron_hdp.megatron.config import data_config

    data = build_training_data(data_config(args, gpus))
    return [[u.length for u in data.train.next_batch()] for _ in range(steps)]
