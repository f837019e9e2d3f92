"""Make Megatron-Core 0.16.1's CUDA assumptions harmless on a CPU-only machine.

Megatron-Core hard-codes CUDA in its schedules, DDP grad buffers and optimizer type
checks (`../shared/design/cpu-gloo-facts.md`, section 5). `cpu_shims()` patches exactly
four things, process-locally, and undoes them on exit:

- P1: a `TorchFunctionMode` that rewrites `device="cuda"` / `device=<int>` arguments of
  torch factory calls to `"cpu"`;
- P2: `torch.cuda.current_device` returns `"cpu"` and `torch.cuda.synchronize` does
  nothing (Megatron passes the former as `device=`);
- P3: `Tensor.type()` reports CPU float tensors as `torch.cuda.*Tensor`, which the
  optimizer's dtype dispatch and grad clipping insist on;
- P4: the tensor-parallel CUDA RNG tracker's `fork()` (entered by sequence-parallel
  regions around their dropout) does nothing, since no CUDA RNG state exists. Sequence
  parallelism with dropout is refused on CPU (`GPTConfig`), so no random draw depends on it.

Nothing is patched at import time. On a machine with CUDA the shims are not needed and
`cpu_shims()` refuses to install them (`force=True` overrides, for tests).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_CUDA_TYPES = ("torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor")


def _is_cuda_device(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """P1: send torch calls that ask for a CUDA device to the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda_device(kwargs.get("device")):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def _type_as_cuda(original):
    def tensor_type(self, *args, **kwargs):
        if args or kwargs:
            return original(self, *args, **kwargs)
        name = original(self)
        return name.replace("torch.", "torch.cuda.", 1) if name in _CUDA_TYPES else name

    return tensor_type


@contextlib.contextmanager
def cpu_shims(*, force: bool = False) -> Iterator[None]:
    """Apply P1-P4 for the duration of the block; restore everything afterwards."""
    if torch.cuda.is_available() and not force:
        raise RuntimeError("CUDA is available: Megatron needs no CPU shims here")
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    saved = (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.type)
    saved_fork = CudaRNGStatesTracker.fork
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.type = _type_as_cuda(saved[2])
    CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    try:
        with CudaToCpuMode():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.type = saved
        CudaRNGStatesTracker.fork = saved_fork


def maybe_cpu_shims() -> contextlib.AbstractContextManager:
    """`cpu_shims()` on a machine without CUDA, a no-op context otherwise."""
    return contextlib.nullcontext() if torch.cuda.is_available() else cpu_shims()
