"""Dense attention block kernels: what the CPU reference varlen kernels are made of (ops).

A *block* is dense attention of some query rows against some key rows, either fully
visible or causal (equal lengths, diagonal included). `kernels.cpu` loops over a ring
step's documents with one block each; ring attention merges partial results with
log-sum-exp, so a block kernel returns the log-sum-exp of every query row and accepts the
*merged* output and lse in its backward (the flash-attention recipe).

Shape legend: H heads, Tq query rows, Tk key rows, D head dim. Inputs are `[H, T, D]`,
lse is `[H, Tq]`. Key/value heads are already expanded to H (GQA is handled by callers).

Block kernels:
- `TorchBackend`: on CPU the aten flash-attention CPU kernels (private ops); on any other
  device the math kernel.
- `MathBackend`: plain matmul + logsumexp; device-generic, the reference and a cross-check.
The varlen GPU kernels (one call per ring step, native GQA) are in `kernels/`.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    """Computes one attention block and its gradients."""

    name: str

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `(out [H,Tq,D], lse [H,Tq])` of softmax(q k^T * scale) v."""
        ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return `(dq, dk, dv)` of the block, given the merged `out` and `lse` of the rows."""
        ...


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class MathBackend:
    """Matmul attention; runs on every device and in every floating dtype.

    16-bit inputs are computed in float32; outputs and gradients come back in the input
    dtype, lse in float32.
    """

    name = "math"

    @staticmethod
    def _probs(q, k, lse, causal, scale):
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if causal:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)
        return torch.exp(scores - lse.unsqueeze(-1)), lse

    def forward(self, q, k, v, *, causal, scale):
        """See `AttentionBackend.forward`."""
        dtype = _compute_dtype(q.dtype)
        q, k, v_c = q.to(dtype), k.to(dtype), v.to(dtype)
        probs, lse = self._probs(q, k, None, causal, scale)
        return torch.matmul(probs, v_c).to(v.dtype), lse

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        """See `AttentionBackend.backward`."""
        in_dtype, dtype = q.dtype, _compute_dtype(q.dtype)
        dout, q, k, v, out = (t.to(dtype) for t in (dout, q, k, v, out))
        lse = lse.to(dtype)
        probs, _ = self._probs(q, k, lse, causal, scale)
        dv = torch.matmul(probs.transpose(-1, -2), dout)
        dprobs = torch.matmul(dout, v.transpose(-1, -2))
        delta = (dout * out).sum(dim=-1, keepdim=True)
        dscores = probs * (dprobs - delta)
        dq = torch.matmul(dscores, k) * scale
        dk = torch.matmul(dscores.transpose(-1, -2), q) * scale
        return dq.to(in_dtype), dk.to(in_dtype), dv.to(in_dtype)


class TorchBackend:
    """aten's flash-attention CPU kernels on CPU; the math kernel elsewhere."""

    name = "torch"

    def __init__(self) -> None:
        self._math = MathBackend()

    def forward(self, q, k, v, *, causal, scale):
        """See `AttentionBackend.forward`."""
        if q.device.type != "cpu":
            return self._math.forward(q, k, v, causal=causal, scale=scale)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, causal, scale=scale
        )
        return out.squeeze(0), lse.squeeze(0)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        """See `AttentionBackend.backward`."""
        if q.device.type != "cpu":
            return self._math.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.unsqueeze(0).contiguous(),
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            out.unsqueeze(0).contiguous(),
            lse.unsqueeze(0).contiguous(),
            0.0,
            causal,
            scale=scale,
        )
        return dq.squeeze(0), dk.squeeze(0), dv.squeeze(0)
