"""The varlen seam: kernels against a float64 per-document reference, one call per ring step,
kernel selection by device, and the private GPU APIs' signatures checked at start-up."""

import math
import types

import pytest
import torch

from megatron_hdp.attention.kernels import flash_attn as flash_attn_adapter
from megatron_hdp.attention.kernels import registry, torch_flash
from megatron_hdp.attention.kernels.base import VarlenBlocks
from megatron_hdp.attention.ring import build_ring_spec, hdp_attention


def reference(q, k, v, lengths_q, lengths_k, causal, scale):
    """float64 attention of each document's block, GQA by explicit head repetition."""
    heads, groups = q.shape[1], k.shape[1]
    outs, lses = [], []
    q0 = k0 = 0
    for lq, lk in zip(lengths_q, lengths_k, strict=True):
        qd = q[q0 : q0 + lq].double().transpose(0, 1)
        kd = k[k0 : k0 + lk].double().repeat_interleave(heads // groups, 1).transpose(0, 1)
        vd = v[k0 : k0 + lk].double().repeat_interleave(heads // groups, 1).transpose(0, 1)
        scores = qd @ kd.transpose(-1, -2) * scale
        if causal:
            scores = scores.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), -math.inf)
        lse = torch.logsumexp(scores, -1)
        outs.append((torch.softmax(scores, -1) @ vd).transpose(0, 1))
        lses.append(lse)
        q0, k0 = q0 + lq, k0 + lk
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("name", ["torch", "math"])
@pytest.mark.parametrize(
    "lengths_q, lengths_k, causal",
    [((5, 1, 9), (5, 1, 9), True), ((3, 7), (6, 2), False), ((4,), (11,), False)],
    ids=["diagonal", "lower-upper", "one-document"],
)
def test_cpu_kernels_equal_float64_reference_with_gqa(name, lengths_q, lengths_k, causal):
    gen = torch.Generator().manual_seed(0)
    tq, tk, heads, groups, dim = sum(lengths_q), sum(lengths_k), 4, 2, 8
    q = torch.randn(tq, heads, dim, generator=gen, requires_grad=True)
    k = torch.randn(tk, groups, dim, generator=gen, requires_grad=True)
    v = torch.randn(tk, groups, dim, generator=gen, requires_grad=True)
    scale = 0.3
    blocks = VarlenBlocks.build(lengths_q, lengths_k, causal=causal, device=torch.device("cpu"))
    kernel = registry.get_kernel(name)
    out, lse = kernel.forward(q.detach(), k.detach(), v.detach(), blocks, scale=scale)
    want_out, want_lse = reference(q, k, v, lengths_q, lengths_k, causal, scale)
    torch.testing.assert_close(out.double(), want_out.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse.detach(), rtol=1e-5, atol=1e-5)
    dout = torch.randn(tq, heads, dim, generator=gen)
    want_out.backward(dout.double())
    dq, dk, dv = kernel.backward(
        dout, q.detach(), k.detach(), v.detach(), out, lse, blocks, scale=scale
    )
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


class CountingKernel:
    """Wraps a kernel and records the documents of every call."""

    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, "counting", []

    def unavailable_reason(self, device):
        return None

    def forward(self, q, k, v, blocks, *, scale):
        self.calls.append(("forward", blocks.lengths_q, blocks.causal))
        return self.inner.forward(q, k, v, blocks, scale=scale)

    def backward(self, *args, **kwargs):
        self.calls.append(("backward",))
        return self.inner.backward(*args, **kwargs)


def test_a_local_micro_batch_of_many_documents_is_one_kernel_call(monkeypatch):
    counting = CountingKernel(registry.get_kernel("math"))
    monkeypatch.setitem(registry._KERNELS, counting.name, counting)
    lengths = (7, 1, 12, 3, 5)
    spec = build_ring_spec(lengths, (0,), rank=0, group=None, backend="counting")
    q = torch.randn(sum(lengths), 4, 8, requires_grad=True)
    k = torch.randn(sum(lengths), 2, 8, requires_grad=True)
    v = torch.randn(sum(lengths), 2, 8, requires_grad=True)
    out = hdp_attention(q, k, v, spec)
    out.sum().backward()
    assert counting.calls == [("forward", lengths, True), ("backward",)]
    want, _ = reference(q, k, v, lengths, lengths, True, 1 / math.sqrt(8))
    torch.testing.assert_close(out.double(), want.detach(), rtol=1e-5, atol=1e-5)


def test_auto_picks_the_cpu_kernels_on_cpu_and_named_gpu_kernels_are_refused_here():
    cpu = torch.device("cpu")
    assert registry.resolve_kernel("auto", cpu) == "torch"
    assert registry.resolve_kernel("math", cpu) == "math"
    with pytest.raises(ValueError, match="'torch_flash' cannot run here: needs a CUDA device"):
        registry.resolve_kernel("torch_flash", cpu)
    with pytest.raises(ValueError, match="unknown attention backend 'cudnn'"):
        registry.resolve_kernel("cudnn", cpu)


def test_torch_flash_keywords_match_the_registered_aten_schemas():
    """The aten ops are registered in CPU builds too: the adapter's keywords are checked here
    against this torch's schemas, and a drifted schema is reported by name."""
    assert torch_flash.signature_problem() is None
    schema = torch.ops.aten._flash_attention_backward.default._schema
    assert [a.name for a in schema.arguments][:6] == [
        "grad_out",
        "query",
        "key",
        "value",
        "out",
        "logsumexp",
    ]


def test_flash_attn_signature_check_names_what_is_missing():
    def forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
    ):
        pass

    def old_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k):
        pass

    fake = types.SimpleNamespace(
        _flash_attn_varlen_forward=forward, _flash_attn_varlen_backward=old_backward
    )
    problem = flash_attn_adapter.signature_problem(fake)
    assert "_flash_attn_varlen_backward lacks arguments" in problem and "max_seqlen_q" in problem
    fake.__dict__.pop("_flash_attn_varlen_backward")
    assert "has no _flash_attn_varlen_backward" in flash_attn_adapter.signature_problem(fake)


def test_blocks_refuse_empty_and_unequal_causal_documents():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="empty blocks"):
        VarlenBlocks.build((3, 0), (3, 2), causal=False, device=cpu)
    with pytest.raises(ValueError, match="causal blocks need equal lengths"):
        VarlenBlocks.build((3,), (4,), causal=True, device=cpu)
