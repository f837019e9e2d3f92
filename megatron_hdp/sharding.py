"""Data-aware zigzag sharding of packed sequences over a ring (pure index math).

A micro-batch on a ring of `k` ranks holds one or more sequences ("documents"). Each
document is cut into `2k` contiguous chunks; the rank at ring position `p` holds chunks `p`
and `2k-1-p` of *every* document, so each rank gets the same share of every causal mask
(ByteScale section 3.1, "dist-attn with packing"). A rank's local tokens are, document by
document, its first chunk followed by its second chunk.

Lengths need not divide by `2k`: the `L mod 2k` leftover tokens of a document are dealt
one per rank, round robin, continuing where the previous document stopped. Every rank
then holds at most one token more than any other, so a micro-batch of `T` tokens puts at
most `ceil(T / k)` tokens on one rank. Chunks may be empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def chunk_sizes(seqlens: Sequence[int], cp_size: int) -> list[list[int]]:
    """Sizes of the `2 * cp_size` zigzag chunks of every document, in position order."""
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    k = cp_size
    offset = 0
    result = []
    for length in seqlens:
        base, rem = divmod(length, 2 * k)
        sizes = [base] * (2 * k)
        for r in range(k):
            extra = rem // k + (1 if (r - offset) % k < rem % k else 0)
            if extra >= 1:
                sizes[r] += 1
            if extra >= 2:
                sizes[2 * k - 1 - r] += 1
        offset = (offset + rem) % k
        result.append(sizes)
    return result


@dataclass(frozen=True, slots=True)
class RankShard:
    """What one ring member holds of every document.

    Attributes:
        first_start, first_len: Position range of chunk `p` of each document.
        second_start, second_len: Position range of chunk `2k-1-p` of each document.
    """

    first_start: tuple[int, ...]
    first_len: tuple[int, ...]
    second_start: tuple[int, ...]
    second_len: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        """Tokens this member holds."""
        return sum(self.first_len) + sum(self.second_len)

    def local_doc_lengths(self) -> list[int]:
        """Local tokens of each document (first plus second chunk)."""
        return [a + b for a, b in zip(self.first_len, self.second_len, strict=True)]

    def doc_offsets(self) -> list[int]:
        """Start of each document's tokens in the local buffer."""
        offsets, total = [], 0
        for n in self.local_doc_lengths():
            offsets.append(total)
            total += n
        return offsets

    def positions(self) -> list[int]:
        """Original position (within its document) of every local token, in local order."""
        out: list[int] = []
        for s1, n1, s2, n2 in zip(
            self.first_start, self.first_len, self.second_start, self.second_len, strict=True
        ):
            out.extend(range(s1, s1 + n1))
            out.extend(range(s2, s2 + n2))
        return out

    def ranges(self) -> list[tuple[int, int, int]]:
        """`(doc, start, length)` of every local piece, in local order (empty ones skipped)."""
        out = []
        for d, (s1, n1, s2, n2) in enumerate(
            zip(self.first_start, self.first_len, self.second_start, self.second_len, strict=True)
        ):
            if n1:
                out.append((d, s1, n1))
            if n2:
                out.append((d, s2, n2))
        return out


def shard(seqlens: Sequence[int], cp_size: int) -> list[RankShard]:
    """The shard of every ring position `0 .. cp_size-1` for documents of `seqlens`."""
    sizes = chunk_sizes(seqlens, cp_size)
    k = cp_size
    shards = []
    for p in range(k):
        f_start, f_len, s_start, s_len = [], [], [], []
        for doc_sizes in sizes:
            starts = [0] * (2 * k)
            for c in range(1, 2 * k):
                starts[c] = starts[c - 1] + doc_sizes[c - 1]
            f_start.append(starts[p])
            f_len.append(doc_sizes[p])
            s_start.append(starts[2 * k - 1 - p])
            s_len.append(doc_sizes[2 * k - 1 - p])
        shards.append(RankShard(tuple(f_start), tuple(f_len), tuple(s_start), tuple(s_len)))
    return shards


def rank_token_counts(seqlens: Sequence[int], cp_size: int) -> list[int]:
    """Tokens each ring position holds."""
    sizes = chunk_sizes(seqlens, cp_size)
    k = cp_size
    return [sum(s[p] + s[2 * k - 1 - p] for s in sizes) for p in range(k)]
