"""HDP attention: causal varlen attention, local or zigzag-ring, with GQA (ops layer).

Two autograd functions cover the two cases of a micro-batch:
- all its tokens on this rank (a ring of one: a pack): one varlen kernel call on the packed
  tensors with the documents' offsets, forward and backward, in the model's dtype;
- a ring of k ranks: zigzag ring attention. K/V circulate k-1 times around the ring in
  the forward pass; in the backward pass K/V circulate again together with a dK/dV
  accumulator that needs k hops to end at its owner. Partial results merge with
  log-sum-exp.

Shape legend: T local tokens, H query heads, G key/value heads (GQA: H % G == 0), D head
dim (the value head dim Dv may differ from the q/k one: multi-latent attention; K and V then
travel as one flat message, `kv_message`). Tensors are `[T, H, D]` (Megatron's THD)
throughout. Each ring step makes ONE varlen
kernel call for all documents of the micro-batch (`kernels.base`): the step's query rows and
K/V rows are gathered, packed per document with `cu_seqlens`, and K/V keep their G heads.

Which blocks a step computes (rank at ring position p holds chunks p and 2k-1-p of every
document; at step s it holds the K/V of source j = (p - s) mod k):
- j == p: the local tokens of each document, causal (the two chunks are in position order);
- j <  p: both local chunks against the source's *first* chunk, fully visible;
- j >  p: the local *second* chunk against both source chunks, fully visible.
Every other chunk pair is masked out entirely. This holds for any chunk sizes.

An attention variant that changes each query row's softmax as a whole (the sink of
`sinks.py`) is a `RowFinalize` step after the merge, on the pack and the ring path alike.
Sliding-window layers (`window=`) run `window_ring` instead: the same ring on a
`window.WindowPlan`, which skips the steps and K/V rows the window hides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_hdp.attention.finalize import RowFinalize, finalize_grads
from megatron_hdp.attention.kernels.base import VarlenKernel, accumulation_dtype
from megatron_hdp.attention.kernels.registry import get_kernel
from megatron_hdp.attention.kv_message import KVLayout
from megatron_hdp.attention.pack import PackAttention
from megatron_hdp.attention.ring_index import StepBlocks, ring_index
from megatron_hdp.distributed.ring_comm import CommStats, RingComm
from megatron_hdp.host_copy import to_device
from megatron_hdp.sharding import RankShard, shard

if TYPE_CHECKING:
    from megatron_hdp.attention.dropout import AttentionDropout

_TAG_FWD_KV, _TAG_BWD_KV, _TAG_BWD_DKV = 11, 12, 13


@dataclass(frozen=True)
class RingAttentionSpec:
    """Everything the attention of one micro-batch needs besides q, k, v.

    Attributes:
        doc_lengths: Full length of every document of the micro-batch.
        shards: The shard of every ring position (`sharding.shard(doc_lengths, k)`).
        position: This rank's ring position.
        active: Ring positions that hold at least one token, in ring order. Only they
            take part: a member without tokens has nothing to attend and skips the
            micro-batch altogether.
        comm: Communicator over the active members' ranks; None when only one is active.
        backend: The varlen kernel: one call per ring step for all documents.
    """

    doc_lengths: tuple[int, ...]
    shards: tuple[RankShard, ...]
    position: int
    active: tuple[int, ...]
    comm: RingComm | None
    backend: VarlenKernel
    _blocks_by_device: dict = field(default_factory=dict, compare=False, repr=False)

    def step_blocks(self, device: torch.device) -> dict[int, StepBlocks]:
        """The packed blocks against every source, built once per micro-batch and device.

        Every layer of the micro-batch attends with the same spec. `build_ring_spec` takes
        them ready-made from the batch (`LocalBatch.attention_steps`, built with the batch);
        otherwise they are built here, on first use.
        """
        if device not in self._blocks_by_device:
            self._blocks_by_device[device] = _step_blocks(self, device)
        return self._blocks_by_device[device]


def active_positions(shards: Sequence[RankShard]) -> tuple[int, ...]:
    """Ring positions that hold tokens."""
    return tuple(p for p, s in enumerate(shards) if s.num_tokens > 0)


def build_ring_spec(
    doc_lengths: Sequence[int],
    ring: Sequence[int],
    *,
    rank: int,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    backend: str = "torch",
    steps: dict[int, StepBlocks] | None = None,
) -> RingAttentionSpec:
    """The spec of `rank` for documents `doc_lengths` on `ring` (ranks of `group`).

    A ring of one needs no group. Raises ValueError if `rank` holds no token of the
    micro-batch (it must skip the micro-batch instead). `steps`: the step blocks already
    built for this rank and micro-batch (`ring_index`), on the device of their tensors.
    """
    shards = tuple(shard(doc_lengths, len(ring)))
    position = tuple(ring).index(rank)
    active = active_positions(shards)
    if position not in active:
        raise ValueError(f"rank {rank} holds no token of this micro-batch")
    comm = None
    if len(active) > 1:
        comm = RingComm(group, [ring[p] for p in active], stats)
    spec = RingAttentionSpec(
        doc_lengths=tuple(doc_lengths),
        shards=shards,
        position=position,
        active=active,
        comm=comm,
        backend=get_kernel(backend),
    )
    if steps:
        device = next(iter(steps.values())).blocks.cu_seqlens_q.device
        spec._blocks_by_device[device] = steps
    return spec


def _segments(spec: RingAttentionSpec, source: int) -> list[tuple[int, int, int, int, bool]]:
    """`(q_start, q_len, kv_start, kv_len, causal)` blocks of this rank against `source`."""
    me, src = spec.shards[spec.position], spec.shards[source]
    q_offsets, kv_offsets = me.doc_offsets(), src.doc_offsets()
    out = []
    for d in range(len(spec.doc_lengths)):
        a, b = me.first_len[d], me.second_len[d]
        if source == spec.position:
            seg = (q_offsets[d], a + b, kv_offsets[d], a + b, True)
        elif source < spec.position:
            seg = (q_offsets[d], a + b, kv_offsets[d], src.first_len[d], False)
        else:
            seg = (q_offsets[d] + a, b, kv_offsets[d], src.first_len[d] + src.second_len[d], False)
        if seg[1] > 0 and seg[3] > 0:
            out.append(seg)
    return out


#: The old name of `ring_index.StepBlocks`.
_StepBlocks = StepBlocks


def _step_blocks(spec: RingAttentionSpec, device: torch.device) -> dict[int, StepBlocks]:
    """The blocks against every active source (sources without any block are left out).

    Row indices and offsets are built on the host (`ring_index`, vectorised) and reach the
    device in one non-blocking copy (`host_copy`): no host-device sync per micro-batch, none
    per layer. A pack gets no row indices (its one kernel call needs only the offsets).
    """
    index = ring_index(spec.shards, spec.position, spec.active)
    return index.on_device(to_device(index.buffer, device))


def _rows(
    blocks: StepBlocks, q_THD: torch.Tensor, kv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's query and K/V rows; every row for a pack (built without row indices)."""
    if blocks.q_rows is not None:
        return blocks.q_rows, blocks.kv_rows
    return (
        torch.arange(q_THD.shape[0], device=q_THD.device),
        torch.arange(kv.shape[0], device=kv.device),
    )


