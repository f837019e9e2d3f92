"""Multi-latent attention under HDP equals stock Megatron-Core MLA on one process.

The reference (`tests/megatron/reference.py`) is Megatron-Core's own `MLASelfAttention`
layer spec, unpacked, one sequence at a time: Megatron rotates the decoupled RoPE channels
itself at positions 0..s-1 (YaRN's frequencies and mscale included) and attends with a few
lines of SDPA. HDP runs the same weights on packs and zigzag rings (pools of 1 and 3,
documents around the capacity), with HDP's core attention (q/k 24 channels, v 8) and MLA's
RoPE at the original positions (`megatron.mla`): the loss and every gradient, in float32
(Megatron's optimizer keeps float32 main grads), to 1e-5 as the other whole-model tests.
"""

import dataclasses

import pytest
import torch.distributed as dist

from megatron_hdp.distributed.layout import ParallelDims
from megatron_hdp.megatron.cpu_shim import cpu_shims
from megatron_hdp.megatron.engine import OptimConfig, build_engine
from megatron_hdp.megatron.model import GPTConfig, model_parallel_dims
from megatron_hdp.megatron.step import StepRuntime, train_step
from megatron_hdp.scheduler import plan_step
from tests.dist import run_ranks
from tests.megatron.reference import train_reference
from tests.megatron.test_model_equivalence import (
    assert_close_rel,
    batch_of_lengths,
    snapshot_grads_before_update,
    source_of,
)

CAPACITY = 16
SEED = 11
MLA = GPTConfig(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=96,
    vocab_size=97,
    multi_latent_attention=True,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_head_dim=16,
    qk_pos_emb_head_dim=8,
    v_head_dim=8,
    qk_layernorm=True,
)
YARN = dataclasses.replace(
    MLA, rope_type="yarn", rotary_scaling_factor=4.0, mscale=0.7, mscale_all_dim=0.5
)
ROPE = dataclasses.replace(MLA, rope_type="rope", q_lora_rank=None, qk_layernorm=False)
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0, adam_eps=1e-4)
# Around the capacity: 1 token, C - 1, C, C + 1, and one needing all three ranks.
LENGTHS = [1, 5, CAPACITY - 1, CAPACITY, CAPACITY + 1, 2 * CAPACITY + 3]


def _body(rank, world_size, cfg):
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            engine = build_engine(cfg, OPTIM, seed=SEED)
            runtime = StepRuntime(group=dist.group.WORLD, check_plans=True, backend="math")
            source = source_of(batch_of_lengths(LENGTHS, seed=3))
            capacity = CAPACITY if world_size > 1 else sum(LENGTHS)  # one rank: one pack
            plan = plan_step(source.seqlens, pool_size=world_size, capacity=capacity)
            rings = sorted(mb.cp_size for mb in plan.micro_batches)
            grads = {}
            snapshot_grads_before_update(engine, grads)
            result = train_step(engine, plan, source, runtime)
            return result.loss, grads, rings
        finally:
            layout.destroy()


def _reference(rank, world_size, cfg):
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            run = train_reference(
                cfg, seed=SEED, optim=OPTIM, batches=[batch_of_lengths(LENGTHS, seed=3)]
            )
            return run["losses"][0], run["grads"]
        finally:
            layout.destroy()


@pytest.mark.parametrize("cfg", [YARN, ROPE], ids=["yarn", "rope"])
@pytest.mark.parametrize("pool_size", [1, 3])
def test_hdp_mla_equals_stock_megatron_mla(cfg, pool_size):
    ((ref_loss, ref_grads),) = run_ranks(_reference, 1, cfg)
    per_rank = run_ranks(_body, pool_size, cfg, timeout_s=240)
    for rank, (loss, grads, rings) in enumerate(per_rank):
        if pool_size > 1:
            assert max(rings) == 3, rings  # the longest document ran on a ring of 3
        assert loss == pytest.approx(ref_loss, rel=1e-5), (rank, loss, ref_loss)
        assert set(grads) == set(ref_grads)
        for name, want in ref_grads.items():
            assert_close_rel(grads[name], want, f"rank {rank} grad {name}", rel=1e-5)


def test_mla_with_keyed_dropout_gives_one_ranks_loss_and_gradients_on_rings():
    """Attention and hidden dropout 0.1: the keyed masks (`attention.dropout`, its dense
    kernel with v's own head dim) are the same on a ring of 3 as on one rank."""
    cfg = dataclasses.replace(YARN, attention_dropout=0.1, hidden_dropout=0.1)
    ((one_loss, one_grads, _),) = run_ranks(_body, 1, cfg)
    ((plain_loss, _, _),) = run_ranks(_body, 1, YARN)
    assert abs(one_loss - plain_loss) > 1e-4  # the dropout is there
    for rank, (loss, grads, rings) in enumerate(run_ranks(_body, 3, cfg, timeout_s=240)):
        assert max(rings) == 3 and loss == pytest.approx(one_loss, rel=1e-5), (rank, loss)
        for name, want in one_grads.items():
            assert_close_rel(grads[name], want, f"rank {rank} grad {name}", rel=1e-5)


def _body_tp_pp(rank, world_size, cfg):
    with cpu_shims():
        layout = model_parallel_dims(cfg, world_size).initialize()
        try:
            engine = build_engine(cfg, OPTIM, seed=SEED)
            runtime = StepRuntime(
                group=layout.pool_group,
                check_plans=True,
                backend="math",
                job_group=dist.group.WORLD,
            )
            source = source_of(batch_of_lengths(LENGTHS, seed=3))
            pp = cfg.pipeline_model_parallel_size
            plan = plan_step(source.seqlens, pool_size=2, capacity=CAPACITY + 4, pipeline_stages=pp)
            result = train_step(engine, plan, source, runtime)
            return result.loss, result.grad_norm, max(mb.cp_size for mb in plan.micro_batches)
        finally:
            layout.destroy()


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_mla_with_tp_or_pp_gives_stock_loss_and_gradient_norm(tp, pp):
    """TP 2 (MLA's heads split over two ranks) or PP 2 (one layer a stage), x a pool of 2
    replicas with rings of 2."""
    base = dataclasses.replace(YARN, vocab_size=98)  # split over 2 TP ranks
    cfg = dataclasses.replace(base, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    ((ref_loss, ref_grads),) = run_ranks(_reference, 1, base)
    ref_norm = sum(float(g.double().pow(2).sum()) for g in ref_grads.values()) ** 0.5
    for rank, (loss, norm, widest) in enumerate(run_ranks(_body_tp_pp, 4, cfg, timeout_s=240)):
        assert widest == 2  # the longest document ran on a ring of 2 replicas
        assert loss == pytest.approx(ref_loss, rel=1e-5), (rank, loss, ref_loss)
        assert norm == pytest.approx(ref_norm, rel=1e-5), (rank, norm, ref_norm)
