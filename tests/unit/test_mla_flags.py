"""`pretrain_hdp.py`'s MLA flags: Megatron-LM's names and defaults, and the shapes HDP refuses
before any process group (each message names the bad value)."""

import pytest

from megatron_hdp.megatron.arguments import build_parser
from megatron_hdp.megatron.config import model_config
from megatron_hdp.megatron.validation import validate_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
BASE += ["--seq-length", "128", "--train-iters", "1", "--hdp-global-batch-tokens", "256"]
BASE += ["--lr", "1e-3"]
MLA = ["--multi-latent-attention", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8"]


def _args(*extra):
    return build_parser().parse_args([*BASE, *MLA, *extra])


def test_megatron_lms_defaults_and_names_reach_the_model():
    cfg = model_config(_args("--v-head-dim", "8", "--mscale", "0.7"), vocab_size=256)
    assert cfg.multi_latent_attention and (cfg.head_dim, cfg.head_dim_v) == (24, 8)
    # Megatron-LM's defaults (_add_mla_args): kv rank 32, no q rank, YaRN factor 1, mscale
    # of all dims 0; --rope-type unset: MLATransformerConfig's default, yarn.
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.rotary_scaling_factor) == (32, None, 1.0)
    assert (cfg.mscale, cfg.mscale_all_dim, cfg.rope_type) == (0.7, 0.0, None)
    assert model_config(build_parser().parse_args(BASE), 256).multi_latent_attention is False


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--group-query-attention", "--num-query-groups", "2"], "num_query_groups 2"),
        (["--qk-pos-emb-head-dim", "7"], "qk_pos_emb_head_dim 7"),
        (["--v-head-dim", "0"], "v_head_dim must be >= 1, got 0"),
        (["--rotary-interleaved"], "rotary_interleaved does not work"),
        (["--tensor-model-parallel-size", "2", "--sequence-parallel"], "sequence_parallel"),
    ],
)
def test_shapes_hdp_cannot_run_are_refused_before_start_up(extra, message):
    with pytest.raises(ValueError, match=message):
        validate_args(_args(*extra), 2, here=False)


def test_every_mla_problem_comes_in_one_message():
    with pytest.raises(ValueError, match=r"v_head_dim must be >= 1.*rotary_interleaved"):
        validate_args(_args("--v-head-dim", "0", "--rotary-interleaved"), 2, here=False)
