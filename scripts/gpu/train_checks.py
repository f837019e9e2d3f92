"""One-GPU training: HDP's throughput and MFU, and HDP core attention against Megatron's own.

Needs megatron-core, imported inside `run()` only: without it the section is skipped (not
failed), so `verify.py` itself keeps needing torch alone.

- Packed HDP training: a ~1B GPT (16 layers, hidden 2048, 16 heads, GQA 4, SwiGLU, RMSNorm,
  RoPE, vocabulary 32000) in bf16, trained by the project's own `build_engine` / `plan_step`
  / `train_step` on one rank, micro-batches of 16K, 32K and 64K tokens (a few random
  documents packed in each, capacity = its size): median step time, tokens/s and MFU.
- Core attention: the same model built a second time from Megatron-Core's stock local layer
  spec (its own `DotProductAttention`, `[s, b]` input, causal mask, its own RoPE) and loaded
  with the HDP model's initial weights. The two models differ only in core attention,
  where RoPE is applied (inside HDP attention at the tokens' positions; in Megatron's
  self-attention) and the THD vs SBHD input; both use the same DDP wrapper, optimizer and
  schedule (`build_engine`).
- The check ("ok", `attention_check`): from equal weights, both models take `CHECK_STEPS`
  optimizer steps on one repeated batch (`check_lengths`, one sequence per micro-batch).
  The batch is learnt, so the loss falls and comes to depend on what attention computes:
  a wrong RoPE position, a causal leak or a wrong scale makes the two loss curves part.
  The losses must agree at every step, and each layer's `linear_qkv` / `linear_proj`
  gradient norm at step 1 (where the global norm, dominated by the output layer, would
  hide them), within `TOLERANCE` (float32 on CPU: tight; bf16 on GPU: bf16's).
- Throughput: both models on the same sequences, one per micro-batch, at lengths where
  Megatron's `[b, heads, s, s]` scores fit.
- An MoE router recomputed in the backward (`moe_checks`: on CUDA that backward runs on
  autograd's device thread) gives the gradients of no recompute.

The CPU mode runs a tiny model (2 layers, hidden 64) for two timed steps: tokens/s only,
no MFU (no peak figure for a CPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import math
import statistics
import tempfile
import time
from unittest import mock

import torch
from common import Mode, synchronize
from moe_checks import recompute_check

DOCS = "docs/gpu.md, 'Running verify.py on a GPU machine without network'"

#: Dense bf16 tensor-core peak FLOP/s by GPU name (first match of a lower-case substring).
#: NVIDIA's datasheets quote bf16 "with sparsity"; the dense figure is half of it:
#: - H100 Tensor Core GPU datasheet: SXM 1,979 TFLOPS, NVL 1,671, PCIe 1,513 (sparse);
#:   989.4 TFLOPS dense for SXM (the H100 whitepaper's table), 756 for PCIe.
#: - H200 Tensor Core GPU datasheet: H200 SXM 1,979 TFLOPS (sparse), as H100 SXM.
#: - A100 Tensor Core GPU datasheet: 312 TFLOPS dense bf16 (624 with sparsity).
#: - HGX B200 / DGX B200 datasheet: 4.5 PFLOPS FP16/BF16 per GPU with sparsity, 2.25 dense.
PEAK_BF16_FLOPS = (
    ("h100 pcie", 756e12),
    ("h100 nvl", 835.5e12),
    ("h100", 989.4e12),
    ("h200", 989.4e12),
    ("a100", 312e12),
    ("b200", 2.25e15),
)

#: Relative difference accepted between the two models' losses at each step of the check
#: ("loss") and between their attention projections' step-1 gradient norms ("grad_norm").
#: float32 (the CPU run): agreement seen here is ~2e-6 (losses, 20 steps) and ~1e-7 (norms);
#: positions restarting mid-sequence gave 1.4e-3 and 2.4e-2. bf16 (GPU), from the same
#: check in bf16 on CPU (4 layers, hidden 256, 2 x 512 tokens; not a GPU figure): agreement
#: 6.5e-2 (losses: bf16 rounding compounds as the batch is learnt) and 4e-4 (norms), the
#: restarting positions 1.1e-1 and 1.4e-2. So in bf16 the norms are the sharp test and the
#: losses catch only gross errors. Unsure on a GPU until a run's JSON shows its agreement.
TOLERANCE = {
    torch.float32: {"loss": 1e-4, "grad_norm": 1e-5},
    torch.bfloat16: {"loss": 1.5e-1, "grad_norm": 5e-3},
}
#: Optimizer steps of the check on its one repeated batch.
CHECK_STEPS = 20
#: The check's loss must fall below this share of its first value (else it saw nothing).
CHECK_LOSS_FALLS_TO = 0.9
#: Standard deviation of the attention scores the check starts from. Megatron's init
#: (std 0.02) gives scores of std 0.02^2 * hidden: 0.03 for the CPU model (near-uniform
#: attention, blind to positions), 0.8 for the GPU model. Both models start with their
#: `linear_qkv` weights scaled so that the scores' std is this (never scaled down).
CHECK_SCORE_STD = 2.0
#: The GPU model: a ~1.1B GPT (SwiGLU, RMSNorm, RoPE), vocabulary padded as Megatron pads it.
GPU_MODEL = {
    "num_layers": 16,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_query_groups": 4,
    "vocab_size": 32000,
}
#: Tokens per step of the throughput comparison (sequences per step = this / length).
COMPARE_TOKENS = 16384


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What the section runs in a mode."""

    cfg: object
    """The model (`GPTConfig`)."""
    packed_tokens: tuple[int, ...]
    """Tokens per micro-batch of the packed HDP runs."""
    compare_lengths: tuple[int, ...]
    """Sequence lengths of the HDP-vs-Megatron comparison (one sequence per micro-batch)."""
    compare_tokens: int
    """Tokens per step of the comparison (sequences per step = this / length)."""
    check_lengths: tuple[int, ...]
    """The check's repeated batch: one sequence of each length, one per micro-batch."""
    check_steps: int
    warmup: int
    steps: int
    """Timed steps (their median is reported)."""


