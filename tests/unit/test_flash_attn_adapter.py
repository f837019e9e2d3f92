"""The `flash_attn` adapter against every supported flash-attn release's real entry points.

`tests/fakes/flash_attn_releases.py` copies each tag's signature and return value (2.6.x
returns an 8-tuple with the log-sum-exp at index 5, 2.7+ a 4-tuple with it at index 1) and
computes with the `math` kernel, so the adapter's forward (out, lse) and backward (dq, dk, dv)
must equal the math kernel's, in one call and through a ring of virtual ranks.
"""

from __future__ import annotations

import inspect
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_hdp.attention.kernels import flash_attn as adapter
from megatron_hdp.attention.kernels import registry
from megatron_hdp.attention.kernels.base import VarlenBlocks
from megatron_hdp.attention.kernels.device import DeviceFacts
from tests.fakes.flash_attn_releases import RELEASES, release

REPO = Path(__file__).resolve().parents[2]
# An Ampere GPU whose torch lacks its own flash kernels: "auto" then takes flash-attn.
A100_NO_TORCH_FLASH = DeviceFacts("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), flash_built=False)


@pytest.fixture
def installed(monkeypatch):
    """Install the fake of one release as `flash_attn.flash_attn_interface`."""

    def install(version):
        fake = release(version)
        monkeypatch.setattr(adapter, "_interface", lambda: fake)
        return fake

    return install


@pytest.fixture
def deterministic_mode():
    """Switch torch's deterministic mode on for the test, and back afterwards."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def _tensors(lengths_q, lengths_k, seed=3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), 4, 8, generator=gen)
    k = torch.randn(sum(lengths_k), 2, 8, generator=gen)
    v = torch.randn(sum(lengths_k), 2, 8, generator=gen)
    return q, k, v, torch.randn_like(q)


def test_the_fakes_copy_what_distinguishes_the_releases():
    """2.6.0/2.6.1 lack the defaults, 2.7+ are custom ops whose signature inspect hides."""
    for version in ("2.6.0", "2.6.1"):
        params = inspect.signature(release(version)._flash_attn_varlen_forward).parameters
        for name in ("window_size", "softcap", "alibi_slopes", "return_softmax"):
            assert params[name].default is inspect.Parameter.empty, (version, name)
    params = inspect.signature(release("2.6.0")._flash_attn_varlen_forward).parameters
    assert params["block_table"].default is inspect.Parameter.empty
    assert "leftpad_k" not in params
    for version in ("2.7.0", "2.8.3"):
        fake = release(version)
        assert str(inspect.signature(fake._flash_attn_varlen_forward)) == "(*args, **kwargs)"
        names = adapter.parameter_names(fake._flash_attn_varlen_backward)
        assert "window_size_left" in names and ("zero_tensors" in names) == (version == "2.8.3")


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize(
    "lengths_q, lengths_k, causal",
    [((3, 6, 1), (5, 2, 4), False), ((4, 9, 2), (4, 9, 2), True)],
    ids=["full", "causal"],
)
def test_every_release_equals_the_math_kernel(version, lengths_q, lengths_k, causal, installed):
    fake = installed(version)
    assert adapter.signature_problem(fake) is None
    assert registry.resolve_kernel(
        "auto", A100_NO_TORCH_FLASH, dtype=torch.bfloat16, head_dim=8
    ) == ("flash_attn")
    q, k, v, dout = _tensors(lengths_q, lengths_k)
    blocks = VarlenBlocks.build(lengths_q, lengths_k, causal=causal, device=torch.device("cpu"))
    kernel, reference = registry.get_kernel("flash_attn"), registry.get_kernel("math")
    out, lse = kernel.forward(q, k, v, blocks, scale=0.25)
    want_out, want_lse = reference.forward(q, k, v, blocks, scale=0.25)
    torch.testing.assert_close(out, want_out)
    assert lse.shape == (4, sum(lengths_q)) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, want_lse)
    got = kernel.backward(dout, q, k, v, out, lse, blocks, scale=0.25)
    want = reference.backward(dout, q, k, v, want_out, want_lse, blocks, scale=0.25)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{version} {name}: {m}")
    assert [c[0] for c in fake.calls] == [
        "_flash_attn_varlen_forward",
        "_flash_attn_varlen_backward",
    ]


def _run_ring():
    sys.path.insert(0, str(REPO / "scripts" / "gpu"))
    try:
        import ring_checks
    finally:
        sys.path.remove(str(REPO / "scripts" / "gpu"))
    return ring_checks.run_ring


@pytest.mark.parametrize("version", ["2.6.0", "2.6.3", "2.7.0", "2.8.3"])
def test_a_ring_of_virtual_ranks_on_each_release_equals_the_math_ring(version, installed):
    fake = installed(version)
    run_ring = _run_ring()
    lengths = (23, 5, 7, 30)
    q, k, v, dout = _tensors(lengths, lengths, seed=11)
    for ranks in (2, 3):
        got = run_ring("flash_attn", lengths, ranks, q, k, v, dout, 0.3)
        want = run_ring("math", lengths, ranks, q, k, v, dout, 0.3)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            torch.testing.assert_close(
                a, b, msg=lambda m, name=name, ranks=ranks: f"{ranks} ranks {name}: {m}"
            )
    assert len(fake.calls) >= 4  # forward and backward of every rank went through the fake


def test_a_log_sum_exp_of_the_wrong_shape_is_refused_on_every_call(installed, monkeypatch):
    fake = installed("2.8.3")
    q, k, v, dout = _tensors((3, 5), (3, 5))
    blocks = VarlenBlocks.build((3, 5), (3, 5), causal=True, device=torch.device("cpu"))
    kernel = registry.get_kernel("flash_attn")
    out, lse = kernel.forward(q, k, v, blocks, scale=0.3)

    def transposed(**kwargs):
        result = fake._flash_attn_varlen_forward(**kwargs)
        return result[0], result[1].t(), *result[2:]

    def five_values(**kwargs):
        return (*fake._flash_attn_varlen_forward(**kwargs), None)

    for wrong, message in (
        (transposed, r"log-sum-exp of shape \(8, 4\), expected \[heads, tokens\] = \(4, 8\)"),
        (five_values, "returned 5 values; 2.6.x returns 8 and 2.7-2.8 return 4"),
    ):
        broken = types.SimpleNamespace(
            _flash_attn_varlen_forward=wrong,
            _flash_attn_varlen_backward=fake._flash_attn_varlen_backward,
        )
        monkeypatch.setattr(adapter, "_interface", lambda broken=broken: broken)
        with pytest.raises(RuntimeError, match=message):
            kernel.forward(q, k, v, blocks, scale=0.3)
    with pytest.raises(RuntimeError, match=r"handed to flash_attn's backward gave .* \(8, 4\)"):
        kernel.backward(dout, q, k, v, out, lse.t(), blocks, scale=0.3)


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_the_backward_follows_torchs_deterministic_mode(version, deterministic, installed, request):
    if deterministic:
        request.getfixturevalue("deterministic_mode")
    fake = installed(version)
    q, k, v, dout = _tensors((3, 5), (3, 5))
    blocks = VarlenBlocks.build((3, 5), (3, 5), causal=True, device=torch.device("cpu"))
    kernel = registry.get_kernel("flash_attn")
    out, lse = kernel.forward(q, k, v, blocks, scale=0.3)
    kernel.backward(dout, q, k, v, out, lse, blocks, scale=0.3)
    ((name, args),) = [c for c in fake.calls if c[0] == "_flash_attn_varlen_backward"]
    assert args["deterministic"] is deterministic


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

    real = release("2.6.3")
    fake = types.SimpleNamespace(
        _flash_attn_varlen_forward=forward,
        _flash_attn_varlen_backward=real._flash_attn_varlen_backward,
    )
    problem = adapter.signature_problem(fake)
    assert "_flash_attn_varlen_forward lacks arguments" in problem
    assert "'softcap', 'alibi_slopes', 'return_softmax', 'block_table', 'window_size_left" in (
        problem
    )
    fake._flash_attn_varlen_forward = real._flash_attn_varlen_forward
    fake._flash_attn_varlen_backward = old_backward
    problem = adapter.signature_problem(fake)
    assert "_flash_attn_varlen_backward lacks arguments" in problem and "max_seqlen_q" in problem
    fake._flash_attn_varlen_backward = backward_without_window
    assert "window_size_left/window_size_right (2.7+) or window_size (2.6)" in (
        adapter.signature_problem(fake)
    )
    fake.__dict__.pop("_flash_attn_varlen_backward")
    assert "has no _flash_attn_varlen_backward" in adapter.signature_problem(fake)
