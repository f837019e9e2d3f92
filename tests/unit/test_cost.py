"""Cost model: formulas against hand computation, monotonicity, and calibration fitting."""

import dataclasses

import numpy as np
import pytest

from megatron_hdp.scheduler.balance import balance_core
from megatron_hdp.scheduler.cost import CPU, H100, CostModel, ModelShape, lower_bound

LLAMA7B = ModelShape(
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_query_groups=8,
    ffn_hidden_size=11008,
    vocab_size=32000,
)


def test_params_and_flops_by_hand():
    h, kv, ffn = 4096, 8 * 128, 11008
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * ffn
    assert LLAMA7B.params_per_token == 32 * per_layer + h * 32000  # ~6.5e9, a 7B model
    model = CostModel(LLAMA7B, H100)
    s = 8192
    assert model.linear_time(s) == pytest.approx(6 * LLAMA7B.params_per_token * s / (0.6 * 989e12))
    causal_forward = 2 * s * s * 32 * 128
    assert model.attention_time(s) == pytest.approx(32 * 3.5 * causal_forward / (0.4 * 989e12))


def test_moe_counts_the_router_and_the_top_k_experts_a_token_runs_through():
    """Mixtral-8x7B: 8 experts of ffn 14336, top-2: about 12.75B active weights per token."""
    h, kv, ffn = 4096, 8 * 128, 14336
    mixtral = dataclasses.replace(LLAMA7B, ffn_hidden_size=ffn, num_experts=8, moe_router_topk=2)
    per_layer = h * (h + 2 * kv) + h * h + h * 8 + 2 * 3 * h * ffn
    assert mixtral.params_per_token == 32 * per_layer + h * 32000
    assert 12.7e9 < mixtral.params_per_token < 12.8e9
    top1 = dataclasses.replace(mixtral, moe_router_topk=1, moe_ffn_hidden_size=2 * ffn)
    assert top1.params_per_token == mixtral.params_per_token  # same FLOPs per token
    model, dense = CostModel(mixtral, H100), CostModel(LLAMA7B, H100)
    assert model.linear_time(8192) > 1.9 * dense.linear_time(8192)


def test_attention_overtakes_linear_at_long_lengths():
    model = CostModel(LLAMA7B, H100)
    assert model.attention_time(4096) < model.linear_time(4096)
    assert model.attention_time(131072) > 3 * model.linear_time(131072)


def test_ring_time_splits_compute_and_hides_communication_when_chunks_are_long():
    model = CostModel(LLAMA7B, H100)
    s = 1 << 20
    for k in (2, 8, 128):
        assert model.time(s, k) >= (model.linear_time(s) + model.attention_time(s)) / k
    # Long chunks hide the ring: only the last dK/dV hop is exposed per layer.
    final_hop = 32 * (10e-6 + 2 * (s / 8) * LLAMA7B.kv_dim * 2 / 50e9)
    assert model.exposed_ring_time(s, 8) == pytest.approx(final_hop)
    # A tiny sequence on a big ring is communication bound.
    slow = CostModel(LLAMA7B, dataclasses.replace(H100, p2p_bandwidth=1e9))
    assert slow.exposed_ring_time(16384, 16) > 0.5 * slow.time(16384, 16)


@pytest.mark.parametrize("profile", [H100, CPU])
def test_monotone_in_length_and_bandwidth(profile):
    model = CostModel(LLAMA7B, profile)
    lengths = np.array([1, 100, 4096, 65536, 1 << 20], dtype=float)
    assert np.all(np.diff(model.time(lengths, 1)) > 0)
    faster = CostModel(
        LLAMA7B, dataclasses.replace(profile, p2p_bandwidth=10 * profile.p2p_bandwidth)
    )
    for s, k in ((65536, 4), (1 << 20, 64), (4096, 2)):
        assert faster.time(s, k) <= model.time(s, k)


def test_vectorised_and_scalar_agree():
    model = CostModel(LLAMA7B, H100)
    s = np.array([10, 9000, 300000], dtype=float)
    k = np.array([1, 2, 37])
    assert model.time(s, k) == pytest.approx([model.time(x, int(y)) for x, y in zip(s, k)])


