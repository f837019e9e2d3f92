"""Host-to-device copies that never block the host (ops layer).

Everything a micro-batch needs on the device besides the model (token ids, labels, positions,
loss mask, document offsets, the ring's row indices) is built on the host and travels in one
packed buffer per kind: on CUDA from pinned memory with `non_blocking=True`, so the host can
queue the next micro-batch while the GPU still runs this one. A pageable `.to(cuda)` or a
`torch.tensor(..., device=cuda)` would wait for the GPU each time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`: one pinned, non-blocking copy on CUDA (none when already there)."""
    if host.device == device:
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def pack_int64(parts: Sequence[torch.Tensor | Sequence[int]]) -> tuple[torch.Tensor, list[int]]:
    """Host int64 tensors or int lists, concatenated; returns the buffer and each part's length.

    `unpack` splits the buffer (on any device) back into views of those lengths.
    """
    tensors = [
        p.reshape(-1).to(torch.int64)
        if isinstance(p, torch.Tensor)
        else torch.tensor(p, dtype=torch.int64)
        for p in parts
    ]
    buffer = torch.cat(tensors) if tensors else torch.zeros(0, dtype=torch.int64)
    return buffer, [len(t) for t in tensors]


def unpack(buffer: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Views of `buffer` of the given consecutive lengths."""
    return list(torch.split(buffer, list(lengths)))
