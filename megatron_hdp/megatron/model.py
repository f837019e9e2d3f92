"""Build a Megatron-Core `GPTModel` whose attention is HDP attention (host layer)."""

from __future__ import annotations

import contextvars
import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    get_transformer_layer_offset,
)
from torch.nn import functional

from megatron_hdp.attention.dropout import check_probability
from megatron_hdp.attention.sinks import check_softmax_type
from megatron_hdp.distributed.layout import ParallelDims, moe_problems, pipeline_problems
from megatron_hdp.megatron import compat
from megatron_hdp.megatron.core_attention import HDPCoreAttention
from megatron_hdp.megatron.dropout import install_keyed_dropout
from megatron_hdp.megatron.moe import GlobalIndexSequentialMLP, SequenceAuxLossRouter
from megatron_hdp.scheduler.cost import ModelShape
from megatron_hdp.scheduler.windows import check_window, window_problems, windowed_layers

POSITION_EMBEDDINGS = ("rope", "learned_absolute")
_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The model shape (Megatron flag names in parentheses)."""

    num_layers: int = 2
    """Transformer layers (--num-layers)."""
    hidden_size: int = 64
    """Hidden size (--hidden-size)."""
    num_attention_heads: int = 4
    """Query heads (--num-attention-heads)."""
    num_query_groups: int | None = None
    """Key/value heads for GQA; None = one per query head (--num-query-groups)."""
    ffn_hidden_size: int | None = None
    """MLP hidden size; None = 4 x hidden (--ffn-hidden-size)."""
    vocab_size: int = 256
    """Vocabulary size, padded by the caller if needed (--vocab-size)."""
    max_position_embeddings: int = 1 << 20
    """Longest position (--max-position-embeddings); sizes learned absolute embeddings."""
    position_embedding_type: str = "rope"
    """"rope" or "learned_absolute" (--position-embedding-type)."""
    rotary_base: float = 10000.0
    """RoPE base (--rotary-base)."""
    rotary_percent: float = 1.0
    """Share of each head's channels RoPE rotates, the first `int(head_dim * p)`; the rest
    pass through, as Megatron-Core's `RotaryEmbedding` (--rotary-percent)."""
    rotary_interleaved: bool = False
    """Rotate interleaved channel pairs (0, 1), (2, 3), ... instead of the two halves
    (--rotary-interleaved)."""
    kv_channels: int | None = None
    """Channels per attention head; None = hidden / heads (--kv-channels)."""
    qk_layernorm: bool = False
    """Normalise each head's queries and keys (the --normalization class) before RoPE
    (--qk-layernorm)."""
    softmax_type: str = "vanilla"
    """The attention softmax, Megatron's meaning (--softmax-type): "vanilla", "off-by-one"
    (a sink logit 0 per head) or "learnable" (a learned sink logit per head, the core
    attention's `softmax_offset`); `attention.sinks`."""
    normalization: str = "RMSNorm"
    """"RMSNorm" or "LayerNorm" (--normalization)."""
    swiglu: bool = True
    """Gated SiLU MLP (--swiglu)."""
    add_bias_linear: bool = False
    """Biases in linear layers (--disable-bias-linear turns them off in Megatron)."""
    init_method_std: float = 0.02
    """Weight init standard deviation (--init-method-std)."""
    tie_embeddings: bool = False
    """Share input embedding and output layer (Megatron's default unless
    --untie-embeddings-and-output-weights)."""
    hidden_dropout: float = 0.0
    """Dropout of the embeddings and after attention and MLP (--hidden-dropout); keyed by
    token identity (`megatron.dropout`), so every layout draws the same masks."""
    attention_dropout: float = 0.0
    """Dropout of the attention probabilities (--attention-dropout); keyed
    (`attention.dropout`)."""
    params_dtype: str = "float32"
    """"float32", "bfloat16", "float16" (Megatron-LM's --fp16, the drop-in only) or
    "float64"."""
    tensor_model_parallel_size: int = 1
    """Tensor-parallel ranks per HDP replica (--tensor-model-parallel-size): attention heads,
    KV groups, MLP and vocabulary are split over them as Megatron does."""
    sequence_parallel: bool = False
    """Split the norm and dropout regions over the TP ranks along the tokens
    (--sequence-parallel); needs tensor parallelism."""
    fp8: bool = False
    """The layers compute in FP8 (--fp8-format, Transformer Engine on GPU): every
    micro-batch is padded to FP8's multiple of tokens (`step.token_multiple`)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages per HDP replica (--pipeline-model-parallel-size): the layers are split
    evenly over them and each replica runs Megatron's 1F1B schedule."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline stage (interleaved 1F1B; Megatron-LM's value from
    --num-layers-per-virtual-pipeline-stage); None = one. Chunk `c` of stage `s` holds the
    layers of virtual stage `c * PP + s`, as Megatron splits them."""
    num_experts: int | None = None
    """Experts per MoE layer; None = dense MLP (--num-experts)."""
    moe_router_topk: int = 2
    """Experts each token is routed to (--moe-router-topk)."""
    moe_ffn_hidden_size: int | None = None
    """Hidden size of each expert; None = ffn_hidden_size (--moe-ffn-hidden-size)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss, computed per sequence (`moe.py`)
    (--moe-aux-loss-coeff)."""
    expert_model_parallel_size: int = 1
    """Ranks the experts are split over, inside one replica: a divisor of the TP size
    (--expert-model-parallel-size)."""
    experts_across_replicas: bool = False
    """TP 1 with the experts split over pool ranks (EP over replicas): only the Megatron-LM
    drop-in runs it, padding each EP group's micro-batches to lock step (`ep_lockstep`)."""
    moe_token_dispatcher_type: str = "allgather"
    """How tokens reach the experts of other EP ranks: "allgather" or "alltoall"
    (--moe-token-dispatcher-type)."""
    mtp_num_layers: int | None = None
    """Multi-token prediction depths, one MTP layer each; None = none (--mtp-num-layers).
    Megatron-Core's MTP block, with HDP's shifted inputs and labels (`mtp.py`)."""
    mtp_loss_scaling_factor: float = 0.1
    """The MTP losses' weight, shared by the depths (--mtp-loss-scaling-factor)."""
    window_size: tuple[int, int] | None = None
    """Sliding-window attention `(left, 0)`: each query sees `left` earlier tokens and its
    own (--window-size, Megatron-Core's meaning); None: full causal attention."""
    window_attn_skip_freq: int | tuple[int, ...] | None = None
    """Which layers keep full attention (--window-attn-skip-freq): an int N makes every N-th
    layer full, a tuple has one 1 (windowed) or 0 (full) per layer; None: all windowed."""
    multi_latent_attention: bool = False
    """Megatron-Core's multi-latent attention (`MLASelfAttention`) with HDP's core attention
    (--multi-latent-attention); the fields below are its shape and RoPE (`megatron.mla`)."""
    q_lora_rank: int | None = None
    """Rank of the queries' low-rank projection; None: one full projection (--q-lora-rank)."""
    kv_lora_rank: int = 32
    """Rank of the keys' and values' low-rank projection (--kv-lora-rank)."""
    qk_head_dim: int = 128
    """Query/key channels per head without RoPE (--qk-head-dim)."""
    qk_pos_emb_head_dim: int = 64
    """The decoupled RoPE channels per head of queries and keys (--qk-pos-emb-head-dim)."""
    v_head_dim: int = 128
    """Value channels per head (--v-head-dim)."""
    rope_type: str | None = None
    """MLA's RoPE: "rope" or "yarn"; None: Megatron-Core's default for MLA, "yarn"
    (--rope-type)."""
    rotary_scaling_factor: float = 1.0
    """YaRN's scaling factor (--rotary-scaling-factor)."""
    mscale: float = 1.0
    """YaRN's mscale (--mscale)."""
    mscale_all_dim: float = 0.0
    """YaRN's mscale of all dims, also in the softmax scale (--mscale-all-dim)."""

    def __post_init__(self) -> None:
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"position_embedding_type {self.position_embedding_type!r} is not one of "
                f"{POSITION_EMBEDDINGS}"
            )
        if self.params_dtype not in _DTYPES:
            raise ValueError(f"params_dtype {self.params_dtype!r} is not one of {tuple(_DTYPES)}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}"
            )
        self._check_head_shape()
        check_softmax_type(self.softmax_type)
        if self.multi_latent_attention:
            self._check_mla()
        groups = self.num_query_groups or self.num_attention_heads
        if self.num_attention_heads % groups:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_query_groups {groups}"
            )
        tp = self.tensor_model_parallel_size
        if tp < 1:
            raise ValueError(f"tensor_model_parallel_size must be >= 1, got {tp}")
        if self.num_attention_heads % tp:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"tensor_model_parallel_size {tp}"
            )
        if groups % tp and tp % groups:
            raise ValueError(
                f"num_query_groups {groups} and tensor_model_parallel_size {tp}: one must "
                "divide the other (Megatron splits or replicates the KV groups)"
            )
        if self.sequence_parallel and tp == 1:
            raise ValueError("sequence_parallel needs tensor_model_parallel_size > 1")
        for name in ("hidden_dropout", "attention_dropout"):
            check_probability(getattr(self, name), name)
        if self.vocab_size % tp:
            raise ValueError(
                f"vocab_size {self.vocab_size} is not divisible by tensor_model_parallel_size "
                f"{tp} (pad it: make_vocab_size_divisible_by x TP)"
            )
        for problem in pipeline_problems(
            num_layers=self.num_layers, pp=self.pipeline_model_parallel_size
        ):
            raise ValueError(problem)
        self._check_chunks()
        for problem in moe_problems(
            num_experts=self.num_experts,
            topk=self.moe_router_topk,
            ep=self.expert_model_parallel_size,
            tp=tp,
            sequence_parallel=self.sequence_parallel,
            dispatcher=self.moe_token_dispatcher_type,
            pp=self.pipeline_model_parallel_size,
            bias=self.add_bias_linear,
            across_replicas=self.experts_across_replicas,
        ):
            raise ValueError(problem)
        if self.moe_aux_loss_coeff < 0:
            raise ValueError(f"moe_aux_loss_coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        self._check_mtp()

    def _check_mtp(self) -> None:
        """Raise ValueError for an MTP setting HDP cannot run."""
        if self.mtp_num_layers is None:
            return
        if self.mtp_num_layers < 1:
            raise ValueError(f"mtp_num_layers must be >= 1 (or None), got {self.mtp_num_layers}")
        if self.pipeline_model_parallel_size > 1:
            raise ValueError(
                f"mtp_num_layers {self.mtp_num_layers} with pipeline_model_parallel_size "
                f"{self.pipeline_model_parallel_size}: multi-token prediction runs with one "
                "pipeline stage only under HDP"
            )

    def _check_chunks(self) -> None:
        """Raise ValueError for virtual pipeline stages HDP cannot split evenly."""
        vp = self.virtual_pipeline_model_parallel_size
        if vp is None:
            return
        pp = self.pipeline_model_parallel_size
        if vp < 1 or pp == 1:
            raise ValueError(
                f"virtual_pipeline_model_parallel_size {vp} needs pipeline parallelism and a "
                f"value >= 1 (pipeline_model_parallel_size {pp})"
            )
        if self.num_layers % (pp * vp):
            raise ValueError(
                f"num_layers {self.num_layers} is not divisible by {pp} stages x {vp} model "
                "chunks (every chunk holds the same number of layers)"
            )
        for problem in window_problems(
            self.window_size,
            self.window_attn_skip_freq,
            num_layers=self.num_layers,
        ):
            raise ValueError(problem)

    def _check_mla(self) -> None:
        """Raise ValueError for an MLA shape or RoPE HDP cannot run, naming the value."""
        from megatron_hdp.megatron.mla_args import mla_problems

        problems = mla_problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    def _check_head_shape(self) -> None:
        """Raise ValueError for a head size or RoPE share HDP attention cannot run."""
        if self.kv_channels is not None and self.kv_channels < 1:
            raise ValueError(f"kv_channels must be >= 1, got {self.kv_channels}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
        if self.multi_latent_attention:
            return  # MLA rotates its decoupled channels only (`_check_mla`)
        rotary = int(self.head_dim * self.rotary_percent)
        if self.position_embedding_type == "rope" and (rotary < 2 or rotary % 2):
            raise ValueError(
                f"rotary_percent {self.rotary_percent} of head dim {self.head_dim} rotates "
                f"{rotary} channels: RoPE needs an even number >= 2"
            )

    @property
    def layers_per_stage(self) -> int:
        """Transformer layers on each pipeline stage."""
        return self.num_layers // self.pipeline_model_parallel_size

    @property
    def num_chunks(self) -> int:
        """Model chunks per pipeline stage (1 without virtual pipeline stages)."""
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def layers_per_chunk(self) -> int:
        """Transformer layers in each model chunk (each stage's without virtual stages)."""
        return self.layers_per_stage // self.num_chunks

    def first_layer(self, stage: int, chunk: int = 0) -> int:
        """The global index (from 0) of the first layer of `chunk` on `stage`."""
        return (chunk * self.pipeline_model_parallel_size + stage) * self.layers_per_chunk

    @property
    def head_dim(self) -> int:
        """Query/key channels per attention head.

        kv_channels, else hidden / heads; with MLA qk_head_dim + qk_pos_emb_head_dim.
        """
        if self.multi_latent_attention:
            return self.qk_head_dim + self.qk_pos_emb_head_dim
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    @property
    def head_dim_v(self) -> int:
        """Value channels per attention head: head_dim, or MLA's v_head_dim."""
        return self.v_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Hidden size of each expert (moe_ffn_hidden_size, else the dense MLP's)."""
        if self.moe_ffn_hidden_size is not None:
            return self.moe_ffn_hidden_size
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def expert_tensor_parallel_size(self) -> int:
        """TP ranks each expert is split over: TP / EP (EP x ETP = the replica's TP ranks)."""
        if self.experts_across_replicas:
            return 1
        return self.tensor_model_parallel_size // self.expert_model_parallel_size

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of the parameters."""
        return _DTYPES[self.params_dtype]


def model_parallel_dims(cfg: GPTConfig, world_size: int) -> ParallelDims:
    """The parallel layout of `world_size` ranks running replicas of `cfg`."""
    return ParallelDims(
        world_size=world_size,
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        num_layers=cfg.num_layers,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        sequence_parallel=cfg.sequence_parallel,
        num_experts=cfg.num_experts,
        moe_router_topk=cfg.moe_router_topk,
        moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
    )


def model_shape(cfg: GPTConfig, kernel: str | None = None) -> ModelShape:
    """The cost model's view of a model configuration run by attention `kernel`.

    `kernel` is the job's resolved attention kernel name (`--hdp-attention-backend` after
    start-up): MLA's v is priced padded where that kernel pads it (`kernels.head_dims`).
    """
    from megatron_hdp.attention.kernels.head_dims import PAD_SUFFIX

    return ModelShape(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        ffn_hidden_size=cfg.ffn_hidden_size,
        vocab_size=cfg.vocab_size,
        swiglu=cfg.swiglu,
        num_experts=cfg.num_experts,
        moe_router_topk=cfg.moe_router_topk,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        window=check_window(cfg.window_size),
        windowed_layers=sum(
            windowed_layers(cfg.num_layers, cfg.window_size, cfg.window_attn_skip_freq)
        ),
        multi_latent_attention=cfg.multi_latent_attention,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_head_dim,
        qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim,
        v_head_dim=cfg.v_head_dim,
        padded_v=bool(cfg.multi_latent_attention and kernel and kernel.endswith(PAD_SUFFIX)),
        mtp_num_layers=cfg.mtp_num_layers or 0,
    )


def transformer_config(cfg: GPTConfig) -> TransformerConfig:
    """Megatron `TransformerConfig` for `cfg`: unfused kernels, per-token loss.

    With multi-latent attention an `MLATransformerConfig` with its shape and RoPE fields.
    """
    config_class, extra = TransformerConfig, {}
    if cfg.multi_latent_attention:
        from megatron_hdp.megatron.mla import mla_config_fields

        config_class, extra = mla_config_fields(cfg)
    return config_class(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        qk_layernorm=cfg.qk_layernorm,
        softmax_type=cfg.softmax_type,
        rotary_interleaved=cfg.rotary_interleaved,
        ffn_hidden_size=cfg.ffn_hidden_size,
        normalization=cfg.normalization,
        gated_linear_unit=cfg.swiglu,
        activation_func=functional.silu if cfg.swiglu else functional.gelu,
        add_bias_linear=cfg.add_bias_linear,
        init_method_std=cfg.init_method_std,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        params_dtype=cfg.dtype,
        pipeline_dtype=cfg.dtype,
        bf16=cfg.dtype == torch.bfloat16,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        calculate_per_token_loss=True,
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        sequence_parallel=cfg.sequence_parallel,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
        # HDP micro-batches hold different token counts: stages exchange shapes first.
        variable_seq_lengths=cfg.pipeline_model_parallel_size > 1,
        # Interleaved stages send and receive between the same two ranks in one step:
        # Megatron-LM's default there (--overlap-p2p-communication) issues them separately.
        **({"overlap_p2p_comm": True, "batch_p2p_comm": False} if cfg.num_chunks > 1 else {}),
        mtp_num_layers=cfg.mtp_num_layers,
        mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor,
        window_size=None if cfg.window_size is None else tuple(cfg.window_size),
        # Megatron-Core tells a pattern by `isinstance(..., list)`.
        window_attn_skip_freq=(
            list(cfg.window_attn_skip_freq)
            if isinstance(cfg.window_attn_skip_freq, tuple)
            else cfg.window_attn_skip_freq
        ),
        **(_moe_settings(cfg) or _dense_settings(cfg)),
        **extra,
    )


def _dense_settings(cfg: GPTConfig) -> dict:
    """Settings a dense model needs: a pipelined one takes an (unused) alltoall dispatcher.

    Megatron refuses variable sequence lengths with its default (allgather) token
    dispatcher even without experts.
    """
    return {"moe_token_dispatcher_type": "alltoall"} if cfg.pipeline_model_parallel_size > 1 else {}


def _moe_settings(cfg: GPTConfig) -> dict:
    """The MoE fields of Megatron's `TransformerConfig` (none for a dense model).

    Megatron's "aux_loss" balancing type stays on so that its router calls the aux-loss
    hook, which `moe.SequenceAuxLossRouter` replaces by a per-sequence loss.
    """
    if cfg.num_experts is None:
        return {}
    return {
        "num_moe_experts": cfg.num_experts,
        "moe_router_topk": cfg.moe_router_topk,
        "moe_ffn_hidden_size": cfg.expert_ffn_hidden_size,
        "moe_aux_loss_coeff": cfg.moe_aux_loss_coeff,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_token_dispatcher_type": cfg.moe_token_dispatcher_type,
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": cfg.expert_model_parallel_size,
        "expert_tensor_parallel_size": cfg.expert_tensor_parallel_size,
    }


class SequenceParallelNorm:
    """Megatron's torch norm (LayerNorm or RMSNorm) inside a sequence-parallel region.

    Megatron's `WrappedTorchNorm` refuses sequence parallelism, although the norm itself is
    per token; it only needs its parameters marked `sequence_parallel`, so that
    `finalize_model_grads` sums their gradients over the TP ranks (each saw a share of the
    tokens). Megatron's fused norms need Apex or Transformer Engine, absent on CPU. (A class,
    not a function: Megatron's `build_module` returns plain functions uncalled.)
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs):
        """A `WrappedTorchNorm` whose parameters are marked for the TP gradient all-reduce."""
        plain = copy.copy(config)  # not dataclasses.replace: no second __post_init__
        plain.sequence_parallel = False
        norm = WrappedTorchNorm(plain, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def hdp_norm(cfg: GPTConfig) -> type:
    """The one norm class of every layer and of the final norm: torch's, whatever is installed.

    Megatron picks its norms from what is installed: the local layer spec Apex's
    `FusedLayerNorm` when Apex is, the block's final norm (`LayerNormImpl`) TE's `TENorm` when
    Transformer Engine is. HDP names torch's norm for all of them, so that a model computes
    the same with or without TE or Apex (sequence-parallel-ready under `sequence_parallel`).
    """
    return SequenceParallelNorm if cfg.sequence_parallel else WrappedTorchNorm


def hdp_layer_spec(cfg: GPTConfig) -> ModuleSpec:
    """Megatron's local GPT layer spec with `HDPCoreAttention` as the core attention.

    With experts, the MLP is Megatron's `MoELayer` with HDP's router (per-sequence aux loss)
    and experts initialised by their global index (`moe.py`). Both norms are `hdp_norm`'s,
    and so are the per-head query and key norms of `qk_layernorm` (Megatron's attention
    applies them to q and k before the core attention, where HDP applies RoPE: norm, then
    rotation, as Megatron's own order).
    """
    spec = get_gpt_layer_local_spec(
        num_experts=cfg.num_experts,
        moe_grouped_gemm=False,
        normalization=cfg.normalization,
        **({"multi_latent_attention": True} if cfg.multi_latent_attention else {}),
    )
    spec.module = SeededTransformerLayer
    spec.submodules.self_attention.submodules.core_attention = HDPCoreAttention
    if cfg.num_experts is not None:
        moe = compat.submodules_of(spec.submodules.mlp)
        moe.router = SequenceAuxLossRouter
        moe.experts = compat.with_module(moe.experts, GlobalIndexSequentialMLP)
    spec.submodules.input_layernorm = hdp_norm(cfg)
    spec.submodules.pre_mlp_layernorm = hdp_norm(cfg)
    if cfg.qk_layernorm:
        attention = spec.submodules.self_attention.submodules
        if cfg.multi_latent_attention:  # MLA's norms of the compressed q and kv (its spec's)
            attention.kv_layernorm = hdp_norm(cfg)
            if cfg.q_lora_rank is not None:  # no compressed q, no norm (core 0.19 refuses one)
                attention.q_layernorm = hdp_norm(cfg)
        else:
            attention.q_layernorm = attention.k_layernorm = hdp_norm(cfg)
    return spec


def hdp_block_spec(cfg: GPTConfig) -> TransformerBlockSubmodules:
    """One stage's decoder: `hdp_layer_spec` per layer of the stage, the final norm.

    The final norm is the layers' class (`hdp_norm`), not Megatron's `LayerNormImpl`, which
    depends on what is installed. Megatron numbers the layers globally itself (the stage's
    offset is added to each).
    """
    return TransformerBlockSubmodules(
        layer_specs=[hdp_layer_spec(cfg)] * cfg.layers_per_chunk, layer_norm=hdp_norm(cfg)
    )


_INIT_SEED: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "hdp_init_seed", default=None
)


class SeededTransformerLayer(TransformerLayer):
    """Megatron's `TransformerLayer`, initialised from a seed of its own global layer number.

    Inside `build_gpt` every layer draws its weights from `seed + global layer number`
    (the global RNG stream is left as it was), so a layer has the same weights on whichever
    pipeline stage it lives and whatever was built before it. Outside, it is the plain layer.
    """

    def __init__(self, config, submodules, layer_number: int = 1, **kwargs):
        base = _INIT_SEED.get()
        if base is None:
            super().__init__(config, submodules, layer_number, **kwargs)
            return
        offset = get_transformer_layer_offset(config, kwargs.get("vp_stage"))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(base + layer_number + offset)
            super().__init__(config, submodules, layer_number, **kwargs)


def _redraw_output_layer(model: GPTModel, cfg: GPTConfig, seed: int, tp_rank: int) -> None:
    """Draw the untied output layer from its own seed (as Megatron's CPU init, TP-sliced).

    Megatron draws it after everything else the rank builds, which differs between pipeline
    layouts (the last stage has no embedding); its own seed makes it layout-independent.
    """
    if cfg.tie_embeddings or not model.post_process:
        return
    tp = cfg.tensor_model_parallel_size
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        _initialize_affine_weight_cpu(
            model.output_layer.weight,
            cfg.vocab_size,
            cfg.hidden_size,
            cfg.vocab_size // tp,
            0,
            model.config.init_method,
            params_dtype=cfg.dtype,
            rank=tp_rank,
            world_size=tp,
            skip_set_tensor_parallel_attributes=True,
        )


def build_gpt(cfg: GPTConfig, *, stage: int = 0, tp_rank: int = 0, chunk: int = 0) -> GPTModel:
    """One pipeline stage of a `GPTModel` that runs HDP micro-batches (`HDPPackedSeqParams`).

    With virtual pipeline stages (`cfg.num_chunks` > 1) it is model chunk `chunk` of the
    stage: the embedding on chunk 0 of stage 0, the output layer on the last chunk of the
    last stage, the layers of virtual stage `chunk x PP + stage` in between.

    Megatron's own RoPE is switched off (`position_embedding_type="none"`) because under
    THD it restarts positions at every packed piece; `HDPCoreAttention` applies RoPE at the
    original positions instead. Parameters and checkpoints are those of the plain model.

    The weights depend only on the torch seed set before the call, not on the layout: the
    embedding is drawn first (always on stage 0), every layer from a seed of its global
    number and the output layer from one of its own. `stage` and `tp_rank` must be this
    rank's (Megatron's parallel state must hold the same layout).
    """
    position_type = "none" if cfg.position_embedding_type == "rope" else cfg.position_embedding_type
    last = cfg.pipeline_model_parallel_size - 1
    chunked = {"vp_stage": chunk} if cfg.num_chunks > 1 else {}
    return build_seeded(
        cfg,
        lambda: GPTModel(
            config=transformer_config(cfg),
            transformer_layer_spec=hdp_block_spec(cfg),
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.max_position_embeddings,
            pre_process=stage == 0 and chunk == 0,
            post_process=stage == last and chunk == cfg.num_chunks - 1,
            share_embeddings_and_output_weights=cfg.tie_embeddings,
            position_embedding_type=position_type,
            **chunked,
            mtp_block_spec=hdp_mtp_block_spec(cfg),
        ),
        tp_rank=tp_rank,
    )


def hdp_mtp_block_spec(cfg: GPTConfig, layer_spec: ModuleSpec | None = None):
    """The MTP block of `cfg.mtp_num_layers` layers; None without MTP.

    Each layer wraps `layer_spec` (default `hdp_layer_spec`).
    """
    if cfg.mtp_num_layers is None:
        return None
    from megatron_hdp.megatron.mtp import mtp_block_spec

    layer = hdp_layer_spec(cfg) if layer_spec is None else layer_spec
    return mtp_block_spec(layer, hdp_norm(cfg), cfg.mtp_num_layers)


def build_seeded(cfg: GPTConfig, construct: Callable[[], GPTModel], *, tp_rank: int) -> GPTModel:
    """`construct()`, a `GPTModel` of `SeededTransformerLayer`s, initialised as `build_gpt`.

    The weights depend on the torch seed alone: the embedding comes from the global stream,
    every layer from a seed of its global number, the output layer from one of its own.
    Hidden dropout is keyed by token identity (`dropout.install_keyed_dropout`).

    Megatron-LM's model builder under `--hdp` uses it, so that its weights are
    `pretrain_hdp.py`'s for the same seed, whatever the layout.
    """
    base = int(torch.randint(0, 2**31, ()))
    token = _INIT_SEED.set(base)
    try:
        model = construct()
    finally:
        _INIT_SEED.reset(token)
    if cfg.multi_latent_attention:
        from megatron_hdp.megatron.mla import rope_at_original_positions

        rope_at_original_positions(model)
    _redraw_output_layer(model, cfg, base + cfg.num_layers + 1, tp_rank)
    install_keyed_dropout(model)
    if cfg.mtp_num_layers is not None:
        from megatron_hdp.megatron.mtp import install_shift

        install_shift()
    return model
