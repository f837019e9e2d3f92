"""A host buffer pool for offloaded activations: one slab, allocated once (ops layer).

The copy engines (`engines.py`) take every host buffer from a `HostBufferPool`, never
from PyTorch's host allocator. The pool allocates one host slab of exactly the budget's
bytes when it is constructed (outside any forward pass) and pins it when asked to
(`cudaHostRegister`, the way `torch.distributed.checkpoint` pins its staging buffers),
so the pinned bytes are exactly the slab's bytes, do not grow, and are not rounded up
to a power of two as `torch.empty(..., pin_memory=True)` would round them. A
sub-allocator hands out 512-byte-aligned blocks of the slab (first fit over a sorted
list of free ranges, merged with their neighbours on free), so memory is reused across
micro-batches.

A block may be freed with a readiness object (a CUDA event: anything with `query()` and
`synchronize()`): it returns to the free ranges only once that reports done, so a new
copy never writes host memory that an earlier asynchronous copy still reads. Without
CUDA the slab is ordinary host memory and the same code runs, which is what the CPU
tests exercise.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from collections import deque
from typing import Protocol

import torch

from megatron_hdp.offload.host_budget import available_memory_bytes, pin_problem

logger = logging.getLogger(__name__)

#: Offset and size granularity of blocks, in bytes: every dtype's alignment, and the
#: start of a DMA-friendly boundary for the copy engines.
ALIGNMENT = 512


class HostPoolExhaustedError(MemoryError):
    """The pool has no free range large enough for a request (the caller keeps the tensor)."""


class Readiness(Protocol):
    """What a deferred free waits on (`torch.cuda.Event` has both methods)."""

    def query(self) -> bool:
        """Whether the work the free waits on has completed (never blocks)."""
        ...

    def synchronize(self) -> None:
        """Block until that work has completed."""
        ...


class Block:
    """A live range of the slab: `offset` and `size` (aligned), `nbytes` as requested."""

    __slots__ = ("offset", "size", "nbytes")

    def __init__(self, offset: int, size: int, nbytes: int) -> None:
        self.offset, self.size, self.nbytes = offset, size, nbytes

    def __repr__(self) -> str:
        return f"Block(offset={self.offset}, size={self.size}, nbytes={self.nbytes})"


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _register(ptr: int, nbytes: int) -> None:
    """Page-lock `nbytes` host bytes at `ptr` for CUDA (portable to every context)."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "pinning host memory for the offload pool needs CUDA, which this torch build or "
            "machine does not have (use an unpinned pool on CPU)"
        )
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))  # cudaHostRegisterPortable
    if err != 0:
        raise RuntimeError(
            f"cudaHostRegister of {nbytes} bytes for the offload pool failed with CUDA error "
            f"{err}; lower --hdp-host-memory-gb"
        )


def _unregister(ptr: int) -> None:
    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        logger.warning("cudaHostUnregister of the offload pool failed with CUDA error %d", err)


