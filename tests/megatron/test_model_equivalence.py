"""Whole-model exactness: HDP and the static mesh equal one process fed the whole batch."""

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist

from megatron_hdp.data.batching import InMemoryTokens
from megatron_hdp.distributed.layout import ParallelDims
from megatron_hdp.megatron.cpu_shim import cpu_shims
from megatron_hdp.megatron.engine import (
    OptimConfig,
    build_engine,
    offload_manager,
)
from megatron_hdp.megatron.model import GPTConfig, build_gpt, model_shape
from megatron_hdp.megatron.step import StepRuntime, train_step
from megatron_hdp.scheduler import plan_step
from megatron_hdp.scheduler.cost import CPU, CostModel
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


@dataclasses.dataclass(frozen=True)
class Case:
    """One distributed run to compare with the single-process reference."""

    pool_size: int
    policy: str = "greedy"
    cp_size: int | None = None
    distributed_optimizer: bool = False
    cfg: GPTConfig = CFG
    batch: str = "mixed"
    offload: bool = False
    wide_rings: bool = False
    """Plan with free ring communication, so the planner gives rings more ranks than needed."""
    overlap: bool = False
    """--overlap-grad-reduce with small buckets (`tests/megatron/test_grad_sync.py`)."""


def batch_lengths(pool_size: int, step: int, kind: str) -> list[int]:
    """The global batch of one step.

    "mixed": short sequences, exactly C, C+1, and sequences needing 3+ ranks where the pool
    allows. "tiny_pack": a full-context sequence and a 2-token one, so the static mesh
    gets a pack smaller than its CP group (members without tokens). "two_rank_context":
    nothing longer than 2 C, for a static mesh with CP 2. "few": two short sequences, so
    some ranks run no micro-batch at all.
    """
    if kind == "tiny_pack":
        return [pool_size * CAPACITY, 2]
    if kind == "few":
        return [5 + step, 11]
    if kind == "two_rank_context":
        return [3 + step, 5, 9, 1, 12, CAPACITY, CAPACITY + 1, 2 * CAPACITY, 7, 20]
    lengths = [3 + step, 5, 9, 1, 12, CAPACITY]
    if pool_size >= 2:
        lengths.append(CAPACITY + 1)
    if pool_size >= 3:
        lengths.append(2 * CAPACITY + 1 + step)
        lengths.append(pool_size * CAPACITY - 3)
    return lengths


def make_batch(pool_size: int, step: int, kind: str = "mixed"):
    """`(tokens, labels, loss_mask)` per sequence of `batch_lengths`."""
    return batch_of_lengths(batch_lengths(pool_size, step, kind), seed=1000 * step + pool_size)


