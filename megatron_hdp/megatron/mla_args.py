"""Multi-latent attention's flags for `pretrain_hdp.py`, with Megatron-LM's names (no torch).

Names, defaults and meaning follow Megatron-LM's `_add_mla_args` and `--rope-type` (core
0.16.1 and 0.19.0 alike); the model side is `megatron.mla`.
"""

from __future__ import annotations

import argparse

ROPE_TYPES = ("rope", "yarn")


def mla_problems(cfg) -> list[str]:
    """What HDP cannot run in an MLA model shape (`GPTConfig`), one message each."""
    problems = []
    if cfg.rope_type not in (None, *ROPE_TYPES):
        problems.append(f"rope_type {cfg.rope_type!r} is not one of {ROPE_TYPES} (--rope-type)")
    for name in ("kv_lora_rank", "qk_head_dim", "v_head_dim"):
        if getattr(cfg, name) < 1:
            problems.append(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.q_lora_rank is not None and cfg.q_lora_rank < 1:
        problems.append(f"q_lora_rank must be >= 1 or None, got {cfg.q_lora_rank}")
    rotary = cfg.qk_pos_emb_head_dim
    if cfg.rope_type == "rope" and cfg.rotary_percent < 1.0:
        rotary = int(rotary * cfg.rotary_percent)
    if rotary < 2 or rotary % 2:
        problems.append(
            f"qk_pos_emb_head_dim {cfg.qk_pos_emb_head_dim} (rotary_percent "
            f"{cfg.rotary_percent}) rotates {rotary} channels: RoPE needs an even number >= 2"
        )
    if cfg.rotary_interleaved:
        problems.append(
            "rotary_interleaved does not work with multi_latent_attention (Megatron-Core "
            "refuses it too)"
        )
    groups = cfg.num_query_groups
    if groups is not None and groups != cfg.num_attention_heads:
        problems.append(
            f"num_query_groups {groups}: multi-latent attention has one key/value head per "
            "query head (Megatron-Core refuses --group-query-attention with it)"
        )
    if cfg.sequence_parallel:
        problems.append(
            "sequence_parallel with multi_latent_attention: MLA rotates the sequence-parallel "
            "pad tokens with the real ones, which HDP's THD micro-batches do not hold; not "
            "supported with HDP yet"
        )
    if getattr(cfg, "window_size", None) is not None:
        problems.append(
            f"window_size {cfg.window_size} with multi_latent_attention: HDP's windowed ring "
            "sends K and V of one head dim; not supported with HDP yet"
        )
    return problems


def args_problems(args) -> list[str]:
    """`mla_problems` of Megatron-named arguments (none without --multi-latent-attention)."""
    if not getattr(args, "multi_latent_attention", False):
        return []
    view = argparse.Namespace(**vars(args))
    view.num_query_groups = args.num_query_groups if args.group_query_attention else None
    return mla_problems(view)


def add_mla_args(parser) -> None:
    """Megatron-LM's MLA flags, with its names, defaults and meaning (core 0.16 and 0.19)."""
    g = parser.add_argument_group("multi-latent attention (Megatron-LM names)")
    g.add_argument(
        "--multi-latent-attention",
        action="store_true",
        help="Megatron-Core's multi-latent attention layer, with HDP's core attention",
    )
    g.add_argument(
        "--q-lora-rank", type=int, default=None, help="rank of the queries' low-rank projection"
    )
    g.add_argument(
        "--kv-lora-rank", type=int, default=32, help="rank of the keys' and values' projection"
    )
    g.add_argument(
        "--qk-head-dim", type=int, default=128, help="query/key channels per head without RoPE"
    )
    g.add_argument(
        "--qk-pos-emb-head-dim", type=int, default=64, help="decoupled RoPE channels per head"
    )
    g.add_argument("--v-head-dim", type=int, default=128, help="value channels per head")
    g.add_argument(
        "--rope-type",
        choices=ROPE_TYPES,
        default=None,
        help="MLA's RoPE (default: yarn, Megatron-Core's default for MLA)",
    )
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="YaRN's scaling factor")
    g.add_argument("--mscale", type=float, default=1.0, help="YaRN's mscale")
    g.add_argument("--mscale-all-dim", type=float, default=0.0, help="YaRN's mscale of all dims")


def mla_fields(args) -> dict:
    """The `GPTConfig` MLA fields of Megatron-named arguments (none without MLA)."""
    if not getattr(args, "multi_latent_attention", False):
        return {}
    return {
        "multi_latent_attention": True,
        "q_lora_rank": args.q_lora_rank,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_head_dim": args.qk_head_dim,
        "qk_pos_emb_head_dim": args.qk_pos_emb_head_dim,
        "v_head_dim": args.v_head_dim,
        "rope_type": args.rope_type,
        "rotary_scaling_factor": float(args.rotary_scaling_factor),
        "mscale": float(args.mscale),
        "mscale_all_dim": float(args.mscale_all_dim),
    }


def head_dims(args) -> tuple[int, int | None]:
    """`(q/k head dim, v head dim or None)` of Megatron-named arguments, for kernel choice."""
    if getattr(args, "multi_latent_attention", False):
        return args.qk_head_dim + args.qk_pos_emb_head_dim, args.v_head_dim
    return args.kv_channels or args.hidden_size // args.num_attention_heads, None


#: The MLA fields that shape the model (the cost model's `ModelShape` has these).
SHAPE_FIELDS = (
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
)


def mla_shape_fields(args) -> dict:
    """The `ModelShape` MLA fields of Megatron-named arguments (none without MLA)."""
    fields = mla_fields(args)
    return {name: fields[name] for name in SHAPE_FIELDS if name in fields}
