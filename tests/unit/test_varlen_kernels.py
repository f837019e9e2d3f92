"""The varlen seam: kernels against a float64 per-document reference, one call per ring step,
and one kernel call per ring step (kernel choice and the GPU adapters: test_kernel_choice.py)."""

import math

import pytest
import torch

from megatron_hdp.attention.kernels import registry
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

    def unavailable_reason(self, facts, *, dtype, head_dim):
        return None

    def activate(self):
        pass

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


def test_blocks_refuse_empty_and_unequal_causal_documents():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="empty blocks"):
        VarlenBlocks.build((3, 0), (3, 2), causal=False, device=cpu)
    with pytest.raises(ValueError, match="causal blocks need equal lengths"):
        VarlenBlocks.build((3,), (4,), causal=True, device=cpu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pack_is_one_direct_kernel_call_equal_to_the_ring_bookkeeping(dtype):
    """The pack path skips the ring's gathers, fp32 buffers and merges, and changes nothing:
    outputs and gradients equal the ring function run on a ring of one, in the model dtype."""
    from megatron_hdp.attention.ring import _HDPAttention

    lengths = (7, 1, 12, 3)
    spec = build_ring_spec(lengths, (0,), rank=0, group=None, backend="torch")
    gen = torch.Generator().manual_seed(4)
    leaves = [
        torch.randn(sum(lengths), heads, 8, generator=gen).to(dtype).requires_grad_()
        for heads in (4, 2, 2)
    ]
    twins = [t.detach().clone().requires_grad_() for t in leaves]
    dout = torch.randn(sum(lengths), 4, 8, generator=gen).to(dtype)
    out = hdp_attention(*leaves, spec)
    out.backward(dout)
    want = _HDPAttention.apply(*twins, spec, 1 / math.sqrt(8))
    want.backward(dout)
    assert out.dtype == dtype and all(t.grad.dtype == dtype for t in leaves)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for a, b in zip(leaves, twins, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
