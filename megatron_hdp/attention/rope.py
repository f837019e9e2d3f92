"""Rotary position embedding at explicit positions (ops layer).

HDP hands each rank chunks of documents that start mid-document, so RoPE must use every
token's original position. Megatron-Core's THD RoPE derives positions from `cu_seqlens`
(restarting at 0 per packed piece), so the HDP model disables Megatron's RoPE and applies
it here, inside the core attention, with the same formulas as Megatron-Core's unfused
`RotaryEmbedding` and `_apply_rotary_pos_emb_bshd` (core 0.16 and 0.19 alike): frequencies
in float32 over the first `int(head_dim * rotary_percent)` channels of a head, the rest
passed through; the halves rotated, or with `interleaved` the channel pairs (0, 1), (2, 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RotaryTable:
    """cos/sin of every local token, shaped `[T, 1, R]` (R = rotary dims of a head)."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool = False
    """Rotate the channel pairs (2i, 2i+1) (Megatron's `rotary_interleaved`), not the halves."""

    @classmethod
    def build(
        cls,
        positions: torch.Tensor,
        *,
        head_dim: int,
        rotary_base: float = 10000.0,
        rotary_percent: float = 1.0,
        interleaved: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> RotaryTable:
        """Table for integer `positions` [T] of a model with `head_dim` dims per head."""
        dim = int(head_dim * rotary_percent) if rotary_percent < 1.0 else head_dim
        steps = torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device)
        inv_freq = 1.0 / (rotary_base ** (steps / dim))
        freqs = torch.outer(positions.to(torch.float32), inv_freq)
        if interleaved:  # f0 f0 f1 f1 ...
            emb = torch.stack([freqs, freqs], dim=-1).flatten(-2).unsqueeze(1)
        else:  # f0 f1 ... f0 f1 ...
            emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        return cls(
            cos=torch.cos(emb).to(dtype), sin=torch.sin(emb).to(dtype), interleaved=interleaved
        )

    def apply(self, x_THD: torch.Tensor) -> torch.Tensor:
        """Rotate the first R dims of every head of `x` [T, heads, D]; the rest pass."""
        rot = self.cos.shape[-1]
        x_rot, x_pass = x_THD[..., :rot], x_THD[..., rot:]
        if self.interleaved:
            x1, x2 = x_rot[..., ::2], x_rot[..., 1::2]
            rotated = torch.stack([-x2, x1], dim=-1).flatten(-2)
        else:
            x1, x2 = torch.chunk(x_rot, 2, dim=-1)
            rotated = torch.cat([-x2, x1], dim=-1)
        out = x_rot * self.cos.to(x_THD.dtype) + rotated * self.sin.to(x_THD.dtype)
        return torch.cat([out, x_pass], dim=-1) if x_pass.shape[-1] else out
