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

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron_hdp.data.batching import LocalBatch, gather_local_batch, read_local
from megatron_hdp.distributed.layout import ParallelDims
from megatron_hdp.megatron.cpu_shim import cpu_shims
from megatron_hdp.megatron.engine import OptimConfig, build_engine
from megatron_hdp.megatron.model import GPTConfig
from megatron_hdp.megatron.step import StepRuntime, forward_backward, read_and_count
from megatron_hdp.scheduler import plan_step
from tests.dist import run_ranks
from tests.megatron.test_model_equivalence import batch_of_lengths, source_of

READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "nonzero"}
READS |= {"argwhere", "masked_select", "unique", "bincount"}
COPY_FUNCTIONS = {"to", "cuda", "copy_"}
CAPACITY = 16


def _is_device(value) -> bool:
    return isinstance(value, torch.device | str) or (isinstance(value, int) and value >= 0)


class SyncCounter(TorchFunctionMode):
    """Counts the calls that block a CUDA host, and the non-blocking copies."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self.async_copies = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS:
            self.syncs.append(name)
        elif name == "__getitem__" and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in _flat(args[1:])
        ):
            self.syncs.append("boolean mask")
        elif (
            name == "repeat_interleave"
            and isinstance(kwargs.get("repeats", args[1] if len(args) > 1 else None), torch.Tensor)
            and "output_size" not in kwargs
        ):
            self.syncs.append("repeat_interleave without output_size")
        elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            self.syncs.append(f"torch.{name}(device=)")
        elif name in COPY_FUNCTIONS:
            device = kwargs.get("device", args[1] if len(args) > 1 else None)
            if name == "cuda" or _is_device(device):
                if kwargs.get("non_blocking"):
                    self.async_copies += 1
                else:
                    self.syncs.append(f"pageable .{name}")
        return func(*args, **kwargs)


def _flat(items):
    for item in items:
        if isinstance(item, tuple | list):
            yield from _flat(item)
        else:
            yield item


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
            with counter:
                batches, tokens = read_and_count(plan, source, runtime, prepared)
                forward_backward(engine, batches, runtime, loss_scale=1.0 / tokens)
            rings = [b.ring for b in batches]
            return counter.syncs, counter.async_copies, rings
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
    from megatron_hdp.attention import ring
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
