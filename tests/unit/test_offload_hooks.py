"""OffloadManager with the host copy engine: exactness, bytes, peak memory, prefetch, errors,
and the host pool behind the engine (one slab at construction, reused, no allocation in the
forward pass, a full pool keeps tensors on the device)."""

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_hdp.offload import host_pool
from megatron_hdp.offload.engines import (
    CopyEngine,
    CudaCopyEngine,
    HostCopyEngine,
    HostPoolExhaustedError,
)
from megatron_hdp.offload.hooks import OffloadManager, offloaded_rows

T, D, NUM_LAYERS = 32, 16, 5
RATIOS = [0.0, 0.25, 0.5, 1.0]
MIN_BYTES = 1024  # LayerNorm's mean/rstd ([T, 1] float64 = 256 bytes) stay resident
BIG_BUDGET = 1 << 30


class AttentionBlock(nn.Module):
    """Pre-norm block: causal softmax attention with matmuls, then a GELU MLP."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D, dtype=torch.float64)
        self.qkv = nn.Linear(D, 3 * D, dtype=torch.float64)
        self.proj = nn.Linear(D, D, dtype=torch.float64)
        self.fc1 = nn.Linear(D, 4 * D, dtype=torch.float64)
        self.fc2 = nn.Linear(4 * D, D, dtype=torch.float64)
        self.register_buffer("mask", torch.ones(T, T, dtype=torch.bool).tril())

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)  # views of one storage
        scores = (q @ k.t() / D**0.5).masked_fill(~self.mask, float("-inf"))
        x = x + self.proj(torch.softmax(scores, dim=-1) @ v)
        return x + self.fc2(F.gelu(self.fc1(x)))


def mlp_block():
    return nn.Sequential(
        nn.Linear(D, 4 * D, dtype=torch.float64),
        nn.GELU(),
        nn.Linear(4 * D, D, dtype=torch.float64),
    )


def make_model(kind):
    torch.manual_seed(0)
    make = AttentionBlock if kind == "attention" else mlp_block
    return nn.Sequential(*[make() for _ in range(NUM_LAYERS)])


def make_input():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(T, D, generator=gen, dtype=torch.float64), torch.randn(
        T, D, generator=gen, dtype=torch.float64
    )


def step(model, x0, w_out, ctx=None):
    """Forward and backward; returns loss, input grad and every parameter grad."""
    model.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    if ctx is None:
        loss = (model(x) * w_out).sum()
        loss.backward()
    else:
        with ctx:
            loss = (model(x) * w_out).sum()
            loss.backward()
    return loss.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


def assert_bitwise(got, want):
    (loss, xg, grads), (rloss, rxg, rgrads) = got, want
    assert torch.equal(loss, rloss)
    assert torch.equal(xg, rxg)
    assert len(grads) == len(rgrads)
    for g, r in zip(grads, rgrads):
        assert torch.equal(g, r)


def independent_accounting(model, x0):
    """Distinct non-parameter storages saved by each layer: {data_ptr: (layer, nbytes)}.

    A plain saved_tensors_hooks pass that only records sizes (keeping every saved tensor
    alive so that no data_ptr is reused during the pass).
    """
    excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen, alive = {}, []

    def pack(layer, t):
        alive.append(t)
        ptr = t.untyped_storage().data_ptr()
        if ptr not in excluded and ptr not in seen:
            seen[ptr] = (layer, t.untyped_storage().nbytes())
        return t

    x = x0.clone().requires_grad_()
    for i, layer in enumerate(model):
        with torch.autograd.graph.saved_tensors_hooks(partial(pack, i), lambda t: t):
            x = layer(x)
    return seen


@pytest.mark.parametrize("kind", ["attention", "mlp"])
def test_loss_and_grads_bitwise_equal_for_every_ratio(kind):
    model = make_model(kind)
    x0, w_out = make_input()
    reference = step(model, x0, w_out)
    engine = HostCopyEngine(BIG_BUDGET)
    manager = OffloadManager(engine, num_layers=NUM_LAYERS, min_offload_bytes=MIN_BYTES)
    manager.install(list(model))
    for ratio in RATIOS:
        assert_bitwise(step(model, x0, w_out, manager.micro_batch(ratio)), reference)
        stats = manager.stats()
        assert stats["offload_ratio"] == ratio
        assert (stats["bytes_to_host"] > 0) == (ratio > 0)
        assert stats["bytes_to_device"] == stats["bytes_to_host"]
        assert stats["resident_bytes"] == 0  # graph freed by backward
    assert engine.host_bytes_in_use == 0
    assert engine.bytes_to_host == engine.bytes_to_device > 0


@pytest.mark.parametrize("kind", ["attention", "mlp"])
def test_bytes_moved_and_peak_resident_match_the_ratio(kind):
    """Tolerance: ceil rounding adds at most one row per offloaded storage (A_off / T here)."""
    model = make_model(kind)
    x0, w_out = make_input()
    saved = independent_accounting(model, x0)
    offloadable = NUM_LAYERS - 2
    per_layer = [sum(n for lay, n in saved.values() if lay == i) for i in range(NUM_LAYERS)]
    off_per_layer = [
        sum(n for lay, n in saved.values() if lay == i and n >= MIN_BYTES)
        for i in range(NUM_LAYERS)
    ]
    assert len(set(per_layer)) == 1 and len(set(off_per_layer)) == 1  # identical layers
    act, act_off = per_layer[0], off_per_layer[0]
    a_all = sum(per_layer)
    a_off = sum(off_per_layer[:offloadable])
    tol = a_off / T

    engine = HostCopyEngine(BIG_BUDGET)
    manager = OffloadManager(engine, num_layers=NUM_LAYERS, min_offload_bytes=MIN_BYTES)
    manager.install(list(model))
    peaks = {}
    for ratio in RATIOS:
        step(model, x0, w_out, manager.micro_batch(ratio))
        s = manager.stats()
        assert s["saved_bytes"] == a_all
        assert s["offloadable_bytes"] == a_off
        assert abs(s["bytes_to_host"] - ratio * a_off) <= tol
        assert s["bytes_to_device"] == s["bytes_to_host"]
        assert s["peak_resident_bytes"] == a_all - s["bytes_to_host"]
        peaks[ratio] = s["peak_resident_bytes"]
    assert peaks[0.0] == a_all
    for ratio in RATIOS:
        # peak(r) = peak(0) - r * A_off; in Eq. 3's form with identical layers:
        # 2 * Act + (l - 2) * ((1 - r) * Act_off + (Act - Act_off)).
        eq3 = 2 * act + offloadable * ((1 - ratio) * act_off + (act - act_off))
        assert abs(peaks[ratio] - (a_all - ratio * a_off)) <= tol
        assert abs(peaks[ratio] - eq3) <= tol
    assert peaks[1.0] < peaks[0.5] < peaks[0.25] < peaks[0.0]


class RecordingEngine(HostCopyEngine):
    def __init__(self, budget_bytes):
        super().__init__(budget_bytes)
        self.current_layer = None
        self.layer_of, self.events = {}, []

    def offload(self, tensor):
        handle = super().offload(tensor)
        self.layer_of[handle] = self.current_layer
        return handle

    def prefetch(self, handle):
        self.events.append(("prefetch", self.layer_of[handle]))
        super().prefetch(handle)

    def fetch(self, handle):
        self.events.append(("fetch", self.layer_of[handle]))
        return super().fetch(handle)


def test_prefetch_one_layer_ahead():
    model = make_model("attention")
    x0, w_out = make_input()
    engine = RecordingEngine(BIG_BUDGET)
    for i, layer in enumerate(model):
        layer.register_forward_pre_hook(lambda m, a, i=i: setattr(engine, "current_layer", i))
    manager = OffloadManager(engine, num_layers=NUM_LAYERS, min_offload_bytes=MIN_BYTES)
    manager.install(list(model))
    step(model, x0, w_out, manager.micro_batch(0.5))
    ev = engine.events

    def where(kind, layer):
        return [n for n, e in enumerate(ev) if e == (kind, layer)]

    offloaded = range(NUM_LAYERS - 2)
    for j in offloaded:
        handles = sum(1 for lay in engine.layer_of.values() if lay == j)
        prefetches, fetches = where("prefetch", j), where("fetch", j)
        assert len(prefetches) == len(fetches) == handles > 0
        assert max(prefetches) < min(fetches)
        if j + 1 in offloaded:  # issued when layer j+1's backward starts, before its fetches
            assert max(prefetches) < min(where("fetch", j + 1))
        if j + 2 in offloaded:  # ... and not earlier than that
            assert min(prefetches) > min(where("fetch", j + 2))
    assert manager.stats()["num_prefetched"] == len(engine.layer_of)


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan"), "half"])
def test_bad_ratio_is_refused(ratio):
    manager = OffloadManager(HostCopyEngine(BIG_BUDGET), num_layers=3)
    with pytest.raises(ValueError, match=f"offload_ratio .* got {ratio!r}"):
        with manager.micro_batch(ratio):
            pass


def test_full_host_pool_keeps_tensors_on_the_device_and_stays_exact(caplog):
    model = make_model("attention")
    x0, w_out = make_input()
    reference = step(model, x0, w_out)
    unlimited = OffloadManager(
        HostCopyEngine(BIG_BUDGET), num_layers=NUM_LAYERS, min_offload_bytes=MIN_BYTES
    )
    unlimited.install(list(model))
    step(model, x0, w_out, unlimited.micro_batch(0.5))
    want = unlimited.stats()
    unlimited.uninstall()
    assert want["num_refused"] == want["bytes_refused"] == 0

    # Room for about half of the offloaded blocks: the rest stay on the device.
    engine = HostCopyEngine(budget_bytes=want["bytes_to_host"] // 2)
    manager = OffloadManager(engine, num_layers=NUM_LAYERS, min_offload_bytes=MIN_BYTES)
    manager.install(list(model))
    with caplog.at_level("WARNING", logger="megatron_hdp.offload.hooks"):
        assert_bitwise(step(model, x0, w_out, manager.micro_batch(0.5)), reference)
    got = manager.stats()
    assert got["num_refused"] > 0 and got["bytes_to_host"] > 0
    assert got["num_offloaded"] + got["num_refused"] == want["num_offloaded"]
    assert got["bytes_to_host"] + got["bytes_refused"] == want["bytes_to_host"]
    assert got["saved_bytes"] == want["saved_bytes"]
    assert got["peak_resident_bytes"] == got["saved_bytes"] - got["bytes_to_host"]
    assert engine.peak_host_bytes <= engine.pool.capacity <= engine.pinned_bytes
    for _ in range(2):  # warned for the first refusing micro-batch only
        with caplog.at_level("WARNING", logger="megatron_hdp.offload.hooks"):
            assert_bitwise(step(model, x0, w_out, manager.micro_batch(0.5)), reference)
    warnings = [r.getMessage() for r in caplog.records if "stayed on the device" in r.message]
    assert len(warnings) == 1 and manager.num_refusing_batches == 3
    assert f"{got['num_refused']} saved activations ({got['bytes_refused']} bytes)" in warnings[0]
    assert "host pool of" in warnings[0] and "1 micro-batches so far" in warnings[0]

    # A pool too small for any block: nothing moves, the result is still exact.
    engine = HostCopyEngine(budget_bytes=host_pool.ALIGNMENT - 1)
    assert engine.pool.capacity == 0
    manager.uninstall()
    manager = OffloadManager(engine, num_layers=NUM_LAYERS, min_offload_bytes=MIN_BYTES)
    manager.install(list(model))
    assert_bitwise(step(model, x0, w_out, manager.micro_batch(0.5)), reference)
    assert manager.stats()["bytes_to_host"] == 0 and manager.stats()["num_refused"] > 0
    assert_bitwise(step(model, x0, w_out), reference)  # outside a micro-batch: no hooks
    assert engine.bytes_to_host == 0 and engine.host_bytes_in_use == 0


def test_backward_after_the_context_and_retain_graph():
    model = make_model("attention")
    x0, w_out = make_input()
    ref_loss, ref_xg, ref_grads = step(model, x0, w_out)
    engine = HostCopyEngine(BIG_BUDGET)
    manager = OffloadManager(engine, num_layers=NUM_LAYERS, min_offload_bytes=MIN_BYTES)
    manager.install(list(model))
    model.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    with manager.micro_batch(0.5) as batch:
        loss = (model(x) * w_out).sum()
    assert batch.bytes_to_host > 0 and batch.bytes_to_device == 0
    loss.backward(retain_graph=True)
    loss.backward()  # unpacks again from the cached device copies
    assert torch.equal(loss.detach(), ref_loss)
    assert torch.equal(x.grad, 2 * ref_xg)
    for p, r in zip(model.parameters(), ref_grads):
        assert torch.equal(p.grad, 2 * r)
    assert batch.bytes_to_device == batch.bytes_to_host
    assert batch.resident_bytes == 0 and engine.host_bytes_in_use == 0


def test_dropped_graph_releases_host_memory():
    model = make_model("mlp")
    x0, w_out = make_input()
    engine = HostCopyEngine(BIG_BUDGET)
    manager = OffloadManager(engine, num_layers=NUM_LAYERS, min_offload_bytes=MIN_BYTES)
    manager.install(list(model))
    with manager.micro_batch(1.0) as batch:
        loss = (model(x0.clone().requires_grad_()) * w_out).sum()
    assert engine.host_bytes_in_use == batch.bytes_to_host > 0
    del loss
    assert engine.host_bytes_in_use == 0 and batch.resident_bytes == 0


def test_in_place_change_of_a_resident_saved_tensor_is_caught():
    layers = [nn.Linear(D, D, dtype=torch.float64) for _ in range(3)]
    manager = OffloadManager(HostCopyEngine(BIG_BUDGET), num_layers=3)
    manager.install(layers)
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    with manager.micro_batch(0.0):
        h = x * 1.0
        out = layers[2](layers[1](layers[0](h)))
        h.add_(1.0)  # layer 0 saved h for its weight gradient
        with pytest.raises(RuntimeError, match="modified in place"):
            out.sum().backward()


def test_small_tensors_parameters_and_uninstall():
    model = make_model("mlp")
    x0, w_out = make_input()
    reference = step(model, x0, w_out)
    engine = HostCopyEngine(BIG_BUDGET)
    manager = OffloadManager(engine, num_layers=NUM_LAYERS, min_offload_bytes=1 << 20)
    manager.install(list(model))
    assert_bitwise(step(model, x0, w_out, manager.micro_batch(1.0)), reference)
    s = manager.stats()
    assert s["bytes_to_host"] == s["offloadable_bytes"] == 0  # all below the threshold
    assert s["saved_bytes"] == sum(n for _, n in independent_accounting(model, x0).values())
    manager.uninstall()
    with manager.micro_batch(1.0) as batch:
        (model(x0) * w_out).sum().backward()
    assert batch.saved_bytes == 0 and engine.bytes_to_host == 0
    with pytest.raises(ValueError, match="expected 5 layers, got 2"):
        manager.install(list(model)[:2])


def test_fewer_than_three_layers_offload_nothing():
    model = nn.Sequential(mlp_block(), mlp_block())
    x0, w_out = make_input()
    manager = OffloadManager(HostCopyEngine(BIG_BUDGET), num_layers=2, min_offload_bytes=0)
    manager.install(list(model))
    step(model, x0, w_out, manager.micro_batch(1.0))
    assert manager.num_offloadable_layers == 0
    assert manager.stats()["bytes_to_host"] == 0 and manager.stats()["saved_bytes"] > 0


def test_host_engine_roundtrip_and_counters():
    engine = HostCopyEngine(budget_bytes=1024)
    assert isinstance(engine, CopyEngine)
    t = torch.randn(4, 8, dtype=torch.float64)
    h = engine.offload(t)
    t_before = t.clone()
    t.zero_()  # the store is a copy, not a view
    engine.prefetch(h)
    back = engine.fetch(h)
    assert torch.equal(back, t_before) and back.device == t.device
    assert engine.bytes_to_host == engine.bytes_to_device == 256
    # Held host bytes are the pool's aligned blocks; the pool's slab is the budget.
    assert engine.host_bytes_in_use == engine.peak_host_bytes == host_pool.ALIGNMENT
    assert engine.pinned_bytes == engine.budget_bytes == 1024 and not engine.pool.pinned
    engine.release(h)
    assert engine.host_bytes_in_use == 0 and engine.num_prefetches == 1
    with pytest.raises(KeyError, match="unknown or released offload handle"):
        engine.fetch(h)
    with pytest.raises(HostPoolExhaustedError, match="offloading 2048 bytes"):
        engine.offload(torch.zeros(256, dtype=torch.float64))
    assert engine.bytes_to_host == 256 and engine.host_bytes_in_use == 0
    with pytest.raises(ValueError, match="-1"):
        HostCopyEngine(budget_bytes=-1)


def test_cuda_engine_pins_its_pool_at_construction():
    with pytest.raises(ValueError, match="CUDA device"):
        CudaCopyEngine("cpu", budget_bytes=0)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            CudaCopyEngine("cuda:0", budget_bytes=1 << 20)
        return
    engine = CudaCopyEngine("cuda:0", budget_bytes=(1 << 20) + 7)
    assert isinstance(engine, CopyEngine)
    assert engine.pool.pinned and engine.pinned_bytes == (1 << 20) + 7
    assert engine.pool._slab.is_pinned()
    assert engine.bytes_to_host == engine.host_bytes_in_use == 0
    assert engine._d2h is None and engine._h2d is None  # streams are created lazily


class SlabCheckingEngine(HostCopyEngine):
    """Checks that every host copy is a view of the pool's slab and comes back bitwise."""

    def __init__(self, budget_bytes):
        super().__init__(budget_bytes)
        self.originals = {}
        self.fetched = 0

    def offload(self, tensor):
        handle = super().offload(tensor)
        host = self._store[handle][1]
        lo = self.pool._slab.data_ptr()
        hi = lo + self.pool._slab.untyped_storage().nbytes()
        assert host.untyped_storage().data_ptr() == lo, "host copy outside the pool's slab"
        assert lo <= host.data_ptr() and host.data_ptr() + _nbytes(host) <= hi
        assert host.data_ptr() % host_pool.ALIGNMENT == 0
        self.originals[handle] = tensor.clone()
        return handle

    def fetch(self, handle):
        back = super().fetch(handle)
        want = self.originals.pop(handle)
        assert back.dtype == want.dtype and back.shape == want.shape
        assert torch.equal(back.view(torch.uint8), want.view(torch.uint8))  # bitwise
        self.fetched += 1
        return back


