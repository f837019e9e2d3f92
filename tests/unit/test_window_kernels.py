"""Banded (sliding-window) steps on the flash adapters, against the CPU banded kernel.

The flash adapters split a banded step into calls with flash's own window arguments
(`kernels.windowed`); the fakes of every flash-attn release (and of torch's aten flash ops)
compute under the C++ code's window mask (`tests/fakes/flash_attn_releases.flash_window`),
so the adapters' out, lse and gradients must equal `kernels.band`'s dense banded math.
"""

from __future__ import annotations

import pytest
import torch

from megatron_hdp.attention.kernels import flash_attn, flash_attn_4, registry, torch_flash
from megatron_hdp.attention.kernels.cpu import MATH
from megatron_hdp.attention.kernels.device import DeviceFacts
from megatron_hdp.attention.kernels.windowed import split_band
from megatron_hdp.attention.window import on_device, window_plan
from megatron_hdp.sharding import shard
from tests.distributed.test_window_attention import megatron_window_mask
from tests.fakes.flash_attn_releases import RELEASES, flash_window, release

H100 = DeviceFacts("cuda", "NVIDIA H100 80GB HBM3", (9, 0))

CASES = [  # (lengths, ring size, window)
    ([33, 1, 9, 16, 2], 1, 3),
    ([33, 1, 9, 16, 2], 2, 4),
    ([33, 1, 9, 16, 2], 3, 0),
    ([33, 9, 16], 3, 6),
    ([40, 7], 4, 2),
    ([40, 7], 4, 11),
]


def banded_steps():
    """Every banded step of every member for `CASES`."""
    for lengths, k, window in CASES:
        shards = shard(lengths, k)
        active = tuple(p for p in range(k) if shards[p].num_tokens)
        for position in active:
            plan = on_device(
                window_plan(shards, position, active, window, lengths), torch.device("cpu")
            )
            for step in plan.steps.values():
                if step.blocks.band is not None:
                    yield step.blocks


def _tensors(blocks, seed):
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(blocks.lengths_q), sum(blocks.lengths_k)
    q = torch.randn(tq, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(tk, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(tk, 2, 8, generator=gen, dtype=torch.float64)
    return q, k, v, torch.randn_like(q)


def _check(kernel, blocks, seed):
    q, k, v, dout = _tensors(blocks, seed)
    want_out, want_lse = MATH.forward(q, k, v, blocks, scale=0.3)
    got_out, got_lse = kernel.forward(q, k, v, blocks, scale=0.3)
    torch.testing.assert_close(got_out, want_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_lse.double(), want_lse.double(), rtol=1e-6, atol=1e-6)
    want = MATH.backward(dout, q, k, v, want_out, want_lse, blocks, scale=0.3)
    got = kernel.backward(dout, q, k, v, want_out, want_lse, blocks, scale=0.3)
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)


def test_the_fake_window_is_megatrons_window():
    """flash's window (w, 0) on equal query and key lengths is Megatron-Core's mask."""
    for s, w in ((9, 0), (9, 3), (9, 8), (9, 20)):
        mask = flash_window(s, s, window=(w, 0), causal=False, max_seqlen_k=s)
        want = megatron_window_mask(s, w)
        assert torch.equal(mask if mask is not None else torch.ones(s, s, dtype=torch.bool), want)


@pytest.mark.parametrize("version", RELEASES)
def test_flash_attn_banded_steps_equal_the_cpu_band(monkeypatch, version):
    fake = release(version)
    monkeypatch.setattr(flash_attn, "_interface", lambda: fake)
    kernel = flash_attn.FlashAttnKernel()
    steps = list(banded_steps())
    assert len(steps) > 10
    windows = set()
    for i, blocks in enumerate(steps):
        _check(kernel, blocks, seed=i)
        windows |= {(c.left, c.right) for c in split_band(blocks)}
    # Some calls bind on both sides, some on one: the adapter's window arithmetic is exercised.
    assert any(left >= 0 and right >= 0 for left, right in windows)
    assert any(left < 0 for left, _ in windows) and any(right < 0 for _, right in windows)
    names = [c[0] for c in fake.calls]
    assert "_flash_attn_varlen_forward" in names and "_flash_attn_varlen_backward" in names


def _aten_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug, *, scale=None,
                  window_size_left=None, window_size_right=None):  # fmt: skip
    """aten::_flash_attention_forward's signature (torch 2.13), computing as the fakes do."""
    from tests.fakes.flash_attn_releases import _attend

    window = (
        -1 if window_size_left is None else window_size_left,
        -1 if window_size_right is None else window_size_right,
    )
    out, lse = _attend(q, k, v, cu_q, cu_k, scale, is_causal, window, max_k)
    return out, lse, torch.zeros(2), torch.empty(0), torch.empty(0)


def _aten_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
                   rng_state, unused, *, scale=None, window_size_left=None,
                   window_size_right=None):  # fmt: skip
    from tests.fakes.flash_attn_releases import _gradients

    args = dict(
        q=q, k=k, v=v, dout=dout, out=out, softmax_lse=lse, cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k, max_seqlen_k=max_k, causal=is_causal, softmax_scale=scale,
        softcap=0.0, alibi_slopes=None, dropout_p=0.0, dq=torch.empty_like(q),
        dk=torch.empty_like(k), dv=torch.empty_like(v),
    )  # fmt: skip
    _gradients(args, (window_size_left, window_size_right))
    return args["dq"], args["dk"], args["dv"]


def test_torch_flash_banded_steps_equal_the_cpu_band(monkeypatch):
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", _aten_forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", _aten_backward)
    kernel = torch_flash.TorchFlashKernel()
    for i, blocks in enumerate(banded_steps()):
        _check(kernel, blocks, seed=i)


def test_window_capability_is_checked_at_start_up(monkeypatch):
    monkeypatch.setattr(flash_attn, "signature_problem", lambda: None)
    monkeypatch.setattr(flash_attn_4, "signature_problem", lambda: None)
    for name in ("torch", "math", "flash_attn"):
        assert registry.window_reason(registry.get_kernel(name)) is None
    for name in ("torch_flash_fa3", "torch_flash_fa4", "flash_attn_4"):
        assert "unverified" in registry.window_reason(registry.get_kernel(name))
    registry.resolve_kernel("flash_attn_4", H100, dtype=torch.bfloat16, head_dim=128)
    with pytest.raises(ValueError, match="cannot run --window-size: flash_attn_4's window"):
        registry.resolve_kernel(
            "flash_attn_4", H100, dtype=torch.bfloat16, head_dim=128, window=True
        )
    problem = torch_flash.window_schema_problem(
        {
            "_flash_attention_forward": torch._C.parse_schema(
                "aten::_flash_attention_forward(Tensor query, Tensor key, Tensor value, "
                "Tensor? cum_seq_q, Tensor? cum_seq_k, SymInt max_q, SymInt max_k, "
                "float dropout_p, bool is_causal, bool return_debug_mask, *, float? scale=None)"
                " -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
            ),
            "_flash_attention_backward": None,
        }
    )
    assert "takes no window arguments" in problem
