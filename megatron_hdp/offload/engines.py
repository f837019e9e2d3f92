"""Copy engines: move tensors between the compute device and host memory (ops layer).

`OffloadManager` (in `hooks.py`) decides *what* to move; an engine only moves it and
counts bytes. The engine is injected, so the same manager runs on CPU with
`HostCopyEngine` (synchronous, a separate store of cloned tensors) and on GPU with
`CudaCopyEngine` (two copy streams, a pinned host buffer pool).

Handles are plain ints, valid from `offload` until `release`. A handle is fetched at
most once in the normal flow, but `fetch` may be called again until `release`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@runtime_checkable
class CopyEngine(Protocol):
    """What `OffloadManager` needs from a copy engine.

    Attributes:
        bytes_to_host: Bytes copied device -> host since construction.
        bytes_to_device: Bytes copied host -> device since construction.
        host_bytes_in_use: Host bytes held for handles not yet released.
        peak_host_bytes: Largest `host_bytes_in_use` seen.
    """

    bytes_to_host: int
    bytes_to_device: int
    host_bytes_in_use: int
    peak_host_bytes: int

    def offload(self, tensor: torch.Tensor) -> int:
        """Start copying `tensor` to host memory (may be asynchronous); return a handle.

        The caller may drop `tensor` right after: the engine keeps what the copy needs.
        Raises MemoryError when the copy would exceed the engine's host budget.
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


