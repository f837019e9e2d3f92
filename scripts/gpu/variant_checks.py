"""The attention variants on the kernel the job's "auto" picks here, against float64 on CPU.

Three cases, each as a pack (one rank holds every token: one kernel call each way) and as
a ring of virtual ranks (threads, as in `ring_checks`):

- `window`: sliding-window attention (`window_ring`: banded steps through the kernel's
  own window arguments, K/V rows the window hides left out of the ring's messages);
- `sink`: an attention sink (`sinks.SoftmaxSink` as the ring's `RowFinalize` step), with
  the sink logits' gradient;
- `mla`: multi-latent attention's unequal head dims (q/k 192, v 128 on GPU), run by the
  kernel `auto` resolves for them (padded, `+pad_v`, where it takes equal dims only).

Each resolves its kernel as the job does (`registry.resolve_kernel("auto", ...)` with the
window or the v head dim), computes in the mode's first dtype (bf16 on GPU), and compares
out and every gradient with `common.reference_attention` in float64 on the CPU (a dense
formula, independent of the code under test). The window's planning needs numpy; without
it that case is reported as skipped.
"""

from __future__ import annotations

import time

import torch
from common import Mode, reference_attention, relative_error, tolerance
from ring_checks import _Context, run_members

from megatron_hdp.attention import ring
from megatron_hdp.attention.kernels import registry
from megatron_hdp.attention.kernels.device import DeviceFacts
from megatron_hdp.attention.sinks import SINK

#: Rings each case runs on: 1 is the pack path.
RING_SIZES = {"window": (1, 4), "sink": (1, 3), "mla": (1, 2)}


