"""Attention sinks: a softmax with one extra logit per head in its denominator (ops layer).

Megatron-Core's `softmax_type` (`TransformerConfig`, 0.16 and 0.19 alike):

- "off-by-one" (Evan Miller's "attention is off by one"): a fixed sink logit 0 per head;
- "learnable" (gpt-oss): a learnable sink logit per head, the parameter `softmax_offset`
  of the core attention.

Megatron's `SoftmaxOne` appends the sink as one more column of the (scaled, masked) scores
of every query row and drops its probability after the softmax: the row's probabilities sum
to less than one, the sink takes the rest, and it carries no value. Per query row and head,
with the row's log-sum-exp `lse` over its keys and the sink logit `s`:

    lse' = logaddexp(lse, s)        out' = out * exp(lse - lse')

HDP's attention merges the partial results of all ring steps (or one pack) into the row's
`(out, lse)` first; `SoftmaxSink` is the step after that merge (`finalize.RowFinalize`), so the
sink enters once per query row, whatever the ring size. Backward: the flash recipe with the
finalized `(out', lse')` is exact for q, k and v (the sink column's probability takes part in
`D = rowsum(dO * O')` with a zero value, so nothing changes there), and

    d s = -sum over query rows of exp(s - lse') * rowsum(dO * O')

Each rank adds its own query rows' share; the gradient sync over the pool sums the shares
of a ring's members as it sums every other parameter's gradient.
"""

from __future__ import annotations

import torch

#: Megatron-Core's `TransformerConfig.softmax_type` choices, the default first.
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def check_softmax_type(value: str) -> str:
    """`value` if it is one of Megatron's softmax types; ValueError naming it otherwise."""
    if value not in SOFTMAX_TYPES:
        raise ValueError(f"softmax_type {value!r} is not one of {SOFTMAX_TYPES}")
    return value


class SoftmaxSink:
    """The finalize step of a softmax with one sink logit per head (`finalize.RowFinalize`).

    Its one parameter is the `[H]` sink logits of this rank's heads (a constant zero for
    off-by-one, Megatron's `softmax_offset` parameter for learnable), in any dtype; the
    arithmetic is in the dtype of the log-sum-exp (float32, or float64 for float64 inputs).
    Local: no communication.
    """

    name = "softmax_sink"

    def forward(
        self, out_THD: torch.Tensor, lse_HT: torch.Tensor, logit_H: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(out', lse')` of the merged `(out [T, H, D], lse [H, T])`, in lse's dtype."""
        acc = lse_HT.dtype
        lse_new = torch.logaddexp(lse_HT, logit_H.to(acc).unsqueeze(-1))
        kept = torch.exp(lse_HT - lse_new)  # [H, T], the keys' share of each row
        return out_THD.to(acc) * kept.T.unsqueeze(-1), lse_new

    def backward(
        self,
        dout_THD: torch.Tensor,
        out_THD: torch.Tensor,
        lse_HT: torch.Tensor,
        logit_H: torch.Tensor,
    ) -> tuple[torch.Tensor]:
        """`(d logit [H],)` of this rank's query rows, given the finalized out' and lse'."""
        acc = lse_HT.dtype
        delta_HT = (dout_THD.to(acc) * out_THD.to(acc)).sum(-1).T
        sink_prob = torch.exp(logit_H.to(acc).unsqueeze(-1) - lse_HT)
        return ((-(sink_prob * delta_HT).sum(-1)).to(logit_H.dtype),)


SINK = SoftmaxSink()
