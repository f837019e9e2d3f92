"""The GPU path on a real GPU: `python -m pytest -m gpu tests/gpu`.

Torch alone is enough, but for the last test (a batch through the planner, which needs
numpy): without numpy it is skipped.

Skipped without CUDA; the same checks run on CPU in every CI run through
`scripts/gpu/verify.py --cpu` (tests/unit/test_gpu_verify.py). These assert correctness
only; `verify.py` also measures speed and writes the figures.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.unit.scripts_loader import REPO

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def checks():
    sys.path.insert(0, str(REPO / "scripts" / "gpu"))
    import common
    import kernel_checks
    import ring_checks

    return common.gpu_mode(quick=True), kernel_checks, ring_checks


def test_every_kernel_that_runs_here_matches_float64(checks):
    mode, kernel_checks, _ = checks
    result = kernel_checks.run(mode, print)
    assert result["results"], f"no kernel ran: {result['not_run']}"
    failed = [r for r in result["results"] if not r["ok"]]
    assert not failed, failed


def test_rings_of_two_to_eight_equal_one_call(checks):
    mode, _, ring_checks = checks
    from megatron_hdp.attention.kernels.device import DeviceFacts
    from megatron_hdp.attention.kernels.registry import resolve_kernel

    kernel = resolve_kernel(
        "auto", DeviceFacts.of("cuda"), dtype=torch.bfloat16, head_dim=mode.head_dim
    )
    result = ring_checks.run(mode, print, kernel)
    assert result["ok"], [r for r in result["results"] if not r["ok"]]


def test_fp32_is_refused_here_with_the_precision_flag():
    from megatron_hdp.attention.kernels.device import DeviceFacts
    from megatron_hdp.attention.kernels.registry import resolve_kernel

    with pytest.raises(ValueError, match="--bf16"):
        resolve_kernel("auto", DeviceFacts.of("cuda"), dtype=torch.float32, head_dim=128)


def test_a_batch_reaches_the_gpu_intact_through_one_pinned_copy():
    pytest.importorskip("numpy", reason="the planner (megatron_hdp.scheduler) needs numpy")
    from megatron_hdp.data.batching import InMemoryTokens, gather_local_batch
    from megatron_hdp.scheduler.placement import plan_step

    gen = torch.Generator().manual_seed(0)
    lengths = [300, 17, 900]
    tokens = [torch.randint(0, 1000, (n,), generator=gen) for n in lengths]
    masks = [torch.rand(n, generator=gen) for n in lengths]
    source = InMemoryTokens(tokens, [t.roll(1) for t in tokens], masks)
    plan = plan_step(lengths, pool_size=1, capacity=2048, policy="greedy")
    host = gather_local_batch(plan, plan.micro_batches[0], 0, source)
    moved = host.to(torch.device("cuda"))
    torch.cuda.synchronize()
    for name in ("tokens", "labels", "position_ids", "loss_mask"):
        assert torch.equal(getattr(moved, name).cpu(), getattr(host, name)), name
    assert torch.equal(moved.cu_seqlens().cpu(), host.cu_seqlens())
