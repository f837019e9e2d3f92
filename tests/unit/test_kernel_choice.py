"""Kernel choice before start-up, and the GPU adapters against the real libraries' signatures.

GPUs are described with `DeviceFacts` (what a CUDA device would report), so every rule runs
here on CPU. The flash-attn 2.6-2.8 adapter is tested against each release's fake in
test_flash_attn_adapter.py; the FA4 fake here copies `flash_attn.cute.interface`'s entry points.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from megatron_hdp.attention.kernels import flash_attn as flash_attn_adapter
from megatron_hdp.attention.kernels import registry, torch_flash
from megatron_hdp.attention.kernels.base import VarlenBlocks
from megatron_hdp.attention.kernels.device import DeviceFacts

H100 = DeviceFacts("cuda", "NVIDIA H100 80GB HBM3", (9, 0), flash_built=True)
A100 = DeviceFacts("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), flash_built=True)
T4 = DeviceFacts("cuda", "Tesla T4", (7, 5), flash_built=True)
B200 = DeviceFacts("cuda", "NVIDIA B200", (10, 0), flash_built=True)
CPU = DeviceFacts.of("cpu")
BF16, FP32 = torch.bfloat16, torch.float32


def resolve(name, facts, dtype=BF16, head_dim=128):
    return registry.resolve_kernel(name, facts, dtype=dtype, head_dim=head_dim)


@pytest.fixture(autouse=True)
def no_flash_attn(monkeypatch):
    """flash-attn is not installed here; tests that want it install a fake."""
    monkeypatch.setattr(flash_attn_adapter, "_interface", lambda: None)


def test_cpu_picks_the_aten_cpu_kernels_and_refuses_gpu_kernels_by_name():
    assert resolve("auto", CPU, FP32, 16) == "torch"
    assert resolve("math", CPU, FP32, 16) == "math"
    with pytest.raises(ValueError, match="'torch_flash' cannot run here: needs a CUDA device"):
        resolve("torch_flash", CPU, FP32, 16)
    with pytest.raises(ValueError, match="unknown attention backend 'cudnn'"):
        resolve("cudnn", CPU)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_auto_on_an_h100_picks_torch_flash_in_16_bit(dtype):
    assert resolve("auto", H100, dtype) == "torch_flash"
    assert resolve("auto", A100, dtype, head_dim=64) == "torch_flash"


def test_fp32_on_cuda_is_refused_before_start_up_with_the_precision_flag():
    with pytest.raises(ValueError) as err:
        resolve("auto", H100, FP32)
    message = str(err.value)
    assert "torch_flash needs float16 or bfloat16 tensors, this job computes in torch.float32" in (
        message
    )
    assert "--bf16" in message and "flash_attn" in message
    assert "CPU kernels are not used on CUDA" in message
    with pytest.raises(ValueError, match="--bf16"):
        resolve("torch_flash", H100, FP32)


@pytest.mark.parametrize(
    "facts, head_dim, expected",
    [
        (T4, 128, "sm80 or newer \\(Ampere\\); cuda \\(Tesla T4, sm75\\) is older"),
        (H100, 100, "multiple of 8 and at most 256, got 100"),
        (H100, 512, "multiple of 8 and at most 256, got 512"),
        (
            DeviceFacts("cuda", "NVIDIA H100", (9, 0), flash_built=False),
            128,
            "was built without flash attention",
        ),
    ],
    ids=["sm75", "head-dim-100", "head-dim-512", "torch-without-flash"],
)
def test_gpu_limits_are_named_and_auto_never_falls_back_to_math(facts, head_dim, expected):
    with pytest.raises(ValueError, match=expected) as err:
        resolve("auto", facts, BF16, head_dim)
    assert "flash_attn " in str(err.value) and "CPU kernels are not used on CUDA" in str(err.value)


@pytest.mark.parametrize("name", ["math", "torch"])
def test_the_cpu_kernels_are_refused_on_cuda(name):
    with pytest.raises(ValueError, match="is a CPU kernel: on cuda it would compute dense"):
        resolve(name, H100)


# --- aten schemas ---------------------------------------------------------------------------

# torch 2.1-2.4's spelling of the backward's RNG arguments, before they became rng_state/unused.
OLD_BACKWARD = (
    "aten::_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
    "Tensor out, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, "
    "SymInt max_k, float dropout_p, bool is_causal, Tensor philox_seed, Tensor philox_offset, "
    "*, float? scale=None) -> (Tensor, Tensor, Tensor)"
)
OLD_FORWARD = (
    "aten::_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor cum_seq_q, "
    "Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, "
    "bool return_debug_mask, *, float? scale=None) -> (Tensor output, Tensor softmax_logsumexp, "
    "Tensor philox_seed, Tensor philox_offset, Tensor debug_attn_mask)"
)


def test_this_torchs_aten_flash_schemas_match_the_adapter():
    assert torch_flash.schema_problem() is None


def test_an_older_spelling_of_the_same_positions_is_accepted():
    schemas = {
        "_flash_attention_forward": torch._C.parse_schema(OLD_FORWARD),
        "_flash_attention_backward": torch._C.parse_schema(OLD_BACKWARD),
    }
    assert torch_flash.schema_problem(schemas) is None


def test_a_drifted_schema_is_refused_by_argument():
    moved = OLD_FORWARD.replace(
        "float dropout_p, bool is_causal", "bool is_causal, float dropout_p"
    )
    no_scale = OLD_BACKWARD.replace(", *, float? scale=None", "")
    schemas = {
        "_flash_attention_forward": torch._C.parse_schema(moved),
        "_flash_attention_backward": torch._C.parse_schema(OLD_BACKWARD),
    }
    assert "argument 7 (is_causal: bool) is not dropout_p: float" in torch_flash.schema_problem(
        schemas
    )
    schemas["_flash_attention_forward"] = torch._C.parse_schema(OLD_FORWARD)
    schemas["_flash_attention_backward"] = torch._C.parse_schema(no_scale)
    assert "has no keyword argument 'scale'" in torch_flash.schema_problem(schemas)
    assert "has no aten::_flash_attention_forward" in torch_flash.schema_problem({})


# --- FA3 / FA4 behind the aten ops -----------------------------------------------------------


def test_fa3_needs_hopper_and_its_module():
    with pytest.raises(ValueError, match="needs a GPU of compute capability sm9x"):
        resolve("torch_flash_fa3", A100)
    reason = registry.get_kernel("torch_flash_fa3").unavailable_reason(
        H100, dtype=BF16, head_dim=128
    )
    has_switch = hasattr(torch.nn.attention, "activate_flash_attention_impl")
    assert (
        ("flash_attn_interface does not import" in reason)
        if has_switch
        else ("cannot switch flash implementations" in reason)
    )


def test_fa4_allows_blackwell_and_names_its_package():
    reason = registry.get_kernel("torch_flash_fa4").unavailable_reason(
        B200, dtype=BF16, head_dim=128
    )
    assert "flash-attn-4" in reason or "cannot switch" in reason
    with pytest.raises(ValueError, match="sm9x or sm10x"):
        resolve("torch_flash_fa4", A100)


@pytest.mark.skipif(
    not hasattr(torch.nn.attention, "activate_flash_attention_impl"),
    reason="this torch cannot switch flash implementations",
)
def test_choosing_fa3_activates_it_once_process_wide(monkeypatch):
    activated = []
    attention = torch.nn.attention
    monkeypatch.setitem(sys.modules, "flash_attn_interface", types.ModuleType("fa3"))
    monkeypatch.setattr(attention, "list_flash_attention_impls", lambda: ["FA3", "FA4"])
    monkeypatch.setattr(attention, "current_flash_attention_impl", lambda: None)
    monkeypatch.setattr(attention, "activate_flash_attention_impl", activated.append)
    assert resolve("torch_flash_fa3", H100) == "torch_flash_fa3"
    assert activated == ["FA3"]
    assert resolve("torch_flash", H100) == "torch_flash" and activated == ["FA3"]


# --- the math kernel behind the FA4 fake (flash-attn 2.6-2.8: test_flash_attn_adapter.py) -----


def _math_varlen(q, k, v, cu_q, cu_k, causal, scale):
    blocks = VarlenBlocks.build(
        torch.diff(cu_q).tolist(), torch.diff(cu_k).tolist(), causal=causal, device=q.device
    )
    return blocks, registry.get_kernel("math")


def _fake_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal):
    blocks, math_kernel = _math_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    out, lse = math_kernel.forward(q, k, v, blocks, scale=softmax_scale)
    return out, lse.float(), torch.empty(0), torch.zeros(2, dtype=torch.int64)


def _fake_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, scale, causal):
    blocks, math_kernel = _math_varlen(q, k, v, cu_q, cu_k, causal, scale)
    got = math_kernel.backward(dout, q, k, v, out, lse, blocks, scale=scale)
    for target, value in zip((dq, dk, dv), got, strict=True):
        target.copy_(value)
    return torch.zeros(q.shape[1], q.shape[0])


# --- flash-attn-4 ------------------------------------------------------------------------------


def _flash_attn_4_module():
    """`flash_attn.cute.interface` of flash-attention at 0251105 (2026-08-15): the two entry
    points with their exact parameter lists (annotations left out), computing with the
    math kernel on CPU."""

    def _flash_attn_fwd(
        q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
        seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None,
        page_table=None, softmax_scale=None, causal=False, softcap=None,
        window_size_left=None, window_size_right=None, learnable_sink=None, tile_mn=None,
        mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384, num_splits=1,
        pack_gqa=None, _arch=None, score_mod=None, mask_mod=None, block_sparse_tensors=None,
        return_lse=False, out=None, lse=None, aux_tensors=None, aux_scalars=None,
        q_descale=None, k_descale=None, v_descale=None, gather_kv_indices=None,
        scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False,
    ):  # fmt: skip
        assert return_lse
        out, lse, *_ = _fake_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        return out, lse, None, None

    def _flash_attn_bwd(
        q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
        window_size_left=None, window_size_right=None, m_block_size=64, n_block_size=128,
        num_threads=256, pack_gqa=False, num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False,
        dKV_swapAB=False, dQ_swapAB=False, AtomLayoutMSdP=2, AtomLayoutNdKV=2,
        AtomLayoutMdQ=2, V_in_regs=False, cu_seqlens_q=None, cu_seqlens_k=None,
        seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
        deterministic=False, dq=None, dk=None, dv=None, score_mod=None, score_mod_bwd=None,
        mask_mod=None, aux_tensors=None, aux_scalars=None, block_sparse_tensors=None,
        dlse=None, learnable_sink=None,
    ):  # fmt: skip
        module.calls.append(("_flash_attn_bwd", {"deterministic": deterministic}))
        grads = [torch.empty_like(t) for t in (q, k, v)]
        _fake_backward(dout, q, k, v, out, lse, *grads, cu_seqlens_q, cu_seqlens_k,
                       softmax_scale, causal)  # fmt: skip
        return tuple(grads)

    module = types.ModuleType("flash_attn.cute.interface")
    module._flash_attn_fwd, module._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
    module.calls = []
    return module


def test_flash_attn_4_is_refused_without_its_package_and_on_ampere():
    with pytest.raises(ValueError, match="flash_attn.cute.interface does not import"):
        resolve("flash_attn_4", H100)
    with pytest.raises(ValueError, match="sm9x or sm10x"):
        resolve("flash_attn_4", A100)


def test_flash_attn_4_adapter_takes_the_real_signature_and_equals_the_math_kernel(monkeypatch):
    from megatron_hdp.attention.kernels import flash_attn_4

    fake = _flash_attn_4_module()
    assert flash_attn_4.signature_problem(fake) is None
    monkeypatch.setattr(flash_attn_4, "_interface", lambda: fake)
    assert resolve("flash_attn_4", B200) == "flash_attn_4"
    gen = torch.Generator().manual_seed(5)
    lengths = (4, 9, 2)
    q = torch.randn(sum(lengths), 4, 8, generator=gen)
    k = torch.randn(sum(lengths), 2, 8, generator=gen)
    v = torch.randn(sum(lengths), 2, 8, generator=gen)
    dout = torch.randn_like(q)
    blocks = VarlenBlocks.build(lengths, lengths, causal=True, device=torch.device("cpu"))
    kernel, reference = registry.get_kernel("flash_attn_4"), registry.get_kernel("math")
    out, lse = kernel.forward(q, k, v, blocks, scale=0.3)
    want_out, want_lse = reference.forward(q, k, v, blocks, scale=0.3)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    got = kernel.backward(dout, q, k, v, out, lse, blocks, scale=0.3)
    want = reference.backward(dout, q, k, v, want_out, want_lse, blocks, scale=0.3)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    renamed = types.SimpleNamespace(
        _flash_attn_fwd=fake._flash_attn_fwd, _flash_attn_bwd=lambda q, k, v, dout, out, lse: 0
    )
    assert "starts with ('q', 'k', 'v', 'dout', 'out', 'lse')" in flash_attn_4.signature_problem(
        renamed
    )


@pytest.mark.parametrize("name", ["flash_attn_4", "torch_flash_fa4"])
@pytest.mark.parametrize("head_dim", [160, 192, 200])
def test_fa4_refuses_blackwell_head_dims_it_asserts_on(name, head_dim):
    """flash-attention cute/interface.py `_validate_head_dims`: sm100 takes 8-128, or the
    (q, v) pairs (192, 128) and (256, 256); the ring's v has q's head dim."""
    with pytest.raises(ValueError, match=rf"Blackwell\) takes head dims 8-128.*got \({head_dim}, "):
        resolve(name, B200, head_dim=head_dim)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fa4_takes_blackwells_head_dims_and_any_of_hoppers(head_dim, monkeypatch):
    from megatron_hdp.attention.kernels import device, flash_attn_4

    monkeypatch.setattr(flash_attn_4, "_interface", _flash_attn_4_module)
    assert resolve("flash_attn_4", B200, head_dim=head_dim) == "flash_attn_4"
    assert resolve("flash_attn_4", H100, head_dim=160) == "flash_attn_4"
    assert device.fa4_limits(B200, dtype=BF16, head_dim=head_dim) is None
    assert device.fa4_limits(B200, dtype=BF16, head_dim=192, head_dim_v=128) is None
    reason = registry.get_kernel("torch_flash_fa4").unavailable_reason(
        B200, dtype=BF16, head_dim=head_dim
    )
    assert "head dims" not in reason  # refused only for the package or torch's switch here


@pytest.fixture
def deterministic_mode():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_flash_attn_4_backward_follows_torchs_deterministic_mode(
    deterministic, monkeypatch, request
):
    from megatron_hdp.attention.kernels import flash_attn_4

    if deterministic:
        request.getfixturevalue("deterministic_mode")
    fake = _flash_attn_4_module()
    monkeypatch.setattr(flash_attn_4, "_interface", lambda: fake)
    q, k, v = (torch.randn(6, h, 8) for h in (4, 2, 2))
    blocks = VarlenBlocks.build((2, 4), (2, 4), causal=True, device=torch.device("cpu"))
    kernel = registry.get_kernel("flash_attn_4")
    out, lse = kernel.forward(q, k, v, blocks, scale=0.3)
    kernel.backward(torch.randn_like(q), q, k, v, out, lse, blocks, scale=0.3)
    assert fake.calls == [("_flash_attn_bwd", {"deterministic": deterministic})]
