"""Attention sinks (`--softmax-type off-by-one / learnable`) in packs and zigzag rings (float64).

The reference is Megatron's `SoftmaxOne` written out: the sink logit appended to every query
row's masked scores as one more column, a plain softmax over the row, the sink's column
dropped. It shares nothing with `sinks.SoftmaxSink` (which finalizes the merged out and
log-sum-exp); autograd through it gives the reference gradients, the sink's included.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_hdp.attention.dropout import ATTENTION, MicroBatchKeys, attention_keep, key_base
from megatron_hdp.attention.ring import build_ring_spec, hdp_attention
from megatron_hdp.attention.sinks import SINK
from megatron_hdp.sharding import shard
from tests.dist import run_ranks
from tests.ring_pieces import assert_pieces_match

HEADS, GROUPS, DIM = 4, 2, 8


def reference_sink_attention(q, k, v, sink_H, keep=None, p=0.0):
    """Causal attention of one document with a sink column per head ([T, H, D]); `keep`:
    the kept `[H, T, T]` probabilities of dropout `p` (after the softmax, as Megatron's)."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1).transpose(0, 1)
    v = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    q = q.transpose(0, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    column = sink_H.reshape(-1, 1, 1).expand(-1, scores.shape[1], 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    if keep is not None:
        probs = probs * keep / (1 - p)
    return (probs @ v).transpose(0, 1)


def _docs(doc_lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((HEADS,), (GROUPS,), (GROUPS,), (HEADS,))
    return [
        [torch.randn(n, *h, DIM, generator=gen, dtype=torch.float64) for h in shapes]
        for n in doc_lengths
    ]


def _sink(kind, seed):
    if kind == "off-by-one":
        return torch.zeros(HEADS, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(HEADS, generator=gen, dtype=torch.float64)).requires_grad_()


def _reference(docs, sink):
    """Per document `(out, dq, dk, dv)` and the sink's gradient summed over the documents."""
    sink = sink.detach().clone().requires_grad_(sink.requires_grad)
    parts = []
    for q, k, v, dout in docs:
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        out = reference_sink_attention(qf, kf, vf, sink)
        out.backward(dout)
        parts.append((out.detach(), qf.grad, kf.grad, vf.grad))
    return parts, sink.grad


#: (rings, document lengths or None for the default, sink kind) per round, on 4 ranks.
ROUNDS = [
    ([[0, 1, 2, 3]], None, "learnable"),  # one ring of 4
    ([[2, 0], [3, 1]], None, "learnable"),  # two rings of 2, non-contiguous
    ([[1, 3, 0], [2]], None, "off-by-one"),  # a ring of 3 beside a pack
    ([[0], [1], [2], [3]], None, "learnable"),  # all packs
    ([[3, 1, 0, 2]], [1, 2], "learnable"),  # 3 tokens on a ring of 4: two members hold none
    ([[0, 1, 2], [3]], [1, 5, 1, 6, 2], "learnable"),  # docs shorter than 2k, 1-token docs
]


def _body(rank, world_size, rounds):
    results = []
    for round_id, (rings, fixed, kind) in enumerate(rounds):
        ((ring_id, ring),) = [(i, r) for i, r in enumerate(rings) if rank in r]
        doc_lengths = fixed or [7 + 5 * ring_id + 3 * round_id, 1, 16 + ring_id, 2, 33]
        docs = _docs(doc_lengths, seed=100 * round_id + ring_id)
        sink = _sink(kind, seed=round_id)
        want, want_dsink = _reference(docs, sink)
        if shard(doc_lengths, len(ring))[ring.index(rank)].num_tokens == 0:
            results.append((round_id, ring_id, None, want_dsink))
            continue  # members without tokens skip the micro-batch
        spec = build_ring_spec(doc_lengths, ring, rank=rank, group=dist.group.WORLD)
        pieces = spec.shards[spec.position].ranges()
        q, k, v, dout = (
            torch.cat([docs[d][i][s : s + n] for d, s, n in pieces]).requires_grad_(i < 3)
            for i in range(4)
        )
        out = hdp_attention(q, k, v, spec, finalize=SINK, finalize_params=(sink,))
        out.backward(dout)
        assert_pieces_match(
            (("out", out, 0), ("dq", q.grad, 1), ("dk", k.grad, 2), ("dv", v.grad, 3)),
            want, pieces, f"rank {rank}, {ring}",
        )  # fmt: skip
        results.append((round_id, ring_id, sink.grad, want_dsink))
    return results


def test_sinks_in_rings_of_1_to_4_equal_the_explicit_sink_column():
    """Outputs, dq, dk, dv on every rank; the sink's gradient summed over each ring's members
    (as the gradient sync sums it) equals the reference's, for every ring and pack."""
    per_rank = run_ranks(_body, 4, ROUNDS)
    shares = {}
    for results in per_rank:
        for round_id, ring_id, share, want in results:
            total, _ = shares.get((round_id, ring_id), (0.0, want))
            shares[(round_id, ring_id)] = (total if share is None else total + share, want)
    assert len(shares) == sum(len(rings) for rings, _, _ in ROUNDS)
    for (round_id, ring_id), (total, want) in sorted(shares.items()):
        if ROUNDS[round_id][2] == "off-by-one":
            assert want is None and not isinstance(total, torch.Tensor)  # a constant: no grad
            continue
        assert want.abs().max() > 1e-3  # a gradient that could be wrong
        torch.testing.assert_close(
            total, want, rtol=1e-10, atol=1e-10, msg=f"{round_id}, {ring_id}"
        )


@pytest.mark.parametrize("backend", ["torch", "math"])
def test_a_pack_with_a_sink_equals_the_explicit_column(backend):
    """One rank, no process group: the pack path finalizes the kernel's own out and lse."""
    doc_lengths = [9, 1, 17, 4]
    docs = _docs(doc_lengths, seed=5)
    sink = _sink("learnable", seed=6)
    want, want_dsink = _reference(docs, sink)
    spec = build_ring_spec(doc_lengths, (0,), rank=0, group=None, backend=backend)
    q, k, v, dout = (torch.cat([d[i] for d in docs]).requires_grad_(i < 3) for i in range(4))
    out = hdp_attention(q, k, v, spec, finalize=SINK, finalize_params=(sink,))
    out.backward(dout)
    for got, i in ((out.detach(), 0), (q.grad, 1), (k.grad, 2), (v.grad, 3)):
        torch.testing.assert_close(got, torch.cat([w[i] for w in want]), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sink.grad, want_dsink, rtol=1e-10, atol=1e-10)
    # Without the sink the output differs: the sink takes a share of every row.
    plain = hdp_attention(q.detach(), k.detach(), v.detach(), spec)
    assert (plain - out.detach()).abs().max() > 1e-2


def test_a_bfloat16_pack_with_a_sink_is_near_the_float64_reference():
    """bfloat16 inputs and sink: the finalize step runs in float32, the output is bfloat16."""
    doc_lengths = [40, 7]
    docs = _docs(doc_lengths, seed=8)
    sink = _sink("learnable", seed=9)
    want, want_dsink = _reference(docs, sink)
    spec = build_ring_spec(doc_lengths, (0,), rank=0, group=None)
    q, k, v, dout = (torch.cat([d[i] for d in docs]).to(torch.bfloat16) for i in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sink16 = sink.detach().to(torch.bfloat16).requires_grad_()
    out = hdp_attention(q, k, v, spec, finalize=SINK, finalize_params=(sink16,))
    out.backward(dout)
    assert out.dtype == sink16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), torch.cat([w[0] for w in want]), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(sink16.grad.double(), want_dsink, rtol=5e-2, atol=5e-2)


P, SEED, ITERATION, LAYER = 0.1, 1234, 7, 3


def _keep(n, doc_id):
    """The keyed dropout mask of a whole document (`attention.dropout`'s own function)."""
    pos = torch.arange(n)
    base = key_base(ATTENTION, SEED, ITERATION, LAYER)
    return attention_keep(base, torch.arange(HEADS), torch.full((n,), doc_id), pos, pos, P)


def _body_dropout(rank, world_size, rings, doc_lengths, doc_ids):
    ((ring,),) = [[r] for r in rings if rank in r]
    docs, sink = _docs(doc_lengths, seed=11), _sink("learnable", seed=12)
    ref_sink = sink.detach().clone().requires_grad_()
    want = []
    for (q, k, v, dout), n, doc in zip(docs, doc_lengths, doc_ids, strict=True):
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        out = reference_sink_attention(qf, kf, vf, ref_sink, _keep(n, doc), P)
        out.backward(dout)
        want.append((out.detach(), qf.grad, kf.grad, vf.grad))
    if shard(doc_lengths, len(ring))[ring.index(rank)].num_tokens == 0:
        return None, ref_sink.grad
    group = dist.group.WORLD if len(ring) > 1 else None
    spec = build_ring_spec(doc_lengths, ring, rank=rank, group=group, backend="math")
    pieces = spec.shards[spec.position].ranges()
    q, k, v, dout = (
        torch.cat([docs[d][i][s : s + n] for d, s, n in pieces]).requires_grad_(i < 3)
        for i in range(4)
    )
    empty = torch.zeros(0, dtype=torch.int64)
    dropout = MicroBatchKeys(SEED, ITERATION, tuple(doc_ids), empty, empty).attention(P, LAYER)
    out = hdp_attention(q, k, v, spec, dropout=dropout, finalize=SINK, finalize_params=(sink,))
    out.backward(dout)
    for name, got, i in (("out", out, 0), ("dq", q.grad, 1), ("dk", k.grad, 2), ("dv", v.grad, 3)):
        expected = torch.cat([want[d][i][s : s + n] for d, s, n in pieces])
        torch.testing.assert_close(got.detach(), expected, rtol=1e-10, atol=1e-10, msg=name)
    return sink.grad, ref_sink.grad


def test_sinks_with_keyed_attention_dropout_in_a_ring_of_3_and_a_pack():
    """Dropout of the sink softmax's probabilities (Megatron's order: softmax with the sink,
    then dropout): outputs, gradients and the sink's gradient of the explicit column."""
    rings = ([3, 0, 2], [1])
    results = run_ranks(_body_dropout, 4, rings, [11, 1, 24, 30], [5, 0, 17, 2])
    for ring in rings:
        shares = [results[r][0] for r in ring if results[r][0] is not None]
        torch.testing.assert_close(sum(shares), results[ring[0]][1], rtol=1e-10, atol=1e-10)
