"""Sliding-window attention on HDP's packs and zigzag rings: which rows meet (ops layer).

Megatron-Core's window `(w, 0)` (`TransformerConfig.window_size`, Transformer Engine's and
flash-attn's convention): the query at position i of a document sees the keys at positions
j with `i - w <= j <= i` (w earlier tokens and itself). The flags' checks and the window's
pricing are pure (`scheduler.windows`).

For one micro-batch and window, `window_plan(shards, position, active, window)` works out on
the host, for every (member, source) pair of the ring, which of the member's query rows see
any key of the source, and which of the source's key rows any of those query rows sees
(vectorised: `searchsorted` over `(document, position)` keys). From this:

- the member's steps (`WindowPlan.steps`): a step where no query row sees a key of the
  source is left out (no kernel call). The others compute only the rows that meet: as the
  causal (own chunks) or fully visible blocks of full attention where the window does not
  bind, as banded blocks (`kernels.base.Band`, the rows' positions) where it does. Every
  query row of a step sees at least one key, so no kernel ever returns an empty row.
- the ring's traffic (`WindowPlan.carried`): a source's K/V travel hop by hop around the
  ring (`window_ring`); after hop t they carry only the rows that some member at least t
  hops further needs, and a hop that carries no row sends no message. Every member derives
  the same plan from the same lengths, so senders and receivers agree on every message.
- the gradients' way back (`WindowPlan.grad_rows`): the dK/dV of the rows other members
  need travel in one fixed layout, hop by hop, to the owner, which keeps its own part.

A window of at least the longest document minus one never binds: callers run full causal
attention instead (`binds`). Pure host work, no collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_hdp.attention.kernels.base import Band, VarlenBlocks
from megatron_hdp.attention.ring_index import StepBlocks
from megatron_hdp.scheduler.windows import check_window, window_problems
from megatron_hdp.sharding import RankShard

__all__ = ["check_window", "window_problems", "binds", "window_plan", "on_device"]


def binds(window: int | None, doc_lengths: Sequence[int]) -> bool:
    """Whether `window` hides any key from any query of documents of `doc_lengths`."""
    return window is not None and bool(doc_lengths) and window < max(doc_lengths) - 1


@dataclass(frozen=True)
class WindowPlan:
    """One member's windowed steps of a micro-batch, and the ring's traffic (all members).

    Attributes:
        window: The left window.
        steps: Blocks against every source that any local query row sees, by source.
        carried: `(source, hop)` -> the source's rows (host int64, sorted) its K/V carry
            after `hop` hops; hop 0 is every row.
        grad_rows: source -> the rows whose dK/dV travel back to it (those any other
            member needs: `carried[source, 1]`).
    """

    window: int
    steps: dict[int, StepBlocks]
    carried: dict[tuple[int, int], torch.Tensor]
    grad_rows: dict[int, torch.Tensor]

    def rows_after(self, source: int, hop: int) -> int:
        """How many of `source`'s rows travel on `hop` (0 for none)."""
        return int(self.carried[source, hop].numel())


