"""The row indices and offsets of a micro-batch's attention steps, built on the host (ops layer).

A rank's ring attention makes one varlen kernel call per ring step (`ring.py`): the step's
query rows and the source's K/V rows are gathered, packed per document, with `cu_seqlens`.
`ring_index` builds all of it for one micro-batch as int64 host tensors, vectorised
(`repeat_interleave` / `cumsum`, no per-row Python), in one buffer, so that it can be built
with the batch (on the prefetch side) and travel with the batch's own tensors in their one
non-blocking copy (`data.batching.LocalBatch.to`). A pack (a micro-batch whose tokens are all
on one rank) needs only the offsets: no row indices are built for it.

Which blocks a step computes: see `ring.py`'s module docstring (`ring._segments` is the
per-document reference of the same blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_hdp.attention.kernels.base import VarlenBlocks
from megatron_hdp.sharding import RankShard


@dataclass(frozen=True)
class StepBlocks:
    """One ring step's blocks of every document, packed for one varlen kernel call.

    `q_rows` are the local query rows taking part, `kv_rows` the rows of the source's K/V;
    both None for a pack (one kernel call on the tensors as they are).
    """

    q_rows: torch.Tensor | None
    kv_rows: torch.Tensor | None
    blocks: VarlenBlocks


@dataclass(frozen=True)
class RingStep:
    """What one ring step computes, on the host: its source and its block lengths."""

    source: int
    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]
    causal: bool


@dataclass(frozen=True)
class RingIndex:
    """A micro-batch's steps, and their indices as one host int64 buffer.

    `buffer` holds, step after step, `q_rows`, `kv_rows` (only with `rows`), `cu_seqlens_q`
    and `cu_seqlens_k`; `sizes` are those parts' lengths, in order.
    """

    steps: tuple[RingStep, ...]
    buffer: torch.Tensor
    sizes: tuple[int, ...]
    rows: bool

    def on_device(self, buffer: torch.Tensor) -> dict[int, StepBlocks]:
        """The steps by source, as views of `buffer` (this index's buffer, on any device).

        The int32 offsets are converted on `buffer`'s device: nothing here waits for it.
        """
        views = iter(torch.split(buffer, list(self.sizes)))
        out = {}
        for step in self.steps:
            q_rows = kv_rows = None
            if self.rows:
                q_rows, kv_rows = next(views), next(views)
            cu_q, cu_k = next(views), next(views)
            out[step.source] = StepBlocks(
                q_rows=q_rows,
                kv_rows=kv_rows,
                blocks=VarlenBlocks(
                    lengths_q=step.lengths_q,
                    lengths_k=step.lengths_k,
                    causal=step.causal,
                    cu_seqlens_q=cu_q.to(torch.int32),
                    cu_seqlens_k=cu_k.to(torch.int32),
                ),
            )
        return out


def _lengths(shard: RankShard) -> tuple[torch.Tensor, torch.Tensor]:
    first = torch.tensor(shard.first_len, dtype=torch.int64)
    second = torch.tensor(shard.second_len, dtype=torch.int64)
    return first, second


def _exclusive_cumsum(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(lengths, 0) - lengths


#: Up to this many blocks, each block's rows are one `arange` written in place (cheaper than
#: the vectorised form's temporaries for the few long documents of a ring micro-batch).
_BLOCKS_PER_ARANGE = 32


def _fill_rows(out: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor) -> None:
    """`out` = the rows `start .. start + length - 1` of every block, block after block."""
    n = out.numel()
    if len(lengths) <= _BLOCKS_PER_ARANGE:
        at = 0
        for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
            torch.arange(start, start + length, dtype=torch.int64, out=out[at : at + length])
            at += length
        return
    torch.arange(n, dtype=torch.int64, out=out)
    out.add_(torch.repeat_interleave(starts - _exclusive_cumsum(lengths), lengths, output_size=n))


def _fill_offsets(out: torch.Tensor, lengths: torch.Tensor) -> None:
    out[0] = 0
    torch.cumsum(lengths, 0, out=out[1:])


def ring_index(shards: Sequence[RankShard], position: int, active: Sequence[int]) -> RingIndex:
    """The steps of ring position `position` against every active source, on the host.

    `shards` are every ring position's (`sharding.shard(doc_lengths, k)`), `active` the
    positions holding tokens, in ring order (`ring.active_positions`). Sources without any
    block are left out. With one active position (a pack) no row indices are built.
    Pure host work, no collective: the prefetch thread may run it.
    """
    rows = len(active) > 1
    first, second = _lengths(shards[position])
    local = first + second
    q_off = _exclusive_cumsum(local)
    plans = []
    for source in active:
        if source == position:
            q0, ql, k0, kl, causal = q_off, local, q_off, local, True
        else:
            src_first, src_second = _lengths(shards[source])
            src_local = src_first + src_second
            k0 = _exclusive_cumsum(src_local)
            if source < position:
                q0, ql, kl = q_off, local, src_first
            else:
                q0, ql, kl = q_off + first, second, src_local
            causal = False
        keep = (ql > 0) & (kl > 0)
        if not bool(keep.all()):
            if not bool(keep.any()):
                continue
            q0, ql, k0, kl = q0[keep], ql[keep], k0[keep], kl[keep]
        plans.append((source, q0, ql, k0, kl, causal))
    sizes, steps = [], []
    for source, _, ql, _, kl, causal in plans:
        lengths_q, lengths_k = tuple(ql.tolist()), tuple(kl.tolist())
        steps.append(RingStep(source, lengths_q, lengths_k, causal))
        if rows:
            sizes += [sum(lengths_q), sum(lengths_k)]
        sizes += [len(lengths_q) + 1, len(lengths_k) + 1]
    buffer = torch.empty(sum(sizes), dtype=torch.int64)
    parts = iter(torch.split(buffer, sizes))
    for _, q0, ql, k0, kl, _ in plans:
        if rows:
            _fill_rows(next(parts), q0, ql)
            _fill_rows(next(parts), k0, kl)
        _fill_offsets(next(parts), ql)
        _fill_offsets(next(parts), kl)
    return RingIndex(steps=tuple(steps), buffer=buffer, sizes=tuple(sizes), rows=rows)
