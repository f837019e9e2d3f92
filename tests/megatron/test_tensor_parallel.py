"""Tensor parallelism inside HDP replicas: TP x pool ranks equal one TP=1 process, exactly.

With TP=2 and pool N, ranks 2p and 2p+1 form replica p; the HDP pool of each TP rank is
Megatron's data-parallel group (the same TP rank of every replica), so a ring of replicas
(0, 1) links global ranks (0, 2) for TP rank 0 and (1, 3) for TP rank 1. Every TP shard is
mapped back to the full TP=1 parameter (Megatron's CPU initialisation draws the full master
weight and slices it, with stride 2 for the gated fc1 of SwiGLU) and compared with the
single-process reference on the same global batch.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_hdp.distributed.layout import ParallelDims
from megatron_hdp.megatron.cpu_shim import cpu_shims
from megatron_hdp.megatron.engine import (
    build_engine,
)
from megatron_hdp.megatron.model import GPTConfig
from megatron_hdp.megatron.step import StepRuntime, train_step
from megatron_hdp.scheduler import plan_step
from tests.dist import run_ranks
from tests.megatron.reference import train_reference
from tests.megatron.test_model_equivalence import (
    CAPACITY,
    OPTIM,
    make_batch,
    snapshot_grads_before_update,
    source_of,
)
from tests.megatron.test_model_equivalence import CFG as EQUIVALENCE_CFG

SEED = 7
TP = 2
NUM_STEPS = 3
# The equivalence test's model with a vocabulary padded to a multiple of TP (ids stay < 97).
CFG = dataclasses.replace(EQUIVALENCE_CFG, vocab_size=128, swiglu=True)


def _tp_layout(param) -> tuple[bool, int, int]:
    return (
        bool(getattr(param, "tensor_model_parallel", False)),
        getattr(param, "partition_dim", -1),
        getattr(param, "partition_stride", 1),
    )


def unshard(shards: list[torch.Tensor], layout: tuple[bool, int, int]) -> torch.Tensor:
    """The full TP=1 tensor from the TP ranks' shards (Megatron's strided split, inverted)."""
    parallel, dim, stride = layout
    if not parallel:
        for shard in shards[1:]:
            assert torch.equal(shard, shards[0]), "a replicated parameter differs across TP ranks"
        return shards[0]
    pieces = [torch.chunk(s, stride, dim=dim) for s in shards]
    return torch.cat([pieces[r][k] for k in range(stride) for r in range(len(shards))], dim=dim)


def _body_tp(rank, world_size, cfg, pool, policy, kind):
    with cpu_shims():
        layout = ParallelDims.of_world(tensor_model_parallel_size=TP).initialize()
        try:
            engine = build_engine(cfg, OPTIM, seed=SEED)
            named = list(engine.model.module.named_parameters())
            init = {n: p.detach().clone() for n, p in named}
            group = layout.pool_group
            runtime = StepRuntime(group=group, check_plans=True, job_group=dist.group.WORLD)
            grads, losses, norms = {}, [], []
            snapshot_grads_before_update(engine, grads)  # of the first step
            cp_size = 2 if policy == "static" else None
            for step in range(NUM_STEPS):
                source = source_of(make_batch(pool, step, kind))
                lengths = source.seqlens
                plan = plan_step(
                    lengths, pool_size=pool, capacity=CAPACITY, policy=policy, cp_size=cp_size
                )
                result = train_step(engine, plan, source, runtime)
                losses.append(result.loss)
                norms.append(result.grad_norm)
            return {
                "losses": losses,
                "norms": norms,
                "grads": grads,
                "init": init,
                "after": {n: p.detach().clone() for n, p in named},
                "layout": {n: _tp_layout(p) for n, p in named},
                "pool": (dist.get_rank(group), dist.get_process_group_ranks(group)),
                "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "rings": [mb.ring for mb in plan.micro_batches if mb.cp_size > 1],
            }
        finally:
            layout.destroy()


def _body_reference(rank, world_size, cfg, pool, kind):
    batches = [make_batch(pool, step, kind) for step in range(NUM_STEPS)]
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            return train_reference(cfg, seed=SEED, optim=OPTIM, batches=batches)
        finally:
            layout.destroy()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize(
    "pool, swiglu, policy, kind, sp",
    [
        (2, True, "greedy", "mixed", False),
        (2, False, "balanced", "mixed", False),
        (3, True, "balanced", "mixed", False),
        (2, True, "static", "two_rank_context", False),
        (2, True, "greedy", "mixed", True),
        (3, True, "balanced", "mixed", True),
    ],
    ids=[
        "tp2-pool2-swiglu",
        "tp2-pool2-gelu",
        "tp2-pool3-swiglu",
        "tp2-static-cp2",
        "tp2-pool2-sp",
        "tp2-pool3-sp",
    ],
)
def test_tensor_parallel_replicas_equal_one_process(pool, swiglu, policy, kind, sp):
    """Mixed lengths: C-1 and below, C, C+1, and (pool 3) sequences needing 2 and 3 replicas
    (odd local token counts, so sequence parallelism pads); the static mesh packs to 2 C and
    shards every pack over CP 2."""
    cfg = dataclasses.replace(CFG, swiglu=swiglu)
    tp_cfg = dataclasses.replace(cfg, tensor_model_parallel_size=TP, sequence_parallel=sp)
    ranks = run_ranks(_body_tp, TP * pool, tp_cfg, pool, policy, kind, timeout_s=180)
    reference = run_ranks(_body_reference, 1, cfg, pool, kind)[0]
    for rank, result in enumerate(ranks):
        assert result["tp_rank"] == rank % TP
        assert result["pool"] == (rank // TP, list(range(rank % TP, TP * pool, TP)))
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert any(len(ring) > 1 for ring in ranks[0]["rings"])  # the batch really uses rings
    for replica in range(pool):
        members = ranks[replica * TP : (replica + 1) * TP]
        layout = members[0]["layout"]
        for name in reference["init"]:
            # The same seed gives the same model in either layout, bit for bit.
            full = unshard([m["init"][name] for m in members], layout[name])
            assert torch.equal(full, reference["init"][name]), name
            grad = unshard([m["grads"][name] for m in members], layout[name])
            assert relative(grad, reference["grads"][name]) < 1e-5, name
            after = unshard([m["after"][name] for m in members], layout[name])
            assert relative(after, reference["after"][name]) < 1e-5, name  # after 3 AdamW steps


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_head_size_rotary_share_and_qk_norm_with_tensor_parallelism(sp):
    """--kv-channels 12, --rotary-percent 0.5 and --qk-layernorm with TP 2 (each TP rank
    holds 2 heads of 12 channels and their query/key norms' gradients are summed over the
    TP ranks by Megatron's finish), with and without sequence parallelism: the stock
    one-process model's losses, gradients and weights."""
    cfg = dataclasses.replace(CFG, kv_channels=12, rotary_percent=0.5, qk_layernorm=True)
    tp_cfg = dataclasses.replace(cfg, tensor_model_parallel_size=TP, sequence_parallel=sp)
    ranks = run_ranks(_body_tp, TP * 2, tp_cfg, 2, "greedy", "mixed", timeout_s=180)
    reference = run_ranks(_body_reference, 1, cfg, 2, "mixed")[0]
    assert any("q_layernorm" in name for name in reference["init"])
    for result in ranks:
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    for replica in range(2):
        members = ranks[replica * TP : (replica + 1) * TP]
        layout = members[0]["layout"]
        for name in reference["init"]:
            grad = unshard([m["grads"][name] for m in members], layout[name])
            assert relative(grad, reference["grads"][name]) < 1e-5, name
            after = unshard([m["after"][name] for m in members], layout[name])
            assert relative(after, reference["after"][name]) < 1e-5, name


def test_learnable_attention_sinks_with_tensor_parallelism():
    """--softmax-type learnable with TP 2: each TP rank holds the sink logits of its 2 heads
    (`softmax_offset`, split on dim 0 as Megatron's checkpoint does), drawn as one TP=1
    vector and sliced, so the model is the one-process model bit for bit; losses, gradients,
    weights after three steps and the first step's gradient norm (every TP rank's sinks
    counted once) are the stock one-process model's (Megatron-Core's DotProductAttention)."""
    cfg = dataclasses.replace(CFG, softmax_type="learnable")
    tp_cfg = dataclasses.replace(cfg, tensor_model_parallel_size=TP)
    ranks = run_ranks(_body_tp, TP * 2, tp_cfg, 2, "greedy", "mixed", timeout_s=180)
    reference = run_ranks(_body_reference, 1, cfg, 2, "mixed")[0]
    sinks = [name for name in reference["init"] if name.endswith("core_attention.softmax_offset")]
    assert len(sinks) == cfg.num_layers
    norm = float(torch.stack([g.double().norm() for g in reference["grads"].values()]).norm())
    for result in ranks:
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert result["norms"][0] == pytest.approx(norm, rel=1e-5)
    for replica in range(2):
        members = ranks[replica * TP : (replica + 1) * TP]
        layout = members[0]["layout"]
        assert all(layout[name] == (True, 0, 1) for name in sinks)
        for name in reference["init"]:
            full = unshard([m["init"][name] for m in members], layout[name])
            assert torch.equal(full, reference["init"][name]), name
            grad = unshard([m["grads"][name] for m in members], layout[name])
            assert relative(grad, reference["grads"][name]) < 1e-5, name
            after = unshard([m["after"][name] for m in members], layout[name])
            assert relative(after, reference["after"][name]) < 1e-5, name


def test_tensor_parallel_shapes_are_checked():
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by tensor"):
        dataclasses.replace(CFG, tensor_model_parallel_size=3)
    with pytest.raises(ValueError, match="sequence_parallel needs tensor_model_parallel_size"):
        dataclasses.replace(CFG, sequence_parallel=True)
    with pytest.raises(ValueError, match="vocab_size 97 is not divisible"):
        dataclasses.replace(CFG, vocab_size=97, tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="num_query_groups 3 and tensor_model_parallel_size 2"):
        GPTConfig(
            hidden_size=48, num_attention_heads=12, num_query_groups=3, tensor_model_parallel_size=2
        )
