"""Whole-model exactness: HDP and the static mesh equal one process fed the whole batch."""

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist

from megatron_hdp.batching import InMemoryTokens
from megatron_hdp.megatron.cpu_shim import cpu_shims
from megatron_hdp.megatron.engine import (
    OptimConfig,
    build_engine,
    destroy_parallel_state,
    initialize_parallel_state,
)
from megatron_hdp.megatron.model import GPTConfig, build_gpt
from megatron_hdp.megatron.step import StepRuntime, train_step
from megatron_hdp.scheduler import plan_step
from tests.dist import run_ranks
from tests.megatron.reference import (
    build_reference,
    reference_loss_and_grads,
    reference_optimizer,
)

CAPACITY = 16
VOCAB = 97
CFG = GPTConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=48,
    vocab_size=VOCAB,
)
# Adam divides every gradient element by its own running RMS, which turns float32 rounding
# noise in near-zero elements into full-size updates; with the default eps (1e-8) three steps
# amplify a 2e-7 gradient difference to ~3e-5 in a few weights. A larger eps keeps the
# parameter comparison about HDP rather than about Adam's conditioning; the gradients are
# compared directly at 1e-5 as well.
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0, adam_eps=1e-4)
NUM_STEPS = 3
SEED = 7


def batch_lengths(pool_size: int, step: int) -> list[int]:
    """Short sequences, exactly C, C+1, and sequences that need 3+ ranks where the pool allows."""
    lengths = [3 + step, 5, 9, 1, 12, CAPACITY]
    if pool_size >= 2:
        lengths.append(CAPACITY + 1)
    if pool_size >= 3:
        lengths.append(2 * CAPACITY + 1 + step)
        lengths.append(pool_size * CAPACITY - 3)
    return lengths


def make_batch(pool_size: int, step: int):
    gen = torch.Generator().manual_seed(1000 * step + pool_size)
    seqs = []
    for n in batch_lengths(pool_size, step):
        ids = torch.randint(0, VOCAB, (n + 1,), generator=gen)
        seqs.append((ids[:-1], ids[1:]))
    return seqs


def _body_train(rank, world_size, policy, cp_size, use_distributed_optimizer):
    optim = dataclasses.replace(OPTIM, use_distributed_optimizer=use_distributed_optimizer)
    with cpu_shims():
        initialize_parallel_state()
        try:
            engine = build_engine(CFG, optim, seed=SEED)
            model = engine.model
            results = []
            runtime = StepRuntime(group=dist.group.WORLD, cfg=CFG, check_plans=True)
            for step in range(NUM_STEPS):
                seqs = make_batch(world_size, step)
                source = InMemoryTokens([t for t, _ in seqs], [lab for _, lab in seqs])
                plan = plan_step(
                    source.seqlens,
                    pool_size=world_size,
                    capacity=CAPACITY,
                    policy=policy,
                    cp_size=cp_size,
                )
                result = train_step(engine, plan, source, runtime)
                grads = None
                if step == 0 and not use_distributed_optimizer:
                    grads = {
                        n: p.main_grad.detach().clone() for n, p in model.module.named_parameters()
                    }
                results.append((result.loss, grads))
            params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
            return results, params
        finally:
            destroy_parallel_state()


def _body_reference(rank, world_size, pool_size):
    with cpu_shims():
        initialize_parallel_state()
        try:
            return _reference(pool_size)
        finally:
            destroy_parallel_state()


@functools.cache
def reference_run(pool_size: int):
    """The single-process run, in a forked process of its own (Megatron needs its state)."""
    return run_ranks(_body_reference, 1, pool_size)[0]


def _reference(pool_size: int):
    torch.manual_seed(SEED)
    state = build_gpt(CFG).state_dict()
    model = build_reference(CFG, state)
    opt = reference_optimizer(
        model,
        lr=OPTIM.lr,
        weight_decay=OPTIM.weight_decay,
        betas=(OPTIM.adam_beta1, OPTIM.adam_beta2),
        eps=OPTIM.adam_eps,
    )
    losses, first_grads = [], None
    for step in range(NUM_STEPS):
        opt.zero_grad()
        losses.append(reference_loss_and_grads(model, make_batch(pool_size, step)))
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.clip_grad)
        if step == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, first_grads, params


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, name: str, rel: float = 1e-5):
    err = (got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)
    assert err <= rel, f"{name}: relative error {err:.3e} > {rel}"


def check_against_reference(pool_size, per_rank, check_grads=True):
    ref_losses, ref_grads, ref_params = reference_run(pool_size)
    for rank, (results, params) in enumerate(per_rank):
        for step, (loss, grads) in enumerate(results):
            assert abs(loss - ref_losses[step]) <= 1e-5 * abs(ref_losses[step]), (
                f"rank {rank} step {step}: loss {loss} vs reference {ref_losses[step]}"
            )
            if grads is not None and check_grads:
                for name, want in ref_grads.items():
                    assert_close_rel(grads[name], want, f"rank {rank} grad {name}")
        for name, want in ref_params.items():
            assert_close_rel(params[name], want, f"rank {rank} param {name} after {NUM_STEPS}")


@pytest.mark.parametrize("pool_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("policy", ["greedy", "static"])
def test_matches_single_process(policy, pool_size):
    per_rank = run_ranks(_body_train, pool_size, policy, None, False, timeout_s=240)
    check_against_reference(pool_size, per_rank)


def test_static_mesh_dp2_cp2_matches_single_process():
    """A real DP x CP mesh (2 x 2): packs go to two CP groups of two."""
    per_rank = run_ranks(_body_train, 4, "static", 4, False, timeout_s=240)
    check_against_reference(4, per_rank)


def test_distributed_optimizer_matches_single_process():
    per_rank = run_ranks(_body_train, 3, "greedy", None, True, timeout_s=240)
    check_against_reference(3, per_rank)
