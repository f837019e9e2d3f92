"""The reference kernels: a loop over the documents inside the kernel, one dense block each.

`"torch"` uses aten's flash-attention CPU kernels; `"math"` is plain matmul + logsumexp, the
cross-check. Both are CPU kernels: on CUDA they would materialise a dense score matrix per
document, so kernel choice refuses them there (tests may still call them on any device).
K/V heads are expanded per block here, inside the kernel (the GPU kernels take GQA natively).
Sliding-window (banded) blocks run the dense banded math of `kernels.band` in both kernels.
`"math"` also takes a value head dim that differs from the q/k one (multi-latent attention);
aten's CPU flash kernels do not, so `"torch"` gets them padded (`kernels.head_dims`).
"""

from __future__ import annotations

import torch

from megatron_hdp.attention.backends import AttentionBackend, MathBackend, TorchBackend
from megatron_hdp.attention.kernels.band import band_backward, band_forward
from megatron_hdp.attention.kernels.base import VarlenBlocks
from megatron_hdp.attention.kernels.device import DeviceFacts


def expand_groups(x_TGD: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V of `groups` heads repeated to `heads` (GQA), [tokens, heads, dim]."""
    groups = x_TGD.shape[1]
    return x_TGD if groups == heads else x_TGD.repeat_interleave(heads // groups, dim=1)


def reduce_groups(x_THD: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `expand_groups`: per-head rows summed back to `groups` heads."""
    t, heads, d = x_THD.shape
    return x_THD if heads == groups else x_THD.view(t, groups, heads // groups, d).sum(dim=2)


class BlockLoopKernel:
    """A varlen kernel made of one dense block call per document (`backends` block kernels)."""

    def __init__(
        self, name: str, block: AttentionBackend, *, unequal_head_dims: bool = False
    ) -> None:
        self.name = name
        self._block = block
        self._unequal_head_dims = unequal_head_dims

    def unavailable_reason(self, facts: DeviceFacts, *, dtype, head_dim) -> str | None:
        """Runs on CPU only: on CUDA a dense block would hold a `[heads, s, s]` score matrix."""
        if facts.type == "cpu":
            return None
        return (
            f"is a CPU kernel: on {facts.type} it would compute dense [heads, s, s] scores per "
            "document (out of memory at real lengths); use a flash kernel "
            f"(torch_flash or flash_attn, with --bf16)"
        )

    def unequal_head_dims_reason(self, facts: DeviceFacts, *, dtype, head_dim, head_dim_v):
        """None on CPU if the block kernel takes a value head dim unlike the q/k one (math)."""
        if not self._unequal_head_dims:
            return "aten's CPU flash kernels need equal q/k and v head dims"
        return self.unavailable_reason(facts, dtype=dtype, head_dim=head_dim)

    def activate(self) -> None:
        """Nothing to set up."""

    def window_reason(self) -> str | None:
        """Banded steps run `kernels.band`'s dense banded math: always available."""
        return None

    def _pieces(self, blocks: VarlenBlocks):
        q0 = k0 = 0
        for lq, lk in zip(blocks.lengths_q, blocks.lengths_k, strict=True):
            yield slice(q0, q0 + lq), slice(k0, k0 + lk)
            q0, k0 = q0 + lq, k0 + lk

    def forward(self, q_THD, k_TGD, v_TGD, blocks, *, scale):
        """See `base.VarlenKernel.forward`."""
        if blocks.band is not None:
            return band_forward(q_THD, k_TGD, v_TGD, blocks, scale=scale)
        heads = q_THD.shape[1]
        out = q_THD.new_empty((*q_THD.shape[:2], v_TGD.shape[-1]))
        lse = None
        for rows, cols in self._pieces(blocks):
            out_b, lse_b = self._block.forward(
                q_THD[rows].transpose(0, 1).contiguous(),
                expand_groups(k_TGD[cols], heads).transpose(0, 1).contiguous(),
                expand_groups(v_TGD[cols], heads).transpose(0, 1).contiguous(),
                causal=blocks.causal,
                scale=scale,
            )
            if lse is None:
                lse = torch.empty((heads, q_THD.shape[0]), dtype=lse_b.dtype, device=q_THD.device)
            out[rows] = out_b.transpose(0, 1)
            lse[:, rows] = lse_b
        return out, lse

    def backward(self, dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_HT, blocks, *, scale):
        """See `base.VarlenKernel.backward`."""
        if blocks.band is not None:
            return band_backward(
                dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_HT, blocks, scale=scale
            )
        heads, groups = q_THD.shape[1], k_TGD.shape[1]
        dq = torch.empty_like(q_THD)
        dk, dv = torch.empty_like(k_TGD), torch.empty_like(v_TGD)
        for rows, cols in self._pieces(blocks):
            dq_b, dk_b, dv_b = self._block.backward(
                dout_THD[rows].transpose(0, 1).contiguous(),
                q_THD[rows].transpose(0, 1).contiguous(),
                expand_groups(k_TGD[cols], heads).transpose(0, 1).contiguous(),
                expand_groups(v_TGD[cols], heads).transpose(0, 1).contiguous(),
                out_THD[rows].transpose(0, 1).contiguous(),
                lse_HT[:, rows].contiguous(),
                causal=blocks.causal,
                scale=scale,
            )
            dq[rows] = dq_b.transpose(0, 1)
            dk[cols] = reduce_groups(dk_b.transpose(0, 1), groups)
            dv[cols] = reduce_groups(dv_b.transpose(0, 1), groups)
        return dq, dk, dv


TORCH = BlockLoopKernel("torch", TorchBackend(), unequal_head_dims=False)
MATH = BlockLoopKernel("math", MathBackend(), unequal_head_dims=True)
