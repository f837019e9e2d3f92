"""Ring and local HDP attention against single-process causal attention (float64)."""

import pytest
import torch
import torch.distributed as dist

from megatron_hdp.attention.ring import build_ring_spec, hdp_attention
from megatron_hdp.distributed.ring_comm import CommStats
from megatron_hdp.sharding import shard
from tests.dist import run_ranks

HEADS, GROUPS, DIM = 4, 2, 8


def reference_attention(q, k, v):
    """Causal softmax attention of one document, written out in full ([T, H, D])."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1).transpose(0, 1)
    v = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    q = q.transpose(0, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return (probs @ v).transpose(0, 1)


def _doc_tensors(doc_lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for n in doc_lengths:
        q = torch.randn(n, HEADS, DIM, generator=gen, dtype=torch.float64)
        k = torch.randn(n, GROUPS, DIM, generator=gen, dtype=torch.float64)
        v = torch.randn(n, GROUPS, DIM, generator=gen, dtype=torch.float64)
        dout = torch.randn(n, HEADS, DIM, generator=gen, dtype=torch.float64)
        docs.append((q, k, v, dout))
    return docs


def _body_rings(rank, world_size, rounds, backend):
    """Each round: a partition of the world into rings, each with its own packed documents."""
    stats = CommStats()
    group = dist.group.WORLD
    for round_id, (rings, fixed_lengths) in enumerate(rounds):
        ((ring_id, ring),) = [(i, r) for i, r in enumerate(rings) if rank in r]
        doc_lengths = fixed_lengths or [7 + 5 * ring_id + 3 * round_id, 1, 16 + ring_id, 2, 33]
        docs = _doc_tensors(doc_lengths, seed=100 * round_id + ring_id)
        shards = shard(doc_lengths, len(ring))
        if shards[ring.index(rank)].num_tokens == 0:
            continue  # members without tokens skip the micro-batch
        spec = build_ring_spec(
            doc_lengths, ring, rank=rank, group=group, stats=stats, backend=backend
        )
        pieces = spec.shards[spec.position].ranges()

        q, k, v, dout = (
            torch.cat([docs[d][i][s : s + n] for d, s, n in pieces]).clone().requires_grad_(i < 3)
            for i in range(4)
        )
        out = hdp_attention(q, k, v, spec)
        out.backward(dout)

        ref_parts = {}
        for d, (dq, dk, dv, ddout) in enumerate(docs):
            qf, kf, vf = (t.clone().requires_grad_() for t in (dq, dk, dv))
            of = reference_attention(qf, kf, vf)
            of.backward(ddout)
            ref_parts[d] = (of.detach(), qf.grad, kf.grad, vf.grad)
        for name, got, i in (
            ("out", out.detach(), 0),
            ("dq", q.grad, 1),
            ("dk", k.grad, 2),
            ("dv", v.grad, 3),
        ):
            want = torch.cat([ref_parts[d][i][s : s + n] for d, s, n in pieces])
            torch.testing.assert_close(
                got, want, rtol=1e-10, atol=1e-10, msg=f"{name} on rank {rank}, ring {ring}"
            )
    return stats.bytes_sent


ROUNDS = [
    ([[3, 1], [0, 2], [4]], None),  # two rings of 2 and a local rank, live together
    ([[0, 2, 4], [1, 3]], None),  # a ring of 3 beside a ring of 2
    ([[2, 0, 3, 1], [4]], None),  # a ring of 4 in non-contiguous order
    ([[4, 0, 2, 1, 3]], None),  # one ring of 5
    ([[0], [1], [2], [3], [4]], None),  # all local
    ([[1, 3, 0, 4, 2]], [1, 2]),  # 3 tokens on a ring of 5: two members hold nothing
]


@pytest.mark.parametrize("backend", ["torch", "math"])
def test_rings_of_1_to_5_match_reference(backend):
    bytes_sent = run_ranks(_body_rings, 5, ROUNDS, backend)
    assert all(b > 0 for b in bytes_sent)


def _body_local_only(rank, world_size):
    stats = CommStats()
    docs = _doc_tensors([5, 9, 1], seed=rank)
    spec = build_ring_spec([5, 9, 1], (rank,), rank=rank, group=None, stats=stats)
    q, k, v, dout = (torch.cat([d[i] for d in docs]).requires_grad_(i < 3) for i in range(4))
    hdp_attention(q, k, v, spec).backward(dout)
    return stats.bytes_sent


def test_local_micro_batches_send_nothing():
    assert run_ranks(_body_local_only, 2) == [0, 0]


def _body_bf16(rank, world_size, backend):
    """bfloat16 inputs: partial results merge in float32; result near the float64 reference."""
    doc_lengths, ring = [40, 7, 64], (2, 0, 1)
    docs = _doc_tensors(doc_lengths, seed=3)
    spec = build_ring_spec(doc_lengths, ring, rank=rank, group=dist.group.WORLD, backend=backend)
    pieces = spec.shards[spec.position].ranges()
    full = [torch.cat([docs[d][i][s : s + n] for d, s, n in pieces]) for i in range(4)]
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in full[:3])
    out = hdp_attention(q, k, v, spec)
    out.backward(full[3].to(torch.bfloat16))
    want = torch.cat([reference_attention(*docs[d][:3])[s : s + n] for d, s, n in pieces])
    assert out.dtype == q.grad.dtype == k.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, rtol=3e-2, atol=3e-2)
    return float((out.double() - want).abs().max())


@pytest.mark.parametrize("backend", ["torch", "math"])
def test_bfloat16_ring(backend):
    errors = run_ranks(_body_bf16, 3, backend)
    assert max(errors) < 3e-2
