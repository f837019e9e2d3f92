"""Sliding-window HDP attention: packs and zigzag rings that skip what the window hides (ops).

The same ring as `ring._HDPAttention` (K/V circulate k-1 hops forward; in the backward K/V
circulate again and dK/dV travel back to their owners; partial results merge with
log-sum-exp), on a `window.WindowPlan`:
- a step whose source the window hides from every local query makes no kernel call;
- each hop sends only the rows some member further along needs, and no message where none
  does (the previous member skips the send exactly where this one skips the receive: both
  read the same plan);
- the dK/dV accumulator of a source holds only the rows other members need
  (`grad_rows`); it starts at the member one hop after the owner and ends at the owner,
  which adds it to the gradient of its own step. With no such row nothing travels back.
A pack (one member) is one kernel call each way on the banded blocks.

Variants ride on the same seams as the full ring's: a `finalize.RowFinalize` step (the sink of
`sinks.py`) after the merge of every query row, pack and ring alike; keyed attention dropout
(`dropout.AttentionDropout.bind_window`) swaps in its kernel and blocks that carry their
rows' keys and the band, so each step drops exactly the probabilities the 1-rank run drops.

Collective over the plan's ring like `ring.hdp_attention`: every active member calls it for
the same micro-batch and layer, in the same order.
"""

from __future__ import annotations

import torch

from megatron_hdp.attention.finalize import finalize_grads
from megatron_hdp.attention.kernels.base import accumulation_dtype
from megatron_hdp.attention.pack import PackAttention
from megatron_hdp.attention.window import DevicePlan, on_device, window_plan

_TAG_FWD_KV, _TAG_BWD_KV, _TAG_BWD_DKV = 21, 22, 23


def device_plan(spec, window: int, device: torch.device) -> DevicePlan:
    """`spec`'s windowed plan on `device`, built once per micro-batch, window and device."""
    key = ("window", window, device)
    cache = spec._blocks_by_device
    if key not in cache:
        plan = window_plan(spec.shards, spec.position, spec.active, window, spec.doc_lengths)
        cache[key] = on_device(plan, device)
    return cache[key]


def _empty(rows: int, like: torch.Tensor, dtype=None) -> torch.Tensor:
    return torch.empty((rows, *like.shape[1:]), dtype=dtype or like.dtype, device=like.device)


def _send_rows(plan: DevicePlan, kv: torch.Tensor, source: int, hop: int):
    """The rows of `kv` (held after `hop - 1` hops) that travel on `hop`; None if none."""
    if plan.plan.rows_after(source, hop) == 0:
        return None
    select = plan.forward_select[source, hop]
    return kv if select is None else kv.index_select(0, select)


def _recv_buffer(plan: DevicePlan, like: torch.Tensor, source: int, hop: int):
    rows = plan.plan.rows_after(source, hop)
    return _empty(rows, like) if rows else None


def _pass_kv(spec, plan, kv_cur, like, step: int, tag: int):
    """Start hop `step + 1` of the K/V: send this step's source's rows, receive the next's."""
    active, me = spec.active, spec.active.index(spec.position)
    n = len(active)
    if step + 1 >= n:
        return None
    source, nxt = active[(me - step) % n], active[(me - step - 1) % n]
    send = None if kv_cur is None else _send_rows(plan, kv_cur, source, step + 1)
    return spec.comm.transfer(send, _recv_buffer(plan, like, nxt, step + 1), tag)


