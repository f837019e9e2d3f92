"""The plan of a `verify.py` run: each section's parts, sizes, memory and estimated seconds.

`verify.py` prints the plan before it runs anything and keeps only what fits:

- **Memory.** A part whose estimated peak device memory exceeds `MEMORY_HEADROOM` of the
  GPU's free memory is skipped with the reason, never tried (the train section's 64K-token
  micro-batch and Megatron's unfused attention at 8K on an 80 GB H100, for example).
  Activation bytes of the train model are the project's own cost model's
  (`CostModel.activation_bytes_per_token`, 34 h bytes per token and layer in bf16); the
  rest are the explicit formulas below.
- **Time.** `--budget-s` drops the parts of lowest priority (the costliest first among
  equals) until the estimate fits. Priorities, highest first: env (everything else needs
  its device and kernel verdicts) > kernels (every kernel's correctness, cheap) > ring
  (the ring's correctness, cheap) > variants (sliding window, sink, MLA head dims: their
  correctness, cheap) > train-check (HDP attention inside Megatron's model
  against Megatron's own: the integration) > speed (the figures the GPU path is for) >
  offload (its bitwise check also runs on CPU in CI; the GPU adds copy speed and memory) >
  train-throughput sizes (figures only, the costliest per second).

Every estimate is FLOPs and bytes at the rates below, assumed for one H100 SXM from public
figures (NVIDIA's datasheet, FlashAttention-2/3 papers); none was measured here, and each is
unsure to about +-50%. On CPU (`--cpu`) there are no estimates and nothing is dropped.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

#: FlashAttention-2 varlen forward + backward, bf16, head dim 128 (papers: 200-300 TFLOP/s).
ATTENTION_FLOPS = 230e12
#: A bf16 GPT training step: 40% of the H100 SXM's 989 TFLOP/s dense bf16 peak.
MODEL_FLOPS = 0.4 * 989e12
#: float64 references: the H100 SXM's 67 TFLOP/s FP64 tensor-core peak, 75% reached.
FP64_FLOPS = 50e12
#: HBM3: 3.35 TB/s on the datasheet (a device copy moves about 3.0).
HBM_BYTES_PER_S = 3.0e12
#: PCIe 5 x16, one direction (64 GB/s raw).
PCIE_BYTES_PER_S = 50e9
#: cudaHostRegister of the offload section's host slab.
PIN_BYTES_PER_S = 10e9
#: Building (initialising on the CPU) the train section's 1.1B model, per build.
MODEL_BUILD_S = 10.0
#: float64 on the host (the variants section's reference): 16 cores, about 200 GFLOP/s.
CPU_FP64_FLOPS = 200e9
#: Host memory bandwidth the float64 reference streams its scores at.
HOST_BYTES_PER_S = 50e9
#: A section's own process: Python, torch, the CUDA context, megatron_hdp.
SECTION_START_S = 6.0
#: `import megatron.core` (the train section's process only).
MEGATRON_IMPORT_S = 5.0
#: Per kernel call checked or timed: Python, launches, synchronisation, allocation.
CALL_OVERHEAD_S = 0.05
#: Per document of a float64 reference (a dozen small ops forward and backward).
PER_DOCUMENT_S = 2e-3
#: Per ring step of a virtual rank (index_select, the lse merge, the thread hand-over).
RING_STEP_OVERHEAD_S = 0.01
#: Per training step beyond its FLOPs (the host's share: planning, launches, optimizer).
TRAIN_STEP_OVERHEAD_S = 0.1
#: Share of the GPU's free memory a part may plan to use (fragmentation, workspaces).
MEMORY_HEADROOM = 0.9
#: Bytes per parameter of the train section's bf16 model: bf16 weights 2, fp32 gradient
#: buffer 4, fp32 main weights 4, Adam's two fp32 moments 8.
STATE_BYTES_PER_PARAMETER = 18
#: Bytes per logit: the fp32 logits and their fp32 gradient, and the bf16 output.
LOGIT_BYTES = 10
#: Bytes per element of [heads, s, s] that Megatron's unfused attention keeps per layer
#: (its fp32 softmax output and the bf16 probabilities).
UNFUSED_SCORE_BYTES = 6

PRIORITY = {
    "env": 0,
    "kernels": 1,
    "ring": 2,
    "variants": 3,
    "train-check": 4,
    "speed": 5,
    "offload": 6,
    "train-throughput": 7,
}


@dataclass(frozen=True)
class Device:
    """What the plan needs of the GPU: its name, free memory, and kernels that run per dtype."""

    name: str
    free_bytes: float | None
    """None: unknown (CPU), nothing is skipped for memory."""
    kernels_per_dtype: int = 1


@dataclass
class Part:
    """One thing a section runs that can be kept or dropped on its own."""

    section: str
    name: str
    kind: str
    """A key of `PRIORITY`."""
    size: int | None
    """Tokens or sequence length it stands for (None: the whole section)."""
    seconds: float | None
    """Estimated seconds (None on CPU)."""
    peak_bytes: float | None
    """Estimated peak device memory (None: not estimated)."""
    skipped: str | None = None
    """Why it does not run (memory, budget); None: it runs."""

    @property
    def priority(self) -> int:
        """Lower runs first and is dropped last."""
        return PRIORITY[self.kind]


@dataclass
class Plan:
    """The parts of every chosen section, which of them run, and the estimate."""

    device: Device
    budget_s: float | None
    parts: list[Part] = field(default_factory=list)

    def kept(self, section: str | None = None) -> list[Part]:
        """Parts that run (of one section, or all)."""
        return [
            p for p in self.parts if not p.skipped and (section is None or p.section == section)
        ]

    def sections(self) -> list[str]:
        """Sections in order."""
        return list(dict.fromkeys(p.section for p in self.parts))

    def section_seconds(self, section: str) -> float | None:
        """Estimated seconds of a section's kept parts and its process start (None on CPU)."""
        if any(p.seconds is None for p in self.parts):
            return None
        kept = self.kept(section)
        return SECTION_START_S + sum(p.seconds for p in kept) if kept else 0.0

    def total_seconds(self) -> float | None:
        """Estimated seconds of the whole run (None on CPU)."""
        each = [self.section_seconds(s) for s in self.sections()]
        return None if any(s is None for s in each) else sum(each)

    def why_not(self, section: str) -> str | None:
        """Why a section runs nothing at all (None: it runs)."""
        if self.kept(section):
            return None
        return "; ".join(f"{p.name}: {p.skipped}" for p in self.parts if p.section == section)

    def apply(self, mode):
        """`mode` with only the kept sizes of the speed and train sections."""

        def sizes(section, kind):
            return tuple(p.size for p in self.kept(section) if p.kind == kind)

        return dataclasses.replace(
            mode,
            speed_tokens=sizes("speed", "speed") or mode.speed_tokens,
            train_packed=tuple(p.size for p in self.kept("train") if p.name.startswith("packed")),
            train_compare=tuple(p.size for p in self.kept("train") if p.name.startswith("compare")),
        )

    def lines(self) -> list[str]:
        """The plan as printed before the run."""
        free = self.device.free_bytes
        head = f"plan     {self.device.name}" + (
            f", {free / 1e9:.1f} GB free" if free is not None else ""
        )
        budget = f", budget {self.budget_s:.0f} s" if self.budget_s else ""
        total = self.total_seconds()
        head += (
            f": estimated {total:.0f} s{budget} (H100 rates, assumed, not measured)"
            if total is not None
            else ": no time estimate on CPU (the rates are an H100's)"
        )
        out = [head]
        for part in self.parts:
            est = "" if part.seconds is None else f"{part.seconds:7.1f} s"
            mem = "" if part.peak_bytes is None else f" {part.peak_bytes / 1e9:6.1f} GB"
            state = f"  SKIPPED: {part.skipped}" if part.skipped else ""
            out.append(f"plan     {part.section:8s} {part.name:34s}{est}{mem}{state}")
        return out

    def to_json(self) -> dict:
        """The plan for the report."""
        return {
            "device": dataclasses.asdict(self.device),
            "budget_s": self.budget_s,
            "estimated_total_s": self.total_seconds(),
            "rates_assumed": {
                "attention_flops": ATTENTION_FLOPS,
                "model_flops": MODEL_FLOPS,
                "fp64_flops": FP64_FLOPS,
                "hbm_bytes_per_s": HBM_BYTES_PER_S,
                "pcie_bytes_per_s": PCIE_BYTES_PER_S,
                "model_build_s": MODEL_BUILD_S,
                "section_start_s": SECTION_START_S,
            },
            "parts": [dataclasses.asdict(p) | {"priority": p.priority} for p in self.parts],
        }


