"""The Megatron-LM drop-in path: a pretrain_gpt.py-style forward_step, our schedule, and
Megatron-Core's own finalize_model_grads give the single-process gradients."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

from megatron_hdp.data.batching import read_local
from megatron_hdp.distributed.layout import ParallelDims
from megatron_hdp.megatron.cpu_shim import cpu_shims
from megatron_hdp.megatron.engine import (
    build_engine,
)
from megatron_hdp.megatron.model import model_parallel_dims
from megatron_hdp.megatron.schedule import HDPGlobalBatch, hdp_forward_backward
from megatron_hdp.megatron.step import StepRuntime
from megatron_hdp.scheduler import plan_step
from tests.dist import run_ranks
from tests.megatron import test_moe as moe_test
from tests.megatron.test_model_equivalence import (
    CAPACITY,
    CFG,
    OPTIM,
    SEED,
    assert_close_rel,
    make_batch,
    reference_run,
    source_of,
)


def pretrain_gpt_forward_step(data_iterator, model):
    """Shaped like Megatron-LM's pretrain_gpt.forward_step (per-token loss variant)."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
        packed_seq_params=batch["packed_seq_params"],
    )

    def loss_func(output_tensor):
        losses = output_tensor.float().view(-1)
        mask = batch["loss_mask"].view(-1).float()
        loss_sum = torch.sum(losses * mask)
        num_tokens = mask.sum().clone().detach().to(torch.int)
        return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens])}

    return output, loss_func


def megatron_lm_engine(cfg, *, seed):
    """The engine as Megatron-LM's `train_step` sees it: its own finish, DDP's no_sync."""
    engine = build_engine(cfg, OPTIM, seed=seed)
    config = engine.model.config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = engine.model.no_sync
    return engine


def _body_dropin(rank, world_size, read_ahead=False):
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            engine = megatron_lm_engine(CFG, seed=SEED)
            source = source_of(make_batch(world_size, 0))
            plan = plan_step(
                source.seqlens, pool_size=world_size, capacity=CAPACITY, policy="greedy"
            )
            runtime = StepRuntime(group=dist.group.WORLD)
            schedule = hdp_forward_backward(runtime, CFG)
            engine.model.zero_grad_buffer()
            step = HDPGlobalBatch(plan=plan, source=source)
            if read_ahead:  # what HDPDataIterator(pool_rank=...) hands over
                step = HDPGlobalBatch(plan, source, read_local(plan, source, rank), None, rank)
            reports = schedule(
                forward_step_func=pretrain_gpt_forward_step,
                data_iterator=iter([step]),
                model=[engine.model],
                num_microbatches=1,
                seq_length=None,
                micro_batch_size=1,
                forward_only=False,
            )
            grads = {n: p.main_grad.clone() for n, p in engine.model.module.named_parameters()}
            sums = torch.stack([r["lm loss"] for r in reports]).sum(0) if reports else None
            return grads, None if sums is None else sums.tolist()
        finally:
            layout.destroy()


@pytest.mark.parametrize("read_ahead", [False, True], ids=["read-in-step", "read-ahead"])
def test_pretrain_gpt_style_step_matches_single_process(read_ahead):
    per_rank = run_ranks(_body_dropin, 3, read_ahead)
    ref_losses, _, ref_grads, _ = reference_run(3, CFG, "mixed")
    loss_sum = sum(s[0] for _, s in per_rank if s is not None)
    tokens = sum(s[1] for _, s in per_rank if s is not None)
    assert abs(loss_sum / tokens - ref_losses[0]) <= 1e-5 * ref_losses[0]
    for rank, (grads, _) in enumerate(per_rank):
        for name, want in ref_grads.items():
            assert_close_rel(grads[name], want, f"rank {rank} grad {name}")


class CallRecorder:
    """Records the pool-group calls of torch.distributed this process makes, in order.

    Wraps the real `all_reduce` and `batch_isend_irecv` (the ring's P2P goes through the
    latter) with their own signatures, and records `(name, group ranks, numel)`.
    """

    def __init__(self):
        self.calls = []
        self._real = {}

    def __enter__(self):
        real_all_reduce, real_batch = dist.all_reduce, dist.batch_isend_irecv
        self._real = {"all_reduce": real_all_reduce, "batch_isend_irecv": real_batch}

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            self.calls.append(("all_reduce", _ranks(group), tensor.numel()))
            return real_all_reduce(tensor, op=op, group=group, async_op=async_op)

        def batch_isend_irecv(p2p_op_list):
            self.calls.append(("p2p", _ranks(p2p_op_list[0].group), None))
            return real_batch(p2p_op_list)

        dist.all_reduce, dist.batch_isend_irecv = all_reduce, batch_isend_irecv
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._real["all_reduce"]
        dist.batch_isend_irecv = self._real["batch_isend_irecv"]


