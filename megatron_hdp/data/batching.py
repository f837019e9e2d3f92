"""Gather one rank's share of a micro-batch into packed (THD) tensors (ops layer).

A rank reads only the token ranges its plan gives it: for a ring micro-batch, its two
zigzag chunks of every document (`sharding.py`); for a local one, whole documents. The
attention's step bookkeeping (`attention.ring_index`) is built with the batch, on the host,
and travels with its tensors.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from megatron_hdp.attention.ring_index import RingIndex, StepBlocks, ring_index
from megatron_hdp.data.mtp_targets import ShiftedTargets, read_shifted
from megatron_hdp.host_copy import pack_int64, to_device, unpack
from megatron_hdp.scheduler.plan import MicroBatch, StepPlan
from megatron_hdp.sharding import RankShard, shard


class TokenSource(Protocol):
    """Random access to the sequences of the current global batch."""

    def read(self, seq_index: int, start: int, length: int) -> tuple[torch.Tensor, ...]:
        """`(tokens, labels, loss_mask)` of positions `[start, start+length)` of a sequence."""
        ...


class InMemoryTokens:
    """A `TokenSource` over tensors held in memory (tests, demos, small data).

    Args:
        tokens: Input ids of every sequence (1-D each).
        labels: Target ids of every sequence, same lengths as `tokens`.
        loss_masks: Optional 0/1 masks; all ones when omitted.
    """

    def __init__(
        self,
        tokens: Sequence[torch.Tensor],
        labels: Sequence[torch.Tensor],
        loss_masks: Sequence[torch.Tensor] | None = None,
    ) -> None:
        if len(tokens) != len(labels):
            raise ValueError(f"{len(tokens)} token sequences but {len(labels)} label sequences")
        self.tokens, self.labels = list(tokens), list(labels)
        self.loss_masks = (
            list(loss_masks)
            if loss_masks is not None
            else [torch.ones(len(t), dtype=torch.float32) for t in tokens]
        )

    @property
    def seqlens(self) -> list[int]:
        """Length of every sequence."""
        return [len(t) for t in self.tokens]

    def read(self, seq_index, start, length):
        """See `TokenSource.read`."""
        end = start + length
        return (
            self.tokens[seq_index][start:end],
            self.labels[seq_index][start:end],
            self.loss_masks[seq_index][start:end],
        )


class IndexedReader(Protocol):
    """The part of Megatron's `IndexedDataset` that `IndexedTokens` uses."""

    def get(self, idx: int, offset: int = 0, length: int | None = None):
        """Tokens `[offset, offset + length)` of sequence `idx` (a numpy array)."""
        ...


class IndexedTokens:
    """A `TokenSource` over indexed datasets: one global batch of sampler units.

    Unit `i` of `units` is `(dataset, doc, start, length)` (see `data.sampler.Unit`); reading
    positions `[a, a + n)` of it reads tokens `[start + a, start + a + n + 1)` of the
    document, so labels are the next tokens. Only the requested ranges are read.

    Args:
        datasets: One reader per dataset of the blend.
        units: The units of the global batch, in batch order.
        vocab_size: When given, a token id outside `[0, vocab_size)` raises ValueError
            (data tokenized with another tokenizer than the job's).
    """

    def __init__(
        self, datasets: Sequence[IndexedReader], units: Sequence, *, vocab_size: int | None = None
    ) -> None:
        self.datasets = list(datasets)
        self.units = list(units)
        self.vocab_size = vocab_size

    @property
    def seqlens(self) -> list[int]:
        """Length of every sequence of the batch."""
        return [u.length for u in self.units]

    def read(self, seq_index, start, length):
        """See `TokenSource.read`."""
        unit = self.units[seq_index]
        if start < 0 or start + length > unit.length:
            raise ValueError(f"positions [{start}, {start + length}) outside unit {unit}")
        ids = self.datasets[unit.dataset].get(
            unit.doc, offset=unit.start + start, length=length + 1
        )
        ids = torch.from_numpy(np.asarray(ids, dtype=np.int64))
        if (
            self.vocab_size is not None
            and len(ids)
            and (int(ids.max()) >= self.vocab_size or int(ids.min()) < 0)
        ):
            raise ValueError(
                f"dataset {unit.dataset}, document {unit.doc}: token id {int(ids.max())} is "
                f"outside the tokenizer's vocabulary of {self.vocab_size} (was the data "
                "tokenized with another --tokenizer-type?)"
            )
        return ids[:-1], ids[1:], torch.ones(length, dtype=torch.float32)