def _kv_buffer(spec: RingAttentionSpec, source: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(
        (spec.shards[source].num_tokens, *like.shape[1:]), dtype=like.dtype, device=like.device
    )


class _HDPAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q_THD, k_TGD, v_TGD, spec: RingAttentionSpec, scale: float, finalize=None, *params
    ):
        kv = KVLayout.of(k_TGD, v_TGD)
        active, me = spec.active, spec.active.index(spec.position)
        n = len(active)
        acc = accumulation_dtype(q_THD.dtype)
        steps = spec.step_blocks(q_THD.device)
        out_shape = (*q_THD.shape[:2], kv.v_dim)
        out_THD = torch.zeros(out_shape, dtype=acc, device=q_THD.device)
        lse_HT = torch.full(q_THD.shape[1::-1], float("-inf"), dtype=acc, device=q_THD.device)
        kv_cur = kv.pack(k_TGD, v_TGD)  # [T, G * (Dk + Dv)], one message
        for step in range(n):
            source = active[(me - step) % n]
            pending = None
            if step + 1 < n:
                nxt = active[(me - step - 1) % n]
                pending = spec.comm.exchange(kv_cur, _kv_buffer(spec, nxt, kv_cur), _TAG_FWD_KV)
            blocks = steps.get(source)
            if blocks is not None:
                rows, cols = _rows(blocks, q_THD, kv_cur)
                out_b, lse_b = spec.backend.forward(
                    q_THD.index_select(0, rows),
                    kv.keys(kv_cur).index_select(0, cols),
                    kv.values(kv_cur).index_select(0, cols),
                    blocks.blocks,
                    scale=scale,
                )
                # Merge with log-sum-exp; rows not yet touched have lse -inf and weight 0.
                lse_b = lse_b.to(acc)
                lse_old = lse_HT[:, rows]
                lse_new = torch.logaddexp(lse_old, lse_b)
                out_THD[rows] = out_THD[rows] * torch.exp(lse_old - lse_new).T.unsqueeze(
                    -1
                ) + out_b.to(acc) * torch.exp(lse_b - lse_new).T.unsqueeze(-1)
                lse_HT[:, rows] = lse_new
            if pending is not None:
                kv_cur = pending.wait()
        if finalize is not None:
            out_THD, lse_HT = finalize.forward(out_THD, lse_HT, *params)
        out_THD = out_THD.to(q_THD.dtype)
        ctx.save_for_backward(q_THD, k_TGD, v_TGD, out_THD, lse_HT, *params)
        ctx.spec, ctx.scale, ctx.steps, ctx.kv = spec, scale, steps, kv
        ctx.finalize = finalize
        return out_THD

    @staticmethod
    def backward(ctx, dout_THD):
        q_THD, k_TGD, v_TGD, out_THD, lse_HT, *params = ctx.saved_tensors
        spec, scale, steps, kv = ctx.spec, ctx.scale, ctx.steps, ctx.kv
        active, me = spec.active, spec.active.index(spec.position)
        n = len(active)
        acc = accumulation_dtype(q_THD.dtype)
        dout_THD = dout_THD.contiguous().to(q_THD.dtype)
        dq_THD = torch.zeros(q_THD.shape, dtype=acc, device=q_THD.device)
        kv_cur = kv.pack(k_TGD, v_TGD)
        pending_dkv = None
        dkv_own = None
        for step in range(n):
            source = active[(me - step) % n]
            nxt = active[(me - step - 1) % n]
            pending_kv = None
            if step + 1 < n:
                pending_kv = spec.comm.exchange(kv_cur, _kv_buffer(spec, nxt, kv_cur), _TAG_BWD_KV)
            dkv = torch.zeros(kv_cur.shape, dtype=acc, device=kv_cur.device)
            dk_TGD, dv_TGD = kv.keys(dkv), kv.values(dkv)
            blocks = steps.get(source)
            if blocks is not None:
                rows, cols = _rows(blocks, q_THD, kv_cur)
                dq_b, dk_b, dv_b = spec.backend.backward(
                    dout_THD.index_select(0, rows),
                    q_THD.index_select(0, rows),
                    kv.keys(kv_cur).index_select(0, cols),
                    kv.values(kv_cur).index_select(0, cols),
                    out_THD.index_select(0, rows),
                    lse_HT[:, rows].contiguous(),
                    blocks.blocks,
                    scale=scale,
                )
                dq_THD.index_add_(0, rows, dq_b.to(acc))
                dk_TGD.index_add_(0, cols, dk_b.to(acc))
                dv_TGD.index_add_(0, cols, dv_b.to(acc))
            if pending_dkv is not None:
                dkv = dkv + pending_dkv.wait()
            if n == 1:
                dkv_own = dkv
            else:
                # The accumulator travels with the K/V it belongs to; after n hops it is home.
                pending_dkv = spec.comm.exchange(dkv, _kv_buffer(spec, nxt, dkv), _TAG_BWD_DKV)
            if pending_kv is not None:
                kv_cur = pending_kv.wait()
        if pending_dkv is not None:
            dkv_own = pending_dkv.wait()
        dk_TGD = kv.keys(dkv_own).to(k_TGD.dtype)
        dv_TGD = kv.values(dkv_own).to(v_TGD.dtype)
        dparams = finalize_grads(ctx, 6, dout_THD, out_THD, lse_HT, params)
        return dq_THD.to(q_THD.dtype), dk_TGD, dv_TGD, None, None, None, *dparams


