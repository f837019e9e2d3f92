"""The core-attention module HDP puts into Megatron-Core's layer spec (host layer).

Megatron builds it in place of `DotProductAttention` / `TEDotProductAttention`; it gets
THD tensors (`[t, heads, dim]`) and the micro-batch's `HDPPackedSeqParams`, applies RoPE at
the tokens' original positions and runs `hdp_attention` (local or ring). A layer that
Megatron-Core makes a sliding-window layer (`config.window_size`, `window_attn_skip_freq`,
its `is_layer_window_attention`) attends within that window (`attention.window`).

Attention dropout (`attention_dropout`, Megatron's meaning: dropout of the probabilities in
training) is keyed (`attention.dropout`): the masks depend on the tokens, not on where they
run. It computes dense `[heads, q, k]` blocks per document (the math path), on every device:
the flash kernels draw their own Philox masks and cannot take a keyed one.

`softmax_type` (Megatron's meaning, `attention.sinks`): "off-by-one" adds a fixed sink logit 0
per head to every query row's softmax, "learnable" the parameter `softmax_offset` (one logit
per head of this TP rank, Megatron's name, shape, initialisation and checkpoint sharding).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_hdp.attention.dropout import MicroBatchKeys, check_probability
from megatron_hdp.attention.ring import RingAttentionSpec, hdp_attention
from megatron_hdp.attention.rope import RotaryTable
from megatron_hdp.attention.sinks import SINK, check_softmax_type
from megatron_hdp.attention.window import check_window
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
        mtp: The local tokens' shifted targets for multi-token prediction's rolls
            (`megatron.mtp.MTPShift`); None without MTP.
        positions: The local tokens' original positions in their documents, `[T]` int64;
            multi-latent attention rotates at them itself (`megatron.mla`), else None.
    """

    attention: RingAttentionSpec | None = None
    rotary: RotaryTable | None = None
    dropout: MicroBatchKeys | None = None
    mtp: object | None = None
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
        self._tp_group = getattr(pg_collection, "tp", None)
        self.softmax_type = check_softmax_type(getattr(config, "softmax_type", "vanilla"))
        if self.softmax_type == "learnable":
            self.register_parameter("softmax_offset", learnable_softmax_offset(config))
        elif self.softmax_type == "off-by-one":
            self.softmax_offset = torch.zeros(_local_heads(config), dtype=config.params_dtype)
        else:
            self.softmax_offset = None
        if self.softmax_offset is not None and layer_number == 1:
            logger.info(
                "softmax_type %s: one sink logit per head in every query row's softmax",
                self.softmax_type,
            )
        # Megatron-Core's own rule (layer numbers from 1, pipeline offset included), as its
        # DotProductAttention and TEDotProductAttention apply it.
        self.window = None
        if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number
        ):
            self.window = check_window(config.window_size)

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
        sink = () if self.softmax_offset is None else (self.softmax_offset.to(query.device),)
        out = hdp_attention(
            query,
            key,
            value,
            spec,
            softmax_scale=self.softmax_scale,
            dropout=dropout,
            finalize=SINK if sink else None,
            finalize_params=sink,
            window=self.window,
        )
        out = out.reshape(out.shape[0], -1)
        if padded != real:
            out = torch.nn.functional.pad(out, (0, 0, 0, padded - real))
        return out

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Megatron's: the learnable `softmax_offset` split by head over the TP ranks (axis 0).

        Nothing else of this module is saved (off-by-one's zeros are no state). Both groups
        are passed: Megatron's helper falls back to its global TP group only when neither is.
        """
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = {}
        if self.softmax_type == "learnable":
            state = self.state_dict(prefix="", keep_vars=True)
        dp_cp_group = (metadata or {}).get("dp_cp_group")
        if dp_cp_group is None:
            dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(
            state,
            prefix,
            {"softmax_offset": 0},
            sharded_offsets,
            tp_group=self._tp_group or parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=dp_cp_group,
        )


def _local_heads(config) -> int:
    """Query heads of this TP rank."""
    return config.num_attention_heads // config.tensor_model_parallel_size


def learnable_softmax_offset(config) -> torch.nn.Parameter:
    """`softmax_offset` of `softmax_type="learnable"`: one sink logit per head of this TP rank.

    Megatron's name, shape (`[heads / TP]`), dtype (`params_dtype`) and initialisation
    (`config.init_method`, normal with `init_method_std`), except that the logits of all
    heads are drawn and this rank keeps its slice, so the model is the same whatever the TP
    size (as the linear layers under `use_cpu_initialization`); with TP 1 the draw is
    Megatron's. Marked tensor-parallel (partition dim 0): each TP rank holds other heads, so
    the gradient norm counts every rank's (Megatron's own leaves it unmarked: its norm
    counts TP rank 0's alone).
    """
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    heads, local = config.num_attention_heads, _local_heads(config)
    device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
    every = torch.zeros(heads, dtype=config.params_dtype, device=device)
    if config.perform_initialization:
        with torch.no_grad():
            config.init_method(every)
    first = keyed.tensor_parallel_rank(config) * local
    param = torch.nn.Parameter(every[first : first + local].clone())
    set_tensor_model_parallel_attributes(param, True, 0, 1)
    return param