def batch_of_lengths(lengths, *, seed: int):
    """`(tokens, labels, loss_mask)` per length: random 0/1 masks, the third sequence
    (where there is one) masked out entirely."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (n + 1,), generator=gen)
        mask = (torch.rand(n, generator=gen) < 0.8).float()
        if i == 2:
            mask.zero_()
        seqs.append((ids[:-1], ids[1:], mask))
    return seqs


def source_of(seqs) -> InMemoryTokens:
    return InMemoryTokens([s[0] for s in seqs], [s[1] for s in seqs], [s[2] for s in seqs])


def snapshot_grads_before_update(engine, into: dict) -> None:
    """Copy the synced gradients when the optimizer steps, before it clips them in place."""
    real_step = engine.optimizer.step

    def step():
        for name, param in engine.model.module.named_parameters():
            into[name] = param.main_grad.detach().clone()
        engine.optimizer.step = real_step
        return real_step()

    engine.optimizer.step = step


def _body_train(rank, world_size, case: Case):
    optim = dataclasses.replace(OPTIM, use_distributed_optimizer=case.distributed_optimizer)
    if case.overlap:
        optim = dataclasses.replace(optim, overlap_grad_reduce=True, ddp_bucket_size=2000)
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            engine = build_engine(case.cfg, optim, seed=SEED)
            runtime = StepRuntime(group=dist.group.WORLD, check_plans=True)
            cost_model, offloaded = None, []
            if case.offload:
                # Copies that always hide, room to spare and a slow network, where narrower
                # rings pay: the planner chooses offloading and the rule offloads all it can.
                profile = dataclasses.replace(
                    CPU, host_bandwidth=1e15, host_memory_bytes=1e12, p2p_bandwidth=1e6
                )
                cost_model = CostModel(model_shape(case.cfg), profile)
                # The engine's pool is allocated up front: 1 GiB is far more than it needs.
                runtime.offload = offload_manager(
                    engine, 1 << 30, torch.device("cpu"), min_offload_bytes=0
                )
            if case.wide_rings:
                profile = dataclasses.replace(CPU, p2p_latency=0.0, p2p_bandwidth=1e18)
                cost_model = CostModel(model_shape(case.cfg), profile)
            widened = []
            groups_before = len(dist.distributed_c10d._world.pg_map)
            results = []
            for step in range(NUM_STEPS):
                source = source_of(make_batch(world_size, step, case.batch))
                plan = plan_step(
                    source.seqlens,
                    pool_size=world_size,
                    capacity=CAPACITY,
                    policy=case.policy,
                    cp_size=case.cp_size,
                    cost_model=cost_model,
                    offload=case.offload,
                )
                widened += [
                    mb.cp_size
                    for mb in plan.micro_batches
                    if mb.cp_size > -(-sum(plan.seqlens[i] for i in mb.seq_indices) // CAPACITY)
                ]
                if case.offload:
                    offloaded.append(
                        sorted(
                            (mb.cp_size, mb.offload_ratio)
                            for mb in plan.micro_batches
                            if mb.offload_ratio > 0
                        )
                    )
                grads = {}
                if step == 0 and not case.distributed_optimizer:
                    snapshot_grads_before_update(engine, grads)
                result = train_step(engine, plan, source, runtime)
                results.append((result.loss, result.grad_norm, grads or None))
            params = {n: p.detach().clone() for n, p in engine.model.module.named_parameters()}
            new_groups = len(dist.distributed_c10d._world.pg_map) - groups_before
            assert new_groups == 0, f"{new_groups} process groups were created during training"
            if case.wide_rings:
                assert widened, "no ring got more ranks than its sequence needs"
            if case.offload:
                moved = runtime.offload.engine.bytes_to_host
                assert all(offloaded) and moved > 0, (offloaded, moved)
            return results, params
        finally:
            layout.destroy()


def _body_reference(rank, world_size, pool_size, cfg, kind):
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            torch.manual_seed(SEED)
            model = build_reference(cfg, build_gpt(cfg).state_dict())
            opt = reference_optimizer(
                model,
                lr=OPTIM.lr,
                weight_decay=OPTIM.weight_decay,
                betas=(OPTIM.adam_beta1, OPTIM.adam_beta2),
                eps=OPTIM.adam_eps,
            )
            losses, norms, first_grads = [], [], None
            for step in range(NUM_STEPS):
                opt.zero_grad()
                losses.append(reference_loss_and_grads(model, make_batch(pool_size, step, kind)))
                if step == 0:
                    first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
                norms.append(
                    float(torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.clip_grad))
                )
                opt.step()
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            return losses, norms, first_grads, params
        finally:
            layout.destroy()


@functools.cache
def reference_run(pool_size: int, cfg: GPTConfig, kind: str):
    """The single-process run, in a forked process of its own (Megatron needs its state)."""
    return run_ranks(_body_reference, 1, pool_size, cfg, kind)[0]


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, name: str, rel: float = 1e-5):
    err = (got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)
    assert err <= rel, f"{name}: relative error {err:.3e} > {rel}"


def check_case(case: Case):
    """Run `case` on its pool and compare loss, gradients and parameters with the reference."""
    per_rank = run_ranks(_body_train, case.pool_size, case, timeout_s=240)
    ref_losses, ref_norms, ref_grads, ref_params = reference_run(
        case.pool_size, case.cfg, case.batch
    )
    for rank, (results, params) in enumerate(per_rank):
        for step, (loss, grad_norm, grads) in enumerate(results):
            assert abs(loss - ref_losses[step]) <= 1e-5 * abs(ref_losses[step]), (
                f"rank {rank} step {step}: loss {loss} vs reference {ref_losses[step]}"
            )
            assert grad_norm == pytest.approx(ref_norms[step], rel=1e-5), (rank, step)
            if grads is not None:
                for name, want in ref_grads.items():
                    assert_close_rel(grads[name], want, f"rank {rank} grad {name}")
        for name, want in ref_params.items():
            assert_close_rel(params[name], want, f"rank {rank} param {name} after {NUM_STEPS}")


@pytest.mark.parametrize("pool_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("policy", ["greedy", "balanced", "static"])
def test_matches_single_process(policy, pool_size):
    check_case(Case(pool_size=pool_size, policy=policy))


def test_static_mesh_dp2_cp2_matches_single_process():
    """A real DP x CP mesh (2 x 2): packs go round robin to two CP groups of two."""
    check_case(Case(pool_size=4, policy="static", cp_size=2, batch="two_rank_context"))


def test_static_pack_smaller_than_its_cp_group_matches_single_process():
    """Ring members without tokens skip the micro-batch; the others still match."""
    check_case(Case(pool_size=4, policy="static", batch="tiny_pack"))


def test_ranks_without_micro_batches_match_single_process():
    check_case(Case(pool_size=4, batch="few"))


def test_distributed_optimizer_matches_single_process():
    check_case(Case(pool_size=3, distributed_optimizer=True))


@pytest.mark.parametrize("pool_size", [3, 4])
def test_rings_wider_than_needed_match_single_process(pool_size):
    """Ring sizes are a decision: rings with more ranks than their sequence needs (short
    sequences on rings too) give the single-process loss, gradients and parameters."""
    check_case(Case(pool_size=pool_size, policy="balanced", wide_rings=True))


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap-grad-reduce"])
def test_offloading_plans_match_single_process(overlap):
    """Eq. 3 plans (fewer ranks, offload ratio 1) and the offload hooks keep training exact,
    also with the gradient reduce started in the last backward."""
    cfg = dataclasses.replace(CFG, num_layers=4)
    check_case(Case(pool_size=3, policy="balanced", cfg=cfg, offload=True, overlap=overlap))


def test_learned_absolute_positions_match_single_process():
    cfg = dataclasses.replace(
        CFG, position_embedding_type="learned_absolute", max_position_embeddings=128
    )
    check_case(Case(pool_size=3, cfg=cfg))


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_head_size_rotary_share_and_qk_norm_match_stock_megatron(interleaved):
    """--kv-channels 12 (hidden 32 / 4 heads would be 8), --rotary-percent 0.5 (RoPE on 6 of
    the 12 channels, the rest passed through), --qk-layernorm, with and without
    --rotary-interleaved: HDP's own RoPE at the original positions and the query/key norms
    of HDP's layer spec against stock Megatron-Core's RotaryEmbedding, RoPE and qk norms
    (its local spec) on one process, with rings of up to 3 ranks."""
    cfg = dataclasses.replace(
        CFG,
        kv_channels=12,
        rotary_percent=0.5,
        qk_layernorm=True,
        rotary_interleaved=interleaved,
    )
    check_case(Case(pool_size=3, cfg=cfg))


def _body_short_only(rank, world_size):
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            engine = build_engine(CFG, OPTIM, seed=SEED)
            source = source_of([s for s in make_batch(world_size, 0) if len(s[0]) <= CAPACITY])
            plan = plan_step(
                source.seqlens, pool_size=world_size, capacity=CAPACITY, policy="greedy"
            )
            runtime = StepRuntime(group=dist.group.WORLD)
            calls = []
            real = dist.batch_isend_irecv
            dist.batch_isend_irecv = lambda ops: calls.append(len(ops)) or real(ops)
            try:
                result = train_step(engine, plan, source, runtime)
            finally:
                dist.batch_isend_irecv = real
            return (
                result.attention_bytes_sent,
                len(calls),
                [mb.cp_size for mb in plan.micro_batches],
            )
        finally:
            layout.destroy()


def test_batch_that_fits_capacity_sends_no_attention_bytes():
    for sent, p2p_calls, ring_sizes in run_ranks(_body_short_only, 3):
        assert sent == 0 and p2p_calls == 0 and set(ring_sizes) == {1}


def _body_wrong_pool(rank, world_size):
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            engine = build_engine(CFG, OPTIM, seed=SEED)
            source = source_of(make_batch(3, 0))
            plan = plan_step(source.seqlens, pool_size=3, capacity=CAPACITY, policy="greedy")
            runtime = StepRuntime(group=dist.group.WORLD)
            try:
                train_step(engine, plan, source, runtime)
            except ValueError as err:
                return str(err), runtime.stats.bytes_sent
            return "no error", runtime.stats.bytes_sent
        finally:
            layout.destroy()


def test_plan_for_another_pool_fails_before_communication():
    for message, sent in run_ranks(_body_wrong_pool, 2, timeout_s=60):
        assert message == "plan is for a pool of 3 ranks, but this pool has 2"
        assert sent == 0


def _body_expect_error(rank, world_size, what):
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            engine = build_engine(CFG, OPTIM, seed=SEED)
            seqs = make_batch(world_size, 0)
            if what == "all_masked":
                seqs = [(t, lab, torch.zeros_like(m)) for t, lab, m in seqs]
            source = source_of(seqs)
            lengths = source.seqlens
            if what == "short_source":
                lengths = [n + 5 if i == 7 else n for i, n in enumerate(lengths)]
            plan = plan_step(lengths, pool_size=world_size, capacity=CAPACITY, policy="greedy")
            try:
                train_step(engine, plan, source, StepRuntime(group=dist.group.WORLD))
            except ValueError as err:
                return str(err)
            return "no error"
        finally:
            layout.destroy()


def test_all_masked_batch_is_refused_on_every_rank():
    for message in run_ranks(_body_expect_error, 3, "all_masked", timeout_s=60):
        assert message == "the global batch has no loss tokens (every loss mask is zero)"


def test_source_shorter_than_plan_fails_on_every_rank_without_hanging():
    messages = run_ranks(_body_expect_error, 3, "short_source", timeout_s=60)
    assert any(m.startswith("sequence 7: the plan expects") for m in messages), messages
    assert all("sequence 7" in m or "another rank could not read" in m for m in messages)


def _body_bf16(rank, world_size):
    cfg = dataclasses.replace(CFG, params_dtype="bfloat16")
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            engine = build_engine(cfg, OPTIM, seed=SEED)
            source = source_of(make_batch(world_size, 0))
            plan = plan_step(
                source.seqlens, pool_size=world_size, capacity=CAPACITY, policy="greedy"
            )
            return train_step(engine, plan, source, StepRuntime(group=dist.group.WORLD)).loss
        finally:
            layout.destroy()


def test_bfloat16_model_runs_and_stays_near_float32_reference():
    losses = run_ranks(_body_bf16, 3)
    ref_loss = reference_run(3, CFG, "mixed")[0][0]
    assert all(abs(loss - ref_loss) <= 1e-2 * ref_loss for loss in losses), (losses, ref_loss)


class CountingSource:
    """Records every (sequence, start, length) a rank reads."""

    def __init__(self, inner):
        self.inner, self.reads = inner, []

    def read(self, seq_index, start, length):
        self.reads.append((seq_index, start, length))
        return self.inner.read(seq_index, start, length)


def _body_reads(rank, world_size, policy):
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            engine = build_engine(CFG, OPTIM, seed=SEED)
            inner = source_of(make_batch(world_size, 0))
            plan = plan_step(inner.seqlens, pool_size=world_size, capacity=CAPACITY, policy=policy)
            source = CountingSource(inner)
            train_step(engine, plan, source, StepRuntime(group=dist.group.WORLD))
            return source.reads, inner.seqlens
        finally:
            layout.destroy()


@pytest.mark.parametrize("policy", ["balanced", "static"])
def test_each_rank_reads_only_its_share(policy):
    """Across the pool every token position is read exactly once."""
    per_rank = run_ranks(_body_reads, 4, policy)
    seqlens = per_rank[0][1]
    covered = {i: [0] * n for i, n in enumerate(seqlens)}
    for reads, _ in per_rank:
        for seq, start, length in reads:
            for pos in range(start, start + length):
                covered[seq][pos] += 1
    assert all(count == 1 for counts in covered.values() for count in counts)


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one"])
def test_attention_sinks_match_stock_megatron(softmax_type):
    """--softmax-type learnable / off-by-one: HDP's sink (a finalize step after the ring's
    merge, `attention.sinks`) with rings of up to 3 ranks, against stock Megatron-Core's
    DotProductAttention (its `SoftmaxOne`: the sink as an extra score column) on one process:
    losses, gradient norms, the first step's gradients (`softmax_offset`'s included) and the
    parameters after three Adam steps."""
    check_case(Case(pool_size=3, cfg=dataclasses.replace(CFG, softmax_type=softmax_type)))


def test_windows_with_a_learnable_sink_match_stock_megatron():
    """gpt-oss's attention: --window-size 3,0 --window-attn-skip-freq 2 (layer 1 windowed,
    layer 2 full) with --softmax-type learnable, HDP's windowed ring with its sink step on
    rings of up to 3 ranks, against stock Megatron-Core's DotProductAttention (its sliding
    window causal mask and `SoftmaxOne`) on one process."""
    cfg = dataclasses.replace(
        CFG, window_size=(3, 0), window_attn_skip_freq=2, softmax_type="learnable"
    )
    check_case(Case(pool_size=3, cfg=cfg))