class _Counters:
    """The byte counters and host budget every copy engine keeps."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"host budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.host_bytes_in_use = 0
        self.peak_host_bytes = 0
        self._next_handle = 0

    def _new_handle(self, copied: int, held: int) -> int:
        """Count one offload of `copied` bytes that holds `held` host bytes; a fresh handle."""
        self.bytes_to_host += copied
        self.host_bytes_in_use += held
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes_in_use)
        handle = self._next_handle
        self._next_handle += 1
        return handle


class HostCopyEngine(_Counters):
    """Synchronous engine for CPU runs and tests: a store of cloned tensors.

    `offload` clones the tensor into a separate store (dict handle -> tensor), so the
    caller's storage can be freed; `fetch` returns a fresh copy on the original device.
    `prefetch` has nothing to overlap and only counts (`num_prefetches`).

    Args:
        budget_bytes: Most bytes the store may hold at once.

    Raises:
        ValueError: If `budget_bytes` is negative.
    """

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self.num_prefetches = 0
        self._store: dict[int, tuple[torch.Tensor, torch.device]] = {}

    def offload(self, tensor: torch.Tensor) -> int:
        """Clone `tensor` into the store; return its handle.

        Raises:
            MemoryError: If the store would exceed `budget_bytes`; names the sizes.
        """
        nbytes = _nbytes(tensor)
        if self.host_bytes_in_use + nbytes > self.budget_bytes:
            raise MemoryError(
                f"offloading {nbytes} bytes needs {self.host_bytes_in_use + nbytes} bytes of "
                f"host memory, more than the host budget of {self.budget_bytes} bytes "
                f"({self.host_bytes_in_use} in use)"
            )
        host = tensor.detach().to("cpu", copy=True)
        handle = self._new_handle(nbytes, nbytes)
        self._store[handle] = (host, tensor.device)
        return handle

    def _entry(self, handle: int) -> tuple[torch.Tensor, torch.device]:
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
        host, device = self._entry(handle)
        self.bytes_to_device += _nbytes(host)
        return host.to(device, copy=True)

    def release(self, handle: int) -> None:
        """Drop the stored copy."""
        host, _ = self._entry(handle)
        del self._store[handle]
        self.host_bytes_in_use -= _nbytes(host)


def _size_class(nbytes: int) -> int:
    """Pinned buffers come in powers of two up to 1 MiB, then multiples of 1 MiB."""
    mib = 1 << 20
    if nbytes <= mib:
        return max(512, 1 << max(0, nbytes - 1).bit_length())
    return -(-nbytes // mib) * mib


@dataclass
class _CudaEntry:
    buffer: torch.Tensor  # pinned uint8 block of the pool
    host: torch.Tensor  # view of `buffer` with the tensor's dtype and shape
    d2h_done: torch.cuda.Event
    h2d_done: torch.cuda.Event | None = None
    device_tensor: torch.Tensor | None = None  # set by prefetch, handed out by fetch


class CudaCopyEngine(_Counters):
    """GPU engine: D2H and H2D copy streams and a reusable pinned host buffer pool.

    Stream ordering:
    - `offload`: the D2H stream waits for the compute stream (the values are written),
      copies, and `record_stream` keeps the caching allocator from reusing the device
      memory before the copy has read it.
    - `prefetch`: the H2D stream waits for the D2H copy's event and copies into a new
      device tensor.
    - `fetch`: the compute stream waits for the H2D event (compute never reads a tensor
      before its copy lands); `record_stream` ties the tensor's memory to the compute
      stream.
    - `release`: the pinned buffer returns to the pool with the event of its last copy;
      the next D2H copy into it waits for that event.

    Streams are created on first use, never in the constructor, so the engine constructs
    (and imports) on a machine without CUDA. Not tested here (no GPU on the build boxes).

    Args:
        device: The CUDA device whose tensors are offloaded.
        budget_bytes: Most pinned host bytes the pool may allocate.

    Raises:
        ValueError: If `device` is not a CUDA device or `budget_bytes` is negative.
    """

    def __init__(self, device: torch.device | str | int, budget_bytes: int) -> None:
        self.device = (
            torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        )
        if self.device.type != "cuda":
            raise ValueError(f"CudaCopyEngine needs a CUDA device, got {self.device}")
        super().__init__(budget_bytes)
        self.pinned_bytes = 0  # allocated by the pool: in use plus free
        self._d2h: torch.cuda.Stream | None = None
        self._h2d: torch.cuda.Stream | None = None
        self._free: dict[int, list[tuple[torch.Tensor, torch.cuda.Event]]] = {}
        self._entries: dict[int, _CudaEntry] = {}

    def _streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._d2h is None or self._h2d is None:
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)
        return self._d2h, self._h2d

    def _take_buffer(self, nbytes: int, d2h: torch.cuda.Stream) -> torch.Tensor:
        size = _size_class(nbytes)
        free = self._free.get(size)
        if free:
            buffer, last_copy = free.pop()
            d2h.wait_event(last_copy)  # an earlier copy may still read or write it
            return buffer
        if self.pinned_bytes + size > self.budget_bytes:
            # Give back free buffers of other sizes before refusing.
            for buffers in self._free.values():
                for buffer, last_copy in buffers:
                    last_copy.synchronize()
                    self.pinned_bytes -= buffer.numel()
            self._free.clear()
        if self.pinned_bytes + size > self.budget_bytes:
            raise MemoryError(
                f"offloading {nbytes} bytes needs a pinned buffer of {size} bytes; "
                f"{self.pinned_bytes} of the host budget of {self.budget_bytes} bytes "
                "are in use"
            )
        self.pinned_bytes += size
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def offload(self, tensor: torch.Tensor) -> int:
        """Copy `tensor` into a pinned buffer on the D2H stream; return its handle."""
        d2h, _ = self._streams()
        nbytes = _nbytes(tensor)
        buffer = self._take_buffer(nbytes, d2h)
        host = buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(d2h):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(d2h)
        done = torch.cuda.Event()
        done.record(d2h)
        handle = self._new_handle(nbytes, buffer.numel())
        self._entries[handle] = _CudaEntry(buffer=buffer, host=host, d2h_done=done)
        return handle

    def prefetch(self, handle: int) -> None:
        """Issue the H2D copy of `handle` on the H2D stream (no-op if already issued)."""
        entry = self._entries[handle]
        if entry.device_tensor is not None:
            return
        _, h2d = self._streams()
        h2d.wait_event(entry.d2h_done)
        with torch.cuda.stream(h2d):
            device_tensor = torch.empty_like(entry.host, device=self.device)
            device_tensor.copy_(entry.host, non_blocking=True)
        entry.h2d_done = torch.cuda.Event()
        entry.h2d_done.record(h2d)
        entry.device_tensor = device_tensor
        self.bytes_to_device += _nbytes(device_tensor)

    def fetch(self, handle: int) -> torch.Tensor:
        """The device tensor of `handle`, ordered after its H2D copy on the current stream."""
        self.prefetch(handle)
        entry = self._entries[handle]
        device_tensor, entry.device_tensor = entry.device_tensor, None
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(entry.h2d_done)
        device_tensor.record_stream(compute)  # allocated on the H2D stream, used here
        return device_tensor

    def release(self, handle: int) -> None:
        """Return the pinned buffer of `handle` to the pool."""
        entry = self._entries.pop(handle)
        last_copy = entry.h2d_done if entry.h2d_done is not None else entry.d2h_done
        self._free.setdefault(entry.buffer.numel(), []).append((entry.buffer, last_copy))
        self.host_bytes_in_use -= entry.buffer.numel()
