"""Multi-latent attention's flags for `pretrain_hdp.py`, with Megatron-LM's names (no torch).

Names, defaults and meaning follow Megatron-LM's `_add_mla_args` and `--rope-type` (core
0.16.1 and 0.19.0 alike); the model side is `megatron.mla`.
"""

from __future__ import annotations

ROPE_TYPES = ("rope", "yarn")


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
