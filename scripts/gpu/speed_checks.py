"""Kernel speed: a ring member's step calls and the pack path, each against one direct call.

- Ring steps: a rank at position 1 of a ring of 4 holds T tokens of a 4T-token document;
  its 4 step calls (one causal diagonal, three full blocks of T x T/2) run on random tensors
  of those shapes. Their attention TFLOP/s is compared with one varlen call over T tokens
  (one causal document): the goal is >= 0.95 at 32K tokens and more.
- Pack path: `hdp_attention` on a ring of one (packed documents, forward and backward
  through autograd) against the kernel's forward and backward called directly on the same
  tensors: the goal is >= 0.98.
"""

from __future__ import annotations

import torch
from common import Mode, attention_flops, median_seconds

from megatron_hdp.attention import ring
from megatron_hdp.attention.kernels import registry
from megatron_hdp.attention.kernels.base import VarlenBlocks
from megatron_hdp.sharding import shard

RING = 4


def _fwd_bwd(kernel, q, k, v, dout, blocks, scale):
    def call():
        out, lse = kernel.forward(q, k, v, blocks, scale=scale)
        kernel.backward(dout, q, k, v, out, lse, blocks, scale=scale)

    return call


def _tensors(mode, dtype, tq, tk):
    def rand(t, h):
        return torch.randn(t, h, mode.head_dim, device=mode.device, dtype=dtype)

    return rand(tq, mode.heads), rand(tk, mode.groups), rand(tk, mode.groups), rand(tq, mode.heads)


def ring_steps(mode: Mode, dtype, kernel, tokens: int) -> dict:
    """TFLOP/s of one ring member's step calls against one direct call over its tokens."""
    scale = mode.head_dim**-0.5
    shards = tuple(shard([RING * tokens], RING))
    spec = ring.RingAttentionSpec(
        doc_lengths=(RING * tokens,),
        shards=shards,
        position=1,
        active=ring.active_positions(shards),
        comm=None,
        backend=kernel,
    )
    steps = spec.step_blocks(mode.device)
    calls, flops = [], 0.0
    for step in steps.values():
        b = step.blocks
        q, k, v, dout = _tensors(mode, dtype, sum(b.lengths_q), sum(b.lengths_k))
        calls.append(_fwd_bwd(kernel, q, k, v, dout, b, scale))
        flops += attention_flops(b.lengths_q, b.lengths_k, b.causal, mode.heads, mode.head_dim)
    ring_s = median_seconds(lambda: [c() for c in calls], mode.device, mode.repeats)
    local = shards[1].num_tokens
    q, k, v, dout = _tensors(mode, dtype, local, local)
    blocks = VarlenBlocks.build([local], [local], causal=True, device=mode.device)
    direct_s = median_seconds(
        _fwd_bwd(kernel, q, k, v, dout, blocks, scale), mode.device, mode.repeats
    )
    direct_flops = attention_flops([local], [local], True, mode.heads, mode.head_dim)
    ring_tflops, direct_tflops = flops / ring_s / 1e12, direct_flops / direct_s / 1e12
    return {
        "tokens": local,
        "ring_size": RING,
        "step_calls": len(calls),
        "ring_steps_s": ring_s,
        "ring_steps_tflops": ring_tflops,
        "direct_call_s": direct_s,
        "direct_call_tflops": direct_tflops,
        "ratio": ring_tflops / direct_tflops,
    }


def pack_path(mode: Mode, dtype, kernel_name: str, tokens: int) -> dict:
    """Time of `hdp_attention` on a pack against the kernel called directly (fwd + bwd)."""
    kernel = registry.get_kernel(kernel_name)
    lengths = _pack_lengths(tokens)
    scale = mode.head_dim**-0.5
    q, k, v, dout = _tensors(mode, dtype, tokens, tokens)
    blocks = VarlenBlocks.build(lengths, lengths, causal=True, device=mode.device)
    direct_s = median_seconds(
        _fwd_bwd(kernel, q, k, v, dout, blocks, scale), mode.device, mode.repeats
    )
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    # A micro-batch builds its spec once; every layer then attends with it.
    spec = ring.build_ring_spec(lengths, (0,), rank=0, group=None, backend=kernel_name)
    spec.step_blocks(mode.device)

    def through_hdp():
        # autograd.grad returns fresh gradients: nothing accumulates on the leaves across
        # repeats (`.backward` would add into `.grad`, three extra passes from the 2nd on).
        out = ring.hdp_attention(*leaves, spec, softmax_scale=scale)
        torch.autograd.grad(out, leaves, dout)

    pack_s = median_seconds(through_hdp, mode.device, mode.repeats)
    return {
        "tokens": tokens,
        "documents": len(lengths),
        "direct_call_s": direct_s,
        "pack_path_s": pack_s,
        "ratio": direct_s / pack_s,
    }


def _pack_lengths(tokens: int) -> list[int]:
    """Uneven documents filling `tokens` (a pack of a long-tailed mix)."""
    lengths, left, i = [], tokens, 0
    while left > 0:
        n = min(left, (97 + 389 * i) % max(tokens // 4, 8) + 1)
        lengths.append(n)
        left -= n
        i += 1
    return lengths


def run(mode: Mode, say, kernel_name: str) -> dict:
    """Both comparisons at every size of the mode, in its first dtype."""
    dtype = mode.dtypes[0]
    kernel = registry.get_kernel(kernel_name)
    kernel.activate()
    rings, packs = [], []
    for tokens in mode.speed_tokens:
        rings.append(ring_steps(mode, dtype, kernel, tokens))
        packs.append(pack_path(mode, dtype, kernel_name, tokens))
        say(
            f"speed    {kernel_name:16s} {tokens:7d} tokens: ring steps "
            f"{rings[-1]['ring_steps_tflops']:.1f} vs direct {rings[-1]['direct_call_tflops']:.1f} "
            f"TFLOP/s ({rings[-1]['ratio']:.3f}); pack path {packs[-1]['ratio']:.3f} of direct"
        )
    return {
        "kernel": kernel_name,
        "dtype": str(dtype).removeprefix("torch."),
        "heads": mode.heads,
        "kv_heads": mode.groups,
        "head_dim": mode.head_dim,
        "ring_steps": rings,
        "pack_path": packs,
        "goals": {"ring_steps_ratio_at_32k_plus": 0.95, "pack_path_ratio": 0.98},
    }