def _nbytes(t):
    return t.numel() * t.element_size()


@pytest.mark.parametrize("kind", ["attention", "mlp"])
def test_one_slab_at_construction_reused_by_every_micro_batch(kind, monkeypatch):
    made = []
    allocate_slab = host_pool.HostBufferPool._allocate_slab

    def counting(pool, nbytes):
        made.append(nbytes)
        return allocate_slab(pool, nbytes)

    monkeypatch.setattr(host_pool.HostBufferPool, "_allocate_slab", counting)
    model = make_model(kind)
    x0, w_out = make_input()
    reference = step(model, x0, w_out)
    engine = SlabCheckingEngine(BIG_BUDGET)
    assert made == [BIG_BUDGET] and engine.pinned_bytes == BIG_BUDGET
    manager = OffloadManager(engine, num_layers=NUM_LAYERS, min_offload_bytes=MIN_BYTES)
    manager.install(list(model))
    water = {}
    for _ in range(3):
        for ratio in (1.0, 0.5, 0.25):
            assert_bitwise(step(model, x0, w_out, manager.micro_batch(ratio)), reference)
            water.setdefault(ratio, engine.pool.high_water)
            assert engine.host_bytes_in_use == engine.pool.bytes_in_use == 0
    assert made == [BIG_BUDGET], "host memory was allocated after construction"
    assert engine.pool.num_slabs == 1 and engine.pinned_bytes == BIG_BUDGET
    # Blocks are reused: the part of the slab ever touched is the first ratio-1 micro-batch's.
    assert 0 < engine.pool.high_water == water[1.0]
    assert engine.bytes_to_host > 3 * engine.pool.high_water
    assert engine.pool.peak_bytes_in_use == engine.peak_host_bytes
    assert engine.fetched > 0 and not engine.originals and not engine._store
    assert engine.pool.free_ranges() == [(0, engine.pool.capacity)]