def _ranks(group) -> tuple:
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def _body_warm_up(rank, world_size):
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            engine = megatron_lm_engine(CFG, seed=SEED)
            pool = _ranks(dist.group.WORLD)
            runtime = StepRuntime(group=dist.group.WORLD)
            with CallRecorder() as setup:
                schedule = hdp_forward_backward(runtime, CFG)
                hdp_forward_backward(runtime, CFG)  # built again (a per-step lambda): no-op
            per_step = []
            for step_index in range(2):
                # One sequence of 2 C tokens: a ring over both ranks, first on each rank.
                source = source_of(
                    make_batch(world_size, step_index, "few")
                    + [make_batch(world_size, step_index, "tiny_pack")[0]]
                )
                plan = plan_step(
                    source.seqlens, pool_size=world_size, capacity=CAPACITY, policy="greedy"
                )
                engine.model.zero_grad_buffer()
                with CallRecorder() as steps:
                    schedule(
                        forward_step_func=pretrain_gpt_forward_step,
                        data_iterator=iter([HDPGlobalBatch(plan=plan, source=source)]),
                        model=[engine.model],
                        num_microbatches=1,
                    )
                per_step.append([c for c in steps.calls if c[1] == pool])
            return pool, setup.calls, per_step
        finally:
            layout.destroy()


def test_dropin_warms_the_pool_up_once_before_any_ring_exchange():
    """The drop-in's step has no pool collective before its first ring P2P (the audit's
    row 10), so the set-up issues one, on every rank; neither a second build nor a step
    repeats it."""
    for pool, setup, per_step in run_ranks(_body_warm_up, 2):
        assert setup == [("all_reduce", pool, 1)], setup
        for calls in per_step:
            # Without the warm-up the ring's exchange would be the pool's first operation.
            assert calls and calls[0][0] == "p2p", calls


def test_data_iterator_plans_sampler_batches_and_reads_the_index(tmp_path):
    import numpy as np

    from megatron_hdp.data.indexed import open_indexed_dataset, write_indexed_dataset
    from megatron_hdp.data.sampler import DatasetUnits, TokenBudgetSampler
    from megatron_hdp.megatron.schedule import HDPDataIterator

    docs = [list(range(i % 50, i % 50 + n)) for i, n in enumerate([3, 40, 7, 90, 12, 5, 66])]
    write_indexed_dataset(tmp_path / "d", docs, vocab_size=200)
    dataset = open_indexed_dataset(tmp_path / "d")
    units = DatasetUnits.from_documents(
        np.arange(len(docs)), np.array([len(d) for d in docs]), max_seq_length=32
    )
    sampler = TokenBudgetSampler([units], [1.0], seed=0, tokens_per_batch=64)
    iterator = HDPDataIterator(sampler, [dataset], pool_size=3, capacity=16)
    plans = []
    for _ in range(4):
        step = next(iterator)  # (closed below: its prefetch thread must not outlive the test)
        step.plan.validate(pool_size=3)
        assert step.local is None  # no pool_rank: read in the step
        plans.append(step.plan.digest())
        for i, unit in enumerate(step.source.units):
            tokens, labels, _ = step.source.read(i, 0, unit.length)
            doc = docs[unit.doc]
            assert tokens.tolist() == doc[unit.start : unit.start + unit.length]
            assert labels.tolist() == doc[unit.start + 1 : unit.start + unit.length + 1]
    iterator.close()
    # With pool_rank, the same plans come with that rank's micro-batches read ahead, and the
    # state counts only the batches handed out.
    fresh = TokenBudgetSampler([units], [1.0], seed=0, tokens_per_batch=64)
    ahead = HDPDataIterator(fresh, [dataset], pool_size=3, capacity=16, pool_rank=1)
    try:
        for k in range(4):
            step = next(ahead)
            assert step.plan.digest() == plans[k] and step.rank == 1
            want = read_local(step.plan, step.source, 1)
            assert [b.tokens.tolist() for b in step.local] == [b.tokens.tolist() for b in want]
            assert ahead.state_dict()["steps"] == k + 1
    finally:
        ahead.close()


def _body_empty_rank(rank, world_size):
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            engine = megatron_lm_engine(CFG, seed=SEED)
            source = source_of(make_batch(world_size, 0, "few"))  # 2 sequences, 4 ranks
            plan = plan_step(
                source.seqlens, pool_size=world_size, capacity=CAPACITY, policy="greedy"
            )
            schedule = hdp_forward_backward(StepRuntime(group=dist.group.WORLD), CFG)
            engine.model.zero_grad_buffer()
            reports = schedule(
                forward_step_func=pretrain_gpt_forward_step,
                data_iterator=iter([HDPGlobalBatch(plan=plan, source=source)]),
                model=[engine.model],
                num_microbatches=1,
            )
            return len(plan.for_rank(rank)), sorted(reports[0].keys()), len(reports)
        finally:
            layout.destroy()


def test_a_rank_without_micro_batches_returns_a_zero_report():
    results = run_ranks(_body_empty_rank, 4)
    assert any(n == 0 for n, _, _ in results)
    for n, keys, count in results:
        assert keys == ["lm loss"] and count == max(n, 1)


MOE_SEED = moe_test.SEED


