"""The core-attention module HDP puts into Megatron-Core's layer spec (host layer).

Megatron builds it in place of `DotProductAttention` / `TEDotProductAttention`; it gets
THD tensors (`[t, heads, dim]`) and the micro-batch's `HDPPackedSeqParams`, applies RoPE at
the tokens' original positions and runs `hdp_attention` (local or ring).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megatron_hdp.attention.ring import RingAttentionSpec, hdp_attention
from megatron_hdp.attention.rope import RotaryTable


@dataclass
class HDPPackedSeqParams(PackedSeqParams):
    """Megatron's THD parameters plus what HDP attention needs for one micro-batch.

    Attributes:
        attention: Documents, ring and backend of the micro-batch on this rank.
        rotary: cos/sin at the local tokens' original positions; None without RoPE.
    """

    attention: RingAttentionSpec | None = None
    rotary: RotaryTable | None = None


class HDPCoreAttention(MegatronModule):
    """Causal HDP attention with Megatron's core-attention constructor and forward signature."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        **unused,
    ) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"HDP attention has no dropout; got attention_dropout={dropout}")
        if attention_type != "self":
            raise ValueError(f"HDP attention supports self-attention only, got {attention_type!r}")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"HDP attention is causal; got attn_mask_type {attn_mask_type}")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """`[t, h, d]` q/k/v of this rank's tokens -> `[t, h * d]` attention output.

        Collective over the micro-batch's ring (see `hdp_attention`).
        """
        params = packed_seq_params
        if not isinstance(params, HDPPackedSeqParams) or params.attention is None:
            raise ValueError(
                "HDPCoreAttention needs the micro-batch's HDPPackedSeqParams (THD format); got "
                f"{type(packed_seq_params).__name__}"
            )
        if attention_bias is not None:
            raise ValueError("HDP attention does not support an attention bias")
        spec = params.attention
        # Sequence parallelism pads a micro-batch's tokens to a multiple of TP (at the end);
        # the pad rows take no part in attention and get a zero output.
        padded, real = query.shape[0], spec.shards[spec.position].num_tokens
        if padded != real:
            query, key, value = query[:real], key[:real], value[:real]
        rotary = params.rotary
        if rotary is not None:
            query, key = rotary.apply(query), rotary.apply(key)
        out = hdp_attention(query, key, value, spec, softmax_scale=self.softmax_scale)
        out = out.reshape(out.shape[0], -1)
        if padded != real:
            out = torch.nn.functional.pad(out, (0, 0, 0, padded - real))
        return out
