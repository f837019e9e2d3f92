"""Mixture of experts in HDP replicas: any layout equals one process running Megatron's MoE.

The reference is a plain TP=1, EP=1 Megatron GPT with Megatron's own `TopKRouter` and
`SequentialMLP`, fed the global batch one sequence at a time, with Megatron's aux-loss scale
set to 1 / (tokens of the batch): that defines the per-sequence load-balancing loss HDP
documents (`megatron_hdp/megatron/moe.py`). HDP runs 4 experts, top-2, with the experts
split over the two TP ranks of each replica (EP = TP = 2, sequence parallelism as Megatron
requires for MoE with TP) on pools of 2 and 3 replicas, and TP = EP = 1 on a pool of 2.
Expert k of TP rank t is global expert t * 2 + k.
"""

import dataclasses
import re

import pytest
import torch

from megatron_hdp.distributed.layout import ParallelDims
from megatron_hdp.megatron.cpu_shim import cpu_shims
from megatron_hdp.megatron.engine import build_engine
from megatron_hdp.megatron.model import GPTConfig, model_parallel_dims
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
from tests.megatron.test_tensor_parallel import CFG as TP_CFG
from tests.megatron.test_tensor_parallel import _tp_layout, relative, unshard

SEED = 11
NUM_STEPS = 3
EXPERTS = 4
COEFF = 0.5  # large, so that a wrong load-balancing gradient shows in every comparison
CFG = dataclasses.replace(
    TP_CFG, num_experts=EXPERTS, moe_router_topk=2, moe_aux_loss_coeff=COEFF, ffn_hidden_size=32
)
_EXPERT = re.compile(r"(.*\.local_experts\.)(\d+)(\..*)")


def _body_hdp(rank, world_size, cfg, pool, kind, optim=OPTIM):
    dims = model_parallel_dims(cfg, world_size)
    with cpu_shims():
        layout = dims.initialize()
        try:
            engine = build_engine(cfg, optim, seed=SEED)
            named = list(engine.model.module.named_parameters())
            init = {n: p.detach().clone() for n, p in named}
            runtime = StepRuntime(
                group=layout.pool_group, check_plans=True, job_group=layout.world_group
            )
            grads, losses, aux, started = {}, [], [], []
            snapshot_grads_before_update(engine, grads)
            for step in range(NUM_STEPS):
                source = source_of(make_batch(pool, step, kind))
                plan = plan_step(source.seqlens, pool_size=pool, capacity=CAPACITY, policy="greedy")
                result = train_step(engine, plan, source, runtime)
                losses.append(result.loss)
                aux.append(result.moe_aux_loss)
                if engine.grad_sync is not None:
                    started.append(engine.grad_sync.started_before_finish)
            return {
                "started_before_finish": started,
                "losses": losses,
                "aux": aux,
                "grads": grads,
                "init": init,
                "after": {n: p.detach().clone() for n, p in named},
                "layout": {n: _tp_layout(p) for n, p in named},
                "rings": [mb.ring for mb in plan.micro_batches if mb.cp_size > 1],
            }
        finally:
            layout.destroy()


def _body_reference(rank, world_size, cfg, pool, kind):
    batches = [make_batch(pool, step, kind) for step in range(NUM_STEPS)]
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            return train_reference(cfg, seed=SEED, optim=OPTIM, batches=batches, aux_coeff=COEFF)
        finally:
            layout.destroy()


def _global_name(name: str, tp_rank: int, experts_per_rank: int) -> str:
    """The reference's name of a parameter of TP rank `tp_rank` (experts by global index)."""
    match = _EXPERT.match(name)
    if match is None:
        return name
    head, local, tail = match.groups()
    return f"{head}{tp_rank * experts_per_rank + int(local)}{tail}"


