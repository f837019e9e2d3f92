"""Multi-latent attention (Megatron-Core's `MLASelfAttention`) on HDP micro-batches (host).

The layer stays Megatron-Core's, with its own submodules (the q/kv down and up projections,
their norms, the output projection); only its core attention is HDP's (`hdp_layer_spec`),
which takes q/k of `qk_head_dim + qk_pos_emb_head_dim` channels per head and v of
`v_head_dim` (ring messages and kernels: `attention.kv_message`, `kernels.head_dims`).

RoPE. MLA rotates the decoupled channels of q and k itself, inside the layer, from its own
rotary module (`RotaryEmbedding` for --rope-type rope, `YarnRotaryEmbedding` with its mscale
for yarn). Under THD Megatron restarts positions at 0 for every packed piece, but an HDP ring
member holds two zigzag chunks from the middle of a document. `rope_at_original_positions`
wraps each layer's rotary module (`OriginalPositionRotary`): it asks the module for the
table up to the longest document, exactly as stock Megatron builds it, and hands MLA the
rows at the local tokens' original positions (`HDPPackedSeqParams.positions`), one row per
packed token. Megatron's THD RoPE takes such a table position by position (its "exact
mapping" case, `freqs.size(0) == cu_seqlens[-1]`, in core 0.16 and 0.19 alike), so q and k
are rotated at their original positions with MLA's own formulas (interleaving, YaRN's
frequencies and mscale included).
"""

from __future__ import annotations

import logging

import torch

from megatron_hdp.megatron.mla_args import mla_problems  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)


def without_transformer_engine() -> None:
    """Make MLA's constructor work where Transformer Engine is not installed (core 0.16).

    Megatron-Core 0.16.1's `multi_latent_attention` sets `HAVE_TE` when its TE extension
    module imports, which it does without TE (placeholders); its constructor then calls
    `isinstance(self.linear_proj, TELinear)` with a placeholder that is no type and fails.
    Where `transformer_engine` cannot be found, `HAVE_TE` is set to what it means: False
    (it guards only that check). Core 0.19 already has False there. Idempotent.
    """
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if multi_latent_attention.HAVE_TE and importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False
        logger.debug("Transformer Engine is not installed: MLA's TE-only output path is off")


def mla_config_fields(cfg) -> tuple[type, dict]:
    """`(MLATransformerConfig, its MLA fields)` of `cfg` (a `GPTConfig`).

    Also readies Megatron-Core's MLA module for a machine without Transformer Engine
    (`without_transformer_engine`), before any MLA layer is built from the config.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    without_transformer_engine()
    fields = {
        "multi_latent_attention": True,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_head_dim": cfg.qk_head_dim,
        "qk_pos_emb_head_dim": cfg.qk_pos_emb_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "rotary_base": cfg.rotary_base,
        "rotary_percent": cfg.rotary_percent,
        "rotary_scaling_factor": cfg.rotary_scaling_factor,
        "mscale": cfg.mscale,
        "mscale_all_dim": cfg.mscale_all_dim,
    }
    if cfg.rope_type is not None:  # else MLATransformerConfig's default ("yarn"), as Megatron-LM
        fields["rope_type"] = cfg.rope_type
    return MLATransformerConfig, fields


class OriginalPositionRotary(torch.nn.Module):
    """An MLA layer's rotary module that gives the table at HDP's original positions.

    MLA calls `get_rotary_seq_len(..., packed_seq_params)` and then the module itself, in
    that order, in one method (`get_query_key_value_tensors`, core 0.16 and 0.19): the first
    call takes the micro-batch's `HDPPackedSeqParams`, the second returns the rows of the
    wrapped module's table at `params.positions` (with YaRN's mscale where it has one).
    The wrapped module stays a submodule (its buffers are not persistent: no checkpoint
    key changes).
    """

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self._params = None

    def get_rotary_seq_len(
        self,
        inference_context,
        transformer,
        transformer_input,
        transformer_config,
        packed_seq_params=None,
        **kwargs,
    ) -> int:
        """The longest document of the micro-batch; remembers its parameters."""
        positions = getattr(packed_seq_params, "positions", None)
        spec = getattr(packed_seq_params, "attention", None)
        if positions is None or spec is None:
            raise ValueError(
                "HDP's multi-latent attention needs the micro-batch's HDPPackedSeqParams with "
                f"the tokens' original positions; got {type(packed_seq_params).__name__}"
            )
        self._params = packed_seq_params
        return max(spec.doc_lengths)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, **kwargs):
        """The table rows of the local tokens, `[T, 1, 1, R]` (and YaRN's mscale)."""
        params, self._params = self._params, None
        if params is None:
            raise RuntimeError("OriginalPositionRotary called before get_rotary_seq_len")
        result = self.inner(max_seq_len, packed_seq=True)
        if isinstance(result, tuple):  # YaRN: (table, mscale)
            table, mscale = result
            return table.index_select(0, params.positions.to(table.device)), mscale
        return result.index_select(0, params.positions.to(result.device))


def rope_at_original_positions(model: torch.nn.Module) -> int:
    """Wrap the rotary module of every MLA layer of `model`; returns how many were wrapped.

    Raises ValueError where a layer would apply fused RoPE (`apply_rope_fusion`): the fused
    kernels read cached cos/sin by packed-piece position, not the original positions.
    """
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    count = 0
    for module in model.modules():
        if not isinstance(module, MultiLatentAttention):
            continue
        if module.config.apply_rope_fusion:
            raise ValueError(
                "multi-latent attention with apply_rope_fusion: HDP applies MLA's RoPE "
                "unfused at the original positions (set apply_rope_fusion=False)"
            )
        if not isinstance(module.rotary_pos_emb, OriginalPositionRotary):
            module.rotary_pos_emb = OriginalPositionRotary(module.rotary_pos_emb)
            count += 1
    return count
