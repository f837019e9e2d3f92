"""Selective activation offloading (`megatron_hdp.offload`) on a torch-only layer stack.

The model: transformer-like layers (LayerNorm, QKV projection, `hdp_attention` on a
one-rank pack of documents with the chosen kernel, output projection, GELU MLP, residuals)
over `[T, hidden]` tokens, hooked by an `OffloadManager` with the device's engine
(`CudaCopyEngine` on GPU: pinned pool, side streams; `HostCopyEngine` on CPU). Figures:

- bitwise: loss and every gradient (input and parameters) at offload ratios 0, 0.5 and 1
  against the run without offloading, bit for bit. The attention kernel's backward runs in
  deterministic mode here (FlashAttention's dQ atomics), and the reference runs twice
  first: a kernel whose backward is still not reproducible fails the check by name, not
  as an offloading error.
- bandwidth: GB/s of the engine's D2H and H2D copies of the tensors a ratio-1 step
  offloads, replayed alone (CUDA events on the copy streams; on CPU the host engine's
  memcpy rate, no PCIe in it).
- overlap: share of the copy time hidden under compute,
  `(t_compute + t_copy - t_both) / t_copy`, from the step without offloading (ratio 0),
  with offloading (ratio r) and the copies alone; recorded on CPU but not judged there.
- memory: peak device memory (`torch.cuda.max_memory_allocated`, reset per run) above the
  memory held before the step, against the planner's resident-activation rule (Eq. 3:
  `offload_rule.resident_fraction(r, l)` times the activation bytes the hooks counted at
  ratio 0); skipped on CPU, where only the hooks' own accounting is compared.
- pinned: the engine's and pool's pinned bytes against `torch.cuda.host_memory_stats()`.

Goals (reported, not pass/fail): copies >= 90% hidden, peak within 5% of the prediction.

Needs torch; only the memory figure's prediction needs numpy (the planner's
`megatron_hdp.scheduler` imports it): without numpy that figure is reported as skipped and
everything else runs. Copy and overlap timings use at most `TIMING_REPEATS` repeats.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch
from common import Mode, median_seconds, synchronize
from torch import nn

from megatron_hdp.attention import ring
from megatron_hdp.offload.engines import CudaCopyEngine, HostCopyEngine
from megatron_hdp.offload.hooks import OffloadManager

RATIOS = (0.0, 0.5, 1.0)
#: Repeats of the copy and overlap timings (at 10, 36 of the ~50 steps; 5 gives a median).
TIMING_REPEATS = 5
GOALS = {"copy_hidden_share_at_least": 0.9, "peak_within_of_prediction": 0.05}


class Layer(nn.Module):
    """Pre-norm attention + GELU MLP on `[T, hidden]` tokens (a Megatron layer's activations)."""

    def __init__(self, mode: Mode, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, kv = mode.heads * mode.head_dim, mode.groups * mode.head_dim
        kw = {"device": mode.device, "dtype": dtype}
        self.heads, self.groups, self.head_dim = mode.heads, mode.groups, mode.head_dim
        self.norm1 = nn.LayerNorm(hidden, **kw)
        self.qkv = nn.Linear(hidden, hidden + 2 * kv, **kw)
        self.proj = nn.Linear(hidden, hidden, **kw)
        self.norm2 = nn.LayerNorm(hidden, **kw)
        self.fc1 = nn.Linear(hidden, 4 * hidden, **kw)
        self.fc2 = nn.Linear(4 * hidden, hidden, **kw)

    def forward(self, x: torch.Tensor, spec: ring.RingAttentionSpec) -> torch.Tensor:
        tokens, d = x.shape[0], self.head_dim
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * d, self.groups * d, self.groups * d], dim=-1
        )
        attn = ring.hdp_attention(
            q.reshape(tokens, self.heads, d).contiguous(),
            k.reshape(tokens, self.groups, d).contiguous(),
            v.reshape(tokens, self.groups, d).contiguous(),
            spec,
        )
        x = x + self.proj(attn.reshape(tokens, -1))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class Bench:
    """The layer stack, its input, a fixed loss probe and the micro-batch's attention spec."""

    def __init__(self, mode: Mode, kernel_name: str) -> None:
        self.mode, self.dtype = mode, mode.dtypes[0]
        # GPU: 16K tokens (8K with --quick), 6 layers; CPU: 512 tokens, 4 layers.
        self.tokens = mode.offload_tokens
        self.num_layers = 4 if mode.cpu else 6
        t = self.tokens
        self.documents = (t // 2, t // 4, t - t // 2 - t // 4)
        self.hidden = mode.heads * mode.head_dim
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Layer(mode, self.dtype) for _ in range(self.num_layers))
        gen = torch.Generator(device=mode.device).manual_seed(1)
        self.x = torch.randn(t, self.hidden, generator=gen, device=mode.device).to(self.dtype)
        self.x.requires_grad_()
        self.probe = torch.randn(t, self.hidden, generator=gen, device=mode.device).to(self.dtype)
        self.spec = ring.build_ring_spec(
            self.documents, (0,), rank=0, group=None, backend=kernel_name
        )
        self.spec.step_blocks(mode.device)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Input and parameters by name (their `.grad` is what the bitwise check compares)."""
        return {"input": self.x, **dict(self.layers.named_parameters())}

    def step(self, manager: OffloadManager | None = None, ratio: float = 0.0, keep_grads=False):
        """Forward and backward of one micro-batch; returns (loss, the micro-batch's counters)."""
        for tensor in self.tensors().values():
            if keep_grads and tensor.grad is not None:
                tensor.grad.zero_()
            else:
                tensor.grad = None
        if manager is None:
            return self._forward_backward(), None
        with manager.micro_batch(ratio) as batch:
            loss = self._forward_backward()
        return loss, batch.stats()

    def _forward_backward(self) -> torch.Tensor:
        x = self.x
        for layer in self.layers:
            x = layer(x, self.spec)
        loss = (x * self.probe).float().sum()
        loss.backward()
        return loss.detach()


def _make_engine(mode: Mode, budget: float):
    if mode.cpu:
        return HostCopyEngine(budget)
    return CudaCopyEngine(mode.device, budget)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def _compare(want: dict, loss_want, got: dict, loss_got) -> dict:
    """Which of the loss and the gradients differ in any bit."""
    differing = []
    for name, tensor in want.items():
        other = got[name]
        same = other is not None and other.shape == tensor.shape and other.dtype == tensor.dtype
        if not (same and torch.equal(_bits(tensor), _bits(other))):
            diff = (tensor.double() - other.double()).abs().max().item() if same else None
            differing.append({"tensor": name, "max_abs_difference": diff})
    return {
        "loss_bitwise_equal": torch.equal(_bits(loss_want), _bits(loss_got)),
        "gradients_compared": len(want),
        "gradients_differing": len(differing),
        "first_differences": differing[:5],
    }


def _grads(bench: Bench) -> dict[str, torch.Tensor]:
    return {name: t.grad.detach().clone() for name, t in bench.tensors().items()}


class DeterministicBackward:
    """A varlen kernel whose backward runs under `torch.use_deterministic_algorithms(True)`.

    FlashAttention's backward adds dQ up with atomics unless asked to be deterministic, so
    two identical steps differ in their last bits. Only the kernel's backward call is
    switched (cuBLAS refuses deterministic mode unless CUBLAS_WORKSPACE_CONFIG was set
    before its first call, which this process cannot promise).
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.name = f"{kernel.name} (deterministic backward)"

    def forward(self, *args, **kwargs):
        """The kernel's forward, unchanged."""
        return self.kernel.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        """The kernel's backward in deterministic mode, the previous mode restored after."""
        enabled = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            return self.kernel.backward(*args, **kwargs)
        finally:
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def bitwise(bench: Bench, manager: OffloadManager) -> dict:
    """Loss and gradients at each ratio against the run without offloading, bit for bit."""
    spec = bench.spec
    bench.spec = replace(spec, backend=DeterministicBackward(spec.backend))
    try:
        loss_ref, _ = bench.step()
        ref = _grads(bench)
        loss_again, _ = bench.step()
        again = _compare(ref, loss_ref, _grads(bench), loss_again)
        reproducible = again["loss_bitwise_equal"] and not again["gradients_differing"]
        results = []
        for ratio in RATIOS:
            loss, stats = bench.step(manager, ratio)
            result = {"ratio": ratio, **_compare(ref, loss_ref, _grads(bench), loss)}
            result["counters"] = stats
            moved = stats["bytes_to_host"] > 0 if ratio > 0 else stats["bytes_to_host"] == 0
            result["offloaded_as_asked"] = (
                moved and stats["bytes_to_device"] == stats["bytes_to_host"]
            )
            result["ok"] = (
                reproducible
                and result["loss_bitwise_equal"]
                and not result["gradients_differing"]
                and result["offloaded_as_asked"]
            )
            results.append(result)
    finally:
        bench.spec = spec
    report = {
        "reference": "the same step without an offload context (no hooks active), run twice",
        "attention_backward": bench.spec.backend.name + " under deterministic algorithms",
        "reference_reproducible": reproducible,
        "ratios": results,
        "ok": all(r["ok"] for r in results),
    }
    if not reproducible:
        report["why_not_judged"] = (
            "two identical steps without offloading differ (the kernel's backward is not "
            f"deterministic: {again['first_differences'][:1]}), so bitwise equality cannot "
            "be asked of the offloaded steps; this counts as a failed check"
        )
    return report


def _offloaded_shapes(bench: Bench, manager: OffloadManager, ratio: float) -> list:
    """(shape, dtype) of every tensor one step at `ratio` hands to the engine."""
    engine, shapes = manager.engine, []
    real = engine.offload

    def recording(tensor):
        shapes.append((tuple(tensor.shape), tensor.dtype))
        return real(tensor)

    engine.offload = recording
    try:
        bench.step(manager, ratio)
    finally:
        del engine.offload
    return shapes


def copy_times(mode: Mode, engine, shapes: list) -> tuple[float, float, int]:
    """Median seconds of the D2H copies of `shapes`, of their H2D copies, and their bytes.

    The copies run alone, D2H first, then H2D (no two directions at once, as in a step:
    D2H in the forward pass, H2D in the backward pass). Sources are views of one buffer.
    """
    largest = max(torch.Size(s).numel() * d.itemsize for s, d in shapes)
    source = torch.empty(largest, dtype=torch.uint8, device=mode.device)
    views = [source[: torch.Size(s).numel() * d.itemsize].view(d).view(s) for s, d in shapes]
    nbytes = sum(v.numel() * v.element_size() for v in views)
    d2h_times, h2d_times = [], []
    for attempt in range(min(mode.repeats, TIMING_REPEATS) + 1):  # the first: warm-up
        if mode.cpu:
            t0 = time.perf_counter()
            handles = [engine.offload(v) for v in views]
            t1 = time.perf_counter()
            for h in handles:
                engine.prefetch(h)
                engine.fetch(h)
            t2 = time.perf_counter()
            d2h, h2d = t1 - t0, t2 - t1
        else:
            d2h_stream, h2d_stream = engine._streams()  # the engine's copy streams
            compute = torch.cuda.current_stream(mode.device)
            events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            synchronize(mode.device)
            events[0].record(compute)
            handles = [engine.offload(v) for v in views]
            events[1].record(d2h_stream)
            compute.wait_event(events[1])
            events[2].record(compute)
            for h in handles:
                engine.prefetch(h)
            events[3].record(h2d_stream)
            events[3].synchronize()
            for h in handles:
                engine.fetch(h)
            d2h = events[0].elapsed_time(events[1]) / 1e3
            h2d = events[2].elapsed_time(events[3]) / 1e3
        for h in handles:
            engine.release(h)
        if attempt:
            d2h_times.append(d2h)
            h2d_times.append(h2d)
    synchronize(mode.device)
    return statistics.median(d2h_times), statistics.median(h2d_times), nbytes


def bandwidth(mode: Mode, engine, shapes: list) -> dict:
    """GB/s of the engine's copies of a ratio-1 step's offloaded tensors, replayed alone."""
    d2h, h2d, nbytes = copy_times(mode, engine, shapes)
    return {
        "what": (
            "host engine memcpy into its pool and back (CPU: no PCIe, not a link figure)"
            if mode.cpu
            else "CudaCopyEngine D2H/H2D copies into its pinned pool, CUDA events on its "
            "copy streams"
        ),
        "copies": len(shapes),
        "bytes": nbytes,
        "d2h_s": d2h,
        "h2d_s": h2d,
        "d2h_gbps": nbytes / d2h / 1e9,
        "h2d_gbps": nbytes / h2d / 1e9,
    }


def overlap(mode: Mode, bench: Bench, manager: OffloadManager, ratio: float, t_compute) -> dict:
    """Share of the copy time hidden under compute in a step at `ratio` (`t_compute`: at 0)."""
    shapes = _offloaded_shapes(bench, manager, ratio)
    repeats = min(mode.repeats, TIMING_REPEATS)
    t_both = median_seconds(lambda: bench.step(manager, ratio), mode.device, repeats)
    d2h, h2d, nbytes = copy_times(mode, manager.engine, shapes)
    t_copy = d2h + h2d
    hidden = (t_compute + t_copy - t_both) / t_copy
    return {
        "ratio": ratio,
        "bytes_each_way": nbytes,
        "t_compute_s": t_compute,
        "t_copy_s": t_copy,
        "t_both_s": t_both,
        "hidden_share": hidden,
        "judged": not mode.cpu,
        "meets_goal": None if mode.cpu else hidden >= GOALS["copy_hidden_share_at_least"],
        **({"why_not_judged": "the CPU engine copies synchronously"} if mode.cpu else {}),
    }


def _cost_model_act(bench: Bench) -> float:
    """Per-layer activation bytes the cost model's formula (34 h per token) gives here."""
    from megatron_hdp.scheduler.cost import CPU, H100, CostModel, ModelShape
    from megatron_hdp.scheduler.offload_rule import layer_activation_bytes

    shape = ModelShape(
        num_layers=bench.num_layers,
        hidden_size=bench.hidden,
        num_attention_heads=bench.mode.heads,
        num_query_groups=bench.mode.groups,
        ffn_hidden_size=4 * bench.hidden,
        swiglu=False,
    )
    profile = replace(CPU if bench.mode.cpu else H100, bytes_per_element=bench.dtype.itemsize)
    return float(layer_activation_bytes(CostModel(shape, profile), bench.tokens))


def memory(mode: Mode, bench: Bench, manager: OffloadManager, saved_bytes: int) -> dict:
    """Resident activation bytes at each ratio: prediction, hooks' count, device peak.

    Raises ImportError without numpy (the planner's rule lives in `megatron_hdp.scheduler`).
    """
    from megatron_hdp.scheduler.offload_rule import resident_fraction

    layers = bench.num_layers
    act = saved_bytes / layers
    rows = []
    for ratio in RATIOS:
        predicted = float(resident_fraction(ratio, layers)) * saved_bytes
        row = {"ratio": ratio, "predicted_resident_bytes": predicted}
        if not mode.cpu:
            bench.step(manager, ratio, keep_grads=True)  # gradients exist before the peak
            synchronize(mode.device)
            before = torch.cuda.memory_allocated(mode.device)
            torch.cuda.reset_peak_memory_stats(mode.device)
            _, stats = bench.step(manager, ratio, keep_grads=True)
            synchronize(mode.device)
            peak = torch.cuda.max_memory_allocated(mode.device) - before
            row.update(
                device_peak_above_start_bytes=peak,
                device_peak_vs_prediction=peak / predicted - 1.0,
                meets_goal=abs(peak / predicted - 1.0) <= GOALS["peak_within_of_prediction"],
            )
        else:
            _, stats = bench.step(manager, ratio)
        row.update(
            accounted_peak_resident_bytes=stats["peak_resident_bytes"],
            accounted_vs_prediction=stats["peak_resident_bytes"] / predicted - 1.0,
        )
        rows.append(row)
    return {
        "predicted": (
            "Eq. 3's resident activations, as the planner counts them: "
            "offload_rule.resident_fraction(r, l) = (2 + (1 - r)(l - 2)) / l times l * Act, "
            "with Act the per-layer saved-activation bytes the hooks counted at ratio 0 "
            "(the same activation bytes); the planner's own 34 h formula is shown for scale"
        ),
        "measured": (
            "device: torch.cuda.max_memory_allocated over one forward + backward, reset "
            "before it, less the memory allocated before it (weights, their gradients, "
            "input); accounted: the hooks' peak_resident_bytes of that micro-batch"
        ),
        **({"device_skipped": "no device memory on CPU"} if mode.cpu else {}),
        "layers": layers,
        "act_bytes_per_layer": act,
        "cost_model_act_bytes_per_layer": _cost_model_act(bench),
        "ratios": rows,
    }


def pinned(mode: Mode, engine, stats_before: dict | None, stats_after: dict | None) -> dict:
    """The pool's pinned bytes, and what the caching host allocator saw of them."""
    pool = engine.pool
    block = pool.allocate(1)
    try:
        view_pinned = pool.view(block, torch.uint8, (1,)).is_pinned()
    finally:
        pool.free(block)
    result = {
        "engine_pinned_bytes": engine.pinned_bytes,
        "pool_bytes": pool.nbytes,
        "pool_capacity": pool.capacity,
        "pool_pinned": pool.pinned,
        "pool_memory_is_pinned": view_pinned,
        "pool_slabs": pool.num_slabs,
        "pool_peak_bytes_in_use": pool.peak_bytes_in_use,
        "engine_peak_host_bytes": engine.peak_host_bytes,
    }
    if stats_before is None or stats_after is None:
        result["host_memory_stats"] = "not available (no CUDA)"
        return result
    keys = sorted(k for k in stats_after if "bytes" in k and "current" in k)
    result["host_allocator_delta_while_building_engine"] = {
        k: stats_after.get(k, 0) - stats_before.get(k, 0) for k in keys
    }
    result["compared"] = (
        "the pool pins its slab with cudaHostRegister, which torch's caching host allocator "
        "does not see: its current bytes should not grow by the pool's bytes while the "
        "engine is built; pool_memory_is_pinned asks CUDA about the slab itself"
    )
    result["ok"] = view_pinned and engine.pinned_bytes == pool.nbytes
    return result


def _host_stats() -> dict | None:
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    return dict(torch.cuda.host_memory_stats())


def run(mode: Mode, say, kernel_name: str) -> dict:
    """Every figure of the module docstring on the mode's first dtype; JSON."""
    bench = Bench(mode, kernel_name)
    counting = OffloadManager(HostCopyEngine(0), num_layers=bench.num_layers)
    counting.install(bench.layers)
    _, stats0 = bench.step(counting, 0.0)
    counting.uninstall()
    budget = stats0["offloadable_bytes"] * 1.01 + (1 << 20)  # blocks are 512-byte aligned
    host_before = _host_stats()
    engine = _make_engine(mode, budget)
    host_after = _host_stats()
    manager = OffloadManager(engine, num_layers=bench.num_layers)
    manager.install(bench.layers)
    try:
        exact = bitwise(bench, manager)
        for r in exact["ratios"]:
            say(
                f"offload  ratio {r['ratio']:.1f}: loss "
                f"{'bitwise equal' if r['loss_bitwise_equal'] else 'DIFFERS'}"
                f", {r['gradients_differing']}/{r['gradients_compared']} gradients differ, "
                f"{r['counters']['bytes_to_host']} bytes offloaded {'ok' if r['ok'] else 'FAILED'}"
            )
        copies = bandwidth(mode, engine, _offloaded_shapes(bench, manager, 1.0))
        say(
            f"offload  copies D2H {copies['d2h_gbps']:.2f} GB/s, H2D {copies['h2d_gbps']:.2f} "
            f"GB/s ({copies['bytes']} bytes)"
        )
        repeats = min(mode.repeats, TIMING_REPEATS)
        t_compute = median_seconds(lambda: bench.step(manager, 0.0), mode.device, repeats)
        hidden = [overlap(mode, bench, manager, r, t_compute) for r in RATIOS if r > 0]
        say(
            "offload  hidden share of copy time "
            + ", ".join(f"r={h['ratio']:.1f}: {h['hidden_share']:.2f}" for h in hidden)
            + (" (CPU: not judged)" if mode.cpu else "")
        )
        try:
            mem = memory(mode, bench, manager, stats0["saved_bytes"])
        except ModuleNotFoundError as err:  # numpy, for the planner's rule
            mem = {"skipped": f"needs numpy (megatron_hdp.scheduler): {err}"}
            say(f"offload  peak vs Eq. 3 skipped: {mem['skipped']}")
        else:
            key = "accounted_vs_prediction" if mode.cpu else "device_peak_vs_prediction"
            say(
                f"offload  peak vs Eq. 3 ({key}) "
                + ", ".join(f"r={m['ratio']:.1f}: {m[key]:+.3f}" for m in mem["ratios"])
            )
        pins = pinned(mode, engine, host_before, host_after)
    finally:
        manager.uninstall()
    ok = exact["ok"] and pins.get("ok", True)
    return {
        "kernel": kernel_name,
        "dtype": str(bench.dtype).removeprefix("torch."),
        "engine": type(engine).__name__,
        "tokens": bench.tokens,
        "documents": list(bench.documents),
        "layers": bench.num_layers,
        "hidden": bench.hidden,
        "bitwise": exact,
        "bandwidth": copies,
        "overlap": hidden,
        "memory": mem,
        "pinned": pins,
        "goals": GOALS,
        "ok": ok,
    }