def cases(mode: Mode) -> dict[str, dict]:
    """name -> documents, window, q/k and v head dims, kv heads (small: seconds on an H100)."""
    s = mode.scale_tokens
    d = mode.head_dim
    return {
        "window": {
            "lengths": (75 * s, 11 * s + 3, 5, 37 * s + 1),
            "window": 16 * s,
            "head_dims": (d, d),
            "kv_heads": mode.groups,
        },
        "sink": {
            "lengths": (64 * s, 9 * s, 3, 30 * s),
            "window": None,
            "head_dims": (d, d),
            "kv_heads": mode.groups,
        },
        # DeepSeek-V3's 192/128 on GPU (3/2 of the mode's head dim, and the head dim).
        "mla": {
            "lengths": (50 * s, 16 * s + 5, 7),
            "window": None,
            "head_dims": (d * 3 // 2, d),
            "kv_heads": mode.heads,
        },
    }


def _attend(ctx, spec, q, k, v, scale, window, finalize, params):
    """One member's forward as `ring.hdp_attention` dispatches it; returns its autograd Function."""
    from megatron_hdp.attention.pack import PackAttention

    if window is not None:
        from megatron_hdp.attention import window_ring

        plan = window_ring.device_plan(spec, window, q.device)
        if len(spec.active) == 1:
            (step,) = plan.steps.values()
            fn = PackAttention
            return fn, fn.forward(ctx, q, k, v, step.blocks, spec.backend, scale, finalize, *params)
        fn = window_ring._WindowRingAttention
        return fn, fn.forward(ctx, q, k, v, spec, plan, scale, finalize, *params)
    if len(spec.active) == 1:
        blocks = spec.step_blocks(q.device)[spec.position].blocks
        fn = PackAttention
        return fn, fn.forward(ctx, q, k, v, blocks, spec.backend, scale, finalize, *params)
    fn = ring._HDPAttention
    return fn, fn.forward(ctx, q, k, v, spec, scale, finalize, *params)


def check_case(mode: Mode, name: str, case: dict, k: int, dtype, seed: int = 0) -> dict:
    """One case on a ring of `k` (1: the pack): errors of out and gradients vs float64."""
    lengths, window = case["lengths"], case["window"]
    dqk, dv = case["head_dims"]
    heads, groups = mode.heads, case["kv_heads"]
    facts = DeviceFacts.of(mode.device)
    try:
        kernel_name = registry.resolve_kernel(
            "auto",
            facts,
            dtype=dtype,
            head_dim=dqk,
            head_dim_v=dv if dv != dqk else None,
            window=window is not None,
        )
    except ValueError as error:  # a job with this variant would be refused here: a failure
        return {
            "case": name,
            "ring_size": k,
            "path": "pack" if k == 1 else "ring",
            "kernel": None,
            "errors": {},
            "error": str(error),
            "ok": False,
        }
    gen = torch.Generator(device=mode.device).manual_seed(seed)
    total = sum(lengths)

    def rand(h, dim):
        return torch.randn(total, h, dim, generator=gen, device=mode.device).to(dtype)

    q, kk, vv, dout = rand(heads, dqk), rand(groups, dqk), rand(groups, dv), rand(heads, dv)
    sink = None
    if name == "sink":  # learnable logits of either sign (off-by-one is the logit 0)
        sink = torch.randn(heads, generator=gen, device=mode.device).float()
    finalize, params = (SINK, (sink,)) if sink is not None else (None, ())
    scale = dqk**-0.5
    out, dq, dk, dvv = (torch.empty_like(t) for t in (dout, q, kk, vv))
    dsink = torch.zeros(heads, dtype=torch.float64)

    def work(spec, rows):
        ctx = _Context()
        ctx.needs_input_grad = (True,) * 8
        with torch.no_grad():
            fn, local = _attend(
                ctx, spec, q[rows], kk[rows], vv[rows], scale, window, finalize, params
            )
            grads = fn.backward(ctx, dout[rows])
        return local, grads

    start = time.perf_counter()
    members = run_members(lengths, k, kernel_name, mode.device, work)
    if mode.device.type == "cuda":
        torch.cuda.synchronize(mode.device)
    seconds = time.perf_counter() - start
    for rows, (local, grads) in members:
        out[rows], dq[rows], dk[rows], dvv[rows] = local, *grads[:3]
        if sink is not None:  # each member's rows' share, summed as the gradient sync would
            dsink += grads[-1].double().cpu()

    cpu = torch.device("cpu")
    leaves = [t.to(cpu).double().requires_grad_() for t in (q, kk, vv)]
    sink64 = sink.to(cpu).double().requires_grad_() if sink is not None else None
    want, _ = reference_attention(
        *leaves, lengths, lengths, True, scale, window=window, sink=sink64
    )
    want.backward(dout.to(cpu).double())
    errors = {
        "out": relative_error(out.cpu(), want.detach()),
        "dq": relative_error(dq.cpu(), leaves[0].grad),
        "dk": relative_error(dk.cpu(), leaves[1].grad),
        "dv": relative_error(dvv.cpu(), leaves[2].grad),
    }
    if sink64 is not None:
        want_dsink = sink64.grad if sink64.grad is not None else torch.zeros_like(sink64)
        errors["dsink"] = relative_error(dsink, want_dsink)
    limit = tolerance(dtype)
    return {
        "case": name,
        "kernel": kernel_name,
        "dtype": str(dtype).removeprefix("torch."),
        "ring_size": k,
        "path": "pack" if k == 1 else "ring",
        "lengths": list(lengths),
        "window": window,
        "head_dims": [dqk, dv],
        "heads": heads,
        "kv_heads": groups,
        "errors": errors,
        "tolerance": limit,
        "seconds": seconds,
        "ok": max(errors.values()) <= limit and out.dtype == dtype,
    }


def _numpy_missing() -> str | None:
    try:
        import numpy  # noqa: F401
    except ImportError as error:
        return f"the window's planning needs numpy ({error})"
    return None


def run(mode: Mode, say, kernel_name: str | None = None) -> dict:
    """Every case, pack and ring, in the mode's first dtype; returns the section's JSON.

    `kernel_name` (what "auto" picks for plain attention) is not used: each case resolves
    its own, as a job with that variant does.
    """
    dtype = mode.dtypes[0]
    results, skipped = [], {}
    for name, case in cases(mode).items():
        why_not = _numpy_missing() if case["window"] is not None else None
        if why_not:
            skipped[name] = why_not
            say(f"variants {name:8s} skipped: {why_not}")
            continue
        for k in RING_SIZES[name]:
            result = check_case(mode, name, case, k, dtype)
            results.append(result)
            if result.get("error"):
                say(f"variants {name:8s} k={k} FAILED: {result['error']}")
                continue
            say(
                f"variants {name:8s} {result['kernel']:18s} {result['dtype']:8s} "
                f"{result['path']} k={k} max rel err {max(result['errors'].values()):.2e} "
                f"in {result['seconds']:.3f} s {'ok' if result['ok'] else 'FAILED'}"
            )
    return {"results": results, "skipped_cases": skipped, "ok": all(r["ok"] for r in results)}