def _body_dropin_moe(rank, world_size, cfg):
    from megatron_hdp.megatron.step import StepRuntime as Runtime

    dims = model_parallel_dims(cfg, world_size)
    with cpu_shims():
        layout = dims.initialize()
        try:
            engine = megatron_lm_engine(cfg, seed=MOE_SEED)
            pool = dims.pool_size
            source = source_of(make_batch(pool, 0))
            plan = plan_step(source.seqlens, pool_size=pool, capacity=CAPACITY, policy="greedy")
            runtime = Runtime(group=layout.pool_group, job_group=layout.world_group)
            schedule = hdp_forward_backward(runtime, cfg)
            engine.model.zero_grad_buffer()
            reports = schedule(
                forward_step_func=pretrain_gpt_forward_step,
                data_iterator=iter([HDPGlobalBatch(plan=plan, source=source)]),
                model=[engine.model],
                num_microbatches=1,
            )
            named = engine.model.module.named_parameters()
            return {
                "grads": {n: p.main_grad.clone() for n, p in named},
                "layout": {
                    n: moe_test._tp_layout(p) for n, p in engine.model.module.named_parameters()
                },
                "sums": torch.stack([r["lm loss"] for r in reports]).sum(0).tolist(),
            }
        finally:
            layout.destroy()


def test_dropin_with_tp2_sp_and_experts_matches_single_process():
    """TP=2 x pool 2 with sequence parallelism (padded micro-batches) and 4 experts over EP=2:
    the drop-in schedule with Megatron's own finish gives the single-process gradients,
    load-balancing loss included."""
    cfg = dataclasses.replace(
        moe_test.CFG,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_model_parallel_size=2,
    )
    ranks = run_ranks(_body_dropin_moe, 4, cfg, timeout_s=240)
    reference = run_ranks(moe_test._body_reference, 1, moe_test.CFG, 2, "mixed")[0]
    # Each TP rank reports the loss of its replica's tokens: count TP rank 0 of each replica.
    loss_sum = sum(r["sums"][0] for r in ranks[::2])
    tokens = sum(r["sums"][1] for r in ranks[::2])
    assert loss_sum / tokens == pytest.approx(reference["losses"][0], rel=1e-5)
    for replica in range(2):
        members = ranks[2 * replica : 2 * replica + 2]
        grads = moe_test._full(members, "grads", members[0]["layout"], 2)
        for name, want in reference["grads"].items():
            assert moe_test.relative(grads[name], want) < 1e-5, name


def _body_dropin_pipeline(rank, world_size, cfg):
    from tests.megatron import test_pipeline_parallel as pp_test

    dims = model_parallel_dims(cfg, world_size)
    with cpu_shims():
        layout = dims.initialize()
        try:
            engine = megatron_lm_engine(cfg, seed=pp_test.SEED)
            plan = pp_test.make_plans(dims.pool_size)[0]
            source = source_of(pp_test.batch_of(plan, 0))
            runtime = StepRuntime(
                group=layout.pool_group,
                job_group=layout.world_group,
                pipeline_group=layout.pp_group,
            )
            engine.model.zero_grad_buffer()
            reports = hdp_forward_backward(runtime, cfg)(
                forward_step_func=pretrain_gpt_forward_step,
                data_iterator=iter([HDPGlobalBatch(plan=plan, source=source)]),
                model=[engine.model],
                num_microbatches=1,
            )
            named = engine.model.module.named_parameters()
            return {
                "stage": layout.stage,
                "grads": {n: p.main_grad.clone() for n, p in named},
                "reports": [r["lm loss"].tolist() for r in reports],
            }
        finally:
            layout.destroy()


def test_dropin_with_pipelines_runs_megatrons_1f1b_and_matches_single_process():
    """PP=2 x pool 2: Megatron-Core's own 1F1B schedule and finish, a ring across the two
    pipelines; every stage's gradients equal the single-process ones."""
    from tests.megatron import test_pipeline_parallel as pp_test

    ranks = run_ranks(_body_dropin_pipeline, 4, pp_test.CFG, timeout_s=180)
    plan = pp_test.make_plans(2)[0]
    single = dataclasses.replace(pp_test.CFG, pipeline_model_parallel_size=1)
    reference = run_ranks(pp_test._body_reference_batches, 1, single, [pp_test.batch_of(plan, 0)])[
        0
    ]
    last = [r for r in ranks if r["stage"] == 1]
    assert all(r["reports"] for r in last) and not any(r["reports"] for r in ranks[:2])
    loss_sum = sum(rep[0] for r in last for rep in r["reports"])
    tokens = sum(rep[1] for r in last for rep in r["reports"])
    assert loss_sum / tokens == pytest.approx(reference["losses"][0], rel=1e-5)
    for r in ranks:
        for name, grad in r["grads"].items():
            want = reference["grads"][
                pp_test.global_name(name, r["stage"], pp_test.CFG.layers_per_stage)
            ]
            assert_close_rel(grad, want, f"stage {r['stage']} grad {name}")