def check_lengths(mode: Mode) -> tuple[int, ...]:
    """Sequence lengths of the check's repeated batch."""
    return (128, 128) if mode.cpu else (4096, 4096)


def sizes(mode: Mode) -> Sizes:
    """The ~1B bf16 model on GPU (the mode's train sizes), a tiny one on CPU."""
    from megatron_hdp.megatron.model import GPTConfig

    if mode.cpu:
        cfg = GPTConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            vocab_size=256,
            params_dtype="float32",
        )
        return Sizes(
            cfg,
            mode.train_packed,
            mode.train_compare,
            256,
            check_lengths(mode),
            CHECK_STEPS,
            warmup=1,
            steps=2,
        )
    dims = dict(GPU_MODEL, vocab_size=padded_vocab(GPU_MODEL["vocab_size"]))
    cfg = GPTConfig(**dims, params_dtype="bfloat16")
    steps = 5 if mode.repeats >= 10 else 3
    return Sizes(
        cfg,
        mode.train_packed,
        mode.train_compare,
        COMPARE_TOKENS,
        check_lengths(mode),
        CHECK_STEPS,
        warmup=2,
        steps=steps,
    )


def padded_vocab(vocab: int, multiple: int = 128) -> int:
    """The vocabulary padded as Megatron pads it (--make-vocab-size-divisible-by 128, TP 1)."""
    return -(-vocab // multiple) * multiple


def model_flops(cfg, doc_lengths) -> float:
    """Model FLOPs of one training step (forward + backward) over documents of these lengths.

        F = 6 * N * sum(s_d)  +  6 * L * h * sum(s_d ** 2)

    N: the weights every token multiplies (`ModelShape.params_per_token`: all layers' linear
    weights and the output layer; not the embedding lookup), 2 FLOPs per multiply-add and
    backward = 2 x forward. Attention, per layer and document: Q K^T and P V are
    2 * s^2 * h FLOPs each over the full square (h = heads x head dim = hidden); causal
    attention counts half the square, so 2 * s^2 * h forward and 6 * s^2 * h with backward.
    Recomputation is not counted (model FLOPs, not hardware FLOPs).
    """
    from megatron_hdp.megatron.model import model_shape

    n = model_shape(cfg).params_per_token
    linear = 6.0 * n * sum(doc_lengths)
    attention = 6.0 * cfg.num_layers * cfg.hidden_size * sum(s * s for s in doc_lengths)
    return linear + attention


def peak_bf16_flops(device: torch.device) -> tuple[float | None, str]:
    """Dense bf16 peak FLOP/s of the device and where it comes from (None: unknown)."""
    if device.type != "cuda":
        return None, "no peak bf16 figure for a CPU: MFU is not computed"
    return peak_of_gpu(torch.cuda.get_device_name(device))


def peak_of_gpu(name: str) -> tuple[float | None, str]:
    """`PEAK_BF16_FLOPS` of the GPU called `name` (as CUDA names it), and a note."""
    for key, flops in PEAK_BF16_FLOPS:
        if key in name.lower():
            return flops, f"{name}: {flops / 1e12:.1f} TFLOP/s dense bf16 (NVIDIA datasheet)"
    known = ", ".join(k for k, _ in PEAK_BF16_FLOPS)
    return None, f"no peak bf16 figure for {name!r} (known: {known}): MFU is not computed"


@contextlib.contextmanager
def one_rank_job(device: torch.device):
    """A process group of this process alone (if none exists) and Megatron's state for it.

    Yields the `ParallelLayout`; destroys what it created on exit. Gloo on CPU, NCCL on
    CUDA, both through a file rendezvous in a temporary folder (no port to pick).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_hdp.distributed.layout import ParallelDims

    own_group = not dist.is_initialized()
    with tempfile.TemporaryDirectory(prefix="verify-train-") as folder:
        if own_group:
            extra = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo",
                init_method=f"file://{folder}/rendezvous",
                rank=0,
                world_size=1,
                timeout=datetime.timedelta(minutes=5),
                **extra,
            )
        elif dist.get_world_size() != 1:
            raise RuntimeError(
                f"the train section runs on one process; torch.distributed already has "
                f"{dist.get_world_size()} ranks"
            )
        own_state = not parallel_state.model_parallel_is_initialized()
        try:
            layout = ParallelDims.of_world().initialize()
            try:
                yield layout
            finally:
                if own_state:
                    layout.destroy()
        finally:
            if own_group:
                dist.destroy_process_group()


def random_sequences(lengths, vocab: int, seed: int):
    """`(tokens, labels)` of random ids per length (labels: the next ids)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n + 1,), generator=gen)
        seqs.append((ids[:-1], ids[1:]))
    return seqs


