"""Mixture-of-experts pieces that make Megatron's `MoELayer` exact under HDP (host layer).

**The load-balancing loss is per sequence.** Megatron's switch loss of a micro-batch,
`coeff * E / (k T^2) * sum_e P_e c_e` (P_e: summed router probabilities, c_e: tokens routed
to expert e, T tokens), is not additive: its value depends on which sequences share a
micro-batch, so it would change with the placement. HDP uses the same loss per sequence s
(its own P_s,e, c_s,e and length T_s) and weights it by the sequence's share of the global
batch, T_s / T:

    aux = coeff * E / (k T) * sum_s (1 / T_s) * sum_e P_s,e * c_s,e

This is what one process computes when it runs the global batch one sequence at a time
with Megatron's own router and `MoEAuxLossAutoScaler` set to 1 / T. It needs no count
outside the sequence: the counts c_s,e of a sequence split over a ring are summed over the
ring's members (point-to-point, in the pool group), those of tokens split over the TP ranks
by sequence parallelism over the TP group. Pad tokens (sequence-parallel padding) count
for nothing. T counts every token of the global batch (loss mask or not).

**The z-loss is per token** (ST-MoE's router z-loss, `--moe-z-loss-coeff`). Megatron takes
the mean of `logsumexp(logits)^2` over the tokens of a micro-batch; HDP takes it over the
tokens of the global batch, `coeff / T * sum_t logsumexp(logits_t)^2`, which is a sum of
per-token terms and needs no count from any other rank. Pad tokens count for nothing.

**The expert-bias counts leave the pad tokens out** (`--moe-router-enable-expert-bias`):
Megatron adds every routed token of the step to `local_tokens_per_expert` and sums the
counts over the stage (TP x DP x CP, which is the HDP pool x TP) in `finalize_model_grads`
before it moves the biases; without the sequence-parallel pad tokens those counts are the
global batch's whatever the layout, so every layout moves the biases alike.

**Forced balancing draws keyed logits** (`--moe-router-force-load-balancing`): Megatron
replaces the router logits by standard normal values from each rank's RNG stream (a
benchmark setting); HDP draws each value from the token's keys (seed, iteration, layer,
document, position, expert; `keyed_normal`), so the routes do not depend on the layout.

**Experts are initialised by their global index**, so a model built with any EP size (and
any TP size) has the same experts: each expert draws its weights from a generator seeded
by one number drawn for the layer plus its global index, and the layer consumes that one
number from the global RNG whatever the EP size.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter

from megatron_hdp.attention.dropout import PAD_DOC, _mix32_, key_base, mix32
from megatron_hdp.distributed.ring_comm import RingComm
from megatron_hdp.host_copy import to_device
from megatron_hdp.megatron import compat
from megatron_hdp.megatron.moe_context import (  # noqa: F401 (moe_micro_batch re-exported)
    current_micro_batch,
    moe_micro_batch,
)

_TAG_EXPERT_COUNTS = 21


@dataclass
class MoEMicroBatch:
    """What the router of every MoE layer needs to know about the micro-batch it runs.

    Attributes:
        segment_ids: Document index of every local token (the padded THD order of the
            micro-batch on this rank, before sequence parallelism splits it), on the
            device; pad tokens carry `len(doc_lengths)` (a row of no document).
        doc_lengths: Full length of every document of the micro-batch.
        global_tokens: Tokens of the whole global batch (T).
        ring: Communicator over the ring members holding tokens; None for a ring of one.
        aux_grad_scale: Gradient of the aux loss in backward (1: as computed).
        aux_loss: Sum of this rank's aux-loss terms so far (all layers), for logging: a
            float64 device scalar once a layer has added to it (never read here).
        device_doc_lengths: `doc_lengths` on the device (int64); None: made when needed.
        keys: The tokens' identities (`attention.dropout.MicroBatchKeys`) for
            `--moe-router-force-load-balancing`'s keyed random logits; None without it.
        tracker_scale: None: the losses are not logged to Megatron's MoE loss tracker;
            else the factor each rank's share is multiplied by there (Megatron-LM's
            `training_log` divides the tracked sums by its micro-batch count: the drop-in
            passes that count, so the log shows the global batch's loss per MoE layer).
    """

    segment_ids: torch.Tensor
    doc_lengths: Sequence[int]
    global_tokens: int
    ring: RingComm | None = None
    aux_grad_scale: float = 1.0
    aux_loss: torch.Tensor | float = field(default=0.0)
    device_doc_lengths: torch.Tensor | None = None
    tracker_scale: float | None = None
    keys: object | None = None


#: Key site of the forced-balancing random logits (beside keyed dropout's sites).
FORCED_ROUTING = 3


def keyed_normal(base: int, docs: torch.Tensor, positions: torch.Tensor, width: int):
    """Float64 `[T, width]` standard normal values keyed like dropout masks.

    Each value is a function of (base, document, position, column) only: Box-Muller on two
    keyed 32-bit hashes.
    """
    tokens = _mix32_(mix32(base ^ docs.to(torch.int64)) ^ positions.to(torch.int64))
    cols = torch.arange(2 * width, dtype=torch.int64, device=tokens.device)
    u = (_mix32_(tokens.unsqueeze(-1) ^ cols).to(torch.float64) + 0.5) / 2.0**32
    return torch.sqrt(-2.0 * torch.log(u[:, :width])) * torch.cos(2.0 * torch.pi * u[:, width:])


def ring_sum(tensor: torch.Tensor, ring: RingComm | None) -> torch.Tensor:
    """P2P over the ring: the sum of `tensor` over every member (each member calls it).

    The partial sums travel k-1 hops; float64 counts keep it exact in any order.
    """
    if ring is None or ring.size == 1:
        return tensor
    total, passing = tensor.clone(), tensor
    for _ in range(ring.size - 1):
        passing = ring.exchange(passing, torch.empty_like(passing), _TAG_EXPERT_COUNTS).wait()
        total += passing
    return total


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `probs` whose backward also sends gradient `scale` into `aux_loss`.

    Not Megatron's `MoEAuxLossAutoScaler`: its scale is a class attribute that Megatron's
    own schedules overwrite; here the scale travels with the micro-batch.
    """

    @staticmethod
    def forward(ctx, probs: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx, grad_probs: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_probs, torch.full_like(aux_loss, ctx.scale), None


class SequenceAuxLossRouter(TopKRouter):
    """Megatron's top-k router whose load-balancing loss is per sequence (module docstring).

    Routing itself is Megatron's. The aux loss needs the current `MoEMicroBatch`
    (`moe_micro_batch`); with sequence parallelism its counts are all-reduced over the TP
    group (collective), and over the ring for ring micro-batches (P2P). It reads nothing
    from the device (no boolean masks: pad tokens add into a row that is then dropped).
    """

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.keyed_random = bool(getattr(config, "moe_router_force_load_balancing", False))
        if self.keyed_random:  # Megatron's draw (per rank's RNG stream) replaced in gating
            self.config = copy.copy(config)
            self.config.moe_router_force_load_balancing = False

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """The router logits, in the router dtype.

        Megatron-Core 0.16.1's `router_gating_linear` reads `te_general_gemm`, a name that
        exists only when Transformer Engine imports; this is its plain-torch branch.

        `--moe-router-force-load-balancing`: Megatron's random logits for benchmarks
        (`RandomSTE`: standard normal values in the forward, the gradient passed to the
        logits unchanged), drawn from keys of each token (seed, iteration, layer, document,
        position: `keyed_normal`) instead of each rank's RNG stream, so every layout routes
        every token alike. A recomputed layer draws the same values.
        """
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
            self.config.moe_router_dtype, input.dtype
        )
        bias = None if self.bias is None else self.bias.to(dtype)
        logits = torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)
        if not self.keyed_random:
            return logits
        batch = current_micro_batch("forced-balancing logits")
        rows = logits.shape[0] * (logits.shape[1] if logits.dim() == 3 else 1)
        keys = batch.keys
        if keys is not None:
            docs = self._local_rows(keys.token_docs, rows)
            positions = self._local_rows(keys.token_positions, rows)
            base = key_base(FORCED_ROUTING, keys.seed, keys.iteration, self.layer_number)
        elif not batch.doc_lengths:  # a lock-step padding slot: pad tokens, counted nowhere
            docs = torch.full((rows,), PAD_DOC, dtype=torch.int64, device=logits.device)
            positions = torch.zeros_like(docs)
            base = key_base(FORCED_ROUTING, self.layer_number)
        else:
            raise RuntimeError("--moe-router-force-load-balancing needs the tokens' keys")
        noise = keyed_normal(base, docs, positions, logits.shape[-1])
        noise = noise.to(logits.dtype).view(logits.shape)
        return logits + (noise - logits).detach()

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        """`--moe-router-load-balancing-type aux_loss`: the per-sequence loss (module docstring)."""
        coeff = self.get_aux_loss_coeff("aux_loss")
        return self._sequence_loss(
            probs, scores_for_aux_loss, routing_map, coeff, "load_balancing_loss"
        )

    def _apply_seq_aux_loss(
        self, probs, scores_for_aux_loss, routing_map, seq_length, bsz, with_padding_mask=False
    ):
        """`seq_aux_loss`: Megatron's per-sequence loss, a sequence being a document.

        Megatron takes the switch loss of each sequence of a [s, b] micro-batch and their
        mean; with `--calculate-per-token-loss` its gradient is weighted by the micro-batch's
        s x b tokens, so the step adds `sum_s (T_s / T) * loss_s` over the global batch. HDP
        computes exactly that sum, with each document its own sequence (a packed micro-batch
        arrives as one row of b = 1, which Megatron would take as one sequence; the packing
        differs per layout). Logged as Megatron logs it, `seq_load_balancing_loss`.
        """
        coeff = self.get_aux_loss_coeff("seq_aux_loss")
        return self._sequence_loss(
            probs, scores_for_aux_loss, routing_map, coeff, "seq_load_balancing_loss"
        )

    def _sequence_loss(self, probs, scores_for_aux_loss, routing_map, coeff, name):
        """Attach `coeff * E / (k T) * sum_s (1 / T_s) * sum_e P_s,e c_s,e` to `probs`.

        Collective over the TP group with sequence parallelism, P2P over the ring.
        """
        if coeff == 0:
            return probs
        batch = current_micro_batch("load-balancing loss")
        segments = self._local_segments(batch, scores_for_aux_loss.shape[0])
        num_docs = len(batch.doc_lengths)
        device = scores_for_aux_loss.device
        # Row num_docs gathers the pad tokens' terms and is dropped: each document's row
        # receives its tokens in the same order as without the pad rows.
        counts = torch.zeros(num_docs + 1, self.num_experts, dtype=torch.float64, device=device)
        counts.index_add_(0, segments, routing_map.to(torch.float64))
        counts = counts[:num_docs]
        if self.config.sequence_parallel:
            dist.all_reduce(counts, group=self.tp_group)
        counts = ring_sum(counts, batch.ring)
        prob_sums = torch.zeros(
            num_docs + 1, self.num_experts, dtype=scores_for_aux_loss.dtype, device=device
        ).index_add(0, segments, scores_for_aux_loss)[:num_docs]
        lengths = batch.device_doc_lengths
        if lengths is None:
            lengths = to_device(torch.tensor(batch.doc_lengths, dtype=torch.int64), device)
        scale = coeff * self.num_experts / (self.topk * batch.global_tokens)
        weights = (counts * (scale / lengths.to(torch.float64))[:, None]).to(prob_sums.dtype)
        aux_loss = (prob_sums * weights).sum()
        # Summed on the device in float64, as a host float would be: no read per layer.
        batch.aux_loss = batch.aux_loss + aux_loss.detach().double()
        self._track(batch, name, aux_loss / coeff)
        return _AttachAuxLoss.apply(probs, aux_loss, batch.aux_grad_scale)

    def apply_z_loss(self, logits: torch.Tensor, padding_mask=None) -> torch.Tensor:
        """Megatron's router z-loss over the tokens of the global batch (module docstring).

        `coeff / T * sum_t logsumexp(logits_t)^2` over this rank's real tokens; its
        gradient goes in with the micro-batch's `aux_grad_scale`. Only in training with
        gradients on, as Megatron's. Collective over nothing.
        """
        coeff = self.config.moe_z_loss_coeff
        if coeff is None or not (self.training and torch.is_grad_enabled()):
            return logits
        batch = current_micro_batch("z-loss")
        segments = self._local_segments(batch, logits.shape[0])
        real = (segments < len(batch.doc_lengths)).to(logits.dtype)
        squares = torch.square(torch.logsumexp(logits, dim=-1))
        z_loss = (squares * real).sum() * (coeff / batch.global_tokens)
        if coeff:
            self._track(batch, "z_loss", z_loss / coeff)
        return _AttachAuxLoss.apply(logits, z_loss, batch.aux_grad_scale)

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask=None) -> None:
        """Megatron's expert-bias token counts, without the pad tokens (module docstring)."""
        if not (self.enable_expert_bias and torch.is_grad_enabled()):
            return
        batch = current_micro_batch("expert-bias token counts")
        segments = self._local_segments(batch, routing_map.shape[0])
        with torch.no_grad():
            real = (segments < len(batch.doc_lengths))[:, None]
            self.local_tokens_per_expert += (routing_map & real).sum(dim=0)

    def _local_segments(self, batch: MoEMicroBatch, rows: int) -> torch.Tensor:
        """The document index of each of the `rows` tokens this rank's router sees."""
        return self._local_rows(batch.segment_ids, rows)

    def _local_rows(self, values: torch.Tensor, rows: int) -> torch.Tensor:
        """The entries of a per-token tensor of the micro-batch for this rank's `rows` tokens.

        With sequence parallelism the router sees this TP rank's share of the micro-batch.
        """
        if self.config.sequence_parallel:
            tp_rank = dist.get_rank(self.tp_group)
            values = values[tp_rank * rows : (tp_rank + 1) * rows]
        if values.numel() != rows:
            raise RuntimeError(f"the router saw {rows} tokens, the micro-batch has {len(values)}")
        return values

    def _track(self, batch: MoEMicroBatch, name: str, share: torch.Tensor) -> None:
        """Add this rank's share of a loss to Megatron's MoE loss tracker (if logging).

        The shares of all ranks of the stage sum to the global batch's loss: the tracker
        sums them over the stage (TP x DP x CP) when Megatron-LM logs, with no DP average.
        """
        if batch.tracker_scale is None:
            return
        from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

        save_to_aux_losses_tracker(
            name,
            share.detach().float() * batch.tracker_scale,
            self.layer_number,
            self.config.num_layers,
            reduce_group=self.tp_dp_cp_group,
            reduce_group_has_dp=True,
        )


