"""Which varlen kernel runs: chosen by name, or by device, dtype and what is installed ("auto").

`resolve_kernel(name, facts, dtype=, head_dim=)` is called once at start-up, before any process
group: it returns the chosen kernel's name (and activates it), or raises ValueError naming
why the requested kernel, or every candidate of "auto", cannot run these tensors here. No
rank can then fail inside a ring step while its peers wait.

"auto" picks on CUDA PyTorch's own flash kernels (`torch_flash`), else flash-attn
(`flash_attn`), and never the CPU kernels (a dense `[heads, s, s]` score matrix per
document); on CPU the aten CPU flash kernels (`torch`). `torch_flash_fa3` and
`torch_flash_fa4` (FA3/FA4 behind torch's ops) and `flash_attn_4` (the flash-attn-4 package
called directly) are chosen by name only.
"""

from __future__ import annotations

import logging

import torch

from megatron_hdp.attention.kernels.base import VarlenKernel
from megatron_hdp.attention.kernels.cpu import MATH, TORCH
from megatron_hdp.attention.kernels.device import PRECISION_HINT, DeviceFacts
from megatron_hdp.attention.kernels.flash_attn import FlashAttnKernel
from megatron_hdp.attention.kernels.flash_attn_4 import FlashAttn4Kernel
from megatron_hdp.attention.kernels.torch_flash import TorchFlashKernel

logger = logging.getLogger(__name__)

_KERNELS: dict[str, VarlenKernel] = {
    k.name: k
    for k in (
        TORCH,
        MATH,
        TorchFlashKernel(),
        TorchFlashKernel("FA3"),
        TorchFlashKernel("FA4"),
        FlashAttnKernel(),
        FlashAttn4Kernel(),
    )
}
#: Names `--hdp-attention-backend` accepts.
CHOICES = ("auto", *_KERNELS)
_AUTO_ORDER = {"cuda": ("torch_flash", "flash_attn"), "cpu": ("torch",)}


def register_kernel(kernel: VarlenKernel) -> None:
    """Make `kernel` selectable by its name (for out-of-tree adapters)."""
    _KERNELS[kernel.name] = kernel


def get_kernel(name: str) -> VarlenKernel:
    """The kernel registered as `name`; ValueError naming the choices otherwise."""
    try:
        return _KERNELS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {sorted(_KERNELS)}"
        ) from None


def kernel_reasons(facts: DeviceFacts, *, dtype: torch.dtype, head_dim: int) -> dict[str, str]:
    """Why each registered kernel cannot run these tensors here ("" where it can)."""
    return {
        name: kernel.unavailable_reason(facts, dtype=dtype, head_dim=head_dim) or ""
        for name, kernel in _KERNELS.items()
    }


def resolve_kernel(name: str, facts: DeviceFacts, *, dtype: torch.dtype, head_dim: int) -> str:
    """The concrete kernel for `name` ("auto" or a kernel) on `facts`, activated.

    Raises ValueError if a named kernel is unknown or cannot run here, or if "auto" finds
    no kernel; the message gives each candidate's reason.
    """
    if name == "auto":
        candidates = _AUTO_ORDER.get(facts.type, ())
        reasons = []
        for candidate in candidates:
            reason = _KERNELS[candidate].unavailable_reason(facts, dtype=dtype, head_dim=head_dim)
            if reason is None:
                skipped = f" (skipped: {'; '.join(reasons)})" if reasons else ""
                # Worth a line where it matters (a GPU); the CPU start stays quiet.
                level = logging.INFO if facts.type == "cuda" else logging.DEBUG
                logger.log(
                    level, "attention kernel %s on %s%s", candidate, facts.describe(), skipped
                )
                _KERNELS[candidate].activate()
                return candidate
            reasons.append(f"{candidate} {reason}")
        message = "; ".join(reasons) or "no kernel for this device type"
        if facts.type == "cuda":
            message += "; the CPU kernels are not used on CUDA (dense [heads, s, s] scores)"
        if PRECISION_HINT not in message and dtype not in (torch.float16, torch.bfloat16):
            message += f"; {PRECISION_HINT}"
        raise ValueError(f"no attention kernel runs this job on {facts.describe()}: {message}")
    kernel = get_kernel(name)
    reason = kernel.unavailable_reason(facts, dtype=dtype, head_dim=head_dim)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} cannot run here: {reason}")
    kernel.activate()
    return name