def packed_documents(tokens: int) -> list[int]:
    """A few uneven documents that fill one micro-batch of `tokens` exactly."""
    lengths = [tokens * share // 10 for share in (4, 3, 2)]
    return [*lengths, tokens - sum(lengths)]


def megatron_gpt(cfg):
    """Megatron-Core's stock GPT for `cfg`: its local layer spec, its own attention and RoPE.

    The same layer spec `model.hdp_layer_spec` starts from, left as Megatron ships it.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_hdp.megatron.model import transformer_config

    spec = get_gpt_layer_local_spec(
        num_experts=None, moe_grouped_gemm=False, normalization=cfg.normalization
    )
    return GPTModel(
        config=transformer_config(cfg),
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type=cfg.position_embedding_type,
        rotary_base=cfg.rotary_base,
    )


def megatron_engine(cfg, optim, weights: dict):
    """Collective (one rank): `build_engine` with Megatron's stock GPT loaded with `weights`.

    `build_engine` builds the model through `engine.build_gpt`; it is swapped for the stock
    model for the call, so both models get the same DDP wrapper, optimizer and schedule.
    """
    from megatron_hdp.megatron import engine as engine_module

    def build(cfg, *, stage: int = 0, tp_rank: int = 0, chunk: int = 0):
        model = megatron_gpt(cfg)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        extra = [k for k in missing if "_extra_state" not in k and "inv_freq" not in k]
        if unexpected or extra:
            raise RuntimeError(
                f"Megatron's model does not take the HDP model's weights: missing {extra}, "
                f"unexpected {unexpected}"
            )
        return model

    with mock.patch.object(engine_module, "build_gpt", build):
        return engine_module.build_engine(cfg, optim)


def megatron_step(engine, seqs, device: torch.device) -> tuple[float, float | None]:
    """One optimizer step of the stock model on `seqs`, one `[1, s]` sequence per micro-batch.

    As `step.train_step` does it: token-loss sums scaled by 1 / all tokens, Megatron's
    gradient finish, the optimizer step and the schedule. Returns the mean loss and the
    gradient norm.
    """
    from megatron.core.distributed import finalize_model_grads

    model = engine.model
    model.zero_grad_buffer()
    engine.optimizer.zero_grad()
    total = sum(len(tokens) for tokens, _ in seqs)
    sums = []
    with model.no_sync():
        for tokens, labels in seqs:
            tokens, labels = tokens.to(device), labels.to(device)
            positions = torch.arange(len(tokens), device=device)
            losses = model(tokens[None], positions[None], None, labels=labels[None])
            loss_sum = losses.float().sum()
            (loss_sum / total).backward()
            sums.append(loss_sum.detach())
    finalize_model_grads([model])
    updated, grad_norm, _ = engine.optimizer.step()
    if updated:
        engine.scheduler.step(increment=1)
    loss = float(torch.stack(sums).sum()) / total
    return loss, None if grad_norm is None else float(grad_norm)


def timed_steps(step, device: torch.device, warmup: int, steps: int) -> dict:
    """Run `step()` `warmup + steps` times; the first step's result and the median time."""
    first, times = None, []
    for i in range(warmup + steps):
        synchronize(device)
        started = time.perf_counter()
        result = step()
        synchronize(device)
        if i == 0:
            first = result
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return {"first": first, "step_s": statistics.median(times)}


def throughput(cfg, timing: dict, doc_lengths, peak: float | None) -> dict:
    """Tokens/s and MFU of a step over `doc_lengths` that took `timing["step_s"]`."""
    tokens = sum(doc_lengths)
    flops = model_flops(cfg, doc_lengths)
    seconds = timing["step_s"]
    return {
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "model_tflops_per_s": flops / seconds / 1e12,
        "mfu": flops / seconds / peak if peak else None,
    }


def attention_grad_norms(module) -> dict[str, float]:
    """Gradient norm of each layer's `linear_qkv` and `linear_proj` weight (DDP's main_grad)."""
    norms = {}
    for name, param in module.named_parameters():
        if name.endswith(("linear_qkv.weight", "linear_proj.weight")):
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            norms[name] = None if grad is None else float(grad.float().norm())
    return norms


def tracked_steps(engine, step, steps: int) -> dict:
    """`steps` calls of `step()` (-> loss, grad norm) on one batch: every loss, and the
    attention projections' gradient norms of the first step, read when the optimizer steps."""
    first_norms: dict[str, float] = {}
    real = engine.optimizer.step

    def recording(*args, **kwargs):
        if not first_norms:
            first_norms.update(attention_grad_norms(engine.model.module))
        return real(*args, **kwargs)

    engine.optimizer.step = recording
    try:
        losses = [float(step()[0]) for _ in range(steps)]
    finally:
        engine.optimizer.step = real
    return {"losses": losses, "attention_grad_norms": first_norms}


def attempt(fn, what: str, say) -> tuple[object, str | None]:
    """`fn()`, or None and the reason when the device runs out of memory."""
    try:
        return fn(), None
    except torch.cuda.OutOfMemoryError as err:
        reason = f"out of memory: {str(err).splitlines()[0]}"
    gc.collect()
    torch.cuda.empty_cache()
    say(f"train    {what}: {reason}")
    return None, reason


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _hdp_run(sz: Sizes, layout, device, kernel_name: str, peak, say) -> tuple[dict, dict]:
    """Build the HDP engine; the comparison runs (first), then the packed runs.

    Returns the results and the model's initial weights (on the CPU).
    """
    from megatron_hdp.data.batching import InMemoryTokens
    from megatron_hdp.megatron.engine import OptimConfig
    from megatron_hdp.megatron.step import StepRuntime, train_step
    from megatron_hdp.scheduler import plan_step

    cfg = sz.cfg
    engine = build_engine_sharpened(cfg, OptimConfig())
    module = engine.model.module
    weights = {
        k: v.detach().to("cpu", copy=True)
        for k, v in module.state_dict().items()
        if torch.is_tensor(v)
    }
    # The non-finite guard computes the grad norm a second time; Megatron's step does not.
    runtime = StepRuntime(
        group=layout.pool_group, backend=kernel_name, device=device, check_nonfinite=False
    )
    out = {"parameters": sum(p.numel() for p in module.parameters()), "compare": {}, "packed": []}

    def hdp_step(seqs, capacity):
        source = InMemoryTokens([t for t, _ in seqs], [lab for _, lab in seqs])
        plan = plan_step(source.seqlens, pool_size=1, capacity=capacity, policy="greedy")

        def step():
            result = train_step(engine, plan, source, runtime)
            return result.loss, result.grad_norm

        return step, len(plan.micro_batches)

    def hdp_steps(seqs, capacity):
        step, micro_batches = hdp_step(seqs, capacity)
        return timed_steps(step, device, sz.warmup, sz.steps), micro_batches

    check = check_sequences(sz)
    step, micro_batches = hdp_step(check, max(sz.check_lengths))
    out["check"], oom = attempt(
        lambda: tracked_steps(engine, step, sz.check_steps), "HDP check", say
    )
    if oom:
        out["check"] = {"oom": oom}
    else:
        out["check"]["micro_batches"] = micro_batches

    for length in sz.compare_lengths:
        seqs = compare_sequences(sz, length)
        done, oom = attempt(lambda s=seqs, n=length: hdp_steps(s, n), f"HDP at {length}", say)
        entry = {"oom": oom} if oom else {}
        if done:
            timing, micro_batches = done
            entry = {
                "micro_batches": micro_batches,
                "first_loss": timing["first"][0],
                "first_grad_norm": timing["first"][1],
                **throughput(cfg, timing, [length] * len(seqs), peak),
            }
        out["compare"][length] = entry
    for tokens in sz.packed_tokens:
        docs = packed_documents(tokens)
        seqs = random_sequences(docs, cfg.vocab_size, seed=tokens)
        done, oom = attempt(lambda s=seqs, n=tokens: hdp_steps(s, n), f"HDP at {tokens}", say)
        entry = {"tokens": tokens, "documents": docs}
        if oom:
            entry["oom"] = oom
        else:
            timing, micro_batches = done
            entry.update(micro_batches=micro_batches, **throughput(cfg, timing, docs, peak))
            say(
                f"train    HDP {kernel_name} {tokens:6d} tokens/micro-batch: "
                f"{entry['tokens_per_s']:.0f} tokens/s, MFU {_percent(entry['mfu'])}"
            )
        out["packed"].append(entry)
    return out, weights


def check_sequences(sz: Sizes):
    """The check's one batch, the same for both models and for every step."""
    return random_sequences(sz.check_lengths, sz.cfg.vocab_size, seed=7)


def qkv_init_scale(cfg) -> float:
    """Factor on `linear_qkv` that gives attention scores of std `CHECK_SCORE_STD` at init."""
    score_std = cfg.init_method_std**2 * cfg.hidden_size
    return max(1.0, math.sqrt(CHECK_SCORE_STD / score_std))


def build_engine_sharpened(cfg, optim):
    """Collective (one rank): `build_engine`, its model's `linear_qkv` weights scaled by
    `qkv_init_scale` before the optimizer copies them (so both models start sharp)."""
    from megatron_hdp.megatron import engine as engine_module

    real, scale = engine_module.build_gpt, qkv_init_scale(cfg)

    def build(cfg, **kwargs):
        model = real(cfg, **kwargs)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("linear_qkv.weight"):
                    param.mul_(scale)
        return model

    with mock.patch.object(engine_module, "build_gpt", build):
        return engine_module.build_engine(cfg, optim)


def compare_sequences(sz: Sizes, length: int):
    """The comparison's sequences of `length` tokens (the same for both models)."""
    count = max(1, sz.compare_tokens // length)
    return random_sequences([length] * count, sz.cfg.vocab_size, seed=length)


def _megatron_run(sz: Sizes, device, weights: dict, peak, say) -> dict:
    """Build the stock-Megatron engine from `weights`; its comparison runs."""
    from megatron_hdp.megatron.engine import OptimConfig

    cfg = sz.cfg
    engine = megatron_engine(cfg, OptimConfig(), weights)
    params = dict(engine.model.module.named_parameters())
    same = set(params) == {k for k in weights if "_extra_state" not in k} and all(
        torch.equal(p.detach().cpu(), weights[name]) for name, p in params.items()
    )
    out = {"weights_equal": same, "compare": {}}
    check = check_sequences(sz)
    out["check"], oom = attempt(
        lambda: tracked_steps(engine, lambda: megatron_step(engine, check, device), sz.check_steps),
        "Megatron check",
        say,
    )
    if oom:
        out["check"] = {"oom": oom}
    for length in sz.compare_lengths:
        seqs = compare_sequences(sz, length)

        def steps(s=seqs):
            def step():
                return megatron_step(engine, s, device)

            return timed_steps(step, device, sz.warmup, sz.steps)

        timing, oom = attempt(steps, f"Megatron at {length}", say)
        if oom:
            out["compare"][length] = {"oom": oom}
            continue
        out["compare"][length] = {
            "first_loss": timing["first"][0],
            "first_grad_norm": timing["first"][1],
            **throughput(cfg, timing, [length] * len(seqs), peak),
        }
    return out


def _relative(a: float | None, b: float | None) -> float:
    if a is None or b is None:
        return math.inf
    return abs(a - b) / max(abs(b), 1e-30)


def _percent(mfu: float | None) -> str:
    return "n/a" if mfu is None else f"{100 * mfu:.1f}%"


def attention_check(sz: Sizes, hdp: dict, megatron: dict) -> dict:
    """The check: equal weights; losses at every step and step-1 attention gradient norms
    of the two models within tolerance; the loss fell (else the check could see nothing)."""
    tolerance = TOLERANCE[sz.cfg.dtype]
    a, b = hdp["check"], megatron["check"]
    result = {
        "sequence_lengths": list(sz.check_lengths),
        "steps": sz.check_steps,
        "weights_equal": megatron["weights_equal"],
        "tolerance": tolerance,
    }
    if "oom" in a or "oom" in b:
        return {**result, "oom": a.get("oom") or b.get("oom"), "ok": False}
    loss_diffs = [_relative(x, y) for x, y in zip(a["losses"], b["losses"], strict=True)]
    norms = {
        name: {
            "hdp": a["attention_grad_norms"].get(name),
            "megatron": value,
            "relative_difference": _relative(a["attention_grad_norms"].get(name), value),
        }
        for name, value in b["attention_grad_norms"].items()
    }
    worst_norm = max((n["relative_difference"] for n in norms.values()), default=math.inf)
    losses = b["losses"]
    fell = losses[-1] < CHECK_LOSS_FALLS_TO * losses[0]
    return {
        **result,
        "losses_hdp": a["losses"],
        "losses_megatron": losses,
        "loss_relative_differences": loss_diffs,
        "max_loss_relative_difference": max(loss_diffs),
        "attention_grad_norms_step1": norms,
        "max_grad_norm_relative_difference": worst_norm,
        "loss_fell": fell,
        "ok": (
            megatron["weights_equal"]
            and fell
            and max(loss_diffs) <= tolerance["loss"]
            and worst_norm <= tolerance["grad_norm"]
        ),
    }


def run(mode: Mode, say, kernel_name: str) -> dict:
    """Packed HDP training and the core-attention comparison on one device (one process)."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as err:
        say("train    skipped: megatron-core is not installed")
        return {
            "ok": None,
            "skipped": f"megatron-core is not installed (carry its wheel: see {DOCS})",
            "import_error": str(err),
        }
    from megatron_hdp.attention.kernels import registry
    from megatron_hdp.megatron.cpu_shim import maybe_cpu_shims
    from megatron_hdp.megatron.model import model_shape

    registry.get_kernel(kernel_name).activate()
    device = mode.device
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
        device = torch.device("cuda", torch.cuda.current_device())
        _free(device)  # what the earlier sections left in the caching allocator
    sz = sizes(mode)
    peak, peak_note = peak_bf16_flops(device)
    with maybe_cpu_shims(), one_rank_job(device) as layout:
        # Each engine is freed (its function returned) before the next one is built.
        hdp, weights = _hdp_run(sz, layout, device, kernel_name, peak, say)
        _free(device)
        megatron = _megatron_run(sz, device, weights, peak, say)
        _free(device)
        try:  # small; its failure must not lose the figures above
            moe_recompute = recompute_check(device, say)
        except Exception as err:  # noqa: BLE001 - recorded as a failed check
            say(f"train    MoE recompute check crashed: {err!r}: FAILED")
            moe_recompute = {"ok": False, "error": repr(err)}
    check = attention_check(sz, hdp, megatron)
    comparison = []
    for length in sz.compare_lengths:
        a, b = hdp["compare"][length], megatron["compare"][length]
        row = {
            "sequence_length": length,
            "sequences_per_step": len(compare_sequences(sz, length)),
            "hdp": a,
            "megatron": b,
        }
        if "tokens_per_s" in a and "tokens_per_s" in b:
            row["hdp_over_megatron"] = a["tokens_per_s"] / b["tokens_per_s"]
        comparison.append(row)
        say(
            f"train    {length:6d}-token sequences: HDP {_rate(a)}, Megatron attention {_rate(b)}"
            + (f" ({row['hdp_over_megatron']:.2f}x)" if "hdp_over_megatron" in row else "")
        )
    say(_check_line(check))
    cfg = sz.cfg
    return {
        "ok": check["ok"] and moe_recompute["ok"],
        "kernel": kernel_name,
        "dtype": cfg.params_dtype,
        "model": {
            "num_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "num_attention_heads": cfg.num_attention_heads,
            "num_query_groups": cfg.num_query_groups,
            "ffn_hidden_size": cfg.ffn_hidden_size or 4 * cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "swiglu": cfg.swiglu,
            "normalization": cfg.normalization,
            "position_embedding_type": cfg.position_embedding_type,
            "parameters": hdp["parameters"],
            "matmul_parameters_per_token": model_shape(cfg).params_per_token,
        },
        "flops_per_step": "6 * N * sum(s) + 6 * layers * hidden * sum(s^2) (causal: half)",
        "peak_bf16_flops": peak,
        "peak_note": peak_note,
        "warmup_steps": sz.warmup,
        "timed_steps": sz.steps,
        "hdp_packed": hdp["packed"],
        "attention_comparison": comparison,
        "attention_check": check,
        "moe_recompute_check": moe_recompute,
        "goals": {"hdp_over_megatron": 1.0},
    }


def _check_line(check: dict) -> str:
    verdict = "ok" if check["ok"] else "FAILED"
    if "oom" in check:
        return f"train    attention check: out of memory ({check['oom']}): {verdict}"
    return (
        f"train    attention check, {check['steps']} steps on one batch: loss "
        f"{check['losses_megatron'][0]:.4f} -> {check['losses_megatron'][-1]:.4f} (Megatron), "
        f"worst step rel diff {check['max_loss_relative_difference']:.1e}, step-1 qkv/proj "
        f"grad norms rel diff {check['max_grad_norm_relative_difference']:.1e} "
        f"(tolerance {check['tolerance']['loss']:g}/{check['tolerance']['grad_norm']:g}): "
        + verdict
    )


def _rate(entry: dict) -> str:
    if "oom" in entry:
        return "out of memory"
    return f"{entry['tokens_per_s']:.0f} tokens/s (MFU {_percent(entry['mfu'])})"