def _full(members: list[dict], key: str, layout: dict, ep: int) -> dict[str, torch.Tensor]:
    """The TP=1, EP=1 tensors of one replica from its TP ranks' results."""
    full = {}
    for name, lay in layout.items():
        if _EXPERT.match(name):  # experts are whole on their EP rank (expert TP = 1)
            for t, m in enumerate(members):
                full[_global_name(name, t, EXPERTS // ep)] = m[key][name]
        else:
            full[name] = unshard([m[key][name] for m in members], lay)
    return full


@pytest.mark.parametrize(
    "pool, tp, dispatcher, bias, overlap",
    [
        (2, 2, "alltoall", False, False),
        (3, 2, "allgather", False, False),
        (2, 1, "allgather", False, False),
        (3, 2, "alltoall", False, True),
        (2, 1, "allgather", True, False),
        (2, 2, "alltoall", True, False),
    ],
    ids=[
        "ep2-tp2-pool2-alltoall",
        "ep2-tp2-pool3-allgather",
        "ep1-tp1-pool2",
        "ep2-tp2-pool3-alltoall-overlap",
        "ep1-tp1-pool2-bias",
        "ep2-tp2-pool2-alltoall-bias",
    ],
)
def test_moe_replicas_equal_one_process(pool, tp, dispatcher, bias, overlap):
    """Mixed lengths (C-1, C, C+1 and, with pool 3, sequences needing 2 and 3 replicas): every
    step's loss and load-balancing loss, the first step's gradients, the parameters after 3
    AdamW steps, and the initial weights bit for bit, expert by global index. With `bias`:
    Megatron's default linear biases, experts' biases included. With `overlap`,
    --overlap-grad-reduce with small buckets (dense and expert bucket groups)."""
    optim = OPTIM
    if overlap:
        optim = dataclasses.replace(OPTIM, overlap_grad_reduce=True, ddp_bucket_size=2000)
    single = dataclasses.replace(CFG, add_bias_linear=bias)
    cfg = dataclasses.replace(
        single,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        expert_model_parallel_size=tp,
        moe_token_dispatcher_type=dispatcher,
    )
    ranks = run_ranks(_body_hdp, tp * pool, cfg, pool, "mixed", optim, timeout_s=240)
    if overlap:  # some rank's reduce really started in a backward
        assert any(n > 0 for r in ranks for n in r["started_before_finish"])
    reference = run_ranks(_body_reference, 1, single, pool, "mixed")[0]
    if bias:
        assert any(".local_experts.0.linear_fc2.bias" in n for n in reference["init"])
    assert all(a > 0 for a in reference["aux"])
    experts = [
        reference["init"][f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight"]
        for e in range(EXPERTS)
    ]
    assert not any(torch.equal(experts[0], e) for e in experts[1:])  # each its own draw
    for result in ranks:
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert result["aux"] == pytest.approx(reference["aux"], rel=1e-5)
    assert any(len(ring) > 1 for ring in ranks[0]["rings"])  # sequences really span replicas
    for replica in range(pool):
        members = ranks[replica * tp : (replica + 1) * tp]
        layout = members[0]["layout"]
        init = _full(members, "init", layout, tp)
        grads = _full(members, "grads", layout, tp)
        after = _full(members, "after", layout, tp)
        assert init.keys() == reference["init"].keys()
        for name, want in reference["init"].items():
            assert torch.equal(init[name], want), name
            assert relative(grads[name], reference["grads"][name]) < 1e-5, name
            assert relative(after[name], reference["after"][name]) < 1e-5, name


def test_moe_set_ups_are_checked():
    with pytest.raises(ValueError, match="moe_router_topk 5 must lie in"):
        dataclasses.replace(CFG, moe_router_topk=5)
    with pytest.raises(ValueError, match="expert_model_parallel_size 2 must divide"):
        dataclasses.replace(CFG, expert_model_parallel_size=2)
    with pytest.raises(ValueError, match="needs sequence parallelism"):
        dataclasses.replace(CFG, tensor_model_parallel_size=2, expert_model_parallel_size=2)
    with pytest.raises(ValueError, match="num_experts 3 is not divisible by expert"):
        GPTConfig(
            num_experts=3,
            expert_model_parallel_size=2,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
        )
