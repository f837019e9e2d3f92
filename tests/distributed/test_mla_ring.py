"""Ring and local HDP attention with unequal q/k and v head dims (multi-latent attention).

float64, against single-process causal attention written out in full, on rings of 1 to 4
ranks with adversarial document lengths around the ring's capacity (one token, fewer tokens
than chunks, `2k - 1`, `2k`, `2k + 1`): output, dQ, dK and dV of every local token.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_hdp.attention.ring import build_ring_spec, hdp_attention
from megatron_hdp.distributed.ring_comm import CommStats
from megatron_hdp.sharding import shard
from tests.dist import run_ranks
from tests.distributed.test_ring_attention import reference_attention

HEADS, GROUPS = 4, 2


def _docs(doc_lengths, qk_dim, v_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in doc_lengths:
        shapes = ((n, HEADS, qk_dim), (n, GROUPS, qk_dim), (n, GROUPS, v_dim), (n, HEADS, v_dim))
        out.append(tuple(torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes))
    return out


def _body(rank, world_size, rounds, backend, qk_dim, v_dim):
    stats = CommStats()
    for round_id, (rings, doc_lengths) in enumerate(rounds):
        ((ring_id, ring),) = [(i, r) for i, r in enumerate(rings) if rank in r]
        lengths = doc_lengths[ring_id]
        docs = _docs(lengths, qk_dim, v_dim, seed=10 * round_id + ring_id)
        if shard(lengths, len(ring))[ring.index(rank)].num_tokens == 0:
            continue
        spec = build_ring_spec(
            lengths, ring, rank=rank, group=dist.group.WORLD, stats=stats, backend=backend
        )
        pieces = spec.shards[spec.position].ranges()
        q, k, v, dout = (
            torch.cat([docs[d][i][s : s + n] for d, s, n in pieces]).clone().requires_grad_(i < 3)
            for i in range(4)
        )
        out = hdp_attention(q, k, v, spec)
        assert out.shape == (q.shape[0], HEADS, v_dim)
        out.backward(dout)
        want = {}
        for d, (dq, dk, dv, ddout) in enumerate(docs):
            qf, kf, vf = (t.clone().requires_grad_() for t in (dq, dk, dv))
            of = reference_attention(qf, kf, vf)
            of.backward(ddout)
            want[d] = (of.detach(), qf.grad, kf.grad, vf.grad)
        for i, (name, got) in enumerate(
            (("out", out.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))
        ):
            expected = torch.cat([want[d][i][s : s + n] for d, s, n in pieces])
            torch.testing.assert_close(
                got, expected, rtol=1e-10, atol=1e-10, msg=f"{name}, rank {rank}, ring {ring}"
            )
    return stats.bytes_sent


ROUNDS = [
    ([[0], [1], [2], [3]], [[5, 1, 9], [1], [2, 3], [16]]),  # packs
    ([[1, 3], [2, 0]], [[3, 4, 5, 1], [1, 2]]),  # rings of 2: 2k-1, 2k, 2k+1, 1 token
    ([[2, 0, 3], [1]], [[5, 6, 7, 2, 13], [4]]),  # a ring of 3 beside a pack
    ([[3, 1, 0, 2]], [[7, 8, 9, 1, 3, 17]]),  # a ring of 4, non-contiguous order
    ([[0, 1, 2, 3]], [[2, 1]]),  # 3 tokens on a ring of 4: one member holds nothing
]


@pytest.mark.parametrize(
    "backend, qk_dim, v_dim",
    [
        ("math", 12, 8),  # native: MLA's shape (q/k wider than v)
        ("torch+pad_v", 12, 8),  # aten's CPU flash kernel, v padded
        ("torch+pad_v", 6, 10),  # q/k padded (v wider)
    ],
)
def test_unequal_head_dims_rings_of_1_to_4_match_reference(backend, qk_dim, v_dim):
    sent = run_ranks(_body, 4, ROUNDS, backend, qk_dim, v_dim)
    # Every rank that was in a ring of more than one sent its K/V (G * (Dk + Dv) per token).
    assert all(b > 0 for b in sent)


def _body_bytes(rank, world_size, qk_dim, v_dim):
    stats = CommStats()
    lengths = [8]
    spec = build_ring_spec(
        lengths, (0, 1), rank=rank, group=dist.group.WORLD, stats=stats, backend="math"
    )
    docs = _docs(lengths, qk_dim, v_dim, seed=1)
    pieces = spec.shards[spec.position].ranges()
    q, k, v = (torch.cat([docs[d][i][s : s + n] for d, s, n in pieces]) for i in range(3))
    hdp_attention(q, k, v, spec)  # forward only: one hop of this rank's K and V
    return stats.bytes_sent


def test_ring_message_is_k_and_v_of_their_own_widths():
    sent = run_ranks(_body_bytes, 2, 12, 8)
    # 4 local tokens, G heads of K (12 channels) and V (8 channels), float64: one hop each.
    assert sent == [4 * GROUPS * (12 + 8) * 8] * 2
