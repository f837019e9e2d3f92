"""--overlap-grad-reduce with HDP's uneven micro-batch counts equals one process.

Hand-made plans on a pool of 4 give every case the overlapped reduce has to get right:
ranks that run 1 and 3 micro-batches, a rank whose last micro-batch is local (its backward
starts the bucket reduces), one whose last is a ring (it starts them after its backward),
and a rank without micro-batches. Gradients, gradient norms and weights after four steps
must equal a single process trained on the same global batches, and no rank may post a ring
exchange after its first gradient reduce (on NCCL that would hang).
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_hdp.distributed.layout import ParallelDims
from megatron_hdp.megatron import grad_sync
from megatron_hdp.megatron import step as step_module
from megatron_hdp.megatron.cpu_shim import cpu_shims
from megatron_hdp.megatron.engine import build_engine
from megatron_hdp.megatron.model import build_gpt
from megatron_hdp.megatron.step import StepRuntime, train_step
from megatron_hdp.scheduler.plan import MicroBatch, plan_from_rank_lists
from tests.dist import run_ranks
from tests.megatron.reference import (
    build_reference,
    reference_loss_and_grads,
    reference_optimizer,
)
from tests.megatron.test_model_equivalence import (
    CAPACITY,
    CFG,
    OPTIM,
    SEED,
    assert_close_rel,
    batch_of_lengths,
    source_of,
)

POOL = 4
# Small buckets: the model's gradients fall into several bucket groups, so their order
# matters (Megatron's default puts this model in one).
BUCKET = 2000
LENGTHS = [24, 10, 6, 12, 9, 14, 20]
# (ring, sequences) in global order.
PLAN_A = [
    ((1, 2), (0,)),  # a ring: first on ranks 1 and 2
    ((1,), (3,)),
    ((2,), (5,)),
    ((2, 3), (6,)),  # the last micro-batch of ranks 2 and 3: a ring
    ((1,), (4,)),  # rank 1: 3 micro-batches, the last one local
    ((0,), (1, 2)),  # rank 0: 1 micro-batch, local
]
PLAN_B = [
    ((0, 1), (0,)),
    ((2,), (3,)),
    ((1,), (1, 2)),
    ((0,), (5,)),
    ((2,), (4,)),  # rank 2: 2 local micro-batches
    ((0, 1), (6,)),  # ranks 0 and 1 end with a ring; rank 3 runs nothing
]
# Step 0 is Megatron's first batch (the hooks only count); a rank's reduce starts in its
# backward from its second step with a local last micro-batch on.
PLANS = [PLAN_A, PLAN_B, PLAN_A, PLAN_B]
# Bucket groups started in the backward (before the finish), per step and rank: all or none.
STARTED_BEFORE_FINISH = [
    [False, False, False, False],
    [False, False, False, False],
    [True, True, False, False],
    [False, False, True, False],
]


def plans():
    out = []
    for items in PLANS:
        micro_batches = [
            MicroBatch(order=n, ring=ring, seq_indices=seqs) for n, (ring, seqs) in enumerate(items)
        ]
        plan = plan_from_rank_lists(LENGTHS, POOL, CAPACITY, "grad-sync-test", micro_batches)
        plan.validate()
        out.append(plan)
    return out


def batches():
    return [batch_of_lengths(LENGTHS, seed=50 + step) for step in range(len(PLANS))]


class Events:
    """This rank's ring exchanges (P2P over `pool`, default the world) and gradient-bucket
    reduces, in the order it posts them."""

    def __init__(self, gate: grad_sync.OrderedGradSync, pool=None):
        self.log: list[str] = []
        real_batch, real_issue = dist.batch_isend_irecv, gate._issue
        pool_ranks = dist.get_process_group_ranks(pool or dist.group.WORLD)

        def batch_isend_irecv(p2p_op_list):
            if dist.get_process_group_ranks(p2p_op_list[0].group) == pool_ranks:
                self.log.append("p2p")
            return real_batch(p2p_op_list)

        def issue(index):
            self.log.append(f"reduce{index}")
            return real_issue(index)

        dist.batch_isend_irecv = batch_isend_irecv
        gate._issue = issue

    def take(self) -> list[str]:
        log, self.log = self.log, []
        return log


def _body_train(rank, world_size, optim, mutation=None):
    if mutation == "sync_in_first":  # the reduce would miss the later micro-batches
        step_module.sync_in_backward = lambda rings, overlap: [
            i == 0 and overlap for i in range(len(rings))
        ]
    if mutation == "sync_in_ring":  # the reduce would start before a ring's exchanges
        step_module.sync_in_backward = lambda rings, overlap: [
            overlap and i == len(rings) - 1 for i in range(len(rings))
        ]
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            engine = build_engine(CFG, optim, seed=SEED)
            gate = engine.grad_sync
            assert gate is not None and gate.num_groups > 2, gate
            events = Events(gate)
            runtime = StepRuntime(group=dist.group.WORLD, check_plans=True)
            per_step = []
            for plan, seqs in zip(plans(), batches(), strict=True):
                grads = {}
                if not optim.use_distributed_optimizer:
                    snapshot(engine, grads)
                result = train_step(engine, plan, source_of(seqs), runtime)
                log = events.take()
                per_step.append(
                    {
                        "loss": result.loss,
                        "norm": result.grad_norm,
                        "micro_batches": result.num_micro_batches,
                        "grads": grads or None,
                        "started_before_finish": gate.started_before_finish,
                        "log": log,
                    }
                )
            params = {n: p.detach().clone() for n, p in engine.model.module.named_parameters()}
            return per_step, params, gate.num_groups
        finally:
            layout.destroy()


def snapshot(engine, into: dict) -> None:
    """Copy the synced gradients when the optimizer steps, before it clips them."""
    real_step = engine.optimizer.step

    def step():
        for name, param in engine.model.module.named_parameters():
            into[name] = param.main_grad.detach().clone()
        engine.optimizer.step = real_step
        return real_step()

    engine.optimizer.step = step


def _body_reference(rank, world_size):
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            torch.manual_seed(SEED)
            model = build_reference(CFG, build_gpt(CFG).state_dict())
            opt = reference_optimizer(
                model,
                lr=OPTIM.lr,
                weight_decay=OPTIM.weight_decay,
                betas=(OPTIM.adam_beta1, OPTIM.adam_beta2),
                eps=OPTIM.adam_eps,
            )
            steps = []
            for seqs in batches():
                opt.zero_grad()
                loss = reference_loss_and_grads(model, seqs)
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
                norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.clip_grad))
                opt.step()
                steps.append((loss, norm, grads))
            return steps, {n: p.detach().clone() for n, p in model.named_parameters()}
        finally:
            layout.destroy()


_REFERENCE = []


def reference():
    if not _REFERENCE:
        _REFERENCE.append(run_ranks(_body_reference, 1)[0])
    return _REFERENCE[0]


def check_against_reference(per_rank) -> None:
    ref_steps, ref_params = reference()
    for rank, (per_step, params, _) in enumerate(per_rank):
        for step, got in enumerate(per_step):
            loss, norm, grads = ref_steps[step]
            assert got["loss"] == pytest.approx(loss, rel=1e-5), (rank, step)
            assert got["norm"] == pytest.approx(norm, rel=1e-5), (rank, step, got["norm"], norm)
            if got["grads"] is not None:
                for name, want in grads.items():
                    assert_close_rel(got["grads"][name], want, f"rank {rank} step {step} {name}")
        for name, want in ref_params.items():
            assert_close_rel(params[name], want, f"rank {rank} param {name}")


def check_order(per_rank) -> None:
    """Each bucket group is reduced once, in one order, and never before a ring exchange."""
    for rank, (per_step, _, num_groups) in enumerate(per_rank):
        for step, got in enumerate(per_step):
            log = got["log"]
            reduces = [e for e in log if e.startswith("reduce")]
            assert reduces == [f"reduce{i}" for i in range(num_groups)], (rank, step, log)
            first = log.index("reduce0")
            assert "p2p" not in log[first:], f"rank {rank} step {step}: P2P after a reduce {log}"


def check_overlap(per_rank) -> None:
    """The reduce starts in the backward exactly where the design says."""
    for rank, (per_step, _, num_groups) in enumerate(per_rank):
        for step, got in enumerate(per_step):
            want = num_groups if STARTED_BEFORE_FINISH[step][rank] else 0
            assert got["started_before_finish"] == want, (rank, step, got["started_before_finish"])


def optim_case(distributed_optimizer: bool, fp32: bool):
    return dataclasses.replace(
        OPTIM,
        overlap_grad_reduce=True,
        ddp_bucket_size=BUCKET,
        use_distributed_optimizer=distributed_optimizer,
        grad_reduce_in_fp32=fp32,
    )


def test_plans_have_the_uneven_counts_the_tests_need():
    counts = [plan.num_micro_batches_per_rank() for plan in plans()]
    assert counts[0] == [1, 3, 3, 1] and counts[1] == [3, 3, 2, 0]
    for plan in plans():
        assert any(mb.cp_size > 1 for mb in plan.micro_batches)


@pytest.mark.parametrize(
    "distributed_optimizer, fp32",
    [(False, True), (False, False), (True, True), (True, False)],
    ids=["allreduce-fp32", "allreduce-param-dtype", "dist-opt-fp32", "dist-opt-param-dtype"],
)
def test_overlapped_reduce_matches_single_process(distributed_optimizer, fp32):
    per_rank = run_ranks(_body_train, POOL, optim_case(distributed_optimizer, fp32), timeout_s=240)
    check_against_reference(per_rank)
    check_order(per_rank)
    check_overlap(per_rank)


def test_a_reduce_started_in_the_first_micro_batch_is_caught():
    """The comparison sees a reduce that misses micro-batches (a wrong sync rule)."""
    per_rank = run_ranks(_body_train, POOL, optim_case(False, True), "sync_in_first", timeout_s=240)
    with pytest.raises(AssertionError):
        check_against_reference(per_rank)


def test_a_reduce_started_in_a_ring_backward_is_caught():
    """Starting the reduce in a ring's backward is exact on gloo but would hang on NCCL;
    the event order shows it."""
    per_rank = run_ranks(_body_train, POOL, optim_case(False, True), "sync_in_ring", timeout_s=240)
    check_against_reference(per_rank)
    with pytest.raises(AssertionError, match="P2P after a reduce"):
        check_order(per_rank)


def test_sync_in_backward_picks_only_a_local_last_micro_batch():
    assert grad_sync.sync_in_backward([2, 1, 1], True) == [False, False, True]
    assert grad_sync.sync_in_backward([1, 1, 3], True) == [False, False, False]
    assert grad_sync.sync_in_backward([1], False) == [False]
    assert grad_sync.sync_in_backward([], True) == []


def _body_bf16(rank, world_size, fp32):
    cfg = dataclasses.replace(CFG, params_dtype="bfloat16")
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            engine = build_engine(cfg, optim_case(False, fp32), seed=SEED)
            runtime = StepRuntime(group=dist.group.WORLD)
            grads = {}
            snapshot(engine, grads)
            losses = [
                train_step(engine, plan, source_of(seqs), runtime).loss
                for plan, seqs in zip(plans(), batches(), strict=True)
            ]
            dtypes = {(p.dtype, p.main_grad.dtype) for p in engine.model.module.parameters()}
            return losses, {n: g.float() for n, g in grads.items()}, dtypes
        finally:
            layout.destroy()


@pytest.mark.parametrize("fp32", [True, False], ids=["fp32-grads", "bf16-grads"])
def test_bf16_parameters_reduce_in_the_chosen_dtype_near_the_reference(fp32):
    """--bf16 reduces float32 gradients (Megatron-LM's default) or, with
    --grad-reduce-in-bf16, bfloat16 ones; both stay near the float32 reference."""
    ref_steps, _ = reference()
    for losses, grads, dtypes in run_ranks(_body_bf16, POOL, fp32, timeout_s=240):
        # (The norms' weights are float32 parameters; the rest bfloat16.)
        bf16 = torch.float32 if fp32 else torch.bfloat16
        assert dtypes == {(torch.bfloat16, bf16), (torch.float32, torch.float32)}
        assert losses == pytest.approx([s[0] for s in ref_steps], rel=2e-2)
        for name, want in ref_steps[0][2].items():
            assert_close_rel(grads[name], want, name, rel=5e-2)


def _body_dropin(rank, world_size):
    """Megatron-LM's set-up for --overlap-grad-reduce around a bare Megatron-Core DDP."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from megatron_hdp.megatron.model import transformer_config
    from megatron_hdp.megatron.schedule import HDPGlobalBatch, hdp_forward_backward
    from tests.megatron.test_dropin import pretrain_gpt_forward_step

    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            torch.manual_seed(SEED)
            ddp_config = DistributedDataParallelConfig(
                overlap_grad_reduce=True, bucket_size=BUCKET, grad_reduce_in_fp32=True
            )
            model = DistributedDataParallel(transformer_config(CFG), ddp_config, build_gpt(CFG))
            config = model.config
            config.finalize_model_grads_func = finalize_model_grads
            config.no_sync_func = model.no_sync
            config.grad_sync_func = model.start_grad_sync  # --align-grad-reduce
            schedule = hdp_forward_backward(StepRuntime(group=dist.group.WORLD), CFG)
            per_step, events = [], None
            for plan, seqs in zip(plans(), batches(), strict=True):
                model.zero_grad_buffer()
                schedule(
                    forward_step_func=pretrain_gpt_forward_step,
                    data_iterator=iter([HDPGlobalBatch(plan=plan, source=source_of(seqs))]),
                    model=[model],
                    num_microbatches=1,
                )
                gate = getattr(model, grad_sync.ATTRIBUTE)  # installed by the drop-in
                log = events.take() if events is not None else None
                events = events or Events(gate)
                per_step.append(
                    {
                        "grads": {
                            n: p.main_grad.clone() for n, p in model.module.named_parameters()
                        },
                        "started_before_finish": gate.started_before_finish,
                        "log": log,
                    }
                )
            return per_step, gate.num_groups
        finally:
            layout.destroy()


def _body_reference_grads(rank, world_size):
    """The gradients of each global batch at the initial weights (no update)."""
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            torch.manual_seed(SEED)
            model = build_reference(CFG, build_gpt(CFG).state_dict())
            out = []
            for seqs in batches():
                model.zero_grad()
                reference_loss_and_grads(model, seqs)
                out.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
            return out
        finally:
            layout.destroy()


def test_dropin_overlapped_reduce_matches_single_process():
    """The Megatron-LM drop-in with Megatron-LM's overlap set-up (no_sync_func, and
    grad_sync_func for --align-grad-reduce) on the uneven plans: exact gradients, the
    reduce in a local last backward only, never before a ring exchange."""
    per_rank = run_ranks(_body_dropin, POOL, timeout_s=240)
    want = run_ranks(_body_reference_grads, 1)[0]
    for rank, (per_step, num_groups) in enumerate(per_rank):
        assert num_groups > 2
        for step, got in enumerate(per_step):
            for name, ref in want[step].items():
                assert_close_rel(got["grads"][name], ref, f"rank {rank} step {step} {name}")
            expected = num_groups if STARTED_BEFORE_FINISH[step][rank] else 0
            assert got["started_before_finish"] == expected, (rank, step)
    check_order([([s for s in steps[1:]], None, n) for steps, n in per_rank])


def _body_dropin_pipeline(rank, world_size, pool):
    """The drop-in with PP 2 and Megatron-LM's overlap set-up, three steps, no update."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_hdp.megatron.model import model_parallel_dims
    from megatron_hdp.megatron.schedule import HDPGlobalBatch, hdp_forward_backward
    from tests.megatron import test_pipeline_parallel as pp_test
    from tests.megatron.test_dropin import pretrain_gpt_forward_step

    dims = model_parallel_dims(pp_test.CFG, world_size)
    with cpu_shims():
        layout = dims.initialize()
        try:
            optim = dataclasses.replace(OPTIM, overlap_grad_reduce=True, ddp_bucket_size=BUCKET)
            engine = build_engine(pp_test.CFG, optim, seed=pp_test.SEED)
            model = engine.model
            config = model.config
            config.finalize_model_grads_func = finalize_model_grads
            config.no_sync_func = model.no_sync
            config.grad_sync_func = model.start_grad_sync  # --align-grad-reduce
            runtime = StepRuntime(
                group=layout.pool_group,
                job_group=layout.world_group,
                pipeline_group=layout.pp_group,
            )
            schedule = hdp_forward_backward(runtime, pp_test.CFG)
            events = Events(engine.grad_sync, layout.pool_group)
            per_step = []
            for step, plan in enumerate(pp_test.make_plans(pool)):
                model.zero_grad_buffer()
                schedule(
                    forward_step_func=pretrain_gpt_forward_step,
                    data_iterator=iter(
                        [HDPGlobalBatch(plan=plan, source=source_of(pp_test.batch_of(plan, step)))]
                    ),
                    model=[model],
                    num_microbatches=1,
                )
                per_step.append(
                    {
                        "grads": {
                            n: p.main_grad.clone() for n, p in model.module.named_parameters()
                        },
                        "started_before_finish": engine.grad_sync.started_before_finish,
                        "log": events.take(),
                    }
                )
            return layout.stage, per_step, engine.grad_sync.num_groups
        finally:
            layout.destroy()


def _body_grads_at_init(rank, world_size, cfg, batch_list):
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            torch.manual_seed(SEED)
            model = build_reference(cfg, build_gpt(cfg).state_dict())
            out = []
            for seqs in batch_list:
                model.zero_grad()
                reference_loss_and_grads(model, seqs)
                out.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
            return out
        finally:
            layout.destroy()


def test_dropin_overlapped_reduce_with_pipelines_matches_single_process():
    """PP 2 x pool 3 through Megatron-Core's 1F1B with Megatron-LM's overlap settings:
    pipelines that end a step on a ring, and one without micro-batches; each stage's
    gradients equal one process's, and no reduce goes before a ring exchange."""
    from tests.megatron import test_pipeline_parallel as pp_test

    pool = 3
    per_rank = run_ranks(_body_dropin_pipeline, 2 * pool, pool, timeout_s=240)
    single = dataclasses.replace(pp_test.CFG, pipeline_model_parallel_size=1)
    plans_ = pp_test.make_plans(pool)
    batch_list = [pp_test.batch_of(plan, step) for step, plan in enumerate(plans_)]
    want = run_ranks(_body_grads_at_init, 1, single, batch_list)[0]
    layers = pp_test.CFG.num_layers // 2
    for stage, per_step, _ in per_rank:
        for step, got in enumerate(per_step):
            for name, grad in got["grads"].items():
                ref = want[step][pp_test.global_name(name, stage, layers)]
                assert_close_rel(grad, ref, f"stage {stage} step {step} {name}")
    check_order([(steps, None, n) for _, steps, n in per_rank])
    # Stage 0 starts its reduce in its last backward (Megatron-LM's --align-grad-reduce).
    assert any(s["started_before_finish"] for st, steps, _ in per_rank if st == 0 for s in steps)
