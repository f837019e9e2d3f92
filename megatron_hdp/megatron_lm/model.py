"""The model under `--hdp`: Megatron-LM's GPT builder with HDP core attention (host layer).

`hdp_gpt_builder` has the signature of Megatron-LM's `gpt_builders.gpt_builder` and builds
the same `GPTModel` from Megatron-LM's arguments and `TransformerConfig`, with
`HDPCoreAttention` in the layer spec (the local spec, or Transformer Engine's where
`--transformer-impl transformer_engine`) and Megatron's own RoPE switched off (HDP applies
it at the original positions). Its weights depend on `--seed` alone, exactly as
`pretrain_hdp.py`'s (`megatron.model.build_seeded`), so both give the same losses; that
holds with `--use-cpu-initialization` (without it Megatron-Core draws the split weights on
the GPU from its CUDA RNG tracker: still equal on every replica, but not `pretrain_hdp.py`'s).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

import torch

from megatron_hdp.megatron.mla_args import mla_fields
from megatron_hdp.megatron.model import GPTConfig
from megatron_hdp.megatron_lm.moe import moe_fields, moe_layer_pattern

logger = logging.getLogger(__name__)


def gpt_config(args: argparse.Namespace, vocab_size: int | None = None) -> GPTConfig:
    """The model shape from Megatron-LM's parsed arguments (after its `validate_args`).

    `vocab_size` defaults to Megatron-LM's `padded_vocab_size` (set once its tokenizer is
    built). Raises ValueError for a shape HDP cannot run (GPTConfig's checks).
    """
    return GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=args.padded_vocab_size if vocab_size is None else vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type,
        rotary_base=float(args.rotary_base),
        rotary_percent=float(args.rotary_percent),
        rotary_interleaved=bool(getattr(args, "rotary_interleaved", False)),
        kv_channels=args.kv_channels,
        qk_layernorm=bool(args.qk_layernorm),
        softmax_type=getattr(args, "softmax_type", "vanilla"),
        normalization=args.normalization,
        swiglu=args.swiglu,
        add_bias_linear=args.add_bias_linear,
        init_method_std=args.init_method_std,
        tie_embeddings=not args.untie_embeddings_and_output_weights,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        params_dtype=params_dtype(args),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=getattr(
            args, "virtual_pipeline_model_parallel_size", None
        ),
        sequence_parallel=args.sequence_parallel,
        fp8=getattr(args, "fp8", None) is not None,
        mtp_num_layers=getattr(args, "mtp_num_layers", None) or None,
        mtp_loss_scaling_factor=float(getattr(args, "mtp_loss_scaling_factor", 0.1)),
        window_size=getattr(args, "window_size", None),
        window_attn_skip_freq=_skip_freq(getattr(args, "window_attn_skip_freq", None)),
        **moe_fields(args),
        **mla_fields(args),
    )


def _skip_freq(value):
    """A list pattern as a tuple (GPTConfig is frozen); ints and None as they are."""
    return tuple(value) if isinstance(value, list) else value


def params_dtype(args: argparse.Namespace) -> str:
    """The parameters' dtype name of `--bf16` / `--fp16` (else float32)."""
    if args.bf16:
        return "bfloat16"
    return "float16" if args.fp16 else "float32"


def _layer_specs(args: argparse.Namespace, cfg: GPTConfig, vp_stage: int | None = None):
    """One model chunk's decoder spec: HDP core attention in Megatron's local or TE spec.

    The chunk is the stage's, or its `vp_stage`-th with virtual pipeline stages.
    """
    from megatron_hdp.megatron.model import hdp_block_spec

    if args.transformer_impl == "local":
        block = hdp_block_spec(cfg)
        if cfg.num_experts is not None:
            dense = hdp_block_spec(_dense(cfg)).layer_specs[0]
            block.layer_specs = _moe_or_dense(args, cfg, block.layer_specs[0], dense, vp_stage)
        return block
    if args.transformer_impl != "transformer_engine":
        raise ValueError(f"--transformer-impl {args.transformer_impl} is not supported with --hdp")
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_hdp.megatron.core_attention import HDPCoreAttention
    from megatron_hdp.megatron.model import SeededTransformerLayer

    def te_spec(num_experts):
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts,
            moe_grouped_gemm=False,
            qk_layernorm=cfg.qk_layernorm,
            **({"multi_latent_attention": True} if cfg.multi_latent_attention else {}),
        )
        spec.module = SeededTransformerLayer
        spec.submodules.self_attention.submodules.core_attention = HDPCoreAttention
        if num_experts is not None:
            _hdp_experts(spec)
        return spec

    if cfg.multi_latent_attention:
        logger.warning(
            "--hdp: multi-latent attention in Transformer Engine's layer spec is unverified (no "
            "TE here to test it); --transformer-impl local is the tested path"
        )
    layers = [te_spec(None)] * cfg.layers_per_chunk
    if cfg.num_experts is not None:
        logger.warning(
            "--hdp: experts in Transformer Engine's layer spec are unverified (no TE here to "
            "test them); --transformer-impl local is the tested path"
        )
        layers = _moe_or_dense(args, cfg, te_spec(cfg.num_experts), layers[0], vp_stage)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=TENorm)


