"""Pipeline parallelism inside HDP replicas: PP (x TP) x pool ranks equal one process, exactly.

Tied embeddings too: the last stage holds a copy of the first stage's embedding as its
output layer, as Megatron does.

Each replica is a pipeline of two stages running Megatron-Core's 1F1B schedule; replicas
run different numbers of micro-batches, and ring micro-batches span pipelines in lock step
(same position, same count on every member). Every stage's parameters are mapped back to
the single-process model by global layer number (and TP shards unsharded) and compared
with the reference on the same global batches: the loss of every step, the first step's
gradients and the weights after three AdamW steps.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_hdp.distributed.layout import ParallelDims
from megatron_hdp.megatron.cpu_shim import cpu_shims
from megatron_hdp.megatron.engine import build_engine
from megatron_hdp.megatron.model import model_parallel_dims
from megatron_hdp.megatron.step import StepRuntime, evaluate, train_step
from megatron_hdp.scheduler import plan_step
from megatron_hdp.scheduler.plan import (
    MicroBatch,
    StepPlan,
    lockstep_problems,
    plan_from_rank_lists,
)
from tests.dist import run_ranks
from tests.megatron.reference import train_reference
from tests.megatron.test_model_equivalence import (
    CAPACITY,
    OPTIM,
    batch_lengths,
    batch_of_lengths,
    snapshot_grads_before_update,
    source_of,
)
from tests.megatron.test_model_equivalence import CFG as EQUIVALENCE_CFG
from tests.megatron.test_moe import CFG as MOE_CFG
from tests.megatron.test_moe import _full as moe_full
from tests.megatron.test_tensor_parallel import relative

SEED = 7
PP = 2
# Untied embeddings (the last stage owns the output layer), a vocabulary divisible by TP.
CFG = dataclasses.replace(EQUIVALENCE_CFG, vocab_size=128, pipeline_model_parallel_size=PP)

# Hand-made lock-step plans, one per step: lengths, then (ring, sequence indices) in order.
C = CAPACITY
PLANS = {
    # Pool 2: a ring over both pipelines (reversed ring order in step 1) among packs.
    2: [
        (
            [C + 1, 16, 9, 12, 3, 5],
            [((0, 1), (0,)), ((0,), (1,)), ((1,), (2,)), ((0,), (3, 4)), ((1,), (5,))],
        ),
        ([C + 4, 2 * C, 7, 11, 1], [((1, 0), (0,)), ((0, 1), (1,)), ((0,), (2, 4)), ((1,), (3,))]),
        (
            [9, C + 2, 6, 14, 8],
            [((0,), (0,)), ((1,), (3,)), ((0, 1), (1,)), ((0,), (2,)), ((1,), (4,))],
        ),
    ],
    # Pool 3: rings over pipelines 0 and 1 while pipeline 2 runs more micro-batches alone;
    # step 1 has a ring over all three pipelines (then all counts are equal); step 2 leaves
    # pipeline 2 without micro-batches.
    3: [
        (
            [C + 1, 20, 16, 12, 3, 9, 5, 7, 1],
            [
                ((0, 1), (0,)),
                ((2,), (2,)),
                ((0, 1), (1,)),
                ((2,), (3, 4)),
                ((2,), (5, 6)),
                ((2,), (7, 8)),
            ],
        ),
        (
            [2 * C + 5, 10, 4, 13, 6],
            [((2, 0, 1), (0,)), ((0,), (1, 2)), ((1,), (3,)), ((2,), (4,))],
        ),
        # Pipeline 2 runs no micro-batch at all (it still joins the gradient sync).
        (
            [C + 9, 15, 3, 8, 2, 11],
            [((1, 0), (0,)), ((0,), (1,)), ((1,), (2,)), ((0,), (4, 5)), ((1,), (3,))],
        ),
    ],
}


def make_plans(pool: int, planner: str | None = None) -> list[StepPlan]:
    """Three plans, checked valid and lock-step: hand-made, or by `planner` for two stages
    on the equivalence test's mixed batches (rings of 2 to `pool` pipelines)."""
    if planner is not None:
        tables = [(batch_lengths(pool, step, "mixed"), None) for step in range(3)]
    else:
        tables = PLANS[pool]
    plans = []
    for lengths, items in tables:
        if items is None:
            plan = plan_step(
                lengths, pool_size=pool, capacity=C, policy=planner, pipeline_stages=PP
            )
        else:
            micro_batches = [
                MicroBatch(order=n, ring=ring, seq_indices=seqs)
                for n, (ring, seqs) in enumerate(items)
            ]
            plan = plan_from_rank_lists(lengths, pool, C, "lockstep-test", micro_batches)
        plan.validate()
        assert not lockstep_problems(plan), lockstep_problems(plan)
        plans.append(plan)
    return plans