class GlobalIndexSequentialMLP(SequentialMLP):
    """Megatron's `SequentialMLP` whose experts are initialised by their global index.

    Megatron draws the local experts one after the other from the global RNG, so expert 0
    of EP rank 1 would equal expert 0 of EP rank 0, and the layers after it would start from
    an RNG state that depends on the EP size.

    Linear biases (Megatron's default) need experts whole on one rank (expert TP 1, as
    Megatron asserts). Two fixes make them work in every such layout:

    - each expert's second linear skips the all-reduce over its one-rank group: Megatron's
      reduce hands back its input as-is, and the expert then adds its bias in place on that
      view, which autograd refuses ("a view ... is being modified inplace");
    - that bias is not marked `sequence_parallel`: its gradient is already whole (the
      dispatcher brought the expert all its tokens), and `finalize_model_grads` would sum
      it with the biases of the other experts on the other TP ranks;
    - that bias is marked `tensor_model_parallel` (no duplicate of another TP rank's): the
      expert optimizer filters TP duplicates out of the gradient norm by the dense TP group,
      and would leave out the biases of the experts on TP ranks other than 0.
    """

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None):
        layer_seed = int(torch.randint(0, 2**31, ()))  # one draw, whatever the EP size
        with torch.random.fork_rng(devices=[]):
            super().__init__(0, config, submodules, pg_collection)
            self.num_local_experts = num_local_experts
            first = self.ep_group.rank() * num_local_experts
            for local in range(num_local_experts):
                torch.manual_seed(layer_seed + first + local)
                self.local_experts.append(
                    MLP(
                        self.config,
                        submodules,
                        ffn_hidden_size=self.config.moe_ffn_hidden_size,
                        is_expert=True,
                        tp_group=pg_collection.expt_tp,
                        **compat.name_kwargs(name and f"{name}.local_experts.{local}"),
                    )
                )
        if self.config.add_bias_linear:
            for expert in self.local_experts:
                expert.linear_fc2.explicit_expert_comm = True
                expert.linear_fc2.bias.sequence_parallel = False
                expert.linear_fc2.bias.tensor_model_parallel = True
