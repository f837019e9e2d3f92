"""What decides whether a flash kernel can run: the device, the dtype, the head dim (ops layer).

`DeviceFacts.of(device)` reads them from torch once, at start-up; tests build them by hand
to describe a GPU this machine does not have. `flash_limits` holds the rules every flash
kernel shares (16-bit inputs, Ampere or newer, head dims that are a multiple of 8 up to 256);
`fa4_limits` adds FlashAttention-4's (Hopper or Blackwell, and Blackwell's head dims).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Precision flag a GPU run needs, named in every refusal (--fp16 works too, with loss scaling).
PRECISION_HINT = "add --bf16 (flash kernels compute in bfloat16 or float16, not float32)"
FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class DeviceFacts:
    """The facts about one device that kernel choice depends on.

    Attributes:
        type: "cuda", "cpu", ...
        name: The device's name, for messages ("NVIDIA H100 80GB HBM3").
        capability: CUDA compute capability `(major, minor)`; None off CUDA.
        flash_built: This torch was built with its own flash-attention kernels
            (`torch.backends.cuda.is_flash_attention_available()`).
    """

    type: str
    name: str = ""
    capability: tuple[int, int] | None = None
    flash_built: bool = False

    @classmethod
    def of(cls, device: torch.device | str) -> DeviceFacts:
        """Read the facts of `device` from this torch (CUDA calls only for a CUDA device)."""
        device = torch.device(device)
        if device.type != "cuda":
            return cls(type=device.type, name=device.type)
        return cls(
            type="cuda",
            name=torch.cuda.get_device_name(device),
            capability=tuple(torch.cuda.get_device_capability(device)),
            flash_built=bool(torch.backends.cuda.is_flash_attention_available()),
        )

    def describe(self) -> str:
        """`cuda (NVIDIA H100, sm90)` or `cpu`."""
        if self.capability is None:
            return self.type
        return f"{self.type} ({self.name}, sm{self.capability[0]}{self.capability[1]})"


def flash_limits(
    facts: DeviceFacts,
    *,
    dtype: torch.dtype,
    head_dim: int,
    min_capability: tuple[int, int] = (8, 0),
    capability_majors: tuple[int, ...] | None = None,
) -> str | None:
    """None if a flash kernel with these limits runs these tensors on `facts`; else why not.

    `capability_majors`, when given, lists the only major compute capabilities allowed
    (FA3: Hopper only).
    """
    if facts.type != "cuda":
        return f"needs a CUDA device (this job runs on {facts.type})"
    if dtype not in FLASH_DTYPES:
        return f"needs float16 or bfloat16 tensors, this job computes in {dtype}: {PRECISION_HINT}"
    capability = facts.capability or (0, 0)
    if capability_majors is not None and capability[0] not in capability_majors:
        wanted = " or ".join(f"sm{m}x" for m in capability_majors)
        return f"needs a GPU of compute capability {wanted}; {facts.describe()} is not"
    if capability < min_capability:
        return (
            f"needs compute capability sm{min_capability[0]}{min_capability[1]} or newer "
            f"(Ampere); {facts.describe()} is older"
        )
    if head_dim % 8 != 0 or head_dim > 256:
        return f"needs a head dim that is a multiple of 8 and at most 256, got {head_dim}"
    return None


#: FA4's Blackwell (sm100/sm110) head dims besides 8-128: `(head_dim, head_dim_v)` pairs.
FA4_BLACKWELL_PAIRS = ((192, 128), (256, 256))


def fa4_limits(
    facts: DeviceFacts, *, dtype: torch.dtype, head_dim: int, head_dim_v: int | None = None
) -> str | None:
    """None if FlashAttention-4 runs these tensors on `facts`; else why not.

    FA4 runs on Hopper and Blackwell (sm90, sm100). On compute capability 10 and 11 it takes
    head dims 8-128 only, or the pairs (192, 128) and (256, 256) (flash-attention
    `flash_attn/cute/interface.py` `_validate_head_dims`, asserted at the first call); the
    ring passes v with q's head dim unless `head_dim_v` says otherwise.
    """
    problem = flash_limits(facts, dtype=dtype, head_dim=head_dim, capability_majors=(9, 10))
    if problem is not None:
        return problem
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    major = (facts.capability or (0, 0))[0]
    standard = 8 <= head_dim <= 128 and 8 <= head_dim_v <= 128
    if major in (10, 11) and not standard and (head_dim, head_dim_v) not in FA4_BLACKWELL_PAIRS:
        return (
            f"on {facts.describe()} (Blackwell) takes head dims 8-128, or (q, v) = (192, 128) "
            f"or (256, 256); got ({head_dim}, {head_dim_v})"
        )
    return None