class HostBufferPool:
    """One host slab of `budget_bytes` (allocated here, once) and a block sub-allocator.

    Accounting: `nbytes` is the slab's size, `int(budget_bytes)`, the host memory this pool
    holds (and pins, with `pin`) for its whole life; nothing is allocated later. Up to
    `ALIGNMENT - 1` bytes at the start are skipped to align the first block, and every
    block's size is rounded up to `ALIGNMENT`, so `capacity <= nbytes` is what blocks can use.

    Attributes:
        nbytes: Bytes of the slab (pinned when `pinned`).
        capacity: Bytes usable by blocks (`nbytes` less the alignment slack).
        pinned: Whether the slab is page-locked for CUDA.
        bytes_in_use: Aligned bytes of live blocks and of frees still waiting on a copy.
        peak_bytes_in_use: Largest `bytes_in_use` seen.
        high_water: Largest end offset any block has reached (bytes of the slab touched).
        num_slabs: Host allocations made by this pool (1, or 0 for an empty budget).

    Args:
        budget_bytes: Bytes of host memory to allocate (a float is truncated).
        pin: Page-lock the slab for CUDA (default: when CUDA is available).

    Raises:
        ValueError: If `budget_bytes` is negative or not finite.
        RuntimeError: If `pin` is asked for without CUDA, or pinning fails.
    """

    def __init__(self, budget_bytes: float, *, pin: bool | None = None) -> None:
        try:
            nbytes = int(budget_bytes)
        except (OverflowError, ValueError, TypeError):
            raise ValueError(
                f"host budget must be a finite number of bytes, got {budget_bytes}"
            ) from None
        if nbytes < 0:
            raise ValueError(f"host budget must be >= 0 bytes, got {budget_bytes}")
        self.pinned = torch.cuda.is_available() if pin is None else bool(pin)
        self.nbytes = nbytes
        self.num_slabs = 0
        self._slab = self._allocate_slab(nbytes)
        start = -self._slab.data_ptr() % ALIGNMENT if nbytes else 0
        self.capacity = max(0, nbytes - start) // ALIGNMENT * ALIGNMENT
        self._data = self._slab[start : start + self.capacity]
        self._free_offsets: list[int] = [0] if self.capacity else []  # sorted
        self._free_sizes: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self._live: dict[int, Block] = {}
        self._pending: deque[tuple[Block, Readiness]] = deque()
        self.bytes_in_use = 0
        self.peak_bytes_in_use = 0
        self.high_water = 0

    def _allocate_slab(self, nbytes: int) -> torch.Tensor:
        """The pool's one host allocation (pinned when `self.pinned`)."""
        if self.pinned:  # pinned pages are resident; unpinned ones only once written
            problem = pin_problem(nbytes, available_memory_bytes())
            if problem is not None:
                raise RuntimeError(problem)
        try:
            slab = torch.empty(nbytes, dtype=torch.uint8)
        except RuntimeError as exc:
            raise RuntimeError(
                f"cannot allocate the offload host pool of {nbytes} bytes ({exc}); lower "
                "--hdp-host-memory-gb"
            ) from exc
        if nbytes:
            self.num_slabs += 1
            if self.pinned:
                _register(slab.data_ptr(), nbytes)
                self._unpin = weakref.finalize(self, _unregister, slab.data_ptr())
                self._unpin.atexit = False  # the process's exit frees it anyway
        return slab

    @property
    def num_live(self) -> int:
        """Blocks allocated and not yet freed."""
        return len(self._live)

    @property
    def num_pending(self) -> int:
        """Freed blocks still waiting for their readiness object."""
        return len(self._pending)

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free `(offset, size)` ranges of the usable slab, by offset (for tests, logs)."""
        return [(off, self._free_sizes[off]) for off in self._free_offsets]

    def largest_free(self) -> int:
        """Bytes of the largest free range (pending frees not counted)."""
        return max(self._free_sizes.values(), default=0)

    def allocate(self, nbytes: int) -> Block:
        """A block of at least `nbytes` bytes (first fit; reclaims finished frees first).

        If no free range fits, waits for pending frees (`synchronize`) and tries again.

        Raises:
            ValueError: If `nbytes` is negative.
            HostPoolExhaustedError: If no free range fits even then; names the sizes.
        """
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        size = max(ALIGNMENT, _aligned(nbytes))
        self._reclaim(wait=False)
        offset = self._first_fit(size)
        if offset is None and self._pending:
            self._reclaim(wait=True)
            offset = self._first_fit(size)
        if offset is None:
            raise HostPoolExhaustedError(
                f"offloading {nbytes} bytes needs a free host block of {size} bytes; the "
                f"host pool of {self.nbytes} bytes ({self.capacity} usable) has "
                f"{self.bytes_in_use} in use and its largest free block is "
                f"{self.largest_free()} bytes"
            )
        block = Block(offset, size, nbytes)
        self._live[offset] = block
        self.bytes_in_use += size
        self.peak_bytes_in_use = max(self.peak_bytes_in_use, self.bytes_in_use)
        self.high_water = max(self.high_water, offset + size)
        return block

    def view(self, block: Block, dtype: torch.dtype, shape: torch.Size | tuple) -> torch.Tensor:
        """The first `block.nbytes` bytes of `block` as a tensor of `dtype` and `shape`."""
        self._check_live(block)
        raw = self._data[block.offset : block.offset + block.nbytes]
        return raw.view(dtype).view(shape)

    def free(self, block: Block, ready: Readiness | None = None) -> None:
        """Return `block`; with `ready`, only once `ready.query()` is true.

        Raises:
            KeyError: If `block` is not live in this pool (double free, foreign block).
        """
        self._check_live(block)
        del self._live[block.offset]
        if ready is None:
            self._insert_free(block)
        else:
            self._pending.append((block, ready))

    def _check_live(self, block: Block) -> None:
        if self._live.get(block.offset) is not block:
            raise KeyError(f"{block} is not a live block of this host pool")

    def _first_fit(self, size: int) -> int | None:
        for index, offset in enumerate(self._free_offsets):
            free = self._free_sizes[offset]
            if free >= size:
                del self._free_sizes[offset]
                if free == size:
                    del self._free_offsets[index]
                else:
                    self._free_offsets[index] = offset + size
                    self._free_sizes[offset + size] = free - size
                return offset
        return None

    def _reclaim(self, *, wait: bool) -> None:
        """Free pending blocks whose readiness is done (all of them, waiting, with `wait`)."""
        kept: deque[tuple[Block, Readiness]] = deque()
        while self._pending:
            block, ready = self._pending.popleft()
            if wait:
                ready.synchronize()
            elif not ready.query():
                kept.append((block, ready))
                continue
            self._insert_free(block)
        self._pending = kept

    def _insert_free(self, block: Block) -> None:
        offset, size = block.offset, block.size
        self.bytes_in_use -= size
        index = bisect.bisect_left(self._free_offsets, offset)
        if index < len(self._free_offsets) and self._free_offsets[index] == offset + size:
            size += self._free_sizes.pop(self._free_offsets.pop(index))
        if index > 0:
            prev = self._free_offsets[index - 1]
            if prev + self._free_sizes[prev] == offset:
                self._free_sizes[prev] += size
                return
        self._free_offsets.insert(index, offset)
        self._free_sizes[offset] = size
