"""FlashAttention-4 (the `flash-attn-4` package's `flash_attn.cute.interface`), when installed.

FA4 is written in CuTe-DSL for Hopper and Blackwell (sm90, sm100) and ships as a pure Python
wheel. Its entry points `_flash_attn_fwd` / `_flash_attn_bwd` are private: q, k, v (and out,
dout, lse) go by position, everything else by keyword, after `signature_problem()` has
checked once, at start-up, that every keyword exists. The varlen log-sum-exp is float32
`[H, Tq]`, as the ring needs (checked on every call). The backward is deterministic when
`torch.are_deterministic_algorithms_enabled()`. Blackwell's head-dim limits are checked at
start-up (`device.fa4_limits`). (torch's own FA4 switch, `torch_flash_fa4`, calls the same
functions the same way; this kernel serves a torch without that switch.)
"""

from __future__ import annotations

import importlib
import inspect

import torch

from megatron_hdp.attention.kernels.base import VarlenBlocks, check_lse
from megatron_hdp.attention.kernels.device import DeviceFacts, fa4_limits

MODULE = "flash_attn.cute.interface"
FORWARD_KEYWORDS = (
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "softmax_scale",
    "causal",
    "return_lse",
)
BACKWARD_KEYWORDS = (
    "softmax_scale",
    "causal",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "deterministic",
)


def _interface():
    try:
        return importlib.import_module(MODULE)
    except ImportError:
        return None


def signature_problem(interface=None) -> str | None:
    """None if the installed FA4 takes every argument passed; otherwise what is wrong."""
    interface = interface or _interface()
    if interface is None:
        return f"{MODULE} does not import (pip install flash-attn-4)"
    for name, positional, keywords in (
        ("_flash_attn_fwd", ("q", "k", "v"), FORWARD_KEYWORDS),
        ("_flash_attn_bwd", ("q", "k", "v", "out", "dout", "lse"), BACKWARD_KEYWORDS),
    ):
        function = getattr(interface, name, None)
        if function is None:
            return f"{MODULE} has no {name}"
        names = tuple(inspect.signature(function).parameters)
        if names[: len(positional)] != positional:
            return f"{MODULE}.{name} starts with {names[: len(positional)]}, not {positional}"
        missing = [k for k in keywords if k not in names]
        if missing:
            return f"{MODULE}.{name} lacks arguments {missing}"
    return None


class FlashAttn4Kernel:
    """FA4 varlen: one call per ring step, native GQA (Hopper and Blackwell)."""

    name = "flash_attn_4"

    def unavailable_reason(self, facts: DeviceFacts, *, dtype, head_dim) -> str | None:
        """Needs sm90/sm100, 16-bit tensors, FA4's head dims (`fa4_limits`) and flash-attn-4."""
        return fa4_limits(facts, dtype=dtype, head_dim=head_dim) or signature_problem()

    def unequal_head_dims_reason(self, facts: DeviceFacts, *, dtype, head_dim, head_dim_v):
        """None on Blackwell for FA4's unequal pair (192, 128); elsewhere the ring pads.

        FA4 validates `(head_dim, head_dim_v)` itself (`fa4_limits`); only Blackwell's pair
        list names an unequal one, so on Hopper the kernel runs padded (`head_dims`).
        """
        major = (facts.capability or (0, 0))[0]
        if major not in (10, 11):
            return f"takes unequal head dims on Blackwell only, not on {facts.describe()}"
        problem = fa4_limits(facts, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v)
        return problem or signature_problem()

    def activate(self) -> None:
        """Nothing to set up."""

    def window_reason(self) -> str | None:
        """FA4's window arguments are not wired in: a window is refused at start-up."""
        return "flash_attn_4's window arguments are unverified; use torch_flash or flash_attn"

    def forward(self, q_THD, k_TGD, v_TGD, blocks: VarlenBlocks, *, scale):
        """See `base.VarlenKernel.forward`."""
        result = _interface()._flash_attn_fwd(
            q_THD,
            k_TGD,
            v_TGD,
            cu_seqlens_q=blocks.cu_seqlens_q,
            cu_seqlens_k=blocks.cu_seqlens_k,
            max_seqlen_q=blocks.max_seqlen_q,
            max_seqlen_k=blocks.max_seqlen_k,
            softmax_scale=scale,
            causal=blocks.causal,
            return_lse=True,
        )
        return result[0], check_lse(result[1], q_THD, f"{MODULE}._flash_attn_fwd")

    def backward(self, dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_HT, blocks, *, scale):
        """See `base.VarlenKernel.backward` (deterministic in torch's deterministic mode)."""
        grads = _interface()._flash_attn_bwd(
            q_THD,
            k_TGD,
            v_TGD,
            out_THD.contiguous(),
            dout_THD.contiguous(),
            lse_HT.float().contiguous(),
            softmax_scale=scale,
            causal=blocks.causal,
            cu_seqlens_q=blocks.cu_seqlens_q,
            cu_seqlens_k=blocks.cu_seqlens_k,
            max_seqlen_q=blocks.max_seqlen_q,
            max_seqlen_k=blocks.max_seqlen_k,
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )
        return grads[0], grads[1], grads[2]
