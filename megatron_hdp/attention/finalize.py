"""The seam for attention variants that change each query row's softmax as a whole (ops).

`RowFinalize` is a step after the log-sum-exp merge of a row's partial results; the full
ring (`ring.py`) and the windowed ring (`window_ring.py`) run it the same way, on their pack
and ring paths. Example: the attention sink of `sinks.SoftmaxSink`. Local: no communication.
"""

from __future__ import annotations

from typing import Protocol

import torch


class RowFinalize(Protocol):
    """A step after the log-sum-exp merge of every query row (an attention variant's seam).

    Runs once per row, on the merged `(out [T, H, D], lse [H, T])` of all ring steps (or of
    the pack's one kernel call), before the output leaves the attention; the kernels'
    backward then takes the finalized out and lse. `params` are tensors it differentiates
    (autograd inputs of the attention). Local: no communication. Example:
    `sinks.SoftmaxSink`.
    """

    def forward(self, out_THD, lse_HT, *params) -> tuple[torch.Tensor, torch.Tensor]:
        """The finalized `(out, lse)`, in lse's dtype."""
        ...

    def backward(self, dout_THD, out_THD, lse_HT, *params) -> tuple[torch.Tensor, ...]:
        """The gradient of each of `params`, given the finalized out and lse."""
        ...


def finalize_grads(ctx, first: int, dout_THD, out_THD, lse_HT, params) -> tuple:
    """The gradients of the finalize step's params (autograd inputs from `first` on).

    `ctx` is the attention's autograd context, with the step as `ctx.finalize` (None: none).
    """
    if ctx.finalize is None or not any(ctx.needs_input_grad[first:]):
        return (None,) * len(params)
    return ctx.finalize.backward(dout_THD, out_THD, lse_HT, *params)
