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

`job_kernel(name, device, ...)` is the same choice made from a device: what benchmarks and
calibration call so that they time the kernel the job runs. `step_kernel(name, device)`
guards the step runtime: "auto" there means the CPU kernel `torch` on CPU and is refused
elsewhere (the choice needs the dtype and head dim), as is a CPU kernel off the CPU.
"""

from __future__ import annotations

import logging

import torch

from megatron_hdp.attention.kernels.base import VarlenKernel
from megatron_hdp.attention.kernels.cpu import MATH, TORCH, BlockLoopKernel
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


def window_reason(kernel: VarlenKernel) -> str | None:
    """None if `kernel` computes sliding-window (banded) steps; otherwise why not."""
    method = getattr(kernel, "window_reason", None)
    if method is None:
        return "takes no sliding window"
    return method()


def _reason(kernel, facts, *, dtype, head_dim, window: bool) -> str | None:
    reason = kernel.unavailable_reason(facts, dtype=dtype, head_dim=head_dim)
    if reason is None and window:
        problem = window_reason(kernel)
        if problem is not None:
            reason = f"cannot run --window-size: {problem}"
    return reason


def resolve_kernel(
    name: str, facts: DeviceFacts, *, dtype: torch.dtype, head_dim: int, window: bool = False
) -> str:
    """The concrete kernel for `name` ("auto" or a kernel) on `facts`, activated.

    `window`: some layer attends within a sliding window, so the kernel must compute banded
    steps (`window_reason`). Raises ValueError if a named kernel is unknown or cannot run
    here, or if "auto" finds no kernel; the message gives each candidate's reason.
    """
    if name == "auto":
        candidates = _AUTO_ORDER.get(facts.type, ())
        reasons = []
        for candidate in candidates:
            reason = _reason(
                _KERNELS[candidate], facts, dtype=dtype, head_dim=head_dim, window=window
            )
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
    reason = _reason(kernel, facts, dtype=dtype, head_dim=head_dim, window=window)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} cannot run here: {reason}")
    kernel.activate()
    return name


def job_kernel(name: str, device: torch.device | str, *, dtype: torch.dtype, head_dim: int) -> str:
    """The kernel a job on `device` runs for `name` ("auto" or a kernel), activated.

    The choice `pretrain_hdp` makes at start-up (`resolve_kernel` on the device's facts), for
    benchmarks and calibration to time the job's kernel: on CUDA a flash kernel, never a CPU
    one. ValueError with the reason where nothing runs these tensors there.
    """
    return resolve_kernel(name, DeviceFacts.of(device), dtype=dtype, head_dim=head_dim)


def step_kernel(name: str | None, device: torch.device | str) -> str:
    """The kernel name a step runtime on `device` uses for `name`; ValueError if none fits.

    "auto" (or None) is the CPU kernel `torch` on CPU. Elsewhere the choice depends on the
    model's dtype and head dim, which the runtime does not know: it must be resolved first
    (`job_kernel`, or the job's resolved `--hdp-attention-backend`), never silently become a
    CPU kernel. A CPU kernel named for a non-CPU device is refused with its reason.
    """
    device = torch.device(device)
    if name in (None, "auto"):
        if device.type == "cpu":
            return TORCH.name
        raise ValueError(
            f"a step runtime on {device} needs the job's attention kernel: resolve it with "
            "registry.job_kernel(name, device, dtype=, head_dim=) (or pass the job's resolved "
            "--hdp-attention-backend); the CPU kernels are not used there"
        )
    kernel = _KERNELS.get(name)
    if isinstance(kernel, BlockLoopKernel) and device.type != "cpu":
        reason = kernel.unavailable_reason(DeviceFacts(device.type), dtype=None, head_dim=0)
        raise ValueError(f"attention backend {name!r} cannot run on {device}: {reason}")
    return name


def add_kernel_flags(parser) -> None:
    """`--hdp-attention-backend` and `--bf16` for a benchmark or tool (an argparse parser).

    Resolve the kernel from them with `job_kernel`, as the job does.
    """
    parser.add_argument(
        "--hdp-attention-backend",
        choices=CHOICES,
        default="auto",
        help="attention kernel, resolved for the device as the job resolves it",
    )
    parser.add_argument("--bf16", action="store_true", help="bfloat16 (GPU flash kernels need it)")
