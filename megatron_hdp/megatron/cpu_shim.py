"""Make Megatron-Core 0.16.1's CUDA assumptions harmless on a CPU-only machine.

Megatron-Core hard-codes CUDA in its schedules, DDP grad buffers and optimizer type
checks (`../shared/design/cpu-gloo-facts.md`, section 5). `cpu_shims()` patches exactly
these things, process-locally, and undoes them on exit:

- P1: a `TorchFunctionMode` that rewrites `device="cuda"` / `device=<int>` arguments of
  torch factory calls to `"cpu"`;
- P2: `torch.cuda.current_device` returns `"cpu"` and `torch.cuda.synchronize` does
  nothing (Megatron passes the former as `device=`);
- P3: `Tensor.type()` reports CPU float tensors as `torch.cuda.*Tensor`, which the
  optimizer's dtype dispatch and grad clipping insist on;
- P4: the tensor-parallel CUDA RNG tracker's `fork()` (entered by sequence-parallel
  regions around their dropout) does nothing, since no CUDA RNG state exists. HDP's
  dropout is keyed by token (`megatron.dropout`), so no random draw depends on it;
- P5: `torch.cuda.Stream`, `torch.cuda.current_stream` and `torch.cuda.stream` give host
  stand-ins whose waits and events do nothing (the MoE all-to-all token dispatcher copies
  its split sizes to the host on a side stream; on CPU every op is already synchronous);
- P6: that dispatcher's host copy also turns the split sizes into numpy arrays, but only for
  CUDA tensors; on CPU they would reach `all_to_all_single` as tensors, which it refuses, so
  CPU tensors asked for as numpy become numpy too;
- P7: `Tensor.cuda()` returns the tensor itself (Megatron moves the tied output weight of
  the last pipeline stage to the GPU before copying the first stage's embedding into it).

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


class _HostEvent:
    def synchronize(self) -> None:
        pass


class HostStream:
    """P5: a CUDA stream stand-in; the CPU runs every op in order, so nothing to wait for."""

    def wait_stream(self, other) -> None:
        """Nothing to wait for."""

    def record_event(self, event=None) -> _HostEvent:
        """An event that is already complete."""
        return _HostEvent()


_DEFAULT_STREAM = HostStream()


def _host_copy(original):
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


@contextlib.contextmanager
def cpu_shims(*, force: bool = False) -> Iterator[None]:
    """Apply P1-P7 for the duration of the block; restore everything afterwards."""
    if torch.cuda.is_available() and not force:
        raise RuntimeError("CUDA is available: Megatron needs no CPU shims here")
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.transformer.moe import token_dispatcher

    saved = (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.type)
    saved_fork = CudaRNGStatesTracker.fork
    saved_streams = (torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream)
    torch.cuda.Stream = HostStream
    torch.cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    saved_host_copy = token_dispatcher.maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy(saved_host_copy)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.type = _type_as_cuda(saved[2])
    saved_cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    try:
        with CudaToCpuMode():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.type = saved
        torch.Tensor.cuda = saved_cuda
        CudaRNGStatesTracker.fork = saved_fork
        torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream = saved_streams
        token_dispatcher.maybe_move_tensor_to_cpu = saved_host_copy


def maybe_cpu_shims() -> contextlib.AbstractContextManager:
    """`cpu_shims()` on a machine without CUDA, a no-op context otherwise."""
    return contextlib.nullcontext() if torch.cuda.is_available() else cpu_shims()
