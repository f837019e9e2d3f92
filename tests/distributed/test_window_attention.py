"""Sliding-window HDP attention (packs and zigzag rings of 1-4) against dense windowed attention.

The reference is single-process softmax attention of each whole document with Megatron-Core's
sliding-window mask (`get_sliding_window_causal_mask`: `triu(diagonal=-left)` and
`tril(diagonal=right)`, written out here), float64. The ring's traffic is checked against a
brute-force count of the K/V rows some member further along the ring needs.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_hdp.attention.ring import build_ring_spec, hdp_attention
from megatron_hdp.distributed.ring_comm import CommStats, order_only_messages
from megatron_hdp.sharding import shard
from tests.dist import run_ranks
from tests.ring_pieces import assert_pieces_match

HEADS, GROUPS, DIM = 4, 2, 8


def megatron_window_mask(s: int, left: int, right: int = 0) -> torch.Tensor:
    """True where visible: Megatron-Core's `get_sliding_window_causal_mask(s, s, (l, r))`
    (which marks the hidden pairs), negated."""
    ones = torch.ones(s, s, dtype=torch.bool)
    return torch.tril(torch.triu(ones, diagonal=-left), diagonal=right)


def reference(q, k, v, window):
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1).transpose(0, 1)
    v = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    q = q.transpose(0, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    mask = megatron_window_mask(q.shape[1], window)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (probs @ v).transpose(0, 1)


def _docs(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    return [
        tuple(
            torch.randn(n, h, DIM, generator=gen, dtype=torch.float64)
            for h in (HEADS, GROUPS, GROUPS, HEADS)
        )
        for n in lengths
    ]


def expected_bytes(lengths, k, window, row_bytes_kv, row_bytes_grad):
    """Bytes the members of a ring of `k` send for one windowed layer, forward and backward.

    Brute force over positions: K/V rows of source j travel on hop t iff a member t or more
    hops after j has a query that sees them; the gradient accumulator of j carries the rows
    any other member sees, on hops 2..k.
    """
    shards = shard(lengths, k)
    active = [p for p in range(k) if shards[p].num_tokens]
    n = len(active)
    if n == 1:
        return 0
    local = {p: [(d, s + i) for d, s, m in shards[p].ranges() for i in range(m)] for p in active}

    def needs(member, source):
        return {
            row
            for row, (d, pk) in enumerate(local[source])
            if any(dq == d and 0 <= pq - pk <= window for dq, pq in local[member])
        }

    total = 0
    for i, j in enumerate(active):
        later = [set() for _ in range(n)]
        for t in range(n - 1, 0, -1):
            later[t] = needs(active[(i + t) % n], j) | (later[t + 1] if t + 1 < n else set())
            total += 2 * len(later[t]) * row_bytes_kv  # forward and backward K/V
        total += (n - 1) * len(later[1]) * row_bytes_grad if n > 1 and later[1] else 0
    return total


def _body(rank, world_size, rounds, backend):
    results = []
    for round_id, (rings, lengths, window) in enumerate(rounds):
        ((ring_id, ring),) = [(i, r) for i, r in enumerate(rings) if rank in r]
        docs = _docs(lengths, seed=10 * round_id + ring_id)
        stats = CommStats()
        if shard(lengths, len(ring))[ring.index(rank)].num_tokens == 0:
            results.append(0)
            continue
        spec = build_ring_spec(
            lengths, ring, rank=rank, group=dist.group.WORLD, stats=stats, backend=backend
        )
        pieces = spec.shards[spec.position].ranges()
        q, k, v, dout = (
            torch.cat([docs[d][i][s : s + n] for d, s, n in pieces]).clone().requires_grad_(i < 3)
            for i in range(4)
        )
        # Windows 2 and 9 match messages by order only, as NCCL does (`ring_comm`): members
        # that skip a hop must skip it on both ends, in the same order.
        with order_only_messages(window in (2, 9)):
            out = hdp_attention(q, k, v, spec, window=window)
            out.backward(dout)
        for d, (dq, dk, dv, ddout) in enumerate(docs):
            qf, kf, vf = (t.clone().requires_grad_() for t in (dq, dk, dv))
            of = reference(qf, kf, vf, window)
            of.backward(ddout)
            docs[d] = (of.detach(), qf.grad, kf.grad, vf.grad)
        assert_pieces_match(
            (("out", out, 0), ("dq", q.grad, 1), ("dk", k.grad, 2), ("dv", v.grad, 3)),
            docs, pieces, f"rank {rank}, ring {ring}, lengths {lengths}, window {window}",
        )  # fmt: skip
        results.append(stats.bytes_sent)
    return results


LENGTHS = [33, 1, 9, 16, 2]
# A chunk of the 33-token document is 4-5 tokens on a ring of 4, 5-6 on 3, 8-9 on 2.
ROUNDS = [
    (rings, lengths, window)
    for window in (0, 2, 4, 9, 40)
    for rings, lengths in (
        ([[0, 1, 2, 3]], LENGTHS),
        ([[2, 0, 3], [1]], LENGTHS),
        ([[3, 1], [0, 2]], LENGTHS),
        ([[0], [1], [2], [3]], LENGTHS),
        ([[1, 3, 0, 2]], [2, 1]),  # fewer tokens than members: one holds none
    )
]


@pytest.mark.parametrize("backend", ["torch"])
def test_window_rings_1_to_4_match_dense_windowed_attention(backend):
    per_rank = run_ranks(_body, 4, ROUNDS, backend)
    row_kv = 2 * GROUPS * DIM * 8
    for r, (rings, lengths, window) in enumerate(ROUNDS):
        for ring in rings:
            sent = sum(per_rank[rank][r] for rank in ring)
            full = window >= max(lengths) - 1
            if full:
                continue  # full causal attention: the ring of `test_ring_attention`
            want = expected_bytes(lengths, len(ring), window, row_kv, row_kv)
            assert sent == want, (ring, lengths, window, sent, want)