@dataclass(frozen=True)
class LocalBatch:
    """This rank's tokens of one micro-batch, shaped `[1, T]` as Megatron's THD input.

    `full_doc_lengths` are the lengths of the micro-batch's documents; `shard` says which
    positions of each this rank holds.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    full_doc_lengths: tuple[int, ...]
    shard: RankShard
    ring: tuple[int, ...]
    rank: int
    offload_ratio: float = 0.0
    device_offsets: torch.Tensor | None = None
    """`cu_seqlens()` on the device, set by `to()`."""
    host_loss_tokens: float = 0.0
    """The loss mask's sum, counted when the batch was read (no device read later)."""
    ring_index: RingIndex | None = None
    """The attention's step indices and offsets on the host, built when the batch was read."""
    device_steps: dict[int, StepBlocks] | None = None
    """`ring_index` on the device, set by `to()` (from the same copy as the tokens)."""
    doc_ids: tuple[int, ...] = ()
    """Index in the global batch of every document (`MicroBatch.seq_indices`): what
    identifies a document within a step, whatever the placement (keyed dropout)."""
    shifted: ShiftedTargets | None = None
    """Multi-token prediction: every local token's next `D` tokens, labels, mask values and
    positions in its document (`mtp_targets`); None without MTP."""

    @property
    def num_tokens(self) -> int:
        """Local tokens."""
        return self.tokens.shape[1]

    def to(self, device: torch.device, *, copy=to_device) -> LocalBatch:
        """The same batch with its tensors on `device`, in one non-blocking copy.

        The token ids, labels, positions, loss mask (its float64 bits), document offsets and
        the attention's step indices (`ring_index`) travel as one int64 buffer through `copy`
        (`host_copy.to_device`), so the host never waits for the device.
        """
        if self.tokens.device == device:
            return self
        n = self.num_tokens
        mask_bits = self.loss_mask.reshape(-1).to(torch.float64).view(torch.int64)
        parts = [self.tokens, self.labels, self.position_ids, mask_bits, self._offsets()]
        if self.shifted is not None:
            sh = self.shifted
            parts += [
                sh.tokens.reshape(-1),
                sh.labels.reshape(-1),
                sh.loss_mask.reshape(-1).to(torch.float64).view(torch.int64),
                sh.position_ids.reshape(-1),
            ]
        if self.ring_index is not None:
            parts.append(self.ring_index.buffer)
        host, lengths = pack_int64(parts)
        tokens, labels, positions, mask, cu, *rest = unpack(copy(host, device), lengths)
        shifted = None
        if self.shifted is not None:
            d = self.shifted.depth
            s_tokens, s_labels, s_mask, s_positions, *rest = rest
            shifted = ShiftedTargets(
                tokens=s_tokens.view(d, n),
                labels=s_labels.view(d, n),
                loss_mask=s_mask.view(torch.float64).to(self.shifted.loss_mask.dtype).view(d, n),
                position_ids=s_positions.view(d, n),
                counts=self.shifted.counts,
            )
        steps = rest
        return dataclasses.replace(
            self,
            tokens=tokens.view(1, n),
            labels=labels.view(1, n),
            loss_mask=mask.view(torch.float64).to(self.loss_mask.dtype).view(1, n),
            position_ids=positions.view(1, n),
            device_offsets=cu.to(torch.int32),
            device_steps=self.ring_index.on_device(steps[0]) if steps else None,
            shifted=shifted,
        )

    def attention_steps(self) -> dict[int, StepBlocks] | None:
        """The attention's step blocks on the batch's device (None: not built with the batch)."""
        if self.device_steps is not None:
            return self.device_steps
        if self.ring_index is not None and self.tokens.device == self.ring_index.buffer.device:
            return self.ring_index.on_device(self.ring_index.buffer)
        return None

    def cu_seqlens(self) -> torch.Tensor:
        """int32 offsets of the local documents, as flash-attn's varlen API expects."""
        if self.device_offsets is not None:
            return self.device_offsets
        return torch.tensor(self._offsets(), dtype=torch.int32)

    def _offsets(self) -> list[int]:
        return [0, *itertools.accumulate(self.shard.local_doc_lengths())]

    def loss_tokens(self) -> float:
        """The sum of the loss mask, counted on the host when the batch was read."""
        return self.host_loss_tokens


