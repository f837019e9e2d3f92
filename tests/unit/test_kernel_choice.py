"""Kernel choice before start-up, and the GPU adapters against the real libraries' signatures.

GPUs are described with `DeviceFacts` (what a CUDA device would report), so every rule runs
here on CPU. The flash-attn fakes copy the exact signatures of flash-attn v2.6.3 and v2.8.3
(`flash_attn/flash_attn_interface.py` at those tags; 2.7.x has 2.8.3's): 2.8.3's are
`torch.library.custom_op`s as upstream defines them with torch >= 2.4.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Optional

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


# --- flash-attn 2.6 and 2.8 -----------------------------------------------------------------


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


def _flash_attn_263():
    """flash-attn v2.6.3: plain functions, the window as one tuple."""

    def _flash_attn_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
        return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None,
    ):  # fmt: skip
        assert window_size == (-1, -1) and dropout_p == 0.0
        return _fake_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)

    def _flash_attn_varlen_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, rng_state=None,
    ):  # fmt: skip
        assert window_size == (-1, -1) and softcap == 0.0 and alibi_slopes is None
        _fake_backward(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
            softmax_scale, causal,
        )  # fmt: skip
        return dq, dk, dv, torch.zeros(q.shape[1], q.shape[0])

    return types.SimpleNamespace(
        _flash_attn_varlen_forward=_flash_attn_varlen_forward,
        _flash_attn_varlen_backward=_flash_attn_varlen_backward,
    )


_FA283 = None


def _flash_attn_283():
    """flash-attn v2.8.3: `torch.library.custom_op`s with upstream's exact signatures.

    Upstream registers them for `device_types="cuda"`; these fakes run on CPU instead, and
    live in their own namespace so that they never shadow a real installation.
    """
    global _FA283
    if _FA283 is not None:
        return _FA283

    @torch.library.custom_op("hdp_fake_fa283::_flash_attn_varlen_forward", mutates_args=())
    def _flash_attn_varlen_forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int = -1,
        window_size_right: int = -1,
        softcap: float = 0.0,
        alibi_slopes: Optional[torch.Tensor] = None,  # noqa: UP045 (upstream's spelling)
        return_softmax: bool = False,
        block_table: Optional[torch.Tensor] = None,  # noqa: UP045
        leftpad_k: Optional[torch.Tensor] = None,  # noqa: UP045
        seqused_k: Optional[torch.Tensor] = None,  # noqa: UP045
        zero_tensors: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _fake_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)

    @torch.library.custom_op(
        "hdp_fake_fa283::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv")
    )
    def _flash_attn_varlen_backward(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        softmax_lse: torch.Tensor,
        dq: Optional[torch.Tensor],  # noqa: UP045
        dk: Optional[torch.Tensor],  # noqa: UP045
        dv: Optional[torch.Tensor],  # noqa: UP045
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: Optional[torch.Tensor],  # noqa: UP045
        deterministic: bool,
        rng_state: Optional[torch.Tensor] = None,  # noqa: UP045
        zero_tensors: bool = False,
    ) -> torch.Tensor:
        assert (window_size_left, window_size_right) == (-1, -1)
        return _fake_backward(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
            softmax_scale, causal,
        )  # fmt: skip

    _FA283 = types.SimpleNamespace(
        _flash_attn_varlen_forward=_flash_attn_varlen_forward,
        _flash_attn_varlen_backward=_flash_attn_varlen_backward,
    )
    return _FA283


def test_custom_ops_hide_their_signature_from_inspect():
    """Why the adapter reads the op schema: this is what refused 2.7/2.8 before."""
    fake = _flash_attn_283()
    assert str(inspect.signature(fake._flash_attn_varlen_forward)) == "(*args, **kwargs)"
    assert "window_size_left" in flash_attn_adapter.parameter_names(
        fake._flash_attn_varlen_backward
    )


@pytest.mark.parametrize("version", ["2.6.3", "2.8.3"])
def test_flash_attn_adapter_takes_both_releases_and_equals_the_math_kernel(version, monkeypatch):
    fake = _flash_attn_263() if version == "2.6.3" else _flash_attn_283()
    assert flash_attn_adapter.signature_problem(fake) is None
    monkeypatch.setattr(flash_attn_adapter, "_interface", lambda: fake)
    assert resolve("auto", DeviceFacts("cuda", "x", (8, 0), flash_built=False)) == "flash_attn"

    gen = torch.Generator().manual_seed(3)
    lengths_q, lengths_k = (3, 6, 1), (5, 2, 4)
    q = torch.randn(sum(lengths_q), 4, 8, generator=gen)
    k = torch.randn(sum(lengths_k), 2, 8, generator=gen)
    v = torch.randn(sum(lengths_k), 2, 8, generator=gen)
    dout = torch.randn_like(q)
    blocks = VarlenBlocks.build(lengths_q, lengths_k, causal=False, device=torch.device("cpu"))
    kernel, reference = registry.get_kernel("flash_attn"), registry.get_kernel("math")
    out, lse = kernel.forward(q, k, v, blocks, scale=0.25)
    want_out, want_lse = reference.forward(q, k, v, blocks, scale=0.25)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    got = kernel.backward(dout, q, k, v, out, lse, blocks, scale=0.25)
    want = reference.backward(dout, q, k, v, want_out, want_lse, blocks, scale=0.25)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_flash_attn_signature_check_names_what_is_missing():
    def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal):  # fmt: skip
        pass

    def backward_without_window(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, dropout_p, softmax_scale, causal, softcap, alibi_slopes, deterministic,
    ):  # fmt: skip
        pass

    def old_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k):
        pass

    fake = types.SimpleNamespace(
        _flash_attn_varlen_forward=forward, _flash_attn_varlen_backward=old_backward
    )
    problem = flash_attn_adapter.signature_problem(fake)
    assert "_flash_attn_varlen_backward lacks arguments" in problem and "max_seqlen_q" in problem
    fake._flash_attn_varlen_backward = backward_without_window
    assert "window_size_left/window_size_right (2.7+) or window_size (2.6)" in (
        flash_attn_adapter.signature_problem(fake)
    )
    fake.__dict__.pop("_flash_attn_varlen_backward")
    assert "has no _flash_attn_varlen_backward" in flash_attn_adapter.signature_problem(fake)


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
        grads = [torch.empty_like(t) for t in (q, k, v)]
        _fake_backward(dout, q, k, v, out, lse, *grads, cu_seqlens_q, cu_seqlens_k,
                       softmax_scale, causal)  # fmt: skip
        return tuple(grads)

    module = types.ModuleType("flash_attn.cute.interface")
    module._flash_attn_fwd, module._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
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