def make_plan(mode, sections, device: Device, budget_s: float | None = None) -> Plan:
    """The parts of `sections` in `mode` on `device`, skipped where memory or budget says."""
    plan = Plan(device=device, budget_s=budget_s)
    builders = {
        "env": _env,
        "kernels": _kernels,
        "ring": _ring,
        "variants": _variants,
        "speed": _speed,
        "offload": _offload,
        "train": _train,
    }
    estimate = not mode.cpu
    for section in sections:
        plan.parts.extend(builders[section](mode, device))
    if not estimate:
        for part in plan.parts:
            part.seconds = part.peak_bytes = None
        return plan
    for part in plan.parts:
        if device.free_bytes is not None and part.peak_bytes is not None:
            limit = MEMORY_HEADROOM * device.free_bytes
            if part.peak_bytes > limit:
                part.skipped = (
                    f"needs about {part.peak_bytes / 1e9:.0f} GB, more than "
                    f"{MEMORY_HEADROOM:.0%} of the {device.free_bytes / 1e9:.0f} GB free"
                )
    _train_needs_its_check(plan)
    if budget_s is not None:
        _fit_budget(plan, budget_s)
    return plan


def _train_needs_its_check(plan: Plan) -> None:
    """Without the train check (it pays for both model builds) the train section runs nothing."""
    check = [p for p in plan.parts if p.kind == "train-check"]
    if check and check[0].skipped:
        for part in plan.parts:
            if part.section == "train" and not part.skipped:
                part.skipped = f"the train check does not run ({check[0].skipped})"


