"""K and V of a ring step as one message, whatever their head dims (ops layer).

The ring sends a rank's keys and values together, and so the dK/dV accumulator of the
backward pass. Multi-latent attention gives them different head dims (K: the q/k dim, the
decoupled RoPE channels included; V: the value dim), so they cannot be stacked on the head
axis: every token's row is its K heads flattened, then its V heads flattened,
`[T, G * (Dk + Dv)]`. With equal dims this is the same number of elements as before.

Shape legend: T tokens, G key/value heads, Dk key head dim, Dv value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Where K and V sit in a token's message row."""

    groups: int
    k_dim: int
    v_dim: int

    @classmethod
    def of(cls, k_TGD: torch.Tensor, v_TGD: torch.Tensor) -> KVLayout:
        """The layout of `k` `[T, G, Dk]` and `v` `[T, G, Dv]`."""
        return cls(groups=k_TGD.shape[1], k_dim=k_TGD.shape[2], v_dim=v_TGD.shape[2])

    @property
    def k_width(self) -> int:
        """Elements of K in one row."""
        return self.groups * self.k_dim

    def pack(self, k_TGD: torch.Tensor, v_TGD: torch.Tensor) -> torch.Tensor:
        """One contiguous `[T, G * (Dk + Dv)]` message of `k` and `v` (or of dK and dV)."""
        t = k_TGD.shape[0]
        return torch.cat([k_TGD.reshape(t, -1), v_TGD.reshape(t, -1)], dim=1).contiguous()

    def keys(self, message: torch.Tensor) -> torch.Tensor:
        """The `[T, G, Dk]` K (or dK) view of a message."""
        return message[:, : self.k_width].view(-1, self.groups, self.k_dim)

    def values(self, message: torch.Tensor) -> torch.Tensor:
        """The `[T, G, Dv]` V (or dV) view of a message."""
        return message[:, self.k_width :].view(-1, self.groups, self.v_dim)