def batch_of(plan: StepPlan, step: int):
    """`(tokens, labels, loss_mask)` per sequence of `plan`, the third one masked out."""
    return batch_of_lengths(plan.seqlens, seed=100 * step + plan.pool_size)


def global_name(name: str, stage: int, layers_per_stage: int) -> str:
    """The single-process parameter name of stage `stage`'s local parameter `name`."""
    prefix = "decoder.layers."
    if not name.startswith(prefix):
        return name
    local, rest = name[len(prefix) :].split(".", 1)
    return f"{prefix}{int(local) + stage * layers_per_stage}.{rest}"


def _tp_layout(param) -> tuple[bool, int, int]:
    return (
        bool(getattr(param, "tensor_model_parallel", False)),
        getattr(param, "partition_dim", -1),
        getattr(param, "partition_stride", 1),
    )


def _body_pp(rank, world_size, cfg, pool, tp, planner, optim=OPTIM, plans=None):
    with cpu_shims():
        layout = model_parallel_dims(cfg, world_size).initialize()
        try:
            engine = build_engine(cfg, optim, seed=SEED)
            named = list(engine.model.module.named_parameters())
            init = {n: p.detach().clone() for n, p in named}
            runtime = StepRuntime(
                group=layout.pool_group, check_plans=True, job_group=dist.group.WORLD
            )
            grads, losses, eval_losses, counts, aux, started = {}, [], [], [], [], []
            snapshot_grads_before_update(engine, grads)
            for step, plan in enumerate(plans or make_plans(pool, planner)):
                source = source_of(batch_of(plan, step))
                eval_losses.append(evaluate(engine, plan, source, runtime))
                result = train_step(engine, plan, source, runtime)
                losses.append(result.loss)
                aux.append(result.moe_aux_loss)
                counts.append(result.num_micro_batches)
                if engine.grad_sync is not None:
                    started.append(engine.grad_sync.started_before_finish)
            return {
                "started_before_finish": started,
                "losses": losses,
                "aux": aux,
                "eval": eval_losses,
                "counts": counts,
                "grads": grads,
                "init": init,
                "after": {n: p.detach().clone() for n, p in named},
                "layout": {n: _tp_layout(p) for n, p in named},
                "stage": layout.stage,
                "replica": layout.pool_rank,
                "tp_rank": layout.tp_rank,
            }
        finally:
            layout.destroy()


def _body_reference_batches(rank, world_size, cfg, batches):
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            return train_reference(
                cfg, seed=SEED, optim=OPTIM, batches=batches, aux_coeff=cfg.moe_aux_loss_coeff
            )
        finally:
            layout.destroy()


def _body_reference(rank, world_size, cfg, pool, planner=None):
    batches = [batch_of(plan, step) for step, plan in enumerate(make_plans(pool, planner))]
    return _body_reference_batches(rank, world_size, cfg, batches)


@pytest.mark.parametrize(
    "pool, tp, tied, planner",
    [
        (2, 1, False, None),
        (3, 1, False, None),
        (2, 2, False, None),
        (2, 1, True, None),
        (3, 1, False, "balanced"),
        (2, 1, False, "static"),
        (3, 1, "moe", None),
        (2, 2, "moe", None),
        (2, 1, "moe-bias", None),
    ],
    ids=[
        "pp2-pool2",
        "pp2-pool3",
        "pp2-tp2-pool2",
        "pp2-pool2-tied",
        "pp2-pool3-pp-balance",
        "pp2-pool2-static",
        "pp2-pool3-moe",
        "pp2-tp2-sp-ep2-pool2-moe",
        "pp2-pool2-moe-bias",
    ],
)
def test_pipelines_equal_one_process(pool, tp, tied, planner):
    """Rings span pipelines; pipelines run different numbers of micro-batches."""
    check_pipelines(pool, tp, tied, planner)


