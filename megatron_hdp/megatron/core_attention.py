"""The core-attention module HDP puts into Megatron-Core's layer spec (host layer).

Megatron builds it in place of `DotProductAttention` / `TEDotProductAttention`; it gets
THD tensors (`[t, heads, dim]`) and the micro-batch's `HDPPackedSeqParams`, applies RoPE at
the tokens' original positions and runs `hdp_attention` (local or ring).

Attention dropout (`attention_dropout`, Megatron's meaning: dropout of the probabilities in
training) is keyed (`attention.dropout`): the masks depend on the tokens, not on where they
run. It computes dense `[heads, q, k]` blocks per document (the math path), on every device:
the flash kernels draw their own Philox masks and cannot take a keyed one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megatron_hdp.attention.dropout import MicroBatchKeys, check_probability
from megatron_hdp.attention.ring import RingAttentionSpec, hdp_attention
from megatron_hdp.attention.rope import RotaryTable
from megatron_hdp.megatron import dropout as keyed

logger = logging.getLogger(__name__)


@dataclass
class HDPPackedSeqParams(PackedSeqParams):
    """Megatron's THD parameters plus what HDP attention needs for one micro-batch.

    Attributes:
        attention: Documents, ring and backend of the micro-batch on this rank.
        rotary: cos/sin at the local tokens' original positions; None without RoPE.
        dropout: What identifies the local tokens, for keyed dropout; None when the model
            has no dropout.
        positions: The local tokens' original positions in their documents, `[T]` int64;
            multi-latent attention rotates at them itself (`megatron.mla`), else None.
    """

    attention: RingAttentionSpec | None = None
    rotary: RotaryTable | None = None
    dropout: MicroBatchKeys | None = None
    positions: torch.Tensor | None = None


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
        self.dropout = check_probability(float(dropout), "attention_dropout")
        if self.dropout and layer_number == 1:
            logger.info(
                "attention dropout %g: keyed masks on HDP's dense math kernel ([heads, q, k] "
                "scores per document), not the configured flash kernel",
                self.dropout,
            )
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
        """`[t, h, d]` q/k/v of this rank's tokens -> `[t, h * dv]` attention output.

        v's head dim dv may differ from q's and k's (multi-latent attention).

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
        # The layer's bias-dropout-adds follow (also when the layer is recomputed).
        keyed.set_current(params.dropout)
        dropout = None
        if self.training and self.dropout > 0:
            if params.dropout is None:
                raise ValueError(
                    f"attention_dropout {self.dropout} needs the micro-batch's dropout keys "
                    "(HDPPackedSeqParams.dropout)"
                )
            heads = query.shape[1]
            dropout = params.dropout.attention(
                self.dropout, self.layer_number, keyed.tensor_parallel_rank(self.config) * heads
            )
        out = hdp_attention(
            query, key, value, spec, softmax_scale=self.softmax_scale, dropout=dropout
        )
        out = out.reshape(out.shape[0], -1)
        if padded != real:
            out = torch.nn.functional.pad(out, (0, 0, 0, padded - real))
        return out
