"""Rotary position embedding at explicit positions (ops layer).

HDP hands each rank chunks of documents that start mid-document, so RoPE must use every
token's original position. Megatron-Core's THD RoPE derives positions from `cu_seqlens`
(restarting at 0 per packed piece), so the HDP model disables Megatron's RoPE and applies
it here, inside the core attention, with the same formulas as Megatron's unfused,
non-interleaved `_apply_rotary_pos_emb_bshd` (frequencies in float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RotaryTable:
    """cos/sin of every local token, shaped `[T, 1, R]` (R = rotary dims of a head)."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def build(
        cls,
        positions: torch.Tensor,
        *,
        head_dim: int,
        rotary_base: float = 10000.0,
        rotary_percent: float = 1.0,
        dtype: torch.dtype = torch.float32,
    ) -> RotaryTable:
        """Table for integer `positions` [T] of a model with `head_dim` dims per head."""
        dim = int(head_dim * rotary_percent)
        steps = torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device)
        inv_freq = 1.0 / (rotary_base ** (steps / dim))
        freqs = torch.outer(positions.to(torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        return cls(cos=torch.cos(emb).to(dtype), sin=torch.sin(emb).to(dtype))

    def apply(self, x_THD: torch.Tensor) -> torch.Tensor:
        """Rotate the first R dims of every head of `x` [T, heads, D]."""
        rot = self.cos.shape[-1]
        x_rot, x_pass = x_THD[..., :rot], x_THD[..., rot:]
        x1, x2 = torch.chunk(x_rot, 2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        out = x_rot * self.cos.to(x_THD.dtype) + rotated * self.sin.to(x_THD.dtype)
        return torch.cat([out, x_pass], dim=-1) if x_pass.shape[-1] else out