def _fit_budget(plan: Plan, budget_s: float) -> None:
    """Drop the lowest-priority parts (the costliest first among equals) until within budget."""
    while (plan.total_seconds() or 0.0) > budget_s:
        candidates = [p for p in plan.kept() if p.priority > 0]
        if not candidates:
            return
        part = max(candidates, key=lambda p: (p.priority, p.seconds))
        part.skipped = f"dropped to fit --budget-s {budget_s:g} (priority {part.priority})"
        _train_needs_its_check(plan)


# --- the sections' estimates -------------------------------------------------------------


def _attention_flops(lengths_q, lengths_k, causal, heads, head_dim) -> float:
    """Forward + backward matmul FLOPs of varlen attention (as `common.attention_flops`)."""
    pairs = sum(
        (lq * (lq + 1) / 2 if causal else lq * lk)
        for lq, lk in zip(lengths_q, lengths_k, strict=True)
    )
    return 4 * pairs * heads * head_dim * 3.5


def _reference(lengths_q, lengths_k, heads, head_dim) -> tuple[float, float]:
    """Seconds and peak bytes of `common.reference_attention` forward + backward in float64.

    Each document's `[heads, lq, lk]` scores pass through HBM about 12 times (scores, mask,
    logsumexp, softmax, their gradients) and stay alive about 6 times over at the peak.
    """
    elements = sum(heads * lq * lk for lq, lk in zip(lengths_q, lengths_k, strict=True))
    flops = 3 * 4 * elements * head_dim  # QK^T and PV, forward and twice backward
    seconds = flops / FP64_FLOPS + 12 * 8 * elements / HBM_BYTES_PER_S
    seconds += PER_DOCUMENT_S * len(lengths_q)
    largest = max(heads * lq * lk for lq, lk in zip(lengths_q, lengths_k, strict=True))
    return seconds, 6 * 8 * largest


def _env(mode, device: Device) -> list[Part]:
    return [Part("env", "versions, device, kernel verdicts", "env", None, 2.0, None)]


def _kernels(mode, device: Device) -> list[Part]:
    import kernel_checks

    seconds, peak = 0.0, 0.0
    for lq, lk, causal, _ in kernel_checks.cases(mode).values():
        ref_s, ref_b = _reference(lq, lk, mode.heads, mode.head_dim)
        flash = _attention_flops(lq, lk, causal, mode.heads, mode.head_dim) / ATTENTION_FLOPS
        seconds += device.kernels_per_dtype * (flash + CALL_OVERHEAD_S) + ref_s
        peak = max(peak, ref_b)
    name = f"{len(mode.dtypes)} dtypes x {device.kernels_per_dtype} kernel(s) x 5 cases"
    return [Part("kernels", name, "kernels", None, len(mode.dtypes) * seconds, peak)]


