"""The vectorised ring step bookkeeping equals the per-row list code it replaced, bitwise."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_hdp.attention import ring
from megatron_hdp.attention.ring_index import ring_index
from megatron_hdp.sharding import shard
from tests.unit.ring_index_reference import list_step_blocks

CPU = torch.device("cpu")


def _spec(lengths, k, position):
    shards = tuple(shard(lengths, k))
    return ring.RingAttentionSpec(
        doc_lengths=tuple(lengths),
        shards=shards,
        position=position,
        active=ring.active_positions(shards),
        comm=None,
        backend=None,
    )


def _documents(rng: random.Random, k: int) -> list[int]:
    """Random documents with adversarial lengths: 1 token, 2k +- 1, odd, long."""
    kinds = [
        lambda: 1,
        lambda: rng.randint(1, 2 * k),
        lambda: 2 * k + rng.choice((-1, 1)),
        lambda: rng.randint(1, 60) * 2 + 1,
        lambda: rng.randint(2 * k, 300),
    ]
    return [rng.choice(kinds)() for _ in range(rng.randint(1, 7))]


def assert_same_steps(lengths, k):
    shards = tuple(shard(lengths, k))
    active = ring.active_positions(shards)
    for position in active:
        spec = _spec(lengths, k, position)
        want = list_step_blocks(spec, CPU)
        index = ring_index(spec.shards, position, spec.active)
        got = index.on_device(index.buffer)
        assert list(got) == list(want), (lengths, k, position)
        for source, blocks in want.items():
            new = got[source]
            where = (lengths, k, position, source)
            assert new.blocks.lengths_q == blocks.blocks.lengths_q, where
            assert new.blocks.lengths_k == blocks.blocks.lengths_k, where
            assert new.blocks.causal == blocks.blocks.causal, where
            for name in ("cu_seqlens_q", "cu_seqlens_k"):
                a, b = getattr(new.blocks, name), getattr(blocks.blocks, name)
                assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b), where
            if len(active) > 1:
                assert new.q_rows.dtype == blocks.q_rows.dtype == torch.int64, where
                assert torch.equal(new.q_rows, blocks.q_rows), where
                assert torch.equal(new.kv_rows, blocks.kv_rows), where
            else:  # a pack: its one kernel call needs no rows
                assert new.q_rows is None and new.kv_rows is None, where


@pytest.mark.parametrize("k", range(1, 9))
def test_vectorised_steps_equal_the_list_code_on_random_documents(k):
    rng = random.Random(1000 + k)
    for _ in range(25):
        assert_same_steps(_documents(rng, k), k)


@pytest.mark.parametrize(
    "lengths",
    [
        [1],
        [1, 1, 1],
        [1] * 17,
        [3, 1, 5, 1, 2],
        [15, 17, 1, 31],
        [2, 4, 6, 8],
        [129],
    ],
)
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_vectorised_steps_equal_the_list_code_on_adversarial_lengths(lengths, k):
    assert_same_steps(lengths, k)


def test_a_pack_builds_no_rows():
    index = ring_index(tuple(shard([5, 9, 3], 1)), 0, (0,))
    assert not index.rows and index.buffer.numel() == 2 * 4
    assert index.buffer.tolist() == [0, 5, 14, 17] * 2


def test_a_batch_brings_its_steps_in_its_one_copy_and_the_spec_takes_them(monkeypatch):
    from megatron_hdp.data.batching import InMemoryTokens, gather_local_batch
    from megatron_hdp.scheduler.plan import MicroBatch, plan_from_rank_lists

    lengths = [9, 4, 15]
    tokens = [torch.arange(n) for n in lengths]
    source = InMemoryTokens(tokens, tokens, [torch.ones(n) for n in lengths])
    mb = MicroBatch(order=0, ring=(2, 0, 1), seq_indices=(0, 1, 2))
    plan = plan_from_rank_lists(lengths, 3, 32, "ring-index-test", [mb])
    host = gather_local_batch(plan, mb, 0, source)
    assert host.ring_index is not None and host.ring_index.rows
    copies = []

    def copy(tensor, device):
        copies.append(tensor.numel())
        return tensor.clone()

    moved = host.to(torch.device("meta"), copy=copy)
    assert len(copies) == 1
    monkeypatch.setattr(ring, "ring_index", None)  # the spec must not build them again
    monkeypatch.setattr(ring, "RingComm", lambda *args: None)  # no process group here
    spec = ring.build_ring_spec(lengths, mb.ring, rank=0, group=None, steps=moved.attention_steps())
    got = spec.step_blocks(CPU)
    want = list_step_blocks(_spec(lengths, 3, 1), CPU)
    assert list(got) == list(want)
    for source_position, blocks in want.items():
        assert torch.equal(got[source_position].q_rows, blocks.q_rows)
        assert torch.equal(got[source_position].kv_rows, blocks.kv_rows)
        assert torch.equal(got[source_position].blocks.cu_seqlens_k, blocks.blocks.cu_seqlens_k)
