"""Benchmarks, calibration and step runtimes run the job's kernel: never a CPU kernel on CUDA.

A CUDA device is described (`DeviceFacts` as an H100 would report them, monkeypatched into
`DeviceFacts.of`), so the choice runs here on CPU.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megatron_hdp.attention.kernels import registry
from megatron_hdp.attention.kernels.device import DeviceFacts
from megatron_hdp.megatron.step import StepRuntime
from tests.unit.scripts_loader import load_script

REPO = Path(__file__).resolve().parents[2]
H100 = DeviceFacts("cuda", "NVIDIA H100 80GB HBM3", (9, 0), flash_built=True)
CUDA = torch.device("cuda", 0)
CPU_KERNELS = ("torch", "math")
BENCHMARKS = ("bench_offload", "bench_placements", "bench_guards", "bench_offload_cpu")


@pytest.fixture
def described_h100(monkeypatch):
    """`DeviceFacts.of` reports an H100 for a CUDA device (this machine has none)."""
    real = DeviceFacts.of.__func__

    def of(cls, device):
        return H100 if torch.device(device).type == "cuda" else real(cls, device)

    monkeypatch.setattr(DeviceFacts, "of", classmethod(of))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 128, 100])
@pytest.mark.parametrize("name", registry.CHOICES)
def test_the_benchmarks_resolution_never_yields_a_cpu_kernel_on_cuda(
    name, head_dim, dtype, described_h100
):
    try:
        kernel = registry.job_kernel(name, CUDA, dtype=dtype, head_dim=head_dim)
    except ValueError as err:
        assert "cannot run here" in str(err) or "no attention kernel runs" in str(err)
        return
    assert kernel not in CPU_KERNELS


def test_auto_on_a_described_h100_is_torch_flash_or_the_reason(described_h100):
    assert registry.job_kernel("auto", CUDA, dtype=torch.bfloat16, head_dim=128) == "torch_flash"
    assert registry.job_kernel("auto", "cpu", dtype=torch.float32, head_dim=16) == "torch"
    with pytest.raises(ValueError, match="--bf16"):
        registry.job_kernel("auto", CUDA, dtype=torch.float32, head_dim=128)
    with pytest.raises(ValueError, match="'math' cannot run here: is a CPU kernel"):
        registry.job_kernel("math", CUDA, dtype=torch.bfloat16, head_dim=128)


def test_a_cuda_step_runtime_without_the_jobs_kernel_is_refused():
    assert StepRuntime(group=None).backend == "torch"  # CPU: the aten CPU flash kernels
    with pytest.raises(ValueError, match="needs the job's attention kernel: resolve it"):
        StepRuntime(group=None, device=CUDA)
    for name in CPU_KERNELS:
        with pytest.raises(ValueError, match=f"'{name}' cannot run on cuda:0: is a CPU kernel"):
            StepRuntime(group=None, device=CUDA, backend=name)
    assert StepRuntime(group=None, device=CUDA, backend="torch_flash").backend == "torch_flash"


def test_calibration_on_a_described_gpu_refuses_instead_of_timing_a_cpu_kernel(described_h100):
    from megatron_hdp.megatron.calibrate import time_lengths
    from megatron_hdp.megatron.model import GPTConfig

    cfg = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=128)
    with pytest.raises(ValueError, match="--bf16"):
        time_lengths(cfg, [8, 16, 32], 1, device=CUDA)


@pytest.mark.parametrize("script", BENCHMARKS)
def test_every_benchmark_takes_the_jobs_kernel_flag_and_resolves_it_like_the_job(script):
    module = load_script(f"scripts/bench/{script}.py", f"_kernel_{script}")
    args = module.parse_args([])
    assert args.hdp_attention_backend == "auto" and args.bf16 is False
    assert module.job_kernel is registry.job_kernel
    assert module.parse_args(["--bf16", "--hdp-attention-backend", "flash_attn"]).bf16


def _step_runtime_calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "StepRuntime":
            yield node


def test_every_step_runtime_outside_the_tests_names_its_kernel():
    """A runtime built without `backend=` would fall back to the CPU default ("torch")."""
    files = [
        *REPO.joinpath("scripts").rglob("*.py"),
        *REPO.joinpath("megatron_hdp").rglob("*.py"),
        *REPO.joinpath("examples").rglob("*.py"),
    ]
    calls = [(f, c) for f in files for c in _step_runtime_calls(f)]
    assert len(calls) >= 8
    unnamed = [
        f"{f.relative_to(REPO)}:{c.lineno}"
        for f, c in calls
        if not any(k.arg == "backend" for k in c.keywords)
    ]
    assert unnamed == []
