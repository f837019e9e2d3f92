"""PyTorch's own CUDA flash-attention varlen kernels (no extra package).

`aten::_flash_attention_forward` / `_flash_attention_backward` are private, versioned ops:
they are called by keyword, and `check_signature()` compares the keywords with the ops'
registered schemas once at start-up (the ops are registered in CPU builds too, so the check
runs everywhere; the kernels themselves need CUDA). Tensors are `[T, heads, D]` with native
GQA; the log-sum-exp comes back as float32 `[H, Tq]`.
"""

from __future__ import annotations

import torch

from megatron_hdp.attention.kernels.base import VarlenBlocks

FORWARD_KEYWORDS = (
    "query",
    "key",
    "value",
    "cum_seq_q",
    "cum_seq_k",
    "max_q",
    "max_k",
    "dropout_p",
    "is_causal",
    "return_debug_mask",
    "scale",
)
BACKWARD_KEYWORDS = (
    "grad_out",
    "query",
    "key",
    "value",
    "out",
    "logsumexp",
    "cum_seq_q",
    "cum_seq_k",
    "max_q",
    "max_k",
    "dropout_p",
    "is_causal",
    "rng_state",
    "unused",
    "scale",
)


def _schema_arguments(op_name: str) -> tuple[str, ...] | None:
    op = getattr(torch.ops.aten, op_name, None)
    if op is None:
        return None
    return tuple(a.name for a in op.default._schema.arguments)


def signature_problem() -> str | None:
    """None if both ops take every keyword this adapter passes; otherwise what is missing."""
    for op_name, keywords in (
        ("_flash_attention_forward", FORWARD_KEYWORDS),
        ("_flash_attention_backward", BACKWARD_KEYWORDS),
    ):
        arguments = _schema_arguments(op_name)
        if arguments is None:
            return f"this torch {torch.__version__} has no aten::{op_name}"
        missing = [k for k in keywords if k not in arguments]
        if missing:
            return f"aten::{op_name} of torch {torch.__version__} lacks arguments {missing}"
    return None


class TorchFlashKernel:
    """`aten::_flash_attention_{forward,backward}`: one varlen call per ring step."""

    name = "torch_flash"

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Needs a CUDA device and the ops' expected signatures."""
        if device.type != "cuda":
            return f"needs a CUDA device (the tensors are on {device.type})"
        return signature_problem()

    def forward(self, q_THD, k_TGD, v_TGD, blocks: VarlenBlocks, *, scale):
        """See `base.VarlenKernel.forward`."""
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            query=q_THD,
            key=k_TGD,
            value=v_TGD,
            cum_seq_q=blocks.cu_seqlens_q,
            cum_seq_k=blocks.cu_seqlens_k,
            max_q=blocks.max_seqlen_q,
            max_k=blocks.max_seqlen_k,
            dropout_p=0.0,
            is_causal=blocks.causal,
            return_debug_mask=False,
            scale=scale,
        )
        if lse.shape != (q_THD.shape[1], q_THD.shape[0]):
            raise RuntimeError(
                f"aten::_flash_attention_forward returned a log-sum-exp of shape "
                f"{tuple(lse.shape)}, expected [heads, tokens] = {(q_THD.shape[1], q_THD.shape[0])}"
            )
        return out, lse

    def backward(self, dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_HT, blocks, *, scale):
        """See `base.VarlenKernel.backward` (no dropout: the RNG state is not used)."""
        empty = torch.empty(0, dtype=torch.int64, device=q_THD.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out=dout_THD.contiguous(),
            query=q_THD,
            key=k_TGD,
            value=v_TGD,
            out=out_THD.contiguous(),
            logsumexp=lse_HT.to(torch.float32).contiguous(),
            cum_seq_q=blocks.cu_seqlens_q,
            cum_seq_k=blocks.cu_seqlens_k,
            max_q=blocks.max_seqlen_q,
            max_k=blocks.max_seqlen_k,
            dropout_p=0.0,
            is_causal=blocks.causal,
            rng_state=empty,
            unused=empty,
            scale=scale,
        )
        return dq, dk, dv
