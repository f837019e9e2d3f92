"""Every available varlen kernel against a float64 reference, forward and backward.

Cases: GQA over packed documents of uneven lengths (causal), zigzag half blocks (full), one
query row per document (the split-KV decode path of FlashAttention with GQA), many tiny
documents, and plain multi-head attention.
"""

from __future__ import annotations

import torch
from common import Mode, reference_attention, relative_error, tolerance

from megatron_hdp.attention.kernels import registry
from megatron_hdp.attention.kernels.base import VarlenBlocks
from megatron_hdp.attention.kernels.device import DeviceFacts


def cases(mode: Mode) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], bool, int]]:
    """name -> (query lengths, key lengths, causal, kv heads)."""
    s = mode.scale_tokens
    tiny = tuple(1 + (i * 7) % 5 for i in range(300))
    return {
        "packed_documents_gqa": ((37 * s, 512 * s, 3, 300 * s),) * 2 + (True, mode.groups),
        "zigzag_half_blocks": ((64 * s, 200 * s), (128 * s, 90 * s), False, mode.groups),
        "one_query_row_per_document": ((1, 1, 1, 1), (50 * s, 7, 300 * s, 1), False, mode.groups),
        "many_tiny_documents": (tiny, tiny, True, mode.groups),
        "multi_head_no_gqa": ((100 * s, 17), (100 * s, 17), True, mode.heads),
    }


def kernels_to_check(mode: Mode, dtype: torch.dtype) -> tuple[list[str], dict[str, str]]:
    """Kernels that run here for `dtype` (in check order), and why the others do not."""
    facts = DeviceFacts.of(mode.device)
    reasons = registry.kernel_reasons(facts, dtype=dtype, head_dim=mode.head_dim)
    runnable = [name for name, why in reasons.items() if not why]
    order = ["torch", "math", "torch_flash", "flash_attn", "torch_flash_fa3", "torch_flash_fa4"]
    runnable.sort(key=lambda n: order.index(n) if n in order else len(order))
    return runnable, {name: why for name, why in reasons.items() if why}


def check_case(kernel_name, mode: Mode, dtype, name, case, seed=0) -> dict:
    """One kernel on one case: relative errors of out, lse, dq, dk, dv against float64."""
    lengths_q, lengths_k, causal, groups = case
    gen = torch.Generator(device=mode.device).manual_seed(seed)
    heads, dim = mode.heads, mode.head_dim

    def rand(t, h):
        return torch.randn(t, h, dim, generator=gen, device=mode.device).to(dtype)

    q, k, v = (
        rand(sum(lengths_q), heads),
        rand(sum(lengths_k), groups),
        rand(sum(lengths_k), groups),
    )
    dout = rand(sum(lengths_q), heads)
    scale = dim**-0.5
    blocks = VarlenBlocks.build(lengths_q, lengths_k, causal=causal, device=mode.device)
    kernel = registry.get_kernel(kernel_name)
    kernel.activate()
    out, lse = kernel.forward(q, k, v, blocks, scale=scale)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, blocks, scale=scale)

    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = reference_attention(*leaves, lengths_q, lengths_k, causal, scale)
    want_out.backward(dout.double())
    errors = {
        "out": relative_error(out, want_out.detach()),
        "lse": relative_error(lse, want_lse.detach()),
        "dq": relative_error(dq, leaves[0].grad),
        "dk": relative_error(dk, leaves[1].grad),
        "dv": relative_error(dv, leaves[2].grad),
    }
    limit = tolerance(dtype)
    lse_shape_ok = tuple(lse.shape) == (heads, sum(lengths_q))
    out_dtype_ok = out.dtype == dtype and dq.dtype == dtype
    return {
        "kernel": kernel_name,
        "dtype": str(dtype).removeprefix("torch."),
        "case": name,
        "tokens_q": sum(lengths_q),
        "documents": len(lengths_q),
        "lse_shape_ok": lse_shape_ok,
        "out_dtype_ok": out_dtype_ok,
        "errors": errors,
        "tolerance": limit,
        "ok": max(errors.values()) <= limit and lse_shape_ok and out_dtype_ok,
    }


def run(mode: Mode, say, kernel_name: str | None = None) -> dict:
    """Every runnable kernel x dtype x case (all kernels, whatever `kernel_name`); JSON."""
    results, skipped = [], {}
    for dtype in mode.dtypes:
        names, why_not = kernels_to_check(mode, dtype)
        skipped[str(dtype).removeprefix("torch.")] = why_not
        for kernel_name in names:
            _restore_flash_impl()  # FA3/FA4 switch torch's ops process-wide; each is checked alone
            for name, case in cases(mode).items():
                result = check_case(kernel_name, mode, dtype, name, case)
                results.append(result)
                worst = max(result["errors"].values())
                say(
                    f"kernels  {kernel_name:16s} {result['dtype']:8s} {name:28s} "
                    f"max rel err {worst:.2e} {'ok' if result['ok'] else 'FAILED'}"
                )
        _restore_flash_impl()
    return {"results": results, "not_run": skipped, "ok": all(r["ok"] for r in results)}


def _restore_flash_impl() -> None:
    attention = torch.nn.attention
    if getattr(attention, "current_flash_attention_impl", lambda: None)() is not None:
        attention.restore_flash_attention_impl()