class _WindowRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_THD, k_TGD, v_TGD, spec, plan: DevicePlan, scale: float, finalize, *params):
        groups = k_TGD.shape[1]
        active, me = spec.active, spec.active.index(spec.position)
        n = len(active)
        acc = accumulation_dtype(q_THD.dtype)
        out_THD = torch.zeros(q_THD.shape, dtype=acc, device=q_THD.device)
        lse_HT = torch.full(q_THD.shape[1::-1], float("-inf"), dtype=acc, device=q_THD.device)
        kv_cur = torch.cat([k_TGD, v_TGD], dim=1).contiguous()
        like = kv_cur[:0]
        for step in range(n):
            source = active[(me - step) % n]
            pending = _pass_kv(spec, plan, kv_cur, like, step, _TAG_FWD_KV)
            blocks = plan.steps.get(source)
            if blocks is not None:
                rows, cols = blocks.q_rows, blocks.kv_rows
                out_b, lse_b = spec.backend.forward(
                    q_THD.index_select(0, rows),
                    kv_cur[:, :groups].index_select(0, cols),
                    kv_cur[:, groups:].index_select(0, cols),
                    blocks.blocks,
                    scale=scale,
                )
                lse_b = lse_b.to(acc)
                lse_old = lse_HT[:, rows]
                lse_new = torch.logaddexp(lse_old, lse_b)
                out_THD[rows] = out_THD[rows] * torch.exp(lse_old - lse_new).T.unsqueeze(
                    -1
                ) + out_b.to(acc) * torch.exp(lse_b - lse_new).T.unsqueeze(-1)
                lse_HT[:, rows] = lse_new
            if step + 1 < n:
                kv_cur = pending.wait() if pending is not None else None
        if finalize is not None:
            out_THD, lse_HT = finalize.forward(out_THD, lse_HT, *params)
        out_THD = out_THD.to(q_THD.dtype)
        ctx.save_for_backward(q_THD, k_TGD, v_TGD, out_THD, lse_HT, *params)
        ctx.spec, ctx.plan, ctx.scale, ctx.finalize = spec, plan, scale, finalize
        return out_THD

    @staticmethod
    def backward(ctx, dout_THD):
        q_THD, k_TGD, v_TGD, out_THD, lse_HT, *params = ctx.saved_tensors
        spec, plan, scale = ctx.spec, ctx.plan, ctx.scale
        groups = k_TGD.shape[1]
        active, me = spec.active, spec.active.index(spec.position)
        n = len(active)
        acc = accumulation_dtype(q_THD.dtype)
        dout_THD = dout_THD.contiguous().to(q_THD.dtype)
        dq_THD = torch.zeros(q_THD.shape, dtype=acc, device=q_THD.device)
        kv_cur = torch.cat([k_TGD, v_TGD], dim=1).contiguous()
        like = kv_cur[:0]
        grad_like = _empty(0, kv_cur, acc)
        dkv_own = None
        pending_acc = None
        for step in range(n):
            source = active[(me - step) % n]
            nxt = active[(me - step - 1) % n]
            pending_kv = _pass_kv(spec, plan, kv_cur, like, step, _TAG_BWD_KV)
            dkv = None
            blocks = plan.steps.get(source)
            if blocks is not None:
                rows, cols = blocks.q_rows, blocks.kv_rows
                dq_b, dk_b, dv_b = spec.backend.backward(
                    dout_THD.index_select(0, rows),
                    q_THD.index_select(0, rows),
                    kv_cur[:, :groups].index_select(0, cols),
                    kv_cur[:, groups:].index_select(0, cols),
                    out_THD.index_select(0, rows),
                    lse_HT[:, rows].contiguous(),
                    blocks.blocks,
                    scale=scale,
                )
                dq_THD.index_add_(0, rows, dq_b.to(acc))
                dkv = _empty(kv_cur.shape[0], kv_cur, acc).zero_()
                dkv[:, :groups].index_add_(0, cols, dk_b.to(acc))
                dkv[:, groups:].index_add_(0, cols, dv_b.to(acc))
            received = pending_acc.wait() if pending_acc is not None else None
            send_acc = None
            if step == 0:
                dkv_own = dkv
            elif plan.plan.grad_rows[source].numel():
                # The source's accumulator, in its fixed layout: what earlier members added.
                send_acc = received
                if send_acc is None:
                    send_acc = _empty(plan.plan.grad_rows[source].numel(), grad_like).zero_()
                if dkv is not None:
                    send_acc.index_add_(0, plan.grad_slots[source, step], dkv)
            # Hop step + 1 of the accumulators: this step's source's goes on, the next's comes.
            recv_acc = None
            if step + 1 >= 2 and n > 1 and plan.plan.grad_rows[nxt].numel():
                recv_acc = _empty(plan.plan.grad_rows[nxt].numel(), grad_like)
            pending_acc = None
            if n > 1:
                pending_acc = spec.comm.transfer(send_acc, recv_acc, _TAG_BWD_DKV)
                if recv_acc is None and pending_acc is not None:
                    pending_acc.wait()  # a send only: nothing comes back to add
                    pending_acc = None
            if step + 1 < n:
                kv_cur = pending_kv.wait() if pending_kv is not None else None
        final = pending_acc.wait() if pending_acc is not None else None
        if dkv_own is None:
            dkv_own = _empty(k_TGD.shape[0], torch.cat([k_TGD, v_TGD], 1), acc).zero_()
        if final is not None:
            dkv_own.index_add_(0, plan.own_slots[spec.position], final)
        dk_TGD = dkv_own[:, :groups].to(k_TGD.dtype)
        dv_TGD = dkv_own[:, groups:].to(v_TGD.dtype)
        dparams = finalize_grads(ctx, 7, dout_THD, out_THD, lse_HT, params)
        return dq_THD.to(q_THD.dtype), dk_TGD, dv_TGD, None, None, None, None, *dparams


def window_attention(
    q_THD,
    k_TGD,
    v_TGD,
    spec,
    window: int,
    scale: float,
    *,
    dropout=None,
    finalize=None,
    finalize_params=(),
) -> torch.Tensor:
    """Causal attention within `window` earlier positions of this rank's tokens; `[T, H, D]`.

    Collective over `spec.comm.ring` when more than one member holds tokens (see the
    module). `spec`, the tensors, `dropout` (`dropout.AttentionDropout`), `finalize` and
    `finalize_params` as for `ring.hdp_attention`, which checks them.
    """
    plan = device_plan(spec, window, q_THD.device)
    if dropout is not None:
        spec, plan = dropout.bind_window(spec, plan, q_THD.device)
    if len(spec.active) == 1:
        (blocks,) = plan.steps.values()
        return PackAttention.apply(
            q_THD, k_TGD, v_TGD, blocks.blocks, spec.backend, scale, finalize, *finalize_params
        )
    return _WindowRingAttention.apply(
        q_THD, k_TGD, v_TGD, spec, plan, scale, finalize, *finalize_params
    )