def _ring(mode, device: Device) -> list[Part]:
    s, seconds, peak = mode.scale_tokens, 0.0, 0.0
    for k in range(2, 9):
        lengths = (512 * s, 75 * s, 2 * k + 1, 194 * s + 3)
        ref_s, ref_b = _reference(lengths, lengths, mode.heads, mode.head_dim)
        flash = _attention_flops(lengths, lengths, True, mode.heads, mode.head_dim)
        seconds += 2 * flash / ATTENTION_FLOPS + ref_s  # the ring, and one call
        seconds += k * k * RING_STEP_OVERHEAD_S + (k + 1) * CALL_OVERHEAD_S
        peak = max(peak, ref_b)
    name = f"{len(mode.dtypes)} dtypes x rings of 2..8"
    return [Part("ring", name, "ring", None, len(mode.dtypes) * seconds, peak)]


def _cpu_reference(lengths, heads, head_dim, head_dim_v) -> float:
    """Seconds of `common.reference_attention` forward + backward in float64 on the host."""
    elements = sum(heads * n * n for n in lengths)
    flops = 3 * 2 * elements * (head_dim + head_dim_v)
    return flops / CPU_FP64_FLOPS + 12 * 8 * elements / HOST_BYTES_PER_S


def _variants(mode, device: Device) -> list[Part]:
    """Per case: the pack and a ring (flash calls, ring-step overheads, the copies to the
    host), and the float64 reference on the host."""
    import variant_checks

    parts = []
    for name, case in variant_checks.cases(mode).items():
        lengths, (dqk, dv) = case["lengths"], case["head_dims"]
        dim = max(dqk, dv)  # padded kernels compute at the larger head dim
        flash = _attention_flops(lengths, lengths, True, mode.heads, dim) / ATTENTION_FLOPS
        seconds, peak = 0.0, 0.0
        for k in variant_checks.RING_SIZES[name]:
            seconds += flash + k * k * RING_STEP_OVERHEAD_S + (k + 1) * CALL_OVERHEAD_S
        seconds += _cpu_reference(lengths, mode.heads, dqk, dv)
        seconds += PER_DOCUMENT_S * len(lengths)
        # q, k, v, dout, out, their gradients and the ring's buffers: about 16 copies.
        peak = 16 * sum(lengths) * mode.heads * dim * 2
        parts.append(Part("variants", name, "variants", None, seconds, peak))
    return parts


def _speed(mode, device: Device) -> list[Part]:
    """Per size T: a ring-of-4 member's steps (about 2 T^2 query-key pairs: one causal
    diagonal of T^2/2 and three T x T/2 blocks) and one causal call over T, then the pack
    path: a direct call and `hdp_attention` over the same pack; each (2 + repeats) times."""
    import speed_checks

    parts = []
    h, d = mode.heads, mode.head_dim
    for t in mode.speed_tokens:
        ring_flops = 4 * (2 * t * t) * h * d * 3.5
        direct = _attention_flops([t], [t], True, h, d)
        pack = speed_checks._pack_lengths(t)
        pack_flops = 2 * _attention_flops(pack, pack, True, h, d)
        runs = 2 + mode.repeats
        seconds = runs * (ring_flops + direct + pack_flops) / ATTENTION_FLOPS
        seconds += runs * 8 * CALL_OVERHEAD_S
        peak = 24 * t * h * d * 2  # q, k, v, dout of the steps and the direct call, and grads
        parts.append(Part("speed", f"{t} tokens", "speed", t, seconds, peak))
    return parts


