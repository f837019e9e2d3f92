"""HostBufferPool: one slab, aligned blocks, no overlap, reuse, deferred frees, accounting."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hdp.offload.host_pool import ALIGNMENT, HostBufferPool, HostPoolExhaustedError

KIB = 1024


class FakeEvent:
    """Stands in for `torch.cuda.Event` (same `query(self)` / `synchronize(self)` methods)."""

    def __init__(self) -> None:
        self.done = False
        self.synchronized = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True


def slab_range(pool):
    ptr = pool._slab.data_ptr()
    return ptr, ptr + pool._slab.untyped_storage().nbytes()


def test_accounting_is_the_one_slab():
    pool = HostBufferPool(1_000_000, pin=False)
    assert pool.nbytes == 1_000_000 == pool._slab.untyped_storage().nbytes()
    assert pool.num_slabs == 1 and not pool.pinned
    assert pool.capacity % ALIGNMENT == 0
    assert 1_000_000 - 2 * (ALIGNMENT - 1) <= pool.capacity <= 1_000_000
    assert pool.free_ranges() == [(0, pool.capacity)]
    assert pool.bytes_in_use == pool.high_water == 0
    # A float budget (GB * 1e9 / tp) is truncated; the slab is what is counted.
    assert HostBufferPool(4096.9, pin=False).nbytes == 4096
    empty = HostBufferPool(0, pin=False)
    assert empty.num_slabs == 0 and empty.capacity == 0
    with pytest.raises(HostPoolExhaustedError, match="host pool of 0 bytes"):
        empty.allocate(1)


@pytest.mark.parametrize("budget", [-1, float("nan"), float("inf")])
def test_bad_budget_is_refused(budget):
    with pytest.raises(ValueError, match=str(budget)):
        HostBufferPool(budget, pin=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pinning_without_cuda_is_refused():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        HostBufferPool(4096, pin=True)
    assert not HostBufferPool(4096).pinned  # the default pins only with CUDA


def test_blocks_are_aligned_views_of_the_slab_and_never_overlap():
    pool = HostBufferPool(256 * KIB, pin=False)
    lo, hi = slab_range(pool)
    sizes = [1, 511, 512, 513, 3000, 8 * KIB, 7, 100 * KIB]
    blocks = [pool.allocate(n) for n in sizes]
    views = []
    for i, (block, n) in enumerate(zip(blocks, sizes)):
        assert block.offset % ALIGNMENT == 0 and block.size % ALIGNMENT == 0
        assert block.size >= max(n, ALIGNMENT) and block.nbytes == n
        view = pool.view(block, torch.uint8, (n,))
        assert view.data_ptr() % ALIGNMENT == 0
        assert lo <= view.data_ptr() and view.data_ptr() + n <= hi
        view.fill_(i + 1)  # distinct pattern per block
        views.append(view)
    for i, view in enumerate(views):
        assert bool((view == i + 1).all()), f"block {i} was overwritten by another block"
    assert pool.bytes_in_use == sum(b.size for b in blocks) == pool.peak_bytes_in_use


def test_typed_views_round_trip():
    pool = HostBufferPool(64 * KIB, pin=False)
    for dtype in (torch.float64, torch.bfloat16, torch.int32, torch.bool):
        src = (torch.randn(3, 5, 7) * 10).to(dtype)
        block = pool.allocate(src.numel() * src.element_size())
        view = pool.view(block, dtype, src.shape)
        view.copy_(src)
        assert view.dtype == dtype and view.shape == src.shape and torch.equal(view, src)
        pool.free(block)


def test_freed_blocks_are_reused_and_the_slab_does_not_grow():
    pool = HostBufferPool(64 * KIB, pin=False)
    for _ in range(100):
        blocks = [pool.allocate(n) for n in (5000, 12_000, 700)]
        for block in reversed(blocks):
            pool.free(block)
    assert pool.high_water == 5120 + 12_288 + 1024
    assert pool.free_ranges() == [(0, pool.capacity)]  # merged back into one range
    assert pool.bytes_in_use == 0 and pool.num_slabs == 1


def test_fragmentation_and_merging_of_neighbours():
    pool = HostBufferPool(4 * KIB + ALIGNMENT, pin=False)
    assert pool.capacity >= 4 * KIB
    a, b, c, d = (pool.allocate(KIB) for _ in range(4))
    rest = pool.capacity - 4 * KIB
    pool.free(a)
    pool.free(c)
    assert pool.bytes_in_use == 2 * KIB
    with pytest.raises(HostPoolExhaustedError, match=f"largest free block is {max(KIB, rest)}"):
        pool.allocate(2 * KIB)  # 2 KiB free in total, but not in one piece
    pool.free(b)  # a, b and c merge
    assert pool.free_ranges()[0] == (0, 3 * KIB)
    big = pool.allocate(3 * KIB)
    assert big.offset == 0
    pool.free(d)
    pool.free(big)
    assert pool.free_ranges() == [(0, pool.capacity)]


def test_exhaustion_names_the_sizes_and_changes_nothing():
    pool = HostBufferPool(8 * KIB, pin=False)
    block = pool.allocate(pool.capacity - KIB)
    before = (pool.bytes_in_use, pool.free_ranges(), pool.num_live)
    with pytest.raises(HostPoolExhaustedError, match=r"offloading 2000 bytes needs a free"):
        pool.allocate(2000)
    assert isinstance(HostPoolExhaustedError("x"), MemoryError)
    assert (pool.bytes_in_use, pool.free_ranges(), pool.num_live) == before
    pool.free(block)
    pool.allocate(2000)


def test_double_free_and_foreign_blocks_are_refused():
    pool, other = HostBufferPool(4 * KIB, pin=False), HostBufferPool(4 * KIB, pin=False)
    block = pool.allocate(100)
    with pytest.raises(KeyError, match="not a live block"):
        other.free(block)
    pool.free(block)
    with pytest.raises(KeyError, match="not a live block"):
        pool.free(block)
    with pytest.raises(KeyError, match="not a live block"):
        pool.view(block, torch.uint8, (100,))


def test_deferred_free_waits_for_its_copy():
    pool = HostBufferPool(2 * KIB + ALIGNMENT, pin=False)
    first = pool.allocate(KIB)
    event = FakeEvent()
    pool.free(first, ready=event)
    assert pool.num_pending == 1 and pool.bytes_in_use == KIB
    second = pool.allocate(KIB)  # the pending range is not handed out while its copy runs
    assert second.offset == KIB and event.synchronized == 0
    event.done = True
    third = pool.allocate(KIB)  # reclaimed without waiting
    assert third.offset == 0 and event.synchronized == 0 and pool.num_pending == 0
    # Full and only a pending free could make room: the pool waits for it.
    slow = FakeEvent()
    pool.free(third, ready=slow)
    fourth = pool.allocate(KIB)
    assert fourth.offset == 0 and slow.synchronized == 1


@st.composite
def operations(draw):
    """A sequence of allocate(size) / free(index) / free_deferred(index) / finish(index)."""
    ops = []
    for _ in range(draw(st.integers(1, 60))):
        kind = draw(st.sampled_from(["alloc", "alloc", "free", "defer", "finish"]))
        if kind == "alloc":
            ops.append(("alloc", draw(st.integers(0, 3000))))
        else:
            ops.append((kind, draw(st.integers(0, 10**6))))
    return ops


def brute_force_offset(capacity, occupied, size):
    """Lowest aligned offset where `size` bytes miss every occupied interval, or None."""
    for start in range(0, capacity - size + 1, ALIGNMENT):
        if all(start + size <= lo or hi <= start for lo, hi in occupied):
            return start
    return None


@given(operations(), st.integers(0, 24))
@settings(max_examples=200, deadline=None)
def test_random_sequences_match_a_brute_force_model(ops, units):
    """First fit over merged free ranges hands out the lowest offset that fits."""
    pool = HostBufferPool(units * ALIGNMENT + ALIGNMENT, pin=False)
    capacity = pool.capacity
    live, pending = [], []  # [(block, pattern)], [(block, event)]
    for n, (kind, arg) in enumerate(ops):
        if kind == "alloc":
            size = max(ALIGNMENT, -(-arg // ALIGNMENT) * ALIGNMENT)
            occupied = [(b.offset, b.offset + b.size) for b, _ in live]
            waiting = [(b.offset, b.offset + b.size) for b, e in pending if not e.done]
            want = brute_force_offset(capacity, occupied + waiting, size)
            if want is None and waiting:  # the pool then waits for every pending free
                want = brute_force_offset(capacity, occupied, size)
                synced = True
            else:
                synced = False
            if want is None:
                with pytest.raises(HostPoolExhaustedError):
                    pool.allocate(arg)
                pending = [(b, e) for b, e in pending if not e.done]
                if synced:
                    pending = []
                continue
            block = pool.allocate(arg)
            assert block.offset == want and block.size == size
            pending = [] if synced else [(b, e) for b, e in pending if not e.done]
            pattern = n % 251 + 1
            pool.view(block, torch.uint8, (arg,)).fill_(pattern)
            live.append((block, pattern))
        elif kind in ("free", "defer") and live:
            block, pattern = live.pop(arg % len(live))
            view = pool.view(block, torch.uint8, (block.nbytes,))
            assert bool((view == pattern).all()), "a live block was overwritten"
            if kind == "free":
                pool.free(block)
            else:
                event = FakeEvent()
                pool.free(block, ready=event)
                pending.append((block, event))
        elif kind == "finish" and pending:
            pending[arg % len(pending)][1].done = True
        in_use = sum(b.size for b, _ in live) + sum(b.size for b, _ in pending)
        assert pool.bytes_in_use == in_use
        assert pool.num_live == len(live)
    for block, pattern in live:
        assert bool((pool.view(block, torch.uint8, (block.nbytes,)) == pattern).all())


def test_a_slab_the_host_cannot_hold_is_refused_clearly(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(torch, "empty", refuse)
    with pytest.raises(RuntimeError, match=r"host pool of 4096 bytes .*--hdp-host-memory-gb"):
        HostBufferPool(4096, pin=False)


def test_only_a_pinned_pool_is_held_to_the_memory_available_when_it_pins(monkeypatch):
    """Unpinned pages cost memory only once an offload writes them (CPU runs); pinned ones now.

    A pinned pool must leave 2 GiB available at the moment it pins (the machine's other
    processes may have pinned theirs already).
    """
    from megatron_hdp.offload import host_pool

    monkeypatch.setattr(host_pool, "available_memory_bytes", lambda: 2 * 2**30 + (1 << 20) - 1)
    pool = HostBufferPool(1 << 20, pin=False)
    assert pool.nbytes == 1 << 20
    with pytest.raises(RuntimeError, match=r"host pool of 1\.0 MiB would leave less than 2\.0 GiB"):
        HostBufferPool(1 << 20, pin=True)  # refused before anything is allocated or pinned
    monkeypatch.setattr(host_pool, "available_memory_bytes", lambda: 2 * 2**30 + (1 << 20))
    with pytest.raises(RuntimeError, match="needs CUDA"):  # the guard passed: pinning is next
        HostBufferPool(1 << 20, pin=True)
