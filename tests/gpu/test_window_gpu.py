"""Sliding-window (banded) steps on a real GPU's flash kernels: `python -m pytest -m gpu tests/gpu`.

Each flash kernel that runs here and takes a window computes every banded step of
`tests/unit/test_window_kernels.CASES` (per-call windows, `kernels.windowed`) in bfloat16;
out and gradients must match the CPU banded kernel in float64 within bfloat16's precision.
Skipped without CUDA (on CPU the adapters run against fakes: tests/unit/test_window_kernels.py).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("name", ["torch_flash", "flash_attn"])
def test_banded_steps_match_the_cpu_band(name):
    from megatron_hdp.attention.kernels import registry
    from megatron_hdp.attention.kernels.cpu import MATH
    from megatron_hdp.attention.kernels.device import DeviceFacts
    from megatron_hdp.attention.window import on_device, window_plan
    from megatron_hdp.sharding import shard
    from tests.unit.test_window_kernels import CASES

    kernel = registry.get_kernel(name)
    facts = DeviceFacts.of("cuda")
    reason = kernel.unavailable_reason(facts, dtype=torch.bfloat16, head_dim=64)
    reason = reason or registry.window_reason(kernel)
    if reason:
        pytest.skip(f"{name} {reason}")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for lengths, k, window in CASES:
        shards = shard(lengths, k)
        active = tuple(p for p in range(k) if shards[p].num_tokens)
        for position in active:
            plan = window_plan(shards, position, active, window, lengths)
            on_gpu, on_cpu = on_device(plan, cuda), on_device(plan, cpu)
            for source, step in on_gpu.steps.items():
                blocks = step.blocks
                if blocks.band is None:
                    continue
                tq, tk = sum(blocks.lengths_q), sum(blocks.lengths_k)
                q, dout = (torch.randn(tq, 4, 64, generator=gen).bfloat16() for _ in range(2))
                k_, v_ = (torch.randn(tk, 2, 64, generator=gen).bfloat16() for _ in range(2))
                ref_blocks = on_cpu.steps[source].blocks
                args64 = [t.double() for t in (q, k_, v_)]
                out64, lse64 = MATH.forward(*args64, ref_blocks, scale=0.125)
                out, lse = kernel.forward(*(t.to(cuda) for t in (q, k_, v_)), blocks, scale=0.125)
                torch.testing.assert_close(out.cpu().double(), out64, rtol=2e-2, atol=2e-2)
                torch.testing.assert_close(lse.cpu().double(), lse64, rtol=1e-2, atol=1e-2)
                want = MATH.backward(dout.double(), *args64, out64, lse64, ref_blocks, scale=0.125)
                got = kernel.backward(
                    *(t.to(cuda) for t in (dout, q, k_, v_)),
                    out64.bfloat16().to(cuda),
                    lse64.float().to(cuda),
                    blocks,
                    scale=0.125,
                )
                for g, w in zip(got, want, strict=True):
                    torch.testing.assert_close(g.cpu().double(), w, rtol=5e-2, atol=5e-2)
                checked += 1
    assert checked > 10
