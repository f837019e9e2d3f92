"""Keyed dropout: masks that depend on what is dropped, not on where it runs (ops layer).

Stock dropout draws its mask from the torch (or CUDA) RNG stream of the rank that runs it, so
the same token gets another mask when it runs on another rank, in another pack, or in a ring
of another size: HDP's placements would give different losses. Here every mask bit is a
counter-based hash of the element's identity instead:

- attention probabilities: (seed, iteration, layer, document, head, query position,
  key position);
- hidden states (`hidden_keep`): (seed, iteration, layer, site, document, token position,
  hidden index), the site being the embedding, the attention output or the MLP output.

The document is its index in the step's global batch (`MicroBatchKeys.doc_ids`), the
positions are within the document and the head is the global query head (TP rank offset
added), so 1 rank, packs, zigzag rings of any size and TP/SP/PP give the same masks. The
hash is Chris Wellons' `lowbias32` on 32-bit words held in int64 tensors (every product
stays below 2**63); an element is dropped when its 32-bit hash is below `p * 2**32`. The
distribution is that of stock dropout (independent Bernoulli(1 - p), kept values scaled by
1 / (1 - p)); the masks are not those of Megatron's RNG stream.

Attention dropout in a ring: each block's partial output uses the dropped probabilities
`P * keep / (1 - p)` but the block's log-sum-exp is that of the undropped scores, so the
log-sum-exp merge of `ring.py` gives exactly the full row's dropped output. The backward
takes the merged output and log-sum-exp (as every kernel does): `D = rowsum(dO * O)` with
the dropped `O` is the softmax-backward term of the dropped probabilities. `KeyedDropoutKernel`
computes dense blocks (materialised `[heads, q, k]` scores per document): it is the CPU math
path; flash kernels draw their own Philox masks and cannot take a keyed one.

Sliding windows (`window_ring`): `AttentionDropout.bind_window` gives the windowed plan's
steps the keys of their rows (the key rows a step sees are those its K/V still carry after
the step's hops); a banded block masks by the band (`kernels.base.Band`), so a step drops
and normalises exactly the pairs the window shows. The same hash of (document, head, query
position, key position) as without a window: the masks do not depend on the layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megatron_hdp.attention.kernels.base import VarlenBlocks, accumulation_dtype
from megatron_hdp.attention.kernels.cpu import expand_groups, reduce_groups
from megatron_hdp.attention.kernels.device import DeviceFacts
from megatron_hdp.attention.ring_index import StepBlocks

if TYPE_CHECKING:
    from megatron_hdp.attention.ring import RingAttentionSpec

_M32 = 0xFFFFFFFF
#: Domains of the hash: attention probabilities, hidden states.
ATTENTION, HIDDEN = 1, 2
#: Hidden dropout sites of a layer (the embedding is site 0 of layer 0).
EMBEDDING, ATTENTION_OUTPUT, MLP_OUTPUT = 0, 1, 2
#: The document id of sequence-parallel pad tokens (never a batch index).
PAD_DOC = _M32


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    """`x = x * c mod 2**32` in place, for int64 tensors of 32-bit words (no int64 overflow)."""
    high = x * (c >> 16)
    high &= 0xFFFF
    high <<= 16
    x *= c & 0xFFFF
    x += high
    x &= _M32
    return x


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """`mix32` in place (on a fresh tensor: in-place integer ops save most of the time)."""
    x ^= x >> 16
    _mul32_(x, 0x7FEB352D)
    x ^= x >> 15
    _mul32_(x, 0x846CA68B)
    x ^= x >> 16
    return x


def mix32(x: torch.Tensor) -> torch.Tensor:
    """`lowbias32` of every 32-bit word of the int64 tensor `x` (a bijection on 32 bits)."""
    return _mix32_(x.to(torch.int64, copy=True))


def _mix_int(h: int) -> int:
    """`mix32` of one Python int (the same arithmetic)."""
    h ^= h >> 16
    h = (h * 0x7FEB352D) & _M32
    h ^= h >> 15
    h = (h * 0x846CA68B) & _M32
    return h ^ (h >> 16)


def key_base(*fields: int) -> int:
    """The 32-bit hash of a chain of integers (each folded in as two 32-bit halves)."""
    h = 0x9E3779B9
    for f in fields:
        f = int(f) & 0xFFFFFFFFFFFFFFFF
        h = _mix_int(h ^ (f & _M32))
        h = _mix_int(h ^ (f >> 32))
    return h


def _threshold(p: float) -> int:
    """Hashes below this are dropped: `p * 2**32`, rounded."""
    return min(round(p * 2**32), 2**32)


def _scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def check_probability(p: float, what: str) -> float:
    """`p` if it is a probability; ValueError naming `what` otherwise."""
    if not 0.0 <= p <= 1.0 or math.isnan(p):
        raise ValueError(f"{what} {p} is not a probability in [0, 1]")
    return p


def attention_keep(
    base: int,
    heads: torch.Tensor,
    q_docs: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    p: float,
) -> torch.Tensor:
    """Bool `[H, Tq, Tk]`: whether each probability (head, query row, key row) is kept.

    `base` is `key_base(ATTENTION, seed, iteration, layer)`; `heads` the global head indices,
    `q_docs` / `q_positions` the document and position of each query row, `k_positions`
    the position of each key row (of the same document).
    """
    rows = _mix32_(mix32(base ^ q_docs.to(torch.int64)) ^ q_positions.to(torch.int64))
    rows = _mix32_(rows.unsqueeze(0) ^ heads.to(torch.int64).unsqueeze(1))  # [H, Tq]
    bits = _mix32_(rows.unsqueeze(-1) ^ k_positions.to(torch.int64).view(1, 1, -1))
    return bits >= _threshold(p)


def hidden_keep(
    base: int, docs: torch.Tensor, positions: torch.Tensor, width: int, p: float
) -> torch.Tensor:
    """Bool `[T, width]`: whether each hidden value of each token is kept.

    `base` is `key_base(HIDDEN, seed, iteration, layer, site)`; `docs` and `positions`
    identify each token (document of the global batch, position in it).
    """
    tokens = _mix32_(mix32(base ^ docs.to(torch.int64)) ^ positions.to(torch.int64))
    hidden = torch.arange(width, dtype=torch.int64, device=tokens.device)
    return _mix32_(tokens.unsqueeze(-1) ^ hidden) >= _threshold(p)


def keyed_dropout(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """`x` with the values `keep` is False at zeroed and the rest scaled by `1 / (1 - p)`.

    Autograd saves the bool mask only (as torch's dropout does).
    """
    return x.masked_fill(~keep, 0) * _scale(p)


@dataclass
class MicroBatchKeys:
    """What identifies this rank's tokens of one micro-batch, for keyed dropout.

    Attributes:
        seed: The job's seed (`--seed`).
        iteration: The training iteration the micro-batch belongs to (completed steps
            before it; Megatron-LM's `args.curr_iteration`).
        doc_ids: Index in the global batch of every document of the micro-batch, in
            packing order.
        token_docs: int64 `[T]` document id of every local token (sequence-parallel pad
            tokens: `PAD_DOC`), on the tokens' device.
        token_positions: int64 `[T]` position of every local token in its document.
    """

    seed: int
    iteration: int
    doc_ids: tuple[int, ...]
    token_docs: torch.Tensor
    token_positions: torch.Tensor
    _steps: dict = field(default_factory=dict, repr=False, compare=False)

    def hidden_base(self, layer: int, site: int) -> int:
        """The hash base of a hidden-dropout site of a layer (`hidden_keep`)."""
        return key_base(HIDDEN, self.seed, self.iteration, layer, site)

    def attention(self, p: float, layer: int, head_offset: int = 0) -> AttentionDropout:
        """Attention dropout of global layer `layer` on this micro-batch.

        `head_offset`: global index of this rank's first query head (TP rank x local heads).
        """
        return AttentionDropout(
            p=p,
            base=key_base(ATTENTION, self.seed, self.iteration, layer),
            head_offset=head_offset,
            keys=self,
        )

    def keyed_steps(self, spec: RingAttentionSpec, device: torch.device) -> dict[int, StepBlocks]:
        """`spec`'s step blocks with the keys of their rows (`KeyedBlocks`), built once."""
        if device not in self._steps:
            self._steps[device] = _keyed_steps(spec, self.doc_ids, spec.step_blocks(device))
        return self._steps[device]

    def keyed_window_steps(self, spec: RingAttentionSpec, plan, device) -> dict[int, StepBlocks]:
        """The windowed plan's (`window.DevicePlan`) steps with their rows' keys, built once.

        A step's key rows index the source's rows its K/V carry after the step's hops
        (`WindowPlan.carried`).
        """
        key = ("window", plan.plan.window, device)
        if key not in self._steps:
            active, me = spec.active, spec.active.index(spec.position)
            held = {
                source: plan.plan.carried[source, (me - active.index(source)) % len(active)]
                for source in plan.steps
            }
            self._steps[key] = _keyed_steps(spec, self.doc_ids, plan.steps, held)
        return self._steps[key]


@dataclass(frozen=True)
class KeyedBlocks(VarlenBlocks):
    """`VarlenBlocks` with the identity of their rows (on the tensors' device).

    `q_docs` / `q_positions`: document id and position of each query row; `k_positions`:
    position of each key row (a block's keys belong to its queries' document).
    """

    q_docs: torch.Tensor
    q_positions: torch.Tensor
    k_positions: torch.Tensor


def _keyed_steps(
    spec: RingAttentionSpec,
    doc_ids: Sequence[int],
    steps: dict[int, StepBlocks],
    held: dict[int, torch.Tensor] | None = None,
) -> dict[int, StepBlocks]:
    """`steps` (this rank's blocks of `spec`, by source) with the keys of their rows.

    `held`: per source, the source's rows (host) that a step's key rows index; None: all.
    """
    if len(doc_ids) != len(spec.doc_lengths):
        raise ValueError(
            f"{len(doc_ids)} document ids for a micro-batch of {len(spec.doc_lengths)} documents"
        )
    device = next(iter(steps.values())).blocks.cu_seqlens_q.device
    me = spec.shards[spec.position]
    docs = torch.repeat_interleave(
        torch.tensor(doc_ids, dtype=torch.int64),
        torch.tensor(me.local_doc_lengths(), dtype=torch.int64),
    ).to(device)
    positions = torch.tensor(me.positions(), dtype=torch.int64).to(device)
    out = {}
    for source, step in steps.items():
        if step.q_rows is None:  # a pack: every row, in order
            q_docs, q_pos, k_pos = docs, positions, positions
        else:
            src = torch.tensor(spec.shards[source].positions(), dtype=torch.int64)
            if held is not None:
                src = src[held[source]]
            src = src.to(device)
            q_docs, q_pos = docs[step.q_rows], positions[step.q_rows]
            k_pos = src[step.kv_rows]
        blocks = KeyedBlocks(
            **{f.name: getattr(step.blocks, f.name) for f in dataclasses.fields(VarlenBlocks)},
            q_docs=q_docs,
            q_positions=q_pos,
            k_positions=k_pos,
        )
        out[source] = dataclasses.replace(step, blocks=blocks)
    return out


@dataclass(frozen=True)
class AttentionDropout:
    """Dropout of one layer's attention probabilities on one micro-batch (`hdp_attention`)."""

    p: float
    base: int
    head_offset: int
    keys: MicroBatchKeys

    def bind(self, spec: RingAttentionSpec, device: torch.device) -> RingAttentionSpec:
        """`spec` computing with `KeyedDropoutKernel` on blocks that carry their row keys."""
        kernel = KeyedDropoutKernel(self.p, self.base, self.head_offset)
        return dataclasses.replace(
            spec, backend=kernel, _blocks_by_device={device: self.keys.keyed_steps(spec, device)}
        )

    def bind_window(self, spec: RingAttentionSpec, plan, device: torch.device):
        """`(spec, plan)` of a windowed layer, computing with `KeyedDropoutKernel`.

        `plan` is the layer's `window.DevicePlan`; its steps get their rows' keys.
        """
        kernel = KeyedDropoutKernel(self.p, self.base, self.head_offset)
        steps = self.keys.keyed_window_steps(spec, plan, device)
        return dataclasses.replace(spec, backend=kernel), dataclasses.replace(plan, steps=steps)


def _pieces(blocks: VarlenBlocks):
    q0 = k0 = 0
    for lq, lk in zip(blocks.lengths_q, blocks.lengths_k, strict=True):
        yield slice(q0, q0 + lq), slice(k0, k0 + lk)
        q0, k0 = q0 + lq, k0 + lk


class KeyedDropoutKernel:
    """A varlen kernel with keyed dropout on the probabilities: dense blocks, any device.

    Takes `KeyedBlocks` (`AttentionDropout.bind` makes them). Scores, probabilities and
    gradients are computed in the accumulation dtype (float32 for 16-bit inputs).
    """

    name = "keyed_dropout"

    def __init__(self, p: float, base: int, head_offset: int) -> None:
        self.p, self.base, self.head_offset = p, base, head_offset

    def unavailable_reason(self, facts: DeviceFacts, *, dtype, head_dim) -> str | None:
        """Runs anywhere (dense blocks: `[heads, q, k]` scores per document)."""
        return None

    def activate(self) -> None:
        """Nothing to set up."""

    def _keep(self, blocks: KeyedBlocks, rows: slice, cols: slice, heads: int, device):
        head_ids = torch.arange(heads, dtype=torch.int64, device=device) + self.head_offset
        return attention_keep(
            self.base,
            head_ids,
            blocks.q_docs[rows],
            blocks.q_positions[rows],
            blocks.k_positions[cols],
            self.p,
        )

    def _probs(self, q, k, blocks, rows, cols, lse, scale):
        """`(probabilities [H, q, k], kept-and-scaled probabilities)`; `lse` None: own."""
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if blocks.band is not None:
            behind = blocks.q_positions[rows].unsqueeze(1) - blocks.k_positions[cols]
            visible = (behind >= 0) & (behind <= blocks.band.window)
            scores = scores.masked_fill(~visible, float("-inf"))
        elif blocks.causal:
            visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~visible, float("-inf"))
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1))
        keep = self._keep(blocks, rows, cols, q.shape[1], q.device)
        return probs, keyed_dropout(probs, keep, self.p), lse, keep

    def forward(self, q_THD, k_TGD, v_TGD, blocks, *, scale):
        """See `base.VarlenKernel.forward`; the lse is that of the undropped scores."""
        _require_keys(blocks)
        acc = accumulation_dtype(q_THD.dtype)
        heads = q_THD.shape[1]
        out = torch.empty((*q_THD.shape[:2], v_TGD.shape[-1]), dtype=acc, device=q_THD.device)
        lse = torch.empty((heads, q_THD.shape[0]), dtype=acc, device=q_THD.device)
        for rows, cols in _pieces(blocks):
            q = q_THD[rows].to(acc)
            k, v = (expand_groups(x[cols], heads).to(acc) for x in (k_TGD, v_TGD))
            _, dropped, lse_b, _ = self._probs(q, k, blocks, rows, cols, None, scale)
            out[rows] = torch.einsum("hqk,khd->qhd", dropped, v)
            lse[:, rows] = lse_b
        return out.to(q_THD.dtype), lse

    def backward(self, dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_HT, blocks, *, scale):
        """See `base.VarlenKernel.backward` (merged out and lse of the query rows)."""
        _require_keys(blocks)
        acc = accumulation_dtype(q_THD.dtype)
        heads, groups = q_THD.shape[1], k_TGD.shape[1]
        dq = torch.empty(q_THD.shape, dtype=acc, device=q_THD.device)
        dk = torch.empty(k_TGD.shape, dtype=acc, device=q_THD.device)
        dv = torch.empty(v_TGD.shape, dtype=acc, device=q_THD.device)
        for rows, cols in _pieces(blocks):
            q, dout, out = (x[rows].to(acc) for x in (q_THD, dout_THD, out_THD))
            k, v = (expand_groups(x[cols], heads).to(acc) for x in (k_TGD, v_TGD))
            probs, dropped, _, keep = self._probs(
                q, k, blocks, rows, cols, lse_HT[:, rows].to(acc), scale
            )
            dv_b = torch.einsum("hqk,qhd->khd", dropped, dout)
            dprobs = keyed_dropout(torch.einsum("qhd,khd->hqk", dout, v), keep, self.p)
            delta = (dout * out).sum(-1).T.unsqueeze(-1)  # [H, q, 1]
            dscores = probs * (dprobs - delta)
            dq[rows] = torch.einsum("hqk,khd->qhd", dscores, k) * scale
            dk[cols] = reduce_groups(torch.einsum("hqk,qhd->khd", dscores, q) * scale, groups)
            dv[cols] = reduce_groups(dv_b, groups)
        return dq.to(q_THD.dtype), dk.to(k_TGD.dtype), dv.to(v_TGD.dtype)


def _require_keys(blocks: VarlenBlocks) -> None:
    if not isinstance(blocks, KeyedBlocks):
        raise TypeError(
            "KeyedDropoutKernel needs KeyedBlocks (the row keys); bind the spec with "
            "AttentionDropout.bind"
        )