def _mtp_spec(args: argparse.Namespace, cfg: GPTConfig, block):
    """The MTP block around the decoder's last layer spec, with its norm (None without MTP)."""
    if cfg.mtp_num_layers is None:
        return None
    from megatron_hdp.megatron.mtp import mtp_block_spec

    linear = None
    if args.transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

        linear = TEColumnParallelLinear
        logger.warning(
            "--hdp: multi-token prediction in Transformer Engine's layer spec is unverified "
            "(no TE here to test it); --transformer-impl local is the tested path"
        )
    return mtp_block_spec(block.layer_specs[-1], block.layer_norm, cfg.mtp_num_layers, linear)


def _hdp_experts(spec) -> None:
    """HDP's router and globally indexed experts in an MoE layer spec (as `hdp_layer_spec`)."""
    from megatron_hdp.megatron import compat
    from megatron_hdp.megatron.moe import GlobalIndexSequentialMLP, SequenceAuxLossRouter

    moe = compat.submodules_of(spec.submodules.mlp)
    moe.router = SequenceAuxLossRouter
    moe.experts = compat.with_module(moe.experts, GlobalIndexSequentialMLP)


def _dense(cfg: GPTConfig) -> GPTConfig:
    """`cfg` without experts: the shape of the dense layers of `--moe-layer-freq`."""
    return dataclasses.replace(cfg, num_experts=None, expert_model_parallel_size=1)


def _moe_or_dense(args, cfg: GPTConfig, moe_spec, dense_spec, vp_stage=None) -> list:
    """This chunk's layer specs: `moe_spec` where `--moe-layer-freq` puts experts."""
    from megatron.core import parallel_state

    first = cfg.first_layer(parallel_state.get_pipeline_model_parallel_rank(), vp_stage or 0)
    pattern = moe_layer_pattern(args)[first : first + cfg.layers_per_chunk]
    return [moe_spec if experts else dense_spec for experts in pattern]


def hdp_gpt_builder(
    args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None
):
    """Megatron-LM's `gpt_builder` with HDP core attention, initialised from `--seed`.

    Collective over nothing; runs after Megatron-LM's parallel state exists.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_hdp.megatron.model import build_seeded

    cfg = gpt_config(args)
    if config is None:
        config = core_transformer_config_from_args(args)
    if cfg.pipeline_model_parallel_size > 1:
        # HDP micro-batches hold different token counts: stages exchange shapes first, which
        # Megatron refuses with its default (allgather) MoE dispatcher even without experts.
        config.variable_seq_lengths = True
        config.moe_token_dispatcher_type = "alltoall"
    position_type = "none" if cfg.position_embedding_type == "rope" else cfg.position_embedding_type
    if cfg.multi_latent_attention:
        from megatron_hdp.megatron.mla import without_transformer_engine

        without_transformer_engine()
    if cfg.multi_latent_attention and config.apply_rope_fusion:
        # Fused MLA RoPE reads cos/sin by packed-piece position; the unfused path computes
        # the same rotation at the original positions (`megatron.mla`).
        logger.info("--hdp: MLA's RoPE runs unfused, at the tokens' original positions")
        config.apply_rope_fusion = False
    spec = _layer_specs(args, cfg, vp_stage)
    mtp = _mtp_spec(args, cfg, spec) if post_process else None
    # torch.manual_seed reseeds CUDA too: fork it as well, Megatron-LM's streams stay as set.
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(args.seed)  # as pretrain_hdp.py: the same weights on every stage
        return build_seeded(
            cfg,
            lambda: GPTModel(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=args.padded_vocab_size,
                max_sequence_length=args.max_position_embeddings,
                pre_process=pre_process,
                post_process=post_process,
                fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
                parallel_output=True,
                share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                position_embedding_type=position_type,
                rotary_base=args.rotary_base,
                vp_stage=vp_stage,
                pg_collection=pg_collection,
                mtp_block_spec=mtp,
            ),
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        )