def _offload(mode, device: Device) -> list[Part]:
    """The ~50 steps of `offload_checks` on its 6-layer stack, the copies replayed alone
    (bandwidth, two overlaps), and pinning the host slab (34 h bytes per token and layer)."""
    from offload_checks import TIMING_REPEATS

    t, layers = mode.offload_tokens, 6
    hidden, kv = mode.heads * mode.head_dim, mode.groups * mode.head_dim
    params = layers * (hidden * (hidden + 2 * kv) + hidden * hidden + 8 * hidden * hidden)
    docs = (t // 2, t // 4, t - t // 2 - t // 4)
    step_flops = 6 * params * t + layers * _attention_flops(
        docs, docs, True, mode.heads, mode.head_dim
    )
    r = min(mode.repeats, TIMING_REPEATS)
    steps = 1 + 5 + 3 + (r + 2) + 2 * (r + 2) + 6
    saved = layers * 34 * hidden * t  # bf16: 34 h bytes per token and layer
    replays = 3 * (r + 1)
    seconds = steps * (step_flops / MODEL_FLOPS + CALL_OVERHEAD_S)
    seconds += replays * 2 * saved / PCIE_BYTES_PER_S + saved / PIN_BYTES_PER_S
    peak = 4 * 2 * params + saved  # bf16 weights, their grads (x2 kept), activations
    return [Part("offload", f"{t} tokens, {layers} layers", "offload", t, seconds, peak)]


def _train(mode, device: Device) -> list[Part]:
    """Both builds and the check's steps; each packed size and each comparison length."""
    import train_checks

    dims = train_checks.GPU_MODEL
    check = train_checks.check_lengths(mode)
    act = _activation_bytes_per_token(dims)
    params = _parameters(dims)
    states = STATE_BYTES_PER_PARAMETER * params
    vocab = train_checks.padded_vocab(dims["vocab_size"])
    warm_steps = 2 + (5 if mode.repeats >= 10 else 3)

    def step_s(lengths) -> float:
        return _model_flops(dims, lengths) / MODEL_FLOPS + TRAIN_STEP_OVERHEAD_S

    def peak(tokens: int, unfused: int = 0) -> float | None:
        if act is None:
            return None
        unfused_bytes = (
            dims["num_layers"] * dims["num_attention_heads"] * unfused**2 * UNFUSED_SCORE_BYTES
        )
        return states + act * tokens + tokens * vocab * LOGIT_BYTES + unfused_bytes

    steps = train_checks.CHECK_STEPS
    check_s = MEGATRON_IMPORT_S + 2 * MODEL_BUILD_S + 2 * steps * step_s(check)
    parts = [
        Part(
            "train",
            f"check: {steps} steps of {len(check)}x{check[0]}",
            "train-check",
            None,
            check_s,
            peak(max(check), unfused=max(check)),
        )
    ]
    for t in mode.train_packed:
        docs = train_checks.packed_documents(t)
        parts.append(
            Part(
                "train",
                f"packed {t} tokens",
                "train-throughput",
                t,
                warm_steps * step_s(docs),
                peak(t),
            )
        )
    for length in mode.train_compare:
        count = max(1, train_checks.COMPARE_TOKENS // length)
        parts.append(
            Part(
                "train",
                f"compare {length} (HDP and Megatron)",
                "train-throughput",
                length,
                2 * warm_steps * step_s([length] * count),
                peak(length, unfused=length),
            )
        )
    return parts


def _parameters(dims: dict) -> int:
    """Parameters of the train model: layers, embedding and output layer (norms ignored)."""
    return _matmul_parameters(dims) + dims["vocab_size"] * dims["hidden_size"]


def _matmul_parameters(dims: dict) -> int:
    """Weights each token multiplies (as `ModelShape.params_per_token`, SwiGLU, ffn 4h)."""
    h = dims["hidden_size"]
    kv = dims["num_query_groups"] * h // dims["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * 4 * h
    return dims["num_layers"] * per_layer + h * dims["vocab_size"]


def _model_flops(dims: dict, lengths) -> float:
    """`train_checks.model_flops`: 6 N sum(s) + 6 layers h sum(s^2)."""
    linear = 6.0 * _matmul_parameters(dims) * sum(lengths)
    return linear + 6.0 * dims["num_layers"] * dims["hidden_size"] * sum(s * s for s in lengths)


def _activation_bytes_per_token(dims: dict) -> float | None:
    """The project's cost model's activation bytes per token, bf16 (None without numpy)."""
    try:
        from megatron_hdp.scheduler.cost import H100, CostModel, ModelShape
    except ImportError:
        return None
    shape = ModelShape(
        num_layers=dims["num_layers"],
        hidden_size=dims["hidden_size"],
        num_attention_heads=dims["num_attention_heads"],
        num_query_groups=dims["num_query_groups"],
        vocab_size=dims["vocab_size"],
        swiglu=True,
    )
    return float(CostModel(shape, H100).activation_bytes_per_token())


def describe_device(mode, free_bytes: float | None = None) -> Device:
    """The plan's view of this machine's device (`free_bytes` overrides what CUDA says)."""
    if mode.cpu:
        return Device(name="cpu", free_bytes=None)
    import torch

    name = torch.cuda.get_device_name(mode.device)
    if free_bytes is None:
        free_bytes, _ = torch.cuda.mem_get_info(mode.device)
    return Device(name=name, free_bytes=float(free_bytes))


def section_limit(estimate_s: float | None, default_s: float) -> float:
    """A section's time limit: three times its estimate, at least a minute (else `default_s`)."""
    if estimate_s is None or not math.isfinite(estimate_s):
        return default_s
    return max(60.0, 3.0 * estimate_s)
