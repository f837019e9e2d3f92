"""Host-device syncs of the dense path, counted on CPU where a GPU would wait.

A CUDA host waits for the device on every read of a device value (`.item()`, `.tolist()`,
`float(t)`, a boolean mask, `nonzero`) and on every pageable host-to-device copy
(`t.to(cuda)`, `torch.tensor(..., device=cuda)`). On CPU nothing waits, but the same calls
are made, so a `TorchFunctionMode` counts them at the Python API while a real step runs
(2 ranks, a ring micro-batch and packs, a Megatron GPT of 1 or 3 layers). The goal (issue
31): at most 2 per micro-batch, none per layer. The host's own reading of the batch (the
prefetch thread's work, on host tensors) happens before, as in the job.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron_hdp.attention import ring
from megatron_hdp.data.batching import LocalBatch, gather_local_batch, read_local
from megatron_hdp.distributed.layout import ParallelDims
from megatron_hdp.megatron.cpu_shim import cpu_shims
from megatron_hdp.megatron.engine import OptimConfig, build_engine
from megatron_hdp.megatron.model import GPTConfig, model_parallel_dims
from megatron_hdp.megatron.step import StepRuntime, forward_backward, read_and_count
from megatron_hdp.scheduler import plan_step
from megatron_hdp.scheduler.plan import MicroBatch, plan_from_rank_lists
from tests.dist import run_ranks
from tests.megatron.test_model_equivalence import batch_of_lengths, source_of

READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "nonzero"}
READS |= {"argwhere", "masked_select", "unique", "bincount", "cpu"}  # .cpu(): a read too
COPY_FUNCTIONS = {"to", "cuda", "copy_"}
CAPACITY = 16
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_MEGATRON_CORE = os.sep + os.path.join("megatron", "core") + os.sep


def _is_device(value) -> bool:
    return isinstance(value, torch.device | str) or (isinstance(value, int) and value >= 0)


class SyncCounter(TorchFunctionMode):
    """Counts the calls that block a CUDA host, and the non-blocking copies.

    Each sync is named by its kind and the caller (the innermost frame outside torch and
    this file, `file:line`). Those whose caller is Megatron-Core's own code (its MoE token
    dispatcher's `.cpu()` of the expert counts, the shape exchange of its variable-shape
    pipeline P2P) go to `megatron_syncs`: HDP cannot remove them from there.
    """

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self.megatron_syncs: list[str] = []
        self.async_copies = 0

    def _sync(self, kind: str) -> None:
        frame = sys._getframe(2)
        while frame is not None and (
            frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == __file__
        ):
            frame = frame.f_back
        where = "?" if frame is None else frame.f_code.co_filename
        line = 0 if frame is None else frame.f_lineno
        entry = f"{kind} at {'/'.join(where.split(os.sep)[-3:])}:{line}"
        (self.megatron_syncs if _MEGATRON_CORE in where else self.syncs).append(entry)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS:
            self._sync(name)
        elif name == "__getitem__" and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in _flat(args[1:])
        ):
            self._sync("boolean mask")
        elif (
            name == "repeat_interleave"
            and isinstance(kwargs.get("repeats", args[1] if len(args) > 1 else None), torch.Tensor)
            and "output_size" not in kwargs
        ):
            self._sync("repeat_interleave without output_size")
        elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            self._sync(f"torch.{name}(device=)")
        elif name in COPY_FUNCTIONS:
            device = kwargs.get("device", args[1] if len(args) > 1 else None)
            if name == "cuda" or _is_device(device):
                if kwargs.get("non_blocking"):
                    self.async_copies += 1
                else:
                    self._sync(f"pageable .{name}")
        return func(*args, **kwargs)


def _flat(items):
    for item in items:
        if isinstance(item, tuple | list):
            yield from _flat(item)
        else:
            yield item


def _not_in_the_step(*args, **kwargs):
    raise AssertionError("ring step indices built during the step, not with the batch")


def _body(rank, world_size, num_layers):
    cfg = GPTConfig(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=48,
        vocab_size=97,
        position_embedding_type="rope",
    )
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            engine = build_engine(cfg, OptimConfig(lr=1e-2), seed=3)
            runtime = StepRuntime(group=dist.group.WORLD)
            source = source_of(batch_of_lengths([5, 9, 3, 2 * CAPACITY - 3, 7, 11], seed=5))
            plan = plan_step(
                source.seqlens, pool_size=world_size, capacity=CAPACITY, policy="greedy"
            )
            # Read ahead on the host, as the job's prefetch thread does.
            prepared = (read_local(plan, source, rank), None)
            counter = SyncCounter()
            # The attention's step indices come with the batch: none is built in a layer.
            built_in_step = ring.ring_index
            ring.ring_index = _not_in_the_step
            try:
                with counter:
                    batches, tokens = read_and_count(plan, source, runtime, prepared)
                    forward_backward(engine, batches, runtime, loss_scale=1.0 / tokens)
            finally:
                ring.ring_index = built_in_step
            rings = [b.ring for b in batches]
            return counter.syncs + counter.megatron_syncs, counter.async_copies, rings
        finally:
            layout.destroy()


@pytest.fixture(scope="module")
def counts():
    return {layers: run_ranks(_body, 2, layers) for layers in (1, 3)}


def test_at_most_two_syncs_per_micro_batch_and_none_per_layer(counts):
    for layers, per_rank in counts.items():
        for syncs, _, rings in per_rank:
            assert (
                len(rings) >= 2
                and any(len(r) > 1 for r in rings)
                or any(len(r) == 1 for r in rings)
            )
            # Per step: the token count's copy and read, the loss read after the last batch.
            assert len(syncs) <= 3, (layers, syncs)
            assert len(syncs) <= 2 * len(rings), (layers, syncs)
    for rank in range(2):
        assert counts[1][rank][0] == counts[3][rank][0], "syncs grow with the layers"
    assert any(len(r) > 1 for _, _, rings in counts[1] for r in rings), "no ring micro-batch"


#: (layers per stage, micro-batches per rank) of each run of a path: the syncs must not change.
RUNS = ((1, 1), (3, 1), (1, 3))
HOST_CFG = GPTConfig(
    num_layers=1,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=48,
    vocab_size=128,
    position_embedding_type="rope",
)
MOE_CFG = dataclasses.replace(
    HOST_CFG, num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.5, ffn_hidden_size=32
)
PP_CFG = dataclasses.replace(HOST_CFG, num_layers=2, pipeline_model_parallel_size=2)


def _plan(pool: int, micro_batches: int):
    """A ring over the pool (when it has two ranks), then packs: `micro_batches` per rank."""
    lengths, items = [], []
    if pool > 1:
        lengths.append(2 * CAPACITY - 3)
        items.append(((0, 1), (0,)))
    while len(items) < pool * micro_batches:
        rank = len(items) % pool
        lengths.append(5 + 2 * len(lengths))
        items.append(((rank,), (len(lengths) - 1,)))
    mbs = [MicroBatch(order=n, ring=ring, seq_indices=seqs) for n, (ring, seqs) in enumerate(items)]
    plan = plan_from_rank_lists(lengths, pool, CAPACITY, "host-syncs-test", mbs)
    plan.validate()
    return plan, source_of(batch_of_lengths(lengths, seed=micro_batches))


def _count_dropin(rank, cfg, layout, micro_batches):
    from megatron_hdp.megatron.schedule import HDPGlobalBatch, hdp_forward_backward
    from tests.megatron.test_dropin import megatron_lm_engine, pretrain_gpt_forward_step

    engine = megatron_lm_engine(cfg, seed=3)
    runtime = StepRuntime(group=dist.group.WORLD)
    schedule = hdp_forward_backward(runtime, cfg)
    plan, source = _plan(2, micro_batches)
    # Read ahead on the host, as HDPDataIterator does.
    step = HDPGlobalBatch(plan, source, read_local(plan, source, rank), None, rank)
    engine.model.zero_grad_buffer()
    counter = SyncCounter()
    with counter:
        schedule(
            forward_step_func=pretrain_gpt_forward_step,
            data_iterator=iter([step]),
            model=[engine.model],
            num_microbatches=1,
            seq_length=None,
            micro_batch_size=1,
            forward_only=False,
        )
    return counter


def _count_step(rank, cfg, layout, micro_batches):
    engine = build_engine(cfg, OptimConfig(lr=1e-2), seed=3)
    runtime = StepRuntime(group=layout.pool_group, job_group=dist.group.WORLD)
    pool = dist.get_world_size(layout.pool_group)
    plan, source = _plan(pool, micro_batches)
    prepared = (read_local(plan, source, dist.get_rank(layout.pool_group)), None)
    counter = SyncCounter()
    with counter:
        batches, tokens = read_and_count(plan, source, runtime, prepared)
        forward_backward(
            engine,
            batches,
            runtime,
            loss_scale=1.0 / tokens,
            global_batch_tokens=plan.total_tokens(),
        )
    return counter


PATHS = {
    "dropin": (HOST_CFG, _count_dropin),
    "pipeline": (PP_CFG, _count_step),
    "moe": (MOE_CFG, _count_step),
}


def _body_path(rank, world_size, path):
    base, count = PATHS[path]
    out = {}
    with cpu_shims():
        layout = model_parallel_dims(base, world_size).initialize()
        try:
            for layers, micro_batches in RUNS:
                pp = base.pipeline_model_parallel_size
                cfg = dataclasses.replace(base, num_layers=layers * pp)
                counter = count(rank, cfg, layout, micro_batches)
                out[layers, micro_batches] = (counter.syncs, counter.megatron_syncs)
        finally:
            layout.destroy()
    return out


@pytest.mark.parametrize("path", list(PATHS))
def test_no_sync_per_micro_batch_or_layer_in_the_dropin_pipeline_and_moe_paths(path):
    per_rank = run_ranks(_body_path, 2, path)
    for rank, runs in enumerate(per_rank):
        one = runs[1, 1][0]
        # At most the dense path's three per step (token count copy and read, loss read).
        assert len(one) <= 3, (path, rank, one)
        assert runs[3, 1][0] == one, f"{path}: syncs grow with the layers: {runs[3, 1][0]}"
        assert runs[1, 3][0] == one, f"{path}: syncs grow with micro-batches: {runs[1, 3][0]}"


def test_a_batch_reaches_the_device_in_one_copy_with_every_value_intact():
    seqs = batch_of_lengths([6, 13, 4], seed=2)
    seqs[1][2][3] = 0.25  # a loss weight that is not 0 or 1 survives the int64 transport
    source = source_of(seqs)
    plan = plan_step(source.seqlens, pool_size=1, capacity=64, policy="greedy")
    host = gather_local_batch(plan, plan.micro_batches[0], 0, source)
    copies = []

    def copy(tensor, device):
        copies.append((tensor.dtype, tensor.numel()))
        return tensor.clone()

    moved = host.to(torch.device("meta"), copy=copy)
    assert len(copies) == 1 and copies[0][0] == torch.int64
    for name in ("tokens", "labels", "position_ids", "loss_mask"):
        got, want = getattr(moved, name), getattr(host, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert torch.equal(moved.cu_seqlens(), host.cu_seqlens())
    assert moved.cu_seqlens().dtype == torch.int32
    assert isinstance(moved, LocalBatch)


def test_a_ring_micro_batchs_indices_reach_the_device_in_one_copy(monkeypatch):
    from megatron_hdp.sharding import shard

    copies = []

    def copy(tensor, device):
        copies.append(tensor.numel())
        return tensor.clone()

    monkeypatch.setattr(ring, "to_device", copy)
    lengths = (9, 4, 15)
    shards = tuple(shard(lengths, 3))
    spec = ring.RingAttentionSpec(
        doc_lengths=lengths,
        shards=shards,
        position=1,
        active=ring.active_positions(shards),
        comm=None,
        backend=None,
    )
    steps = spec.step_blocks(torch.device("cpu"))
    assert len(copies) == 1 and len(steps) == 3
    for source, blocks in steps.items():
        segments = ring._segments(spec, source)
        assert blocks.q_rows.tolist() == [r for q0, n, *_ in segments for r in range(q0, q0 + n)]
        assert blocks.kv_rows.tolist() == [
            r for _, _, k0, n, _ in segments for r in range(k0, k0 + n)
        ]
        assert blocks.blocks.cu_seqlens_q.dtype == torch.int32
        assert blocks.blocks.cu_seqlens_k.tolist()[-1] == len(blocks.kv_rows)
    spec.step_blocks(torch.device("cpu"))
    assert len(copies) == 1, "built again for the next layer"