def test_offloaded_rows_rounding():
    assert offloaded_rows(0.1, 30) == 3  # not 4 from 0.1 * 30 = 3.0000000000000004
    assert offloaded_rows(0.25, 10) == 3 == math.ceil(2.5)
    assert offloaded_rows(0.0, 10) == 0 and offloaded_rows(1.0, 10) == 10
    assert offloaded_rows(1e-6, 10) == 1


class _SaveThenModifyInPlace(nn.Module):
    """Saves a tensor for backward, then modifies it in place (a bug autograd must catch)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64, dtype=torch.float64)

    def forward(self, x):
        h = self.lin(x)
        y = h * h  # saves h (offloaded when the ratio is > 0)
        h.mul_(2.0)  # modifies the saved h in place
        z = h * h  # saves h again: its offloaded copy is stale now
        return y + z


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_in_place_change_of_a_saved_tensor_is_caught_with_offloading(ratio):
    torch.manual_seed(0)
    layers = nn.ModuleList([_SaveThenModifyInPlace() for _ in range(4)])
    manager = OffloadManager(HostCopyEngine(1 << 30), num_layers=4, min_offload_bytes=0)
    manager.install(list(layers))
    x = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified in place"):
        with manager.micro_batch(ratio):
            out = x
            for layer in layers[:2]:  # the offloadable layers (0 .. l-3)
                out = layer(out)
        out.sum().backward()
    manager.uninstall()