def test_overlapped_reduce_in_pipelines_equals_one_process():
    """--overlap-grad-reduce with 1F1B: a stage's reduce starts in its last backward when
    that micro-batch is local (Megatron's schedule leaves no_sync for it), after the
    backward when it is a ring; small buckets give stage 0 several bucket groups."""
    optim = dataclasses.replace(OPTIM, overlap_grad_reduce=True, ddp_bucket_size=2000)
    ranks = check_pipelines(3, 1, False, None, optim)
    plans = make_plans(3)
    for result in ranks:
        lasts = [p.for_rank(result["replica"])[-1:] for p in plans]
        started = result["started_before_finish"]
        # Step 0 is Megatron's first batch (the hooks only count). A pipeline whose first
        # counted step ended on a ring counts on the next local one.
        assert started[0] == 0
        for step in (1, 2):
            local_last = bool(lasts[step]) and lasts[step][0].is_local
            counted_before = any(bool(last) and last[0].is_local for last in lasts[:step])
            assert (started[step] > 0) == (local_last and counted_before), (result, step)
    assert any(s > 0 for r in ranks for s in r["started_before_finish"])


def check_pipelines(pool, tp, tied, planner, optim=OPTIM):
    """Run the pipelines and compare them with one process; return the ranks' results."""
    if tied in ("moe", "moe-bias"):  # 4 experts, top-2, a large load-balancing loss (test_moe's)
        bias, tied = tied == "moe-bias", False  # with Megatron's default linear biases
        cfg = dataclasses.replace(
            MOE_CFG,
            add_bias_linear=bias,
            pipeline_model_parallel_size=PP,
            moe_token_dispatcher_type="alltoall",
            tensor_model_parallel_size=tp,
            sequence_parallel=tp > 1,
            expert_model_parallel_size=tp,
        )
    else:
        cfg = dataclasses.replace(CFG, tensor_model_parallel_size=tp, tie_embeddings=tied)
    ranks = run_ranks(_body_pp, PP * tp * pool, cfg, pool, tp, planner, optim, timeout_s=240)
    reference = run_ranks(
        _body_reference,
        1,
        dataclasses.replace(
            cfg,
            pipeline_model_parallel_size=1,
            tensor_model_parallel_size=1,
            sequence_parallel=False,
            expert_model_parallel_size=1,
        ),
        pool,
        planner,
    )[0]
    plans = make_plans(pool, planner)
    for rank, result in enumerate(ranks):
        assert result["stage"] == rank // (tp * pool)
        assert result["replica"] == (rank // tp) % pool
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        if cfg.num_experts is not None:
            assert result["aux"] == pytest.approx(reference["aux"], rel=1e-5)
            assert min(reference["aux"]) > 0
        for step, (loss_sum, tokens) in enumerate(result["eval"]):
            assert loss_sum / tokens == pytest.approx(reference["losses"][step], rel=1e-5)
        want = [len(p.for_rank(result["replica"])) for p in plans]
        assert result["counts"] == want
    if pool == 3 and planner is None:
        assert len({tuple(r["counts"]) for r in ranks}) > 1  # pipelines run different counts
    assert any(mb.cp_size > 1 for plan in plans for mb in plan.micro_batches)
    layers_per_stage = cfg.num_layers // PP
    seen = set()
    for stage in range(PP):
        for replica in range(pool):
            members = [r for r in ranks if r["stage"] == stage and r["replica"] == replica]
            members.sort(key=lambda r: r["tp_rank"])
            layout = members[0]["layout"]
            ep = cfg.expert_model_parallel_size
            full = {key: moe_full(members, key, layout, ep) for key in ("init", "grads", "after")}
            for name in full["init"]:
                full_name = global_name(name, stage, layers_per_stage)
                if tied and name == "output_layer.weight":
                    # The last stage's copy of the tied embedding (Megatron keeps the two
                    # copies equal: same start, gradients summed over both stages).
                    full_name = "embedding.word_embeddings.weight"
                seen.add(full_name)
                assert torch.equal(full["init"][name], reference["init"][full_name]), full_name
                assert relative(full["grads"][name], reference["grads"][full_name]) < 1e-5
                assert relative(full["after"][name], reference["after"][full_name]) < 1e-5
    assert seen == set(reference["init"])  # every parameter lives on exactly one stage
    return ranks


def _body_not_lockstep(rank, world_size, plan):
    with cpu_shims():
        layout = ParallelDims.of_world(
            pipeline_model_parallel_size=PP, num_layers=CFG.num_layers
        ).initialize()
        try:
            engine = build_engine(CFG, OPTIM, seed=SEED)
            runtime = StepRuntime(group=layout.pool_group, job_group=dist.group.WORLD)
            with pytest.raises(ValueError) as err:
                train_step(engine, plan, source_of(batch_of(plan, 0)), runtime)
            return str(err.value)
        finally:
            layout.destroy()


def test_a_plan_that_is_not_lockstep_is_refused_on_every_rank_before_any_ring():
    """Pipeline 1 runs a pack before the shared ring, pipeline 0 after: 1F1B would run the
    ring's forward on different slots of the two pipelines (a deadlock), so it is refused."""
    lengths = [C + 1, 9, 5]
    items = [((0, 1), (0,)), ((0,), (1,)), ((1,), (2,))]
    mbs = [MicroBatch(order=n, ring=r, seq_indices=s) for n, (r, s) in enumerate(items)]
    good = plan_from_rank_lists(lengths, 2, C, "test", mbs)
    assert not lockstep_problems(good)
    bad_items = [((1,), (2,)), ((0, 1), (0,)), ((0,), (1,))]
    bad = plan_from_rank_lists(
        lengths,
        2,
        C,
        "test",
        [MicroBatch(order=n, ring=r, seq_indices=s) for n, (r, s) in enumerate(bad_items)],
    )
    bad.validate()  # a fine plan without pipelines
    messages = run_ranks(_body_not_lockstep, 4, bad, timeout_s=120)
    for message in messages:
        assert "cannot run on pipelines in lock step" in message
        assert "ring micro-batch 1" in message and "positions {0: 0, 1: 1}" in message


# Four stages: packs of 6 to 16 tokens, at least 6 per step (more than the 3 warm-up
# micro-batches of the first stage), so Megatron's 1F1B runs warm-up, steady state and
# cool-down with tensors of a different shape at nearly every send.
PP4_LENGTHS = [
    [16, 5, 11, 3, 14, 7, 9, 2, 13, 6, 1, 12],
    [15, 8, 4, 10, 16, 3, 6, 12, 2, 9],
    [7, 16, 11, 5, 13, 2, 8, 14, 6],
]


def test_four_stages_with_variable_micro_batch_lengths_equal_one_process():
    """PP=4, one pipeline of 4 ranks (Megatron-LM issue #5100: 1F1B with variable sequence
    lengths and batched P2P deadlocked at PP >= 4): every step's loss, the first step's
    gradients and the weights after three steps equal one process."""
    cfg = dataclasses.replace(CFG, num_layers=4, pipeline_model_parallel_size=4)
    plans = [
        plan_step(lengths, pool_size=1, capacity=C, policy="balanced", pipeline_stages=4)
        for lengths in PP4_LENGTHS
    ]
    for plan in plans:
        sizes = [sum(plan.seqlens[i] for i in mb.seq_indices) for mb in plan.micro_batches]
        assert len(sizes) >= 6 and len(set(sizes)) >= 3, sizes
    ranks = run_ranks(_body_pp, 4, cfg, 1, 1, None, OPTIM, plans, timeout_s=240)
    batches = [batch_of(plan, step) for step, plan in enumerate(plans)]
    single = dataclasses.replace(cfg, pipeline_model_parallel_size=1)
    reference = run_ranks(_body_reference_batches, 1, single, batches)[0]
    seen = set()
    for rank, result in enumerate(ranks):
        assert result["stage"] == rank
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert result["counts"] == [len(p.micro_batches) for p in plans]
        for name, init in result["init"].items():
            full_name = global_name(name, rank, 1)
            seen.add(full_name)
            assert torch.equal(init, reference["init"][full_name]), full_name
            assert relative(result["grads"][name], reference["grads"][full_name]) < 1e-5
            assert relative(result["after"][name], reference["after"][full_name]) < 1e-5
    assert seen == set(reference["init"])  # every parameter lives on exactly one stage
