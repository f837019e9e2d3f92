"""Seeded global batches of sequence lengths with a target token budget (pure: stdlib + numpy).

Three generators share one signature, `gen(rng, total_tokens, max_len) -> list[int]`:

- `github_like`: ByteScale's GitHub code mix (bytescale-paper.md, section 1): 16.2% of the
  tokens in sequences of at least 128K, 9.8% in sequences of at least 256K.
- `byted_like`: ByteScale's Byted production mix: about 80% of the samples at most 4K;
  0.05% of the samples at 2M carrying 12.1% of the tokens; per-bucket token shares
  2M 12.1%, 1M 9.7%, 512K 7.6%, 256K 7.6%, 128K 7.3% (so 44.3% of the tokens at 128K or
  more, 37.0% at 256K or more).
- `stdlib_like`: lengths drawn (with replacement) from the real byte lengths of the embedded
  corpus documents (`megatron_hdp.data.corpus.stdlib_documents`, one document per
  standard-library package or module): byte-level tokens, so bytes are tokens.

`rng` is a `numpy.random.Generator` (or anything `numpy.random.default_rng` accepts, such
as an int seed); equal seeds give equal batches. `K` below is 1024 tokens, `M` 1024 K.

**Construction of the published mixes.** A mix is a mixture of *pieces*, each log-uniform
over an integer range `[low, high]` (a point mass when `low == high`). A length is drawn by
picking a piece with its sample probability `p_j` and then `floor(exp(U))`, `U` uniform on
`[ln low, ln(high + 1))`. The probabilities are *solved for*: every published statistic is
a linear equation in `p` (a sample share `sum_{j in S} p_j = f`; a token share
`sum_j p_j m_j (1[j in S] - t) = 0`, `m_j` the piece mean), together with `sum_j p_j = 1`;
the pieces are chosen so that the system is square, and `numpy.linalg.solve` gives `p`
(all positive; checked at import).

- Byted, 8 pieces: `[32, 4K]`, `(4K, 32K)`, `[32K, 128K)`, one quarter-octave piece
  `[b, b * 2^(1/4)]` at each of b = 128K, 256K, 512K, 1M, and a point mass at 2M.
  Equations: sum 1; 80% of the samples in `[32, 4K]`; 0.05% at 2M; the five bucket token
  shares. The buckets are narrow (a quarter octave) because the published counts nearly
  force point masses at the bucket labels: 0.05% of samples at 2M holding 12.1% of the
  tokens fixes the mean length at about 8.7K, and then 44.3% of the tokens in 1% of the
  samples means those samples average about 380K, i.e. they sit at the low edge of each
  octave. With quarter-octave pieces the share of samples at 128K or more comes out at
  0.91% (published: "1%"); it is an output, not an equation.
- GitHub, 5 pieces: `[32, 2K]`, `(2K, 16K)`, `[16K, 128K)`, `[128K, 256K)`, `[256K, 2M]`.
  Equations: sum 1; 50% of the samples at most 2K and 42% in `(2K, 16K)` (our choice: the
  paper gives no body statistics, so the body follows the per-file percentiles of real code
  in field-anchors.md section 4, median about 2K tokens, p90 about 13K); token shares 6.4%
  in `[128K, 256K)` and 9.8% in `[256K, 2M]`, i.e. 16.2% at 128K or more.

**Context and budget.** Every length is clipped to `max_len` (the context); clipping piles
the tail up at `max_len`, so the published shares hold when `max_len >= 2M`. Lengths are
drawn until their sum reaches `total_tokens`; the last one is shortened so that the batch
holds exactly `total_tokens` tokens (it stays >= 1).

`describe(lengths)` returns the statistics above for any batch, so tests and benchmarks
can compare a generated batch with the published numbers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

K = 1024
M = 1024 * K

__all__ = [
    "BYTED",
    "GENERATORS",
    "GITHUB",
    "Mixture",
    "Piece",
    "BENCH_MIXES",
    "byted_like",
    "describe",
    "first_sequences",
    "github_like",
    "pareto_like",
    "stdlib_lengths",
    "stdlib_like",
]


@dataclass(frozen=True)
class Piece:
    """Lengths log-uniform over the integers `[low, high]` (a point mass if `low == high`)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"a piece needs 1 <= low <= high, got [{self.low}, {self.high}]")

    @property
    def mean(self) -> float:
        """Mean length of `floor(exp(U))`, `U` uniform on `[ln low, ln(high + 1))`.

        Continuous mean of the log-uniform law on `[low, high + 1)` minus the average
        rounding loss of one half (exact for a point mass).
        """
        if self.low == self.high:
            return float(self.low)
        lo, hi = float(self.low), float(self.high + 1)
        return (hi - lo) / math.log(hi / lo) - 0.5

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` lengths (int64)."""
        if self.low == self.high:
            return np.full(n, self.low, dtype=np.int64)
        u = rng.uniform(math.log(self.low), math.log(self.high + 1), size=n)
        return np.clip(np.floor(np.exp(u)).astype(np.int64), self.low, self.high)


@dataclass(frozen=True)
class Mixture:
    """A mixture of pieces with sample probabilities `probs`."""

    name: str
    pieces: tuple[Piece, ...]
    probs: tuple[float, ...]

    @property
    def mean(self) -> float:
        """Mean length before clipping."""
        return float(sum(p * piece.mean for p, piece in zip(self.probs, self.pieces)))

    def token_shares(self) -> tuple[float, ...]:
        """Expected share of the tokens held by each piece (before clipping)."""
        mass = [p * piece.mean for p, piece in zip(self.probs, self.pieces)]
        total = sum(mass)
        return tuple(m / total for m in mass)

    def clipped_mean(self, max_len: int) -> float:
        """Approximate mean length after clipping at `max_len` (pieces' means clipped)."""
        return float(sum(p * min(piece.mean, max_len) for p, piece in zip(self.probs, self.pieces)))

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` lengths (int64), unclipped."""
        which = rng.choice(len(self.pieces), size=n, p=np.asarray(self.probs))
        out = np.empty(n, dtype=np.int64)
        for j, piece in enumerate(self.pieces):
            mask = which == j
            count = int(mask.sum())
            if count:
                out[mask] = piece.draw(rng, count)
        return out


def solve_mixture(
    name: str,
    pieces: Sequence[Piece],
    *,
    sample_shares: Sequence[tuple[Sequence[int], float]] = (),
    token_shares: Sequence[tuple[Sequence[int], float]] = (),
) -> Mixture:
    """The mixture whose sample and token shares of the given piece sets are as stated.

    Args:
        name: Mixture name.
        pieces: The pieces.
        sample_shares: `(piece indices, share of the samples)` equations.
        token_shares: `(piece indices, share of the tokens)` equations.

    Raises:
        ValueError: if the system is not square, is singular, or has a negative solution.
    """
    n = len(pieces)
    means = np.array([piece.mean for piece in pieces])
    rows, rhs = [np.ones(n)], [1.0]
    for idx, share in sample_shares:
        row = np.zeros(n)
        row[list(idx)] = 1.0
        rows.append(row)
        rhs.append(share)
    for idx, share in token_shares:
        member = np.zeros(n)
        member[list(idx)] = 1.0
        rows.append(means * (member - share))
        rhs.append(0.0)
    if len(rows) != n:
        raise ValueError(f"{name}: {len(rows)} equations for {n} pieces (need a square system)")
    try:
        probs = np.linalg.solve(np.array(rows), np.array(rhs))
    except np.linalg.LinAlgError as err:
        raise ValueError(f"{name}: the share equations are singular") from err
    if np.any(probs <= 0):
        raise ValueError(f"{name}: the stated shares need a negative piece mass {probs}")
    return Mixture(name, tuple(pieces), tuple(float(p) for p in probs))


def _quarter_octave(low: int) -> Piece:
    return Piece(low, int(low * 2**0.25))


#: ByteScale's Byted mix (see the module docstring for the construction).
BYTED = solve_mixture(
    "byted_like",
    [
        Piece(32, 4 * K),
        Piece(4 * K + 1, 32 * K - 1),
        Piece(32 * K, 128 * K - 1),
        _quarter_octave(128 * K),
        _quarter_octave(256 * K),
        _quarter_octave(512 * K),
        _quarter_octave(1 * M),
        Piece(2 * M, 2 * M),
    ],
    sample_shares=[([0], 0.80), ([7], 0.0005)],
    token_shares=[([7], 0.121), ([6], 0.097), ([5], 0.076), ([4], 0.076), ([3], 0.073)],
)

#: ByteScale's GitHub mix (see the module docstring for the construction).
GITHUB = solve_mixture(
    "github_like",
    [
        Piece(32, 2 * K),
        Piece(2 * K + 1, 16 * K - 1),
        Piece(16 * K, 128 * K - 1),
        Piece(128 * K, 256 * K - 1),
        Piece(256 * K, 2 * M),
    ],
    sample_shares=[([0], 0.50), ([1], 0.42)],
    token_shares=[([3], 0.162 - 0.098), ([4], 0.098)],
)


def _check_budget(total_tokens: int, max_len: int) -> None:
    if int(total_tokens) < 1:
        raise ValueError(f"total_tokens must be >= 1, got {total_tokens!r}")
    if int(max_len) < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len!r}")


def _fill(
    rng: np.random.Generator,
    draw: Callable[[np.random.Generator, int], np.ndarray],
    mean: float,
    total_tokens: int,
    max_len: int,
) -> list[int]:
    """Draw clipped lengths in chunks until they hold `total_tokens`; trim the last one."""
    _check_budget(total_tokens, max_len)
    chunks = []
    remaining = int(total_tokens)
    while remaining > 0:
        n = int(remaining / max(mean, 1.0) * 1.1) + 64
        x = np.minimum(draw(rng, n), max_len)
        cum = np.cumsum(x)
        cut = int(np.searchsorted(cum, remaining))  # first index with cum >= remaining
        if cut < n:
            x = x[: cut + 1].copy()
            x[-1] -= int(cum[cut]) - remaining
            chunks.append(x)
            remaining = 0
        else:
            chunks.append(x)
            remaining -= int(cum[-1])
    return np.concatenate(chunks).tolist()


def _mixture_batch(mix: Mixture, rng, total_tokens: int, max_len: int) -> list[int]:
    rng = np.random.default_rng(rng)
    return _fill(rng, mix.draw, mix.clipped_mean(max_len), total_tokens, max_len)


def github_like(rng, total_tokens: int, max_len: int) -> list[int]:
    """A global batch of exactly `total_tokens` tokens, GitHub-like, clipped at `max_len`."""
    return _mixture_batch(GITHUB, rng, total_tokens, max_len)


def byted_like(rng, total_tokens: int, max_len: int) -> list[int]:
    """A global batch of exactly `total_tokens` tokens, Byted-like, clipped at `max_len`."""
    return _mixture_batch(BYTED, rng, total_tokens, max_len)


@functools.lru_cache(maxsize=1)
def stdlib_lengths() -> tuple[int, ...]:
    """Byte lengths of the embedded corpus documents, in document order (read once)."""
    from megatron_hdp.data.corpus import stdlib_documents

    return tuple(len(text) for _, text in stdlib_documents() if text)


def stdlib_like(rng, total_tokens: int, max_len: int) -> list[int]:
    """A global batch of exactly `total_tokens` tokens of real corpus document lengths.

    Lengths are drawn with replacement from `stdlib_lengths()` and clipped at `max_len`.
    """
    rng = np.random.default_rng(rng)
    lengths = np.asarray(stdlib_lengths(), dtype=np.int64)
    mean = float(np.minimum(lengths, max_len).mean())
    return _fill(rng, lambda g, n: g.choice(lengths, size=n), mean, total_tokens, max_len)


#: The heavy-tailed mix's Pareto shape and smallest length.
PARETO_SHAPE = 1.1
PARETO_MIN = 256


def pareto_like(rng, total_tokens: int, max_len: int) -> list[int]:
    """A global batch of exactly `total_tokens` tokens with Pareto-tailed lengths.

    Not from the paper: lengths `floor(256 / U^(1 / 1.1))`, `U` uniform on (0, 1], clipped
    at `max_len`; a tail as heavy as long-context fine-tuning and RL batches (half the
    sequences under 480 tokens, one in a thousand over 137K before clipping).
    """
    rng = np.random.default_rng(rng)

    def draw(g, n):
        u = 1.0 - g.random(n)  # (0, 1]
        return np.floor(PARETO_MIN / u ** (1.0 / PARETO_SHAPE)).astype(np.int64)

    mean = float(np.minimum(draw(np.random.default_rng(0), 200_000), max_len).mean())
    return _fill(rng, draw, mean, total_tokens, max_len)


def first_sequences(gen, rng, count: int, max_len: int) -> list[int]:
    """The first `count` lengths `gen` draws (independent draws, none trimmed).

    For batches sized by their number of sequences rather than tokens.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count!r}")
    budget = count * 64 * 1024
    while True:
        lengths = gen(np.random.default_rng(rng), budget, max_len)
        if len(lengths) > count:
            return lengths[:count]
        budget *= 4