def gather_local_batch(
    plan: StepPlan, micro_batch: MicroBatch, rank: int, source: TokenSource, *, mtp_depth: int = 0
) -> LocalBatch:
    """Read this rank's share of `micro_batch` from `source` (possibly no token at all).

    `mtp_depth` (`--mtp-num-layers`, 0: none): also read the up to `mtp_depth` tokens after
    each local piece that ends inside its document, for multi-token prediction's shifted
    inputs and labels (`LocalBatch.shifted`, `mtp_targets`).

    Raises ValueError if the source returns fewer or more tokens than the plan expects
    (the source and the plan disagree on a sequence's length).
    """
    full_lengths = tuple(plan.seqlens[i] for i in micro_batch.seq_indices)
    shards = shard(full_lengths, micro_batch.cp_size)
    position = micro_batch.ring.index(rank)
    my_shard = shards[position]
    parts: list[tuple[torch.Tensor, ...]] = []
    ranges = my_shard.ranges()
    for d, start, length in ranges:
        seq_index = micro_batch.seq_indices[d]
        piece = source.read(seq_index, start, length)
        if any(len(t) != length for t in piece):
            raise ValueError(
                f"sequence {seq_index}: the plan expects {plan.seqlens[seq_index]} tokens, but "
                f"reading positions [{start}, {start + length}) returned "
                f"{[len(t) for t in piece]} values"
            )
        parts.append(piece)

    def cat(i: int, dtype: torch.dtype) -> torch.Tensor:
        if not parts:
            return torch.zeros(1, 0, dtype=dtype)
        return torch.cat([torch.as_tensor(p[i]).to(dtype) for p in parts]).unsqueeze(0)

    loss_mask = cat(2, torch.float32)
    shifted = None
    if mtp_depth and parts:
        shifted = read_shifted(
            [
                (full_lengths[d], start, length, piece)
                for (d, start, length), piece in zip(ranges, parts, strict=True)
            ],
            mtp_depth,
            lambda i, start, length: source.read(
                micro_batch.seq_indices[ranges[i][0]], start, length
            ),
        )
    index = None
    if my_shard.num_tokens > 0:
        active = tuple(p for p, s in enumerate(shards) if s.num_tokens > 0)
        index = ring_index(shards, position, active)
    return LocalBatch(
        tokens=cat(0, torch.int64),
        labels=cat(1, torch.int64),
        loss_mask=loss_mask,
        host_loss_tokens=float(loss_mask.sum()),
        position_ids=torch.tensor(my_shard.positions(), dtype=torch.int64).unsqueeze(0),
        full_doc_lengths=full_lengths,
        shard=my_shard,
        ring=micro_batch.ring,
        rank=rank,
        offload_ratio=micro_batch.offload_ratio,
        ring_index=index,
        doc_ids=tuple(int(i) for i in micro_batch.seq_indices),
        shifted=shifted,
    )


def read_local(plan, source: TokenSource, rank: int, *, mtp_depth: int = 0) -> list[LocalBatch]:
    """Pool rank `rank`'s micro-batches of `plan` (a `StepPlan`), read from `source` (host tensors).

    Local work only (no collective): the prefetch thread runs it ahead of the step. A ring
    member without tokens (a pack smaller than its ring) skips the micro-batch.
    `mtp_depth`: see `gather_local_batch`.
    """
    batches = (
        gather_local_batch(plan, mb, rank, source, mtp_depth=mtp_depth)
        for mb in plan.for_rank(rank)
    )
    return [batch for batch in batches if batch.num_tokens > 0]
