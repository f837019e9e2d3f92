"""Saved-activation bytes of a model's layers, measured per micro-batch (ops layer).

`SavedBytesCounter` is the measurement the offloading memory rule is checked against
(`tests/distributed/test_offload_memory.py`, `scripts/bench/bench_offload_cpu.py`): it
counts what autograd saves inside each hooked layer, each device storage once, with its
own `torch.autograd.graph.saved_tensors_hooks` (independent of `OffloadManager`'s
accounting). The layers' parameters and buffers are not activations and are left out.

A micro-batch starts when the first layer's forward pass starts; `peaks[i]` is the bytes
micro-batch `i` saved by the end of its forward pass (nothing saved is freed before the
backward pass, so that is its peak). Not for layers an `OffloadManager` is installed on:
the innermost hooks win, and the manager's would hide the tensors from this counter.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import partial

import torch
from torch import nn


class SavedBytesCounter:
    """Bytes each micro-batch's forward pass saves in `layers` (see the module docstring)."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        self.peaks: list[int] = []
        self._seen: set[int] = set()
        self._excluded: set[int] = set()
        self._open: list[torch.autograd.graph.saved_tensors_hooks] = []
        self._handles = []
        for index, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(partial(self._enter, index)))
            self._handles.append(layer.register_forward_hook(self._exit, always_call=True))

    def _enter(self, index: int, module: nn.Module, args) -> None:
        if index == 0:
            self.peaks.append(0)
            self._seen = set()
            params = itertools.chain.from_iterable(
                itertools.chain(layer.parameters(), layer.buffers()) for layer in self.layers
            )
            self._excluded = {p.untyped_storage().data_ptr() for p in params}
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        hooks.__enter__()
        self._open.append(hooks)

    def _exit(self, module: nn.Module, args, output) -> None:
        if self._open:
            self._open.pop().__exit__(None, None, None)

    def _pack(self, tensor: torch.Tensor):
        if tensor.layout == torch.strided and type(tensor) is torch.Tensor and self.peaks:
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._excluded and ptr not in self._seen:
                self._seen.add(ptr)
                self.peaks[-1] += storage.nbytes()
        return tensor

    def remove(self) -> None:
        """Remove the layer hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
