"""Dense banded attention per document: the CPU kernels' path for sliding-window blocks (ops).

A banded step (`base.Band`) says by position which key rows each query row sees. Per
document block this computes dense `[H, q, k]` scores, masks them with the band and runs
plain softmax attention (16-bit inputs in float32), forward and backward, with the merged
output and log-sum-exp in the backward as every kernel takes them. Every query row of a
banded block sees at least one key (`attention.window` leaves the others out), so no row's
log-sum-exp is -inf. CPU reference only: the GPU kernels take the window as their own
arguments (`kernels.windowed`).
"""

from __future__ import annotations

import torch

from megatron_hdp.attention.kernels.base import Band, VarlenBlocks


def band_mask(positions_q: torch.Tensor, positions_k: torch.Tensor, window: int) -> torch.Tensor:
    """`[q, k]` bool: key j visible to query i iff `i - window <= j <= i` (positions)."""
    diff = positions_q.unsqueeze(1) - positions_k.unsqueeze(0)
    return (diff >= 0) & (diff <= window)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _pieces(blocks: VarlenBlocks):
    q0 = k0 = 0
    for lq, lk in zip(blocks.lengths_q, blocks.lengths_k, strict=True):
        yield slice(q0, q0 + lq), slice(k0, k0 + lk)
        q0, k0 = q0 + lq, k0 + lk


def _expand(x_TGD: torch.Tensor, heads: int) -> torch.Tensor:
    groups = x_TGD.shape[1]
    return x_TGD if groups == heads else x_TGD.repeat_interleave(heads // groups, dim=1)


def _reduce(x_THD: torch.Tensor, groups: int) -> torch.Tensor:
    t, heads, d = x_THD.shape
    return x_THD if heads == groups else x_THD.view(t, groups, heads // groups, d).sum(dim=2)


def _scores(q, k, band: Band, rows, cols, scale):
    """Masked scores `[H, q, k]` of one document block in the compute dtype."""
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = band_mask(band.positions_q[rows], band.positions_k[cols], band.window)
    return scores.masked_fill(~mask, float("-inf"))


def band_forward(q_THD, k_TGD, v_TGD, blocks: VarlenBlocks, *, scale):
    """`(out [Tq, H, D], lse [H, Tq])` of every document's banded block."""
    band, heads = blocks.band, q_THD.shape[1]
    dtype = _compute_dtype(q_THD.dtype)
    out = torch.empty_like(q_THD)
    lse = torch.empty((heads, q_THD.shape[0]), dtype=dtype, device=q_THD.device)
    for rows, cols in _pieces(blocks):
        q = q_THD[rows].to(dtype)
        k, v = (_expand(t[cols], heads).to(dtype) for t in (k_TGD, v_TGD))
        scores = _scores(q, k, band, rows, cols, scale)
        lse_b = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse_b.unsqueeze(-1))
        out[rows] = torch.einsum("hqk,khd->qhd", probs, v).to(q_THD.dtype)
        lse[:, rows] = lse_b
    return out, lse


def band_backward(dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_HT, blocks, *, scale):
    """`(dq, dk, dv)` of every document's banded block, given the merged out and lse."""
    band, heads, groups = blocks.band, q_THD.shape[1], k_TGD.shape[1]
    dtype = _compute_dtype(q_THD.dtype)
    dq, dk, dv = torch.empty_like(q_THD), torch.empty_like(k_TGD), torch.empty_like(v_TGD)
    for rows, cols in _pieces(blocks):
        q, dout, out = (t[rows].to(dtype) for t in (q_THD, dout_THD, out_THD))
        k, v = (_expand(t[cols], heads).to(dtype) for t in (k_TGD, v_TGD))
        scores = _scores(q, k, band, rows, cols, scale)
        probs = torch.exp(scores - lse_HT[:, rows].to(dtype).unsqueeze(-1))
        dv_b = torch.einsum("hqk,qhd->khd", probs, dout)
        dprobs = torch.einsum("qhd,khd->hqk", dout, v)
        delta = (dout * out).sum(-1).transpose(0, 1).unsqueeze(-1)  # [H, q, 1]
        dscores = probs * (dprobs - delta)
        dq[rows] = (torch.einsum("hqk,khd->qhd", dscores, k) * scale).to(q_THD.dtype)
        dk[cols] = _reduce(torch.einsum("hqk,qhd->khd", dscores, q) * scale, groups).to(dk.dtype)
        dv[cols] = _reduce(dv_b, groups).to(dv.dtype)
    return dq, dk, dv