def _window_binds(window: int, doc_lengths: Sequence[int]) -> bool:
    """`window.binds`, imported for windowed layers only.

    The window's planning needs numpy, which a job without windows does not (the GPU check
    runs this module without it).
    """
    from megatron_hdp.attention.window import binds

    return binds(window, doc_lengths)


def hdp_attention(
    q_THD: torch.Tensor,
    k_TGD: torch.Tensor,
    v_TGD: torch.Tensor,
    spec: RingAttentionSpec,
    *,
    softmax_scale: float | None = None,
    dropout: AttentionDropout | None = None,
    finalize: RowFinalize | None = None,
    finalize_params: Sequence[torch.Tensor] = (),
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's tokens of a micro-batch; returns `[T, H, Dv]`.

    Collective over `spec.comm.ring` (the active members) when more than one member holds
    tokens: each must call it (forward and backward) for the same micro-batch and layer,
    in the same order. A ring of one communicates nothing.

    Args:
        q_THD: Local queries, laid out as `spec.shards[spec.position]` says.
        k_TGD: Local keys, G heads (G divides H), q's head dim.
        v_TGD: Local values, G heads; their head dim Dv may differ (multi-latent attention).
        spec: The micro-batch's documents, ring and backend.
        softmax_scale: Defaults to `1 / sqrt(D)`, D the q/k head dim.
        dropout: Keyed dropout of the probabilities (`attention.dropout`): the spec then
            computes with its kernel, on blocks that carry their rows' keys.
        finalize: A step after the merge of every query row (`RowFinalize`, e.g. the
            attention sink of `sinks.SoftmaxSink`); None: none.
        finalize_params: The tensors `finalize` differentiates (its autograd inputs).
        window: Sliding window (`attention.window`): each query sees `window` earlier
            positions and its own; None (or a window no document exceeds) is full causal.
            Runs `window_ring.window_attention`, which skips what the window hides.
    """
    num_tokens = spec.shards[spec.position].num_tokens
    if (
        q_THD.shape[0] != num_tokens
        or k_TGD.shape[:2] != v_TGD.shape[:2]
        or k_TGD.shape[0] != num_tokens
        or q_THD.shape[-1] != k_TGD.shape[-1]
    ):
        raise ValueError(
            f"expected {num_tokens} local tokens for this ring position, k/v of equal heads "
            f"and q/k of equal head dims, got q {tuple(q_THD.shape)}, k {tuple(k_TGD.shape)}, "
            f"v {tuple(v_TGD.shape)}"
        )
    if q_THD.shape[1] % k_TGD.shape[1] != 0:
        raise ValueError(
            f"{q_THD.shape[1]} query heads are not a multiple of {k_TGD.shape[1]} key/value heads"
        )
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q_THD.shape[-1])
    if window is not None and _window_binds(window, spec.doc_lengths):
        from megatron_hdp.attention.window_ring import window_attention

        if k_TGD.shape[-1] != v_TGD.shape[-1]:
            raise ValueError(
                f"a sliding window with a value head dim ({v_TGD.shape[-1]}) unlike the key's "
                f"({k_TGD.shape[-1]}) is not supported"
            )
        return window_attention(
            q_THD,
            k_TGD,
            v_TGD,
            spec,
            window,
            scale,
            dropout=dropout,
            finalize=finalize,
            finalize_params=finalize_params,
        )
    if dropout is not None:
        spec = dropout.bind(spec, q_THD.device)
    if len(spec.active) == 1:
        blocks = spec.step_blocks(q_THD.device)[spec.position].blocks
        return PackAttention.apply(
            q_THD, k_TGD, v_TGD, blocks, spec.backend, scale, finalize, *finalize_params
        )
    return _HDPAttention.apply(q_THD, k_TGD, v_TGD, spec, scale, finalize, *finalize_params)
