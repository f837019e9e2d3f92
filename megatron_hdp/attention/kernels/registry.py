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

Unequal q/k and v head dims (multi-latent attention, `head_dim_v=`): a kernel that takes them
natively runs them as they are, any other one padded to one head dim (`kernels.head_dims`);
the resolved name then ends in `+pad_v`, and `get_kernel` builds the padded kernel from it.

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
from megatron_hdp.attention.kernels.head_dims import (
    PAD_SUFFIX,
    PaddedHeadDims,
    base_name,
    native_reason,
)
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
_PADDED: dict[str, VarlenKernel] = {}


def register_kernel(kernel: VarlenKernel) -> None:
    """Make `kernel` selectable by its name (for out-of-tree adapters)."""
    _KERNELS[kernel.name] = kernel


def get_kernel(name: str) -> VarlenKernel:
    """The kernel registered as `name`; ValueError naming the choices otherwise.

    `name + "+pad_v"` is that kernel on zero-padded head dims (`head_dims.PaddedHeadDims`).
    """
    if name.endswith(PAD_SUFFIX) and base_name(name) in _KERNELS:
        if name not in _PADDED:
            _PADDED[name] = PaddedHeadDims(_KERNELS[base_name(name)])
        return _PADDED[name]
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


def _for_head_dims(
    name: str, facts: DeviceFacts, *, dtype: torch.dtype, head_dim: int, head_dim_v: int | None
) -> tuple[str, str | None]:
    """`(name to run, why it cannot)` of kernel `name` for these head dims.

    Equal dims: the kernel itself. Unequal: the kernel where it takes them natively, else
    the kernel padded to `max(head_dim, head_dim_v)` (`head_dims.PaddedHeadDims`).
    """
    kernel = _KERNELS[name]
    if head_dim_v is None or head_dim_v == head_dim:
        return name, kernel.unavailable_reason(facts, dtype=dtype, head_dim=head_dim)
    if native_reason(kernel, facts, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v) is None:
        return name, None
    padded = max(head_dim, head_dim_v)
    reason = kernel.unavailable_reason(facts, dtype=dtype, head_dim=padded)
    if reason is not None:
        dims = f"q/k head dim {head_dim} and v head dim {head_dim_v} padded to {padded}"
        reason = f"{reason} ({dims})"
    return name + PAD_SUFFIX, reason


def _activate(name: str, head_dim: int, head_dim_v: int | None) -> None:
    """Set the chosen kernel up; say once that unequal head dims run padded."""
    if name.endswith(PAD_SUFFIX):
        logger.info(
            "attention kernel %s takes equal head dims only: q/k (%d) and v (%d) run padded "
            "with zeros to %d (exact; the padded FLOPs are paid)",
            base_name(name),
            head_dim,
            head_dim_v,
            max(head_dim, head_dim_v or 0),
        )
    get_kernel(name).activate()


def _for_job(
    name: str,
    facts: DeviceFacts,
    *,
    dtype: torch.dtype,
    head_dim: int,
    head_dim_v: int | None,
    window: bool,
) -> tuple[str, str | None]:
    """`(name to run, why it cannot)`: `_for_head_dims`, then the window capability."""
    chosen, reason = _for_head_dims(
        name, facts, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v
    )
    if reason is None and window:
        problem = window_reason(get_kernel(chosen))
        if problem is not None:
            reason = f"cannot run --window-size: {problem}"
    return chosen, reason


def resolve_kernel(
    name: str,
    facts: DeviceFacts,
    *,
    dtype: torch.dtype,
    head_dim: int,
    head_dim_v: int | None = None,
    window: bool = False,
) -> str:
    """The concrete kernel for `name` ("auto" or a kernel) on `facts`, activated.

    `head_dim` is the q/k head dim; `head_dim_v` the value head dim where it differs
    (multi-latent attention): the result is then the kernel's name, or its padded form
    (`name + "+pad_v"`) where the kernel takes equal head dims only. `window`: some layer
    attends within a sliding window, so the kernel must compute banded steps
    (`window_reason`).

    Raises ValueError if a named kernel is unknown or cannot run here, or if "auto" finds
    no kernel; the message gives each candidate's reason.
    """
    if name == "auto":
        candidates = _AUTO_ORDER.get(facts.type, ())
        reasons = []
        for candidate in candidates:
            chosen, reason = _for_job(
                candidate,
                facts,
                dtype=dtype,
                head_dim=head_dim,
                head_dim_v=head_dim_v,
                window=window,
            )
            if reason is None:
                skipped = f" (skipped: {'; '.join(reasons)})" if reasons else ""
                # Worth a line where it matters (a GPU); the CPU start stays quiet.
                level = logging.INFO if facts.type == "cuda" else logging.DEBUG
                logger.log(level, "attention kernel %s on %s%s", chosen, facts.describe(), skipped)
                _activate(chosen, head_dim, head_dim_v)
                return chosen
            reasons.append(f"{candidate} {reason}")
        message = "; ".join(reasons) or "no kernel for this device type"
        if facts.type == "cuda":
            message += "; the CPU kernels are not used on CUDA (dense [heads, s, s] scores)"
        if PRECISION_HINT not in message and dtype not in (torch.float16, torch.bfloat16):
            message += f"; {PRECISION_HINT}"
        raise ValueError(f"no attention kernel runs this job on {facts.describe()}: {message}")
    get_kernel(name)  # unknown names: ValueError with the choices
    chosen, reason = _for_job(
        base_name(name),
        facts,
        dtype=dtype,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        window=window,
    )
    if reason is not None:
        raise ValueError(f"attention backend {name!r} cannot run here: {reason}")
    _activate(chosen, head_dim, head_dim_v)
    return chosen


def job_kernel(
    name: str,
    device: torch.device | str,
    *,
    dtype: torch.dtype,
    head_dim: int,
    head_dim_v: int | None = None,
) -> str:
    """The kernel a job on `device` runs for `name` ("auto" or a kernel), activated.

    The choice `pretrain_hdp` makes at start-up (`resolve_kernel` on the device's facts), for
    benchmarks and calibration to time the job's kernel: on CUDA a flash kernel, never a CPU
    one. ValueError with the reason where nothing runs these tensors there.
    """
    return resolve_kernel(
        name, DeviceFacts.of(device), dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v
    )


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
    kernel = _KERNELS.get(base_name(name))
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
