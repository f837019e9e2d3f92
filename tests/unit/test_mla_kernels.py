"""Unequal q/k and v head dims (multi-latent attention): which kernel runs them, and how.

The choice is made at start-up (`registry.resolve_kernel(..., head_dim_v=)`): natively where
a kernel takes them (the CPU math kernel; FA4 on Blackwell for (192, 128)), else padded with
zeros (`head_dims.PaddedHeadDims`). The padded kernels are checked against the math kernel
on unequal dims, and the flash-attn adapter through the fakes of its releases, which refuse
a v head size unlike q's as the real `mha_varlen_fwd` does.
"""

from __future__ import annotations

import pytest
import torch

from megatron_hdp.attention.kernels import flash_attn as flash_attn_adapter
from megatron_hdp.attention.kernels import flash_attn_4, registry
from megatron_hdp.attention.kernels.base import VarlenBlocks
from megatron_hdp.attention.kernels.device import DeviceFacts
from tests.fakes.flash_attn_releases import release
from tests.unit.test_kernel_choice import _flash_attn_4_module

H100 = DeviceFacts("cuda", "NVIDIA H100 80GB HBM3", (9, 0), flash_built=True)
B200 = DeviceFacts("cuda", "NVIDIA B200", (10, 0), flash_built=True)
CPU = DeviceFacts.of("cpu")
BF16 = torch.bfloat16


def resolve(name, facts, dtype=BF16, head_dim=192, head_dim_v=128):
    return registry.resolve_kernel(
        name, facts, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v
    )


@pytest.fixture(autouse=True)
def no_flash_attn(monkeypatch):
    monkeypatch.setattr(flash_attn_adapter, "_interface", lambda: None)


def _tensors(qk_dim, v_dim, lengths_q, lengths_k, dtype=torch.float64, seed=4):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), 4, qk_dim, generator=gen, dtype=dtype)
    k = torch.randn(sum(lengths_k), 2, qk_dim, generator=gen, dtype=dtype)
    v = torch.randn(sum(lengths_k), 2, v_dim, generator=gen, dtype=dtype)
    dout = torch.randn(sum(lengths_q), 4, v_dim, generator=gen, dtype=dtype)
    return q, k, v, dout


def _against_math(name, qk_dim, v_dim, dtype=torch.float64, tol=1e-12):
    for lengths_q, lengths_k, causal in (((5, 1, 7), (5, 1, 7), True), ((3, 2), (6, 1), False)):
        q, k, v, dout = _tensors(qk_dim, v_dim, lengths_q, lengths_k, dtype)
        blocks = VarlenBlocks.build(lengths_q, lengths_k, causal=causal, device=q.device)
        kernel, math = registry.get_kernel(name), registry.get_kernel("math")
        out, lse = kernel.forward(q, k, v, blocks, scale=0.21)
        want_out, want_lse = math.forward(q, k, v, blocks, scale=0.21)
        assert out.shape == (q.shape[0], 4, v_dim)
        torch.testing.assert_close(out, want_out, rtol=tol, atol=tol)
        torch.testing.assert_close(lse, want_lse.to(lse.dtype), rtol=tol, atol=tol)
        got = kernel.backward(dout, q, k, v, out, lse, blocks, scale=0.21)
        want = math.backward(dout, q, k, v, want_out, want_lse, blocks, scale=0.21)
        for a, b, x in zip(got, want, (q, k, v), strict=True):
            assert a.shape == x.shape
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("qk_dim, v_dim", [(12, 8), (6, 10)])
def test_aten_cpu_kernel_runs_unequal_dims_padded_as_the_math_kernel(qk_dim, v_dim):
    _against_math("torch+pad_v", qk_dim, v_dim)


def test_cpu_choice_pads_the_aten_kernel_and_keeps_math_native():
    assert resolve("auto", CPU, torch.float64, 12, 8) == "torch+pad_v"
    assert resolve("math", CPU, torch.float64, 12, 8) == "math"
    assert resolve("torch", CPU, torch.float64, 12, 8) == "torch+pad_v"
    # Equal head dims: the kernels as they were.
    assert resolve("auto", CPU, torch.float64, 12, 12) == "torch"
    assert resolve("auto", CPU, torch.float64, 12, None) == "torch"


def test_gpu_choice_pads_flash_2_kernels_and_names_the_padded_dim():
    assert resolve("auto", H100) == "torch_flash+pad_v"  # DeepSeek-V3's 192 / 128
    with pytest.raises(ValueError, match=r"at most 256, got 320 \(q/k head dim 320 and v .*320"):
        resolve("auto", H100, head_dim=320)


def test_flash_attn_releases_run_unequal_dims_padded(monkeypatch):
    fake = release("2.8.3")
    monkeypatch.setattr(flash_attn_adapter, "_interface", lambda: fake)
    assert resolve("flash_attn", H100) == "flash_attn+pad_v"
    # The release itself refuses a v head size unlike q's, as mha_varlen_fwd does ...
    q, k, v, _ = _tensors(12, 8, (4,), (4,), torch.float32)
    blocks = VarlenBlocks.build((4,), (4,), causal=True, device=q.device)
    with pytest.raises(RuntimeError, match="v must have shape"):
        registry.get_kernel("flash_attn").forward(q, k, v, blocks, scale=0.3)
    # ... and padded it computes what the math kernel computes on the unpadded tensors.
    refused = len(fake.calls)
    _against_math("flash_attn+pad_v", 12, 8, torch.float32, tol=1e-5)
    assert {args["v"].shape[-1] for _, args in fake.calls[refused:]} == {12}


def test_fa4_takes_192_128_natively_on_blackwell_and_padded_on_hopper(monkeypatch):
    monkeypatch.setattr(flash_attn_4, "_interface", _flash_attn_4_module)
    assert resolve("flash_attn_4", B200) == "flash_attn_4"
    assert resolve("flash_attn_4", H100) == "flash_attn_4+pad_v"
    # Natively (its fake computes what the release returns): v keeps its own head dim.
    _against_math("flash_attn_4", 12, 8, torch.float32, tol=1e-5)
    _against_math("flash_attn_4+pad_v", 12, 8, torch.float32, tol=1e-5)
    # torch's FA4 switch has no unequal-dim path here; padded to (192, 192), which Blackwell
    # refuses: the refusal names the padding.
    with pytest.raises(ValueError, match=r"got \(192, 192\).*padded to 192"):
        resolve("torch_flash_fa4", B200)


def test_padded_kernel_names_round_trip_through_the_registry():
    kernel = registry.get_kernel("torch_flash+pad_v")
    assert kernel.name == "torch_flash+pad_v" and kernel.inner is registry.get_kernel("torch_flash")
    assert registry.step_kernel("torch+pad_v", "cpu") == "torch+pad_v"
    with pytest.raises(ValueError, match="cannot run on cuda"):
        registry.step_kernel("torch+pad_v", "cuda")
    with pytest.raises(ValueError, match="unknown attention backend"):
        registry.get_kernel("nope+pad_v")