def _keys(shard: RankShard, span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(doc * span + position, doc, position)` of every local row, in local order."""
    lengths = torch.tensor(shard.local_doc_lengths(), dtype=torch.int64)
    docs = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    positions = torch.tensor(shard.positions(), dtype=torch.int64)
    return docs * span + positions, docs, positions


def _count(sorted_keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """How many of `sorted_keys` lie in `[lo, hi]`, elementwise.

    numpy's searchsorted: torch's is several times slower on the host. numpy is imported
    here, not with the module: the ring imports this module, and runs without numpy
    unless a window binds.
    """
    import numpy as np

    keys = sorted_keys.numpy()
    first = np.searchsorted(keys, lo.numpy(), side="left")
    last = np.searchsorted(keys, hi.numpy(), side="right")
    return torch.from_numpy(last - first)


def _sees(q_keys: torch.Tensor, k_keys: torch.Tensor, window: int) -> torch.Tensor:
    """For every query key: whether a key lies in `[q - window, q]`."""
    return _count(k_keys, q_keys - window, q_keys) > 0


def _seen(q_keys: torch.Tensor, k_keys: torch.Tensor, window: int) -> torch.Tensor:
    """For every key: whether a query lies in `[k, k + window]`."""
    return _count(q_keys, k_keys, k_keys + window) > 0


def window_plan(
    shards: Sequence[RankShard],
    position: int,
    active: Sequence[int],
    window: int,
    doc_lengths: Sequence[int],
) -> WindowPlan:
    """The windowed steps of ring position `position` and the ring's traffic, on the host.

    `shards` are every ring position's (`sharding.shard(doc_lengths, k)`), `active` the
    positions holding tokens, in ring order. With one active position (a pack) the one step
    gets no row indices.
    """
    import numpy as np

    span = max(doc_lengths) + window + 2  # keeps [pos - w, pos + w] inside its document
    keys = {p: _keys(shards[p], span) for p in active}
    n = len(active)
    carried: dict[tuple[int, int], torch.Tensor] = {}
    for i, source in enumerate(active):
        k_keys = keys[source][0]
        carried[source, 0] = torch.arange(k_keys.numel())
        # Suffix union over the members t..n-1 hops further along.
        needed = torch.zeros(k_keys.numel(), dtype=torch.bool)
        for hop in range(n - 1, 0, -1):
            member = active[(i + hop) % n]
            needed |= _seen(keys[member][0], k_keys, window)
            carried[source, hop] = needed.nonzero().flatten()
    grad_rows = {s: carried[s, 1] for s in active if n > 1}
    steps = {}
    me = active.index(position)
    q_keys, q_docs, q_pos = keys[position]
    num_docs = len(doc_lengths)
    for hop in range(n):
        source = active[(me - hop) % n]
        k_keys, k_docs, k_pos = keys[source]
        sees = _sees(q_keys, k_keys, window)
        if not bool(sees.any()):
            continue  # the whole step lies outside the window: no kernel call
        q_rows = sees.nonzero().flatten()
        k_need = _seen(q_keys[q_rows], k_keys, window).nonzero().flatten()
        lengths_q = torch.bincount(q_docs[q_rows], minlength=num_docs)
        lengths_k = torch.bincount(k_docs[k_need], minlength=num_docs)
        keep = lengths_q > 0
        lengths_q, lengths_k = lengths_q[keep], lengths_k[keep]
        pq, pk = q_pos[q_rows], k_pos[k_need]
        cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), lengths_q.cumsum(0)])
        cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), lengths_k.cumsum(0)])
        last_q, first_q = pq[cu_q[1:] - 1], pq[cu_q[:-1]]
        last_k, first_k = pk[cu_k[1:] - 1], pk[cu_k[:-1]]
        banded = bool((last_q - first_k > window).any())
        if source == position:
            causal = True
        else:
            causal = False
            banded = banded or bool((last_k > first_q).any())
        kv_rows = torch.from_numpy(np.searchsorted(carried[source, hop].numpy(), k_need.numpy()))
        steps[source] = _HostStep(
            q_rows=q_rows if n > 1 else None,
            kv_rows=kv_rows if n > 1 else None,
            lengths_q=tuple(lengths_q.tolist()),
            lengths_k=tuple(lengths_k.tolist()),
            causal=causal,
            positions=(pq, pk) if banded else None,
        )
    return WindowPlan(window=window, steps=steps, carried=carried, grad_rows=grad_rows)


@dataclass(frozen=True)
class _HostStep:
    q_rows: torch.Tensor | None
    kv_rows: torch.Tensor | None
    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]
    causal: bool
    positions: tuple[torch.Tensor, torch.Tensor] | None

    def on_device(self, device: torch.device, window: int) -> StepBlocks:
        band = None
        if self.positions is not None:
            pq, pk = self.positions
            band = Band(window, pq.to(device), pk.to(device), pq, pk)
        blocks = VarlenBlocks.build(
            self.lengths_q, self.lengths_k, causal=self.causal and band is None, device=device
        )
        if band is not None:
            blocks = dataclasses.replace(blocks, band=band)
        return StepBlocks(
            q_rows=None if self.q_rows is None else self.q_rows.to(device),
            kv_rows=None if self.kv_rows is None else self.kv_rows.to(device),
            blocks=blocks,
        )


@dataclass(frozen=True)
class DevicePlan:
    """A `WindowPlan` with its steps and the traffic's row selections on one device.

    Attributes:
        plan: The host plan.
        steps: `plan.steps` on the device.
        forward_select: `(source, hop)` -> rows of the K/V held after `hop - 1` hops that
            travel on `hop` (None: all of them); only hops that carry rows.
        grad_slots: `(source, hop)` -> where the rows held after `hop` hops sit in the
            gradient layout `plan.grad_rows[source]` (hops >= 1 that carry rows).
        own_slots: source -> where `grad_rows[source]` sit among the source's rows.
    """

    plan: WindowPlan
    steps: dict[int, StepBlocks]
    forward_select: dict[tuple[int, int], torch.Tensor | None]
    grad_slots: dict[tuple[int, int], torch.Tensor]
    own_slots: dict[int, torch.Tensor]


def on_device(plan: WindowPlan, device: torch.device) -> DevicePlan:
    """`plan`'s tensors on `device` (host work and one copy each; done once per micro-batch)."""
    steps = {s: step.on_device(device, plan.window) for s, step in plan.steps.items()}
    forward_select, grad_slots = {}, {}
    for (source, hop), rows in plan.carried.items():
        if hop == 0 or rows.numel() == 0:
            continue
        held = plan.carried[source, hop - 1]
        if held.numel() == rows.numel():
            forward_select[source, hop] = None
        else:
            forward_select[source, hop] = _positions_in(held, rows).to(device)
        grad_slots[source, hop] = _positions_in(plan.grad_rows[source], rows).to(device)
    own_slots = {s: rows.to(device) for s, rows in plan.grad_rows.items()}
    return DevicePlan(plan, steps, forward_select, grad_slots, own_slots)


def _positions_in(sorted_rows: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Where each of `rows` sits in `sorted_rows` (every one is there)."""
    import numpy as np

    return torch.from_numpy(np.searchsorted(sorted_rows.numpy(), rows.numpy()))
