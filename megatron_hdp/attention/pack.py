"""Attention of a micro-batch whose tokens all sit on this rank: one kernel call each way (ops).

Shared by the full causal path (`ring`) and the sliding-window path (`window_ring`): the
blocks say what the kernel computes (causal, or banded by a window), the kernel does it.
"""

from __future__ import annotations

import torch

from megatron_hdp.attention.finalize import finalize_grads
from megatron_hdp.attention.kernels.base import VarlenBlocks, VarlenKernel


class PackAttention(torch.autograd.Function):
    """A micro-batch whose tokens all sit on this rank: one kernel call each way.

    The documents are whole and in packing order, so the kernel runs on q, k, v as they are,
    with the documents' offsets; output and gradients stay in the model's dtype (no ring
    buffers, no log-sum-exp merge; a finalize step, if any, works on the kernel's output).
    """

    @staticmethod
    def forward(
        ctx,
        q_THD,
        k_TGD,
        v_TGD,
        blocks: VarlenBlocks,
        kernel: VarlenKernel,
        scale,
        finalize=None,
        *params,
    ):
        """`[T, H, Dv]` output of the kernel over `blocks`, finalized (e.g. a sink) if given."""
        out_THD, lse_HT = kernel.forward(q_THD, k_TGD, v_TGD, blocks, scale=scale)
        if finalize is not None:
            out_THD, lse_HT = finalize.forward(out_THD, lse_HT, *params)
            out_THD = out_THD.to(q_THD.dtype)
        ctx.save_for_backward(q_THD, k_TGD, v_TGD, out_THD, lse_HT, *params)
        ctx.blocks, ctx.kernel, ctx.scale, ctx.finalize = blocks, kernel, scale, finalize
        return out_THD

    @staticmethod
    def backward(ctx, dout_THD):
        """dq, dk, dv from the kernel's backward, and the finalize step's parameter grads."""
        q_THD, k_TGD, v_TGD, out_THD, lse_HT, *params = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(
            dout_THD.contiguous().to(q_THD.dtype),
            q_THD,
            k_TGD,
            v_TGD,
            out_THD,
            lse_HT,
            ctx.blocks,
            scale=ctx.scale,
        )
        dparams = finalize_grads(ctx, 7, dout_THD, out_THD, lse_HT, params)
        return dq, dk, dv, None, None, None, None, *dparams
