"""Copy engines: move tensors between the compute device and host memory (ops layer).

`OffloadManager` (in `hooks.py`) decides *what* to move; an engine only moves it and
counts bytes. The engine is injected, so the same manager runs on CPU with
`HostCopyEngine` (synchronous copies) and on GPU with `CudaCopyEngine` (two copy streams).
Both keep their host copies in one `HostBufferPool` (`host_pool.py`): a slab of exactly
the host budget, allocated once when the engine is constructed (pinned for CUDA), carved
into aligned blocks and reused across micro-batches. The host memory an engine holds is
therefore `budget_bytes` from construction on, never more, and no offload allocates
host memory.

Handles are plain ints, valid from `offload` until `release`. A handle is fetched at
most once in the normal flow, but `fetch` may be called again until `release`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from megatron_hdp.offload.host_pool import Block, HostBufferPool, HostPoolExhaustedError

__all__ = ["CopyEngine", "CudaCopyEngine", "HostCopyEngine", "HostPoolExhaustedError"]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@runtime_checkable
class CopyEngine(Protocol):
    """What `OffloadManager` needs from a copy engine.

    Attributes:
        bytes_to_host: Bytes copied device -> host since construction.
        bytes_to_device: Bytes copied host -> device since construction.
        host_bytes_in_use: Host bytes (aligned blocks of the pool) held for handles not
            yet released.
        peak_host_bytes: Largest `host_bytes_in_use` seen.
        pinned_bytes: Host bytes the engine allocated (its pool's slab, pinned on CUDA).
    """

    bytes_to_host: int
    bytes_to_device: int
    host_bytes_in_use: int
    peak_host_bytes: int
    pinned_bytes: int

    def offload(self, tensor: torch.Tensor) -> int:
        """Start copying `tensor` to host memory (may be asynchronous); return a handle.

        The caller may drop `tensor` right after: the engine keeps what the copy needs.
        Raises `HostPoolExhaustedError` (a MemoryError) when the host pool has no free block
        large enough; nothing was copied then, and the caller keeps the tensor.
        """
        ...

    def prefetch(self, handle: int) -> None:
        """Start bringing `handle` back to its device early; a later `fetch` finds it ready."""
        ...

    def fetch(self, handle: int) -> torch.Tensor:
        """The tensor of `handle` on its original device, safe to read on the current stream."""
        ...

    def release(self, handle: int) -> None:
        """Free the host memory of `handle`; the handle is invalid afterwards."""
        ...


class _PooledEngine:
    """The byte counters and the host pool every copy engine keeps.

    Args:
        budget_bytes: Bytes of host memory the pool allocates now, once.
        pin: Page-lock the pool for CUDA.
    """

    def __init__(self, budget_bytes: float, *, pin: bool) -> None:
        self.pool = HostBufferPool(budget_bytes, pin=pin)
        self.budget_bytes = self.pool.nbytes
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.host_bytes_in_use = 0
        self.peak_host_bytes = 0
        self._next_handle = 0

    @property
    def pinned_bytes(self) -> int:
        """Host bytes allocated by the pool (pinned when `pool.pinned`): its slab."""
        return self.pool.nbytes

    def _new_handle(self, copied: int, block: Block) -> int:
        """Count one offload of `copied` bytes held in `block`; a fresh handle."""
        self.bytes_to_host += copied
        self.host_bytes_in_use += block.size
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes_in_use)
        handle = self._next_handle
        self._next_handle += 1
        return handle

    def _count_release(self, block: Block) -> None:
        self.host_bytes_in_use -= block.size


class HostCopyEngine(_PooledEngine):
    """Synchronous engine for CPU runs and tests: copies into blocks of an unpinned pool.

    `offload` copies the tensor into a block of the pool, so the caller's storage can be
    freed; `fetch` returns a fresh copy on the original device. `prefetch` has nothing to
    overlap and only counts (`num_prefetches`).

    Args:
        budget_bytes: Bytes of host memory allocated now for the pool (untouched pages
            cost nothing until an offload writes them).
        pin: Page-lock the pool (only useful when a CUDA tensor is offloaded).

    Raises:
        ValueError: If `budget_bytes` is negative.
    """

    def __init__(self, budget_bytes: float, *, pin: bool = False) -> None:
        super().__init__(budget_bytes, pin=pin)
        self.num_prefetches = 0
        self._store: dict[int, tuple[Block, torch.Tensor, torch.device]] = {}

    def offload(self, tensor: torch.Tensor) -> int:
        """Copy `tensor` into a block of the pool; return its handle.

        Raises:
            HostPoolExhaustedError: If no free block of the pool fits; names the sizes.
        """
        nbytes = _nbytes(tensor)
        block = self.pool.allocate(nbytes)
        host = self.pool.view(block, tensor.dtype, tensor.shape)
        host.copy_(tensor.detach())
        handle = self._new_handle(nbytes, block)
        self._store[handle] = (block, host, tensor.device)
        return handle

    def _entry(self, handle: int) -> tuple[Block, torch.Tensor, torch.device]:
        try:
            return self._store[handle]
        except KeyError:
            raise KeyError(f"unknown or released offload handle {handle}") from None

    def prefetch(self, handle: int) -> None:
        """Count the prefetch; the copy itself happens in `fetch`."""
        self._entry(handle)
        self.num_prefetches += 1

    def fetch(self, handle: int) -> torch.Tensor:
        """A new copy of the stored tensor on its original device."""
        _, host, device = self._entry(handle)
        self.bytes_to_device += _nbytes(host)
        return host.to(device, copy=True)

    def release(self, handle: int) -> None:
        """Return the handle's block to the pool."""
        block, _, _ = self._entry(handle)
        del self._store[handle]
        self.pool.free(block)
        self._count_release(block)


@dataclass
class _CudaEntry:
    block: Block  # of the pinned pool
    host: torch.Tensor  # view of `block` with the tensor's dtype and shape
    d2h_done: torch.cuda.Event
    h2d_done: torch.cuda.Event | None = None
    device_tensor: torch.Tensor | None = None  # set by prefetch, handed out by fetch


class CudaCopyEngine(_PooledEngine):
    """GPU engine: D2H and H2D copy streams over a pinned host pool allocated once.

    The pool (one slab of `budget_bytes`, page-locked with `cudaHostRegister`) is allocated
    in the constructor, so no offload calls `cudaHostAlloc` inside the forward pass.

    Stream ordering:
    - `offload`: the D2H stream waits for the compute stream (the values are written),
      copies into a pool block, and `record_stream` keeps the caching allocator from
      reusing the device memory before the copy has read it.
    - `prefetch`: the destination is allocated on the compute stream (one caching
      allocator pool for all activations); the H2D stream waits for the compute stream
      (that memory's earlier users) and for the D2H copy's event, copies, and
      `record_stream` keeps the destination alive until the copy lands even if the handle
      is released unfetched.
    - `fetch`: the compute stream waits for the H2D event (compute never reads a tensor
      before its copy lands).
    - `release`: the block goes back to the pool with the event of its last copy; the pool
      reuses it only once that event has completed.

    Streams are created on first use. Not tested here (no GPU on the build boxes).

    Args:
        device: The CUDA device whose tensors are offloaded.
        budget_bytes: Bytes of pinned host memory allocated now for the pool.

    Raises:
        ValueError: If `device` is not a CUDA device or `budget_bytes` is negative.
        RuntimeError: If CUDA is unavailable or pinning the pool fails.
    """

    def __init__(self, device: torch.device | str | int, budget_bytes: float) -> None:
        self.device = (
            torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        )
        if self.device.type != "cuda":
            raise ValueError(f"CudaCopyEngine needs a CUDA device, got {self.device}")
        super().__init__(budget_bytes, pin=True)
        self._d2h: torch.cuda.Stream | None = None
        self._h2d: torch.cuda.Stream | None = None
        self._entries: dict[int, _CudaEntry] = {}

    def _streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._d2h is None or self._h2d is None:
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)
        return self._d2h, self._h2d

    def offload(self, tensor: torch.Tensor) -> int:
        """Copy `tensor` into a pinned block on the D2H stream; return its handle.

        Raises:
            HostPoolExhaustedError: If no free block of the pool fits; names the sizes.
        """
        d2h, _ = self._streams()
        nbytes = _nbytes(tensor)
        block = self.pool.allocate(nbytes)  # reused only after its last copy completed
        host = self.pool.view(block, tensor.dtype, tensor.shape)
        d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(d2h):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(d2h)
        done = torch.cuda.Event()
        done.record(d2h)
        handle = self._new_handle(nbytes, block)
        self._entries[handle] = _CudaEntry(block=block, host=host, d2h_done=done)
        return handle

    def prefetch(self, handle: int) -> None:
        """Issue the H2D copy of `handle` on the H2D stream (no-op if already issued)."""
        entry = self._entries[handle]
        if entry.device_tensor is not None:
            return
        _, h2d = self._streams()
        compute = torch.cuda.current_stream(self.device)
        device_tensor = torch.empty_like(entry.host, device=self.device)  # compute's pool
        h2d.wait_stream(compute)
        h2d.wait_event(entry.d2h_done)
        with torch.cuda.stream(h2d):
            device_tensor.copy_(entry.host, non_blocking=True)
        device_tensor.record_stream(h2d)
        entry.h2d_done = torch.cuda.Event()
        entry.h2d_done.record(h2d)
        entry.device_tensor = device_tensor
        self.bytes_to_device += _nbytes(device_tensor)

    def fetch(self, handle: int) -> torch.Tensor:
        """The device tensor of `handle`, ordered after its H2D copy on the current stream."""
        self.prefetch(handle)
        entry = self._entries[handle]
        device_tensor, entry.device_tensor = entry.device_tensor, None
        torch.cuda.current_stream(self.device).wait_event(entry.h2d_done)
        return device_tensor

    def release(self, handle: int) -> None:
        """Return the block of `handle` to the pool once its last copy has completed."""
        entry = self._entries.pop(handle)
        last_copy = entry.h2d_done if entry.h2d_done is not None else entry.d2h_done
        self.pool.free(entry.block, ready=last_copy)
        self._count_release(entry.block)
