"""The single-process reference: plain Megatron GPT (its own RoPE), one sequence at a time.

It shares nothing with HDP's attention path: Megatron applies RoPE itself (sbhd format,
positions 0..s-1, its own `rotary_percent` / `rotary_interleaved`), its local spec brings
its own query/key norms (`qk_layernorm`), and the core attention is a few lines of causal
SDPA written here; with a sink (`softmax_type` off-by-one or learnable) it is Megatron-Core's
own `DotProductAttention` (its `SoftmaxOne`: the sink as an extra score column).
"""

from __future__ import annotations

import math

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
)

# Megatron-Core 0.16.1's router gating reads this name, defined only when Transformer Engine
# imports; None selects its plain-torch branch.
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None

from megatron_hdp.megatron.model import GPTConfig, build_gpt, transformer_config


class SDPACoreAttention(MegatronModule):
    """Causal attention of one unpacked sequence, `[s, b, h, d] -> [s, b, h*d]`."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        **unused,
    ):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale  # MLA passes its own (YaRN's mscale)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        assert packed_seq_params is None
        rep = query.shape[2] // key.shape[2]
        q = query.permute(1, 2, 0, 3)
        k = key.repeat_interleave(rep, dim=2).permute(1, 2, 0, 3)
        v = value.repeat_interleave(rep, dim=2).permute(1, 2, 0, 3)
        scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out = torch.matmul(probs, v)  # [b, h, s, d]
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def build_reference(cfg: GPTConfig, state_dict: dict) -> GPTModel:
    """A plain GPTModel with Megatron's own position handling, loaded with `state_dict`."""
    # With experts: Megatron's own MoELayer, TopKRouter and SequentialMLP.
    spec = get_gpt_layer_local_spec(
        num_experts=cfg.num_experts,
        moe_grouped_gemm=False,
        normalization=cfg.normalization,
        qk_layernorm=cfg.qk_layernorm,
        # Megatron-Core's MLASelfAttention, its own RoPE (positions 0..s-1, YaRN, mscale).
        **({"multi_latent_attention": True} if cfg.multi_latent_attention else {}),
    )
    if cfg.softmax_type == "vanilla":  # else: the local spec's stock DotProductAttention
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    model = GPTModel(
        config=transformer_config(cfg),
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type=cfg.position_embedding_type,
        rotary_percent=cfg.rotary_percent,
        rotary_base=int(cfg.rotary_base),
    )
    if cfg.num_experts is not None and cfg.add_bias_linear:
        # Megatron's expert adds its bias in place on what a reduce over one rank returned
        # as-is, which autograd refuses; skipping that identity reduce changes no number.
        for name, module in model.named_modules():
            if name.endswith("linear_fc2") and ".local_experts." in name:
                module.explicit_expert_comm = True
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected, unexpected
    assert all("_extra_state" in k or "inv_freq" in k for k in missing), missing
    return model


def reference_loss_and_grads(model: GPTModel, seqs):
    """Mean loss over all unmasked tokens, backward; returns the loss (grads in `.grad`).

    `seqs` holds `(tokens, labels, loss_mask)` per sequence.
    """
    total = sum(float(mask.sum()) for _, _, mask in seqs)
    all_tokens = sum(len(tokens) for tokens, _, _ in seqs)
    # Megatron's router scales each sequence's load-balancing loss by its token count (per-token
    # loss mode); 1 / all tokens makes it the sequence's share of the batch.
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / all_tokens))
    loss_sum = 0.0
    for tokens, labels, mask in seqs:
        positions = torch.arange(len(tokens)).unsqueeze(0)
        losses = model(tokens.unsqueeze(0), positions, None, labels=labels.unsqueeze(0))
        loss = (losses.float()[0] * mask).sum() / total
        loss.backward()
        loss_sum += float(loss.detach())
    return loss_sum


def reference_aux_loss(model: GPTModel, seqs, coeff: float) -> float:
    """The load-balancing loss of the batch, per sequence, from Megatron's own logging tracker.

    Runs forward passes (training mode, gradients on, nothing accumulated).
    """
    all_tokens = sum(len(tokens) for tokens, _, _ in seqs)
    total = 0.0
    for tokens, labels, _ in seqs:
        clear_aux_losses_tracker()
        positions = torch.arange(len(tokens)).unsqueeze(0)
        model(tokens.unsqueeze(0), positions, None, labels=labels.unsqueeze(0))
        # Read after the forward: from megatron-core 0.17 on this is a snapshot, not the store.
        tracker = get_moe_layer_wise_logging_tracker()
        per_layer = tracker["load_balancing_loss"]["values"]  # aux / coeff per layer
        total += float(per_layer.sum()) * coeff * len(tokens) / all_tokens
    model.zero_grad()
    return total


def reference_optimizer(model: GPTModel, *, lr, weight_decay, betas, eps):
    """AdamW with Megatron's default groups: no weight decay on biases and 1-D parameters."""
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1 or n.endswith(".bias")]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=betas,
        eps=eps,
    )


def train_reference(cfg: GPTConfig, *, seed: int, optim, batches, aux_coeff: float = 0.0) -> dict:
    """AdamW steps of the reference on `batches` (one list of sequences per step).

    The model starts from `build_gpt(cfg)` under `seed`, the weights every HDP layout builds.
    Returns the initial weights, every step's loss (and, with `aux_coeff`, load-balancing
    loss), the first step's gradients before clipping and the weights after the last step.
    """
    torch.manual_seed(seed)
    hdp = build_gpt(cfg)
    init = {n: p.detach().clone() for n, p in hdp.named_parameters()}
    model = build_reference(cfg, hdp.state_dict())
    optimizer = reference_optimizer(
        model,
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=(optim.adam_beta1, optim.adam_beta2),
        eps=optim.adam_eps,
    )
    losses, aux, grads = [], [], None
    for seqs in batches:
        if aux_coeff:
            aux.append(reference_aux_loss(model, seqs, aux_coeff))
        optimizer.zero_grad()
        losses.append(reference_loss_and_grads(model, seqs))
        if grads is None:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip_grad)
        optimizer.step()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "aux": aux, "grads": grads, "init": init, "after": after}
