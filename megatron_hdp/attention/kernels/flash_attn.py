"""flash-attn 2.6-2.8's varlen kernels (`flash_attn.flash_attn_interface`), when installed.

`_flash_attn_varlen_forward` / `_flash_attn_varlen_backward` are private and change between
releases: they are called by keyword, after `signature_problem()` has checked with
`inspect.signature` that they take every keyword passed (once, at start-up). From 2.6 the
varlen log-sum-exp is float32 `[H, Tq]`; the backward fills `dq`, `dk`, `dv` in place.
"""

from __future__ import annotations

import importlib
import inspect

import torch

from megatron_hdp.attention.kernels.base import VarlenBlocks

FORWARD_KEYWORDS = (
    "q",
    "k",
    "v",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "dropout_p",
    "softmax_scale",
    "causal",
)
BACKWARD_KEYWORDS = (
    "dout",
    "q",
    "k",
    "v",
    "out",
    "softmax_lse",
    "dq",
    "dk",
    "dv",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "dropout_p",
    "softmax_scale",
    "causal",
    "window_size_left",
    "window_size_right",
    "softcap",
    "alibi_slopes",
    "deterministic",
)


def _interface():
    try:
        return importlib.import_module("flash_attn.flash_attn_interface")
    except ImportError:
        return None


def signature_problem(interface=None) -> str | None:
    """None if the installed flash-attn takes every keyword passed; otherwise what is wrong."""
    interface = interface or _interface()
    if interface is None:
        return "flash-attn is not installed (pip install flash-attn)"
    for name, keywords in (
        ("_flash_attn_varlen_forward", FORWARD_KEYWORDS),
        ("_flash_attn_varlen_backward", BACKWARD_KEYWORDS),
    ):
        function = getattr(interface, name, None)
        if function is None:
            return f"flash_attn.flash_attn_interface has no {name}"
        parameters = inspect.signature(function).parameters
        missing = [k for k in keywords if k not in parameters]
        if missing:
            return f"flash_attn's {name} lacks arguments {missing} (tested: 2.6-2.8)"
    return None


class FlashAttnKernel:
    """flash-attn 2.x varlen: one call per ring step, native GQA."""

    name = "flash_attn"

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Needs CUDA and flash-attn 2.6-2.8."""
        if device.type != "cuda":
            return f"needs a CUDA device (the tensors are on {device.type})"
        return signature_problem()

    def forward(self, q_THD, k_TGD, v_TGD, blocks: VarlenBlocks, *, scale):
        """See `base.VarlenKernel.forward`."""
        result = _interface()._flash_attn_varlen_forward(
            q=q_THD,
            k=k_TGD,
            v=v_TGD,
            cu_seqlens_q=blocks.cu_seqlens_q,
            cu_seqlens_k=blocks.cu_seqlens_k,
            max_seqlen_q=blocks.max_seqlen_q,
            max_seqlen_k=blocks.max_seqlen_k,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=blocks.causal,
        )
        return result[0], result[1]

    def backward(self, dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_HT, blocks, *, scale):
        """See `base.VarlenKernel.backward`."""
        dq, dk, dv = torch.empty_like(q_THD), torch.empty_like(k_TGD), torch.empty_like(v_TGD)
        _interface()._flash_attn_varlen_backward(
            dout=dout_THD.contiguous(),
            q=q_THD,
            k=k_TGD,
            v=v_TGD,
            out=out_THD.contiguous(),
            softmax_lse=lse_HT.to(torch.float32).contiguous(),
            dq=dq,
            dk=dk,
            dv=dv,
            cu_seqlens_q=blocks.cu_seqlens_q,
            cu_seqlens_k=blocks.cu_seqlens_k,
            max_seqlen_q=blocks.max_seqlen_q,
            max_seqlen_k=blocks.max_seqlen_k,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=blocks.causal,
            window_size_left=-1,
            window_size_right=-1,
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
        )
        return dq, dk, dv
