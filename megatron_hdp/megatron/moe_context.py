"""Which micro-batch the MoE routers run, in the forward and in a recompute during backward.

HDP's router (`moe.SequenceAuxLossRouter`) needs the micro-batch's documents
(`moe.MoEMicroBatch`) to compute its per-sequence losses. The forward finds it in a context
variable (`moe_micro_batch`). A recomputed MoE layer (`--recompute-modules moe`, or full
activation recompute) routes again in the *backward*, and the backward may run where that
variable is not set:

- under pipeline parallelism Megatron's schedule runs each micro-batch's backward on its own,
  outside the forward's block;
- on CUDA, PyTorch's autograd engine runs the backward on a device thread of its own, and a
  context variable set on the thread that called `backward()` is not visible there (PyTorch
  2.11 does not propagate Python `contextvars` to autograd worker threads).

`carry_into_backward(output, batch)` covers both: an identity on the micro-batch's output
whose backward (the first node of that micro-batch's backward, whichever thread runs it)
makes `batch` the routers' micro-batch until the autograd engine finishes that backward
(`queue_callback`). `current_micro_batch` reads the forward's context variable first, then
that backward's batch. No call here is collective.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

import torch

_FORWARD: contextvars.ContextVar[Any] = contextvars.ContextVar("hdp_moe_micro_batch", default=None)


class _BackwardBatch:
    """The micro-batch whose backward is running (one backward at a time per process)."""

    def __init__(self) -> None:
        self.batch: Any = None
        self.lock = threading.Lock()

    def set(self, batch: Any) -> None:
        with self.lock:
            self.batch = batch

    def clear(self) -> None:
        self.set(None)


_BACKWARD = _BackwardBatch()


@contextlib.contextmanager
def moe_micro_batch(batch: Any) -> Iterator[Any]:
    """Make `batch` the micro-batch the MoE routers see during the block (the forward)."""
    token = _FORWARD.set(batch)
    try:
        yield batch
    finally:
        _FORWARD.reset(token)


def current_micro_batch(what: str) -> Any:
    """The micro-batch the MoE routers run; RuntimeError naming `what` outside one.

    In a forward: the batch of `moe_micro_batch`. In a backward that recomputes a layer:
    the batch `carry_into_backward` put on that micro-batch's output.
    """
    batch = _FORWARD.get()
    if batch is None:
        batch = _BACKWARD.batch
    if batch is None:
        raise RuntimeError(
            f"an MoE layer computed its {what} outside an HDP micro-batch (wrap the forward "
            "in moe_micro_batch, and carry_into_backward its output if the backward "
            "recomputes the layer)"
        )
    return batch


class _CarryIntoBackward(torch.autograd.Function):
    """Identity whose backward makes `batch` the routers' micro-batch until it ends."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, batch: Any) -> torch.Tensor:
        ctx.batch = batch
        # A new tensor on the same storage, not a view: Megatron's pipeline schedule frees
        # a stage's output tensor after sending it (`deallocate_output_tensor` refuses views).
        return output.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _BACKWARD.set(ctx.batch)
        torch.autograd.Variable._execution_engine.queue_callback(_BACKWARD.clear)
        return grad, None


def carry_into_backward(output: Any, batch: Any) -> Any:
    """`output`, unchanged in value, whose backward runs the routers on `batch`.

    Use it on the tensor a micro-batch's forward returns (a loss or a pipeline stage's
    output) when that backward may recompute MoE layers. Anything that is not a tensor
    needing a gradient (evaluation, a forward under `no_grad`) is returned as it is.
    """
    if not isinstance(output, torch.Tensor) or not output.requires_grad:
        return output
    return _CarryIntoBackward.apply(output, batch)
