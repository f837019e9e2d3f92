"""The cost model, the simulator's models and the advisor price multi-latent attention.

Formulas written out here: causal attention FLOPs `s^2 H (d_qk + d_v)` forward (the scores
over the q/k dim, the values over the v dim, half the square), x3.5 with the backward; a
ring message holds every head's K and V (`H (d_qk + d_v)` elements per token, not the
latent); MLA's projection weights.
"""

import dataclasses

import pytest

from megatron_hdp.advise.job import parse_job, total_params
from megatron_hdp.scheduler.cost import H100, CostModel, ModelShape
from megatron_hdp.sim.models import MLA_MODELS, MODELS

# DeepSeek-V3's attention (config.json): 128 heads, q/k 128 + 64 RoPE channels, v 128.
DSV3 = ModelShape(
    num_layers=2,
    hidden_size=7168,
    num_attention_heads=128,
    ffn_hidden_size=18432,
    vocab_size=129280,
    multi_latent_attention=True,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_head_dim=128,
    qk_pos_emb_head_dim=64,
    v_head_dim=128,
)


def test_attention_flops_use_the_qk_and_the_v_head_dims():
    s = 4096.0
    forward = s * s * 128 * (192 + 128)  # 2 s^2 H d_qk / 2 + 2 s^2 H d_v / 2
    want = 2 * 3.5 * forward / H100.attention_flops
    assert CostModel(DSV3, H100).attention_time(s) == pytest.approx(want, rel=1e-12)
    # Equal dims: the formula it always was, 2 s^2 H d x 3.5 per layer.
    gqa = ModelShape(num_layers=2, hidden_size=4096, num_attention_heads=32, num_query_groups=8)
    want = 2 * 3.5 * 2 * s * s * 32 * 128 / H100.attention_flops
    assert CostModel(gqa, H100).attention_time(s) == pytest.approx(want, rel=1e-12)


def test_ring_ships_every_heads_k_and_v_of_their_own_widths():
    assert DSV3.kv_message_dim == 128 * (192 + 128)
    gqa = ModelShape(num_layers=2, hidden_size=4096, num_attention_heads=32, num_query_groups=8)
    assert gqa.kv_message_dim == 2 * 8 * 128
    # No compute to hide behind: every transfer is exposed. Per layer: k-1 forward K/V
    # messages, k-1 backward steps of two messages (K/V and dK/dV) and one last dK/dV hop;
    # a message: latency + H (d_qk + d_v) bf16 elements of s / k tokens.
    device = dataclasses.replace(H100, attention_flops=1e30, linear_flops=1e30)
    s, k = 65536.0, 4
    message = device.p2p_latency + (s / k) * 128 * 320 * 2 / device.p2p_bandwidth
    want = 2 * ((k - 1) * message + (k - 1) * 2 * message + message)
    assert CostModel(DSV3, device).exposed_ring_time(s, k) == pytest.approx(want, rel=1e-9)


def test_mla_projection_weights():
    h, heads = 7168, 128
    q = 1536 * (h + heads * 192)  # down, up
    kv = h * (512 + 64) + 512 * heads * (128 + 128)  # down (latent + RoPE), up (k, v)
    out = heads * 128 * h
    assert DSV3.attention_params == q + kv + out
    no_q_lora = dataclasses.replace(DSV3, q_lora_rank=None)
    assert no_q_lora.attention_params == h * heads * 192 + kv + out
    assert DSV3.params_per_token == 2 * (q + kv + out + 3 * h * 18432) + h * 129280


def test_the_simulator_has_an_mla_model_priced_by_its_shape():
    model = MLA_MODELS["llama-7b-mla"]
    dense = MODELS["llama-7b"]
    assert model.shape.multi_latent_attention and model.shape.kv_message_dim == 32 * (192 + 128)
    assert (model.tp, model.pp, model.gpus) == (dense.tp, dense.pp, dense.gpus)
    cost, base = CostModel(model.shape, H100), CostModel(dense.shape, H100)
    ratio = (192 + 128) / (2 * 128)  # attention FLOPs of MLA's head dims over 128 / 128
    assert cost.attention_time(8192) == pytest.approx(ratio * base.attention_time(8192))


def test_the_advisor_reads_the_mla_flags():
    flags = [
        "--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
        "--multi-latent-attention", "--kv-lora-rank", "256", "--qk-head-dim", "64",
        "--qk-pos-emb-head-dim", "32", "--v-head-dim", "64", "--q-lora-rank", "384",
        "--ffn-hidden-size", "4096", "--swiglu", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "32000", "--seq-length", "8192",
    ]  # fmt: skip
    job = parse_job(flags, gpus=8, steps=1, capacity="job", hbm_bytes=80e9, own_data=False)
    shape = job.model.shape
    assert shape.multi_latent_attention
    assert (shape.qk_dim_per_head, shape.v_dim_per_head) == (96, 64)
    assert shape.kv_message_dim == 16 * (96 + 64)
    assert shape.attention_params == (
        384 * (1024 + 16 * 96) + 1024 * (256 + 32) + 256 * 16 * (64 + 64) + 16 * 64 * 1024
    )
    assert total_params(shape, tied_embeddings=True) == pytest.approx(
        4 * (shape.attention_params + 3 * 1024 * 4096) + 1024 * shape.vocab_size
    )


def test_a_kernel_that_pads_v_is_priced_at_the_padded_dims():
    """Every Hopper kernel runs MLA's v zero-padded to 192 (`kernels.head_dims`): attention
    computes `s^2 H (192 + 192)` forward; the ring still ships K and V unpadded."""
    s = 4096.0
    padded = dataclasses.replace(DSV3, padded_v=True)
    want = 2 * 3.5 * s * s * 128 * (192 + 192) / H100.attention_flops
    assert CostModel(padded, H100).attention_time(s) == pytest.approx(want, rel=1e-12)
    assert padded.kv_message_dim == DSV3.kv_message_dim == 128 * (192 + 128)
    assert padded.params_per_token == DSV3.params_per_token


def test_the_job_prices_v_padded_where_its_resolved_kernel_pads_it():
    from megatron_hdp.megatron.model import GPTConfig, model_shape

    mla = GPTConfig(
        multi_latent_attention=True, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16
    )
    assert model_shape(mla, "torch_flash+pad_v").padded_v
    assert not model_shape(mla, "math").padded_v  # the CPU kernel takes 24 / 16 as they are
    assert not model_shape(mla).padded_v
    assert not model_shape(GPTConfig(), "torch_flash").padded_v