GENERATORS: dict[str, Callable[..., list[int]]] = {
    "github_like": github_like,
    "byted_like": byted_like,
    "stdlib_like": stdlib_like,
}
"""The generators of the paper's mixes and the embedded corpus, by name."""

BENCH_MIXES: dict[str, Callable[..., list[int]]] = {**GENERATORS, "pareto_like": pareto_like}
"""`GENERATORS` and the heavy-tailed mix of our own, for the planner benchmark."""

#: Byted token-share buckets: [128K, 256K), [256K, 512K), [512K, 1M), [1M, 2M), [2M, inf).
_BUCKETS = (("128k", 128 * K), ("256k", 256 * K), ("512k", 512 * K), ("1m", 1 * M), ("2m", 2 * M))


def describe(lengths: Sequence[int]) -> dict:
    """Statistics of a batch in the terms of the published mixes (shares are fractions).

    Keys: `num_sequences`, `total_tokens`, `mean`, `p50`, `p90`, `p99`, `max`;
    `sample_share_le_4k`, `sample_share_ge_128k`, `sample_share_ge_2m`;
    `token_share_ge_128k`, `token_share_ge_256k`, `token_share_ge_2m`; and
    `token_share_bucket` with the Byted buckets `128k` = [128K, 256K), `256k`, `512k`, `1m`
    and `2m` = [2M, inf). Thresholds are inclusive (the paper writes both "> 128K" and
    ">= 128K"; the mixes put no mass on the exact thresholds except the 2M point).
    """
    s = np.asarray(lengths, dtype=np.int64)
    if s.size == 0:
        raise ValueError("describe needs at least one length")
    total = int(s.sum())
    n = int(s.size)

    def tok(mask):
        return float(s[mask].sum()) / total

    bucket = {}
    for i, (name, low) in enumerate(_BUCKETS):
        high = _BUCKETS[i + 1][1] if i + 1 < len(_BUCKETS) else None
        mask = s >= low if high is None else (s >= low) & (s < high)
        bucket[name] = tok(mask)
    p50, p90, p99 = (float(v) for v in np.percentile(s, [50, 90, 99]))
    return {
        "num_sequences": n,
        "total_tokens": total,
        "mean": total / n,
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "max": int(s.max()),
        "sample_share_le_4k": float((s <= 4 * K).mean()),
        "sample_share_ge_128k": float((s >= 128 * K).mean()),
        "sample_share_ge_2m": float((s >= 2 * M).mean()),
        "token_share_ge_128k": tok(s >= 128 * K),
        "token_share_ge_256k": tok(s >= 256 * K),
        "token_share_ge_2m": tok(s >= 2 * M),
        "token_share_bucket": bucket,
    }
