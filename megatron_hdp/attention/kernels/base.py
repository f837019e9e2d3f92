"""The varlen seam: one ring step of every document of a packed (THD) micro-batch, one call.

A ring step attends some query rows of each document to some key rows of the same document
(`VarlenBlocks`): in a step either every document's block is causal (the diagonal: equal
lengths, diagonal included) or every one is fully visible (the zigzag lower and upper
blocks, the three block kinds of Transformer Engine's ring). The rows of all documents are
packed one after the other, with `cu_seqlens` offsets, as flash-attn's varlen API takes them.

Shape legend: Tq / Tk packed query / key rows, H query heads, G key/value heads (native GQA:
G divides H, nothing is expanded by the caller), D head dim. Tensors are `[T, heads, D]`;
the log-sum-exp is float32 (or float64 for float64 inputs) `[H, Tq]`.

A kernel's backward takes the *merged* output and log-sum-exp of the query rows (over all
ring steps), as the flash-attention recipe and Transformer Engine's ring do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megatron_hdp.attention.kernels.device import DeviceFacts


@dataclass(frozen=True)
class Band:
    """A sliding window over a step's blocks (`attention.window`).

    Query row r sees key row c of its block iff
    `positions_k[c] <= positions_q[r] <= positions_k[c] + window` (Megatron-Core's window
    `(window, 0)`: `window` earlier positions and the query's own). The positions are the
    rows' positions in their document, packed as the rows are; every query row of a banded
    block sees at least one key (rows that see none are left out of the step).

    Attributes:
        window: Earlier positions each query sees (>= 0).
        positions_q / positions_k: int64 positions on the tensors' device.
        host_q / host_k: The same on the host (for kernels that split blocks by position).
    """

    window: int
    positions_q: torch.Tensor
    positions_k: torch.Tensor
    host_q: torch.Tensor
    host_k: torch.Tensor
    _calls: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class VarlenBlocks:
    """The documents' blocks of one ring step.

    Attributes:
        lengths_q: Query rows of each document (all > 0), in packing order.
        lengths_k: Key rows of each document (all > 0).
        causal: Every block is causal (then lengths_q == lengths_k) or every one is full.
        cu_seqlens_q: int32 `[B + 1]` offsets of `lengths_q`, on the tensors' device.
        cu_seqlens_k: int32 `[B + 1]` offsets of `lengths_k`.
        band: A sliding window; then `causal` is ignored and the band's positions decide
            which pairs are visible. None for the causal / full blocks of full attention.
    """

    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]
    causal: bool
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    band: Band | None = field(default=None, kw_only=True)

    @classmethod
    def build(
        cls,
        lengths_q: Sequence[int],
        lengths_k: Sequence[int],
        *,
        causal: bool,
        device: torch.device,
    ) -> VarlenBlocks:
        """Blocks with their offsets on `device`; ValueError for empty or unequal causal ones."""
        if len(lengths_q) != len(lengths_k) or not lengths_q:
            raise ValueError(
                f"need one query and one key length per document: {lengths_q}, {lengths_k}"
            )
        if min(lengths_q) <= 0 or min(lengths_k) <= 0:
            raise ValueError(f"empty blocks must be left out: {lengths_q}, {lengths_k}")
        if causal and tuple(lengths_q) != tuple(lengths_k):
            raise ValueError(f"causal blocks need equal lengths: {lengths_q}, {lengths_k}")

        def offsets(lengths):
            cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
            return cu.to(device)

        return cls(
            lengths_q=tuple(lengths_q),
            lengths_k=tuple(lengths_k),
            causal=causal,
            cu_seqlens_q=offsets(lengths_q),
            cu_seqlens_k=offsets(lengths_k),
        )

    @property
    def max_seqlen_q(self) -> int:
        """Longest query block."""
        return max(self.lengths_q)

    @property
    def max_seqlen_k(self) -> int:
        """Longest key block."""
        return max(self.lengths_k)


class VarlenKernel(Protocol):
    """Computes one ring step's blocks of all documents, forward and backward."""

    name: str

    def unavailable_reason(
        self, facts: DeviceFacts, *, dtype: torch.dtype, head_dim: int
    ) -> str | None:
        """None if the kernel runs `dtype` tensors of `head_dim` on the device; else why not.

        Checked once at start-up, before any process group, so that no rank fails inside a
        ring step while its peers wait.
        """
        ...

    def activate(self) -> None:
        """Process-wide set-up once the kernel is chosen (most kernels need none)."""
        ...

    def window_reason(self) -> str | None:
        """None if the kernel computes banded steps (`Band`, sliding windows); else why not.

        Optional (`registry.window_reason`): a kernel without it takes no window.
        """
        ...

    def forward(
        self,
        q_THD: torch.Tensor,
        k_TGD: torch.Tensor,
        v_TGD: torch.Tensor,
        blocks: VarlenBlocks,
        *,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(out [Tq, H, D], lse [H, Tq])` of softmax(q k^T scale) v per document block."""
        ...

    def backward(
        self,
        dout_THD: torch.Tensor,
        q_THD: torch.Tensor,
        k_TGD: torch.Tensor,
        v_TGD: torch.Tensor,
        out_THD: torch.Tensor,
        lse_HT: torch.Tensor,
        blocks: VarlenBlocks,
        *,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(dq [Tq, H, D], dk [Tk, G, D], dv [Tk, G, D])`, given the merged out and lse."""
        ...


def check_lse(lse_HT: torch.Tensor, q_THD: torch.Tensor, source: str) -> torch.Tensor:
    """`lse_HT` if it is the `[H, Tq]` log-sum-exp of `q_THD`; RuntimeError naming `source` else.

    Flash libraries do not check the log-sum-exp they are handed back (flash-attn 2.6's
    backward reads the first `H * Tq` floats of whatever it gets), so a wrong tensor taken
    for it would silently give wrong gradients; every adapter checks it on every call.
    """
    expected = (q_THD.shape[1], q_THD.shape[0])
    if tuple(lse_HT.shape) != expected:
        raise RuntimeError(
            f"{source} gave a log-sum-exp of shape {tuple(lse_HT.shape)}, expected "
            f"[heads, tokens] = {expected}"
        )
    return lse_HT


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial outputs, lse and gradients accumulate in float32 for 16-bit inputs."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
