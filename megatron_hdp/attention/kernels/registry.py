"""Which varlen kernel runs: chosen by name, or by device and what is installed ("auto").

`resolve_kernel(name, device)` is called once at start-up: it returns the kernel's concrete
name, or raises ValueError naming why the requested one cannot run here. "auto" picks, in
order: on CUDA PyTorch's own flash kernels (`torch_flash`), else flash-attn (`flash_attn`),
else the `math` kernel; on CPU the aten CPU flash kernels (`torch`).
"""

from __future__ import annotations

import torch

from megatron_hdp.attention.kernels.base import VarlenKernel
from megatron_hdp.attention.kernels.cpu import MATH, TORCH
from megatron_hdp.attention.kernels.flash_attn import FlashAttnKernel
from megatron_hdp.attention.kernels.torch_flash import TorchFlashKernel

_KERNELS: dict[str, VarlenKernel] = {
    k.name: k for k in (TORCH, MATH, TorchFlashKernel(), FlashAttnKernel())
}
#: Names `--hdp-attention-backend` accepts.
CHOICES = ("auto", *_KERNELS)
_AUTO_ORDER = {"cuda": ("torch_flash", "flash_attn", "math"), "cpu": ("torch",)}


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


def resolve_kernel(name: str, device: torch.device) -> str:
    """The concrete kernel name for `name` ("auto" or a kernel) on `device`.

    Raises ValueError if a named kernel is unknown or cannot run here (with the reason).
    """
    if name == "auto":
        for candidate in _AUTO_ORDER.get(device.type, ("math",)):
            if _KERNELS[candidate].unavailable_reason(device) is None:
                return candidate
        return "math"
    reason = get_kernel(name).unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} cannot run here: {reason}")
    return name