def test_calibration_recovers_known_speeds():
    from megatron_hdp.megatron.calibrate import fit_profile

    shape = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=384)
    truth = dataclasses.replace(CPU, linear_flops=3e10, attention_flops=7e10)
    lengths = [256, 512, 1024, 2048, 4096]
    seconds = [CostModel(shape, truth).time(s, 1) + 0.002 for s in lengths]
    fitted = fit_profile(lengths, seconds, shape, CPU, "fitted")
    assert fitted.linear_flops == pytest.approx(3e10, rel=1e-6)
    assert fitted.attention_flops == pytest.approx(7e10, rel=1e-6)
    with pytest.raises(ValueError, match="non-positive coefficients"):
        fit_profile(lengths, [1.0, 0.9, 0.8, 0.7, 0.6], shape, CPU, "bad")


def test_balanced_plan_is_close_to_the_lower_bound_on_a_mixed_batch():
    rng = np.random.default_rng(1)
    pool, capacity = 256, 8192
    lengths = np.minimum(
        rng.lognormal(np.log(2048), 1.4, size=3000).astype(int) + 1, pool * capacity
    )
    k, local, ring = CostModel(LLAMA7B, H100).cost_arrays(lengths, capacity)
    placements = balance_core(
        lengths.tolist(),
        k.tolist(),
        local.tolist(),
        ring.tolist(),
        pool_size=pool,
        capacity=capacity,
    )
    makespan = max(p.start + p.cost for p in placements)
    bound = lower_bound(k, local, ring, pool)
    assert bound <= makespan <= 1.05 * bound


def test_a_replica_profile_adds_up_its_devices():
    """A simulator rank profile is one pipeline stage of TP devices, by the stated formula."""
    import pytest

    from megatron_hdp.sim.clusters import H100_CLUSTER

    tp4 = H100_CLUSTER.rank_profile(4)
    assert tp4.linear_flops == pytest.approx(0.6 * 989e12 * 4 * 0.9, rel=1e-12)
    assert tp4.attention_flops == pytest.approx(0.4 * 989e12 * 4 * 0.9, rel=1e-12)
    assert tp4.p2p_bandwidth == pytest.approx(50e9 * 4)
    assert tp4.memory_bytes == pytest.approx(80e9 * 4)
    assert tp4.p2p_latency == 10e-6 and tp4.name == "h100-tp4"
    assert not hasattr(H100_CLUSTER, "pp_efficiency")  # PP is a 1F1B timeline now
    tp2 = H100_CLUSTER.gpu_profile().replica(2)
    assert tp2.linear_flops == pytest.approx(0.6 * 989e12 * 2 * 0.9, rel=1e-12)
    assert H100_CLUSTER.gpu_profile().replica(1) == H100_CLUSTER.gpu_profile()
    with pytest.raises(ValueError, match="tp and pp must be >= 1"):
        H100_CLUSTER.gpu_profile().replica(0)


def test_each_mtp_depth_is_priced_as_one_more_layer_with_its_projection_and_output_layer():
    """`--mtp-num-layers 2`: two more full-attention layers (GEMMs, attention, ring), two
    `2h x h` input projections and two more output-layer GEMMs; activations unchanged."""
    base = ModelShape(num_layers=4, hidden_size=1024, num_attention_heads=8, vocab_size=5000)
    mtp = dataclasses.replace(base, mtp_num_layers=2)
    h, per_layer = 1024, base.attention_params + 3 * 1024 * 4096  # SwiGLU, ffn 4h
    assert base.params_per_token == 4 * per_layer + h * 5000
    assert mtp.params_per_token == 6 * per_layer + h * 5000 + 2 * (2 * h * h + h * 5000)
    a, b = CostModel(base, H100), CostModel(mtp, H100)
    s = 32768.0
    assert b.attention_time(s) == pytest.approx(a.attention_time(s) * 6 / 4, rel=1e-12)
    slow = dataclasses.replace(H100, attention_flops=1e30, linear_flops=1e30)  # all exposed
    ring_a, ring_b = CostModel(base, slow), CostModel(mtp, slow)
    assert ring_b.exposed_ring_time(s, 4) == pytest.approx(
        ring_a.exposed_ring_time(s, 4) * 6 / 4, rel=1e-12
    )
    assert b.activation_bytes_per_token() == a.activation_bytes_per_token()
