"""Unequal q/k and v head dims (multi-latent attention): native, or padded (ops layer).

MLA's queries and keys carry `qk_head_dim + qk_pos_emb_head_dim` channels per head, its
values `v_head_dim` (DeepSeek-V3: 192 and 128). A varlen kernel may take that natively: it
then has a method `unequal_head_dims_reason(facts, *, dtype, head_dim, head_dim_v)` that
returns None where it runs such tensors on the device (its whole check, in place of
`unavailable_reason`) (the CPU `math` kernel; FlashAttention-4 on Blackwell for the
pairs of `device.FA4_BLACKWELL_PAIRS`). Every other kernel runs such tensors through
`PaddedHeadDims`: q, k and v are zero-padded to one head dim `max(Dqk, Dv)`, the output and
the gradients are sliced back. Zero channels add nothing to a score (q.k) and give zero
output channels, so the result is exact; the price is the padded FLOPs and memory
(`scheduler.cost` prices what runs).

The choice is made once, at start-up (`registry.resolve_kernel(..., head_dim_v=)`): the
resolved name is the kernel's, or the kernel's with `PAD_SUFFIX` (`"torch_flash+pad_v"`),
which `registry.get_kernel` turns into the padded kernel on every rank.
"""

from __future__ import annotations

import torch
from torch.nn import functional

from megatron_hdp.attention.kernels.base import VarlenBlocks, VarlenKernel
from megatron_hdp.attention.kernels.device import DeviceFacts

#: Appended to a kernel's name when it runs unequal head dims padded.
PAD_SUFFIX = "+pad_v"


def native_reason(
    kernel: VarlenKernel,
    facts: DeviceFacts,
    *,
    dtype: torch.dtype,
    head_dim: int,
    head_dim_v: int,
) -> str | None:
    """None if `kernel` runs q/k of `head_dim` with v of `head_dim_v` here, as they are."""
    method = getattr(kernel, "unequal_head_dims_reason", None)
    if method is None:
        return f"{kernel.name} takes equal q/k and v head dims only"
    return method(facts, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v)


def base_name(name: str) -> str:
    """The kernel's own name, without `PAD_SUFFIX`."""
    return name.removesuffix(PAD_SUFFIX)


def _pad(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x if x.shape[-1] == dim else functional.pad(x, (0, dim - x.shape[-1]))


class PaddedHeadDims:
    """`inner` on q, k, v zero-padded to one head dim; results sliced back (exact).

    Args:
        inner: A kernel that takes equal head dims only.
    """

    def __init__(self, inner: VarlenKernel) -> None:
        self.inner = inner
        self.name = inner.name + PAD_SUFFIX

    def unavailable_reason(self, facts: DeviceFacts, *, dtype, head_dim) -> str | None:
        """The inner kernel's reason at the padded head dim (the caller passes the max)."""
        return self.inner.unavailable_reason(facts, dtype=dtype, head_dim=head_dim)

    def activate(self) -> None:
        """The inner kernel's set-up."""
        self.inner.activate()

    def forward(self, q_THD, k_TGD, v_TGD, blocks: VarlenBlocks, *, scale):
        """See `base.VarlenKernel.forward`; `scale` must be given (the padded dim is not D)."""
        dim = max(q_THD.shape[-1], v_TGD.shape[-1])
        out, lse = self.inner.forward(
            _pad(q_THD, dim), _pad(k_TGD, dim), _pad(v_TGD, dim), blocks, scale=scale
        )
        return out[..., : v_TGD.shape[-1]], lse

    def backward(self, dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_HT, blocks, *, scale):
        """See `base.VarlenKernel.backward`: dout and out padded with zeros as v is."""
        dim = max(q_THD.shape[-1], v_TGD.shape[-1])
        dq, dk, dv = self.inner.backward(
            _pad(dout_THD, dim),
            _pad(q_THD, dim),
            _pad(k_TGD, dim),
            _pad(v_TGD, dim),
            _pad(out_THD, dim),
            lse_HT,
            blocks,
            scale=scale,
        )
        qk = q_THD.shape[-1]
        return dq[..., :qk], dk[..., :qk], dv[..., : v_TGD.shape[-1]]
