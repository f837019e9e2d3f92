"""Keyed attention dropout: rings of 1-4 ranks against one dense attention (float64).

The reference materialises each document's scores, softmax, keyed mask and matmul in full
and gets its gradients from autograd; the mask is the keyed function of (layer, document,
head, query position, key position), whose own hash is checked against a plain Python
`lowbias32` here.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_hdp.attention.dropout import (
    ATTENTION,
    MicroBatchKeys,
    attention_keep,
    hidden_keep,
    key_base,
    mix32,
)
from megatron_hdp.attention.ring import build_ring_spec, hdp_attention
from megatron_hdp.sharding import shard
from tests.dist import run_ranks

HEADS, GROUPS, DIM, P = 4, 2, 8, 0.1
SEED, ITERATION, LAYER = 1234, 7, 3


def lowbias32(x: int) -> int:
    """Chris Wellons' lowbias32, on Python ints."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    return x ^ (x >> 16)


def test_hash_is_lowbias32_on_every_32_bit_range():
    words = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF, 123456789]
    got = mix32(torch.tensor(words, dtype=torch.int64)).tolist()
    assert got == [lowbias32(w) for w in words]


def test_masks_depend_on_the_key_not_on_the_split():
    """Any subset of rows / columns / tokens gets the sub-mask of the full one."""
    base = key_base(ATTENTION, SEED, ITERATION, LAYER)
    heads = torch.arange(HEADS)
    q_pos, k_pos = torch.arange(50), torch.arange(50)
    docs = torch.full((50,), 9)
    full = attention_keep(base, heads, docs, q_pos, k_pos, P)
    rows, cols = torch.tensor([3, 49, 17, 0]), torch.tensor([40, 2, 2, 31])
    part = attention_keep(base, heads[2:], docs[rows], q_pos[rows], k_pos[cols], P)
    assert torch.equal(part, full[2:][:, rows][:, :, cols])
    # Another document, layer or iteration draws another mask.
    other = attention_keep(base, heads, docs + 1, q_pos, k_pos, P)
    assert not torch.equal(other, full)
    assert not torch.equal(
        attention_keep(
            key_base(ATTENTION, SEED, ITERATION + 1, LAYER), heads, docs, q_pos, k_pos, P
        ),
        full,
    )
    hidden = hidden_keep(base, docs, q_pos, 64, P)
    assert torch.equal(hidden_keep(base, docs[rows], q_pos[rows], 64, P), hidden[rows])
    # Bernoulli(1 - p): 4 * 50 * 50 + 50 * 64 draws, the drop rate within 5 sigma of p.
    for mask in (full, hidden):
        n = mask.numel()
        rate = 1.0 - mask.double().mean().item()
        assert abs(rate - P) < 5 * (P * (1 - P) / n) ** 0.5, rate


def reference_dropout_attention(q, k, v, doc_id, head_offset=0):
    """Causal attention of one whole document with keyed dropout, written out in full."""
    n, heads = q.shape[0], q.shape[1]
    rep = heads // k.shape[1]
    k = k.repeat_interleave(rep, dim=1).transpose(0, 1)
    v = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    pos = torch.arange(n)
    keep = attention_keep(
        key_base(ATTENTION, SEED, ITERATION, LAYER),
        torch.arange(heads) + head_offset,
        torch.full((n,), doc_id),
        pos,
        pos,
        P,
    )
    return ((probs * keep / (1 - P)) @ v).transpose(0, 1)


def _docs(doc_lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    return [
        tuple(
            torch.randn(n, h, DIM, generator=gen, dtype=torch.float64)
            for h in (HEADS, GROUPS, GROUPS, HEADS)
        )
        for n in doc_lengths
    ]


def _keys(doc_ids):
    empty = torch.zeros(0, dtype=torch.int64)
    return MicroBatchKeys(SEED, ITERATION, tuple(doc_ids), empty, empty)


def _body(rank, world_size, rings, doc_lengths, doc_ids):
    ((ring,),) = [[r] for r in rings if rank in r]
    docs = _docs(doc_lengths, seed=5)
    if shard(doc_lengths, len(ring))[ring.index(rank)].num_tokens == 0:
        return None
    group = dist.group.WORLD if len(ring) > 1 else None
    spec = build_ring_spec(doc_lengths, ring, rank=rank, group=group, backend="math")
    pieces = spec.shards[spec.position].ranges()
    q, k, v, dout = (
        torch.cat([docs[d][i][s : s + n] for d, s, n in pieces]).clone().requires_grad_(i < 3)
        for i in range(4)
    )
    dropout = _keys(doc_ids).attention(P, LAYER)
    out = hdp_attention(q, k, v, spec, dropout=dropout)
    out.backward(dout)
    ref = {}
    for d, (dq, dk, dv, ddout) in enumerate(docs):
        qf, kf, vf = (t.clone().requires_grad_() for t in (dq, dk, dv))
        of = reference_dropout_attention(qf, kf, vf, doc_ids[d])
        of.backward(ddout)
        ref[d] = (of.detach(), qf.grad, kf.grad, vf.grad)
    for name, got, i in (
        ("out", out.detach(), 0),
        ("dq", q.grad, 1),
        ("dk", k.grad, 2),
        ("dv", v.grad, 3),
    ):
        want = torch.cat([ref[d][i][s : s + n] for d, s, n in pieces])
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"{name}, rank {rank}")
    # Without the mask the output differs: the test sees the dropout.
    plain = hdp_attention(q.detach(), k.detach(), v.detach(), spec)
    return float((plain - out.detach()).abs().max())


@pytest.mark.parametrize(
    "rings",
    [
        ([0], [1], [2], [3]),  # packs
        ([1, 3], [2, 0]),  # rings of 2
        ([3, 0, 2], [1]),  # a ring of 3 beside a pack
        ([2, 0, 3, 1],),  # a ring of 4
    ],
)
def test_ring_dropout_equals_dense_reference(rings):
    differences = run_ranks(_body, 4, rings, [11, 1, 24, 30], [5, 0, 17, 2])
    assert max(d for d in differences if d is not None) > 1e-3


def test_tensor_parallel_heads_take_their_global_masks():
    """Heads 2-3 and their KV group computed alone (TP rank 1 of 2) get the full model's
    heads 2-3: output and gradients."""
    (q, k, v, dout), n = _docs([13], seed=8)[0], 13
    spec = build_ring_spec([n], (0,), rank=0, group=None, backend="math")
    part = [t.clone().requires_grad_() for t in (q[:, 2:], k[:, 1:], v[:, 1:])]
    out = hdp_attention(*part, spec, dropout=_keys([4]).attention(P, LAYER, 2))
    out.backward(dout[:, 2:])
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = reference_dropout_attention(*full, 4)[:, 2:]
    want.backward(dout[:, 2:])
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    for got, ref, sl in zip(part, full, (slice(2, None), slice(1, None), slice(1, None))):
        torch.testing.assert_close(got.grad, ref.grad[:, sl], rtol=1e-10, atol=1e-10)
