"""Sliding windows with keyed attention dropout and with attention sinks (gpt-oss's layers).

Packs and zigzag rings of 1-4 on 4 ranks, float64, against single-process dense attention
of each whole document written out here: Megatron-Core's sliding-window mask
(`get_sliding_window_causal_mask`), the sink logit as one more column of every row's scores
(Megatron's `SoftmaxOne`), then dropout of the probabilities with the keyed mask of the
whole document (`attention_keep` of document id, head, query and key position). Autograd
through it gives the reference gradients, the sink's included; the sink's gradient of a ring
is the sum of its members' shares (as the gradient sync sums it).
"""

import torch
import torch.distributed as dist

from megatron_hdp.attention.dropout import ATTENTION, MicroBatchKeys, attention_keep, key_base
from megatron_hdp.attention.ring import build_ring_spec, hdp_attention
from megatron_hdp.attention.sinks import SINK
from megatron_hdp.sharding import shard
from tests.dist import run_ranks
from tests.ring_pieces import assert_pieces_match

HEADS, GROUPS, DIM = 4, 2, 8
P, SEED, ITERATION, LAYER = 0.25, 99, 3, 2


def reference(q, k, v, window, sink_H=None, keep=None):
    """Dense windowed attention of one document `[T, H, D]`; optional sink column and kept
    probabilities `keep [H, T, T]` (dropout P, after the softmax)."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1).transpose(0, 1)
    v = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    q = q.transpose(0, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    ones = torch.ones(scores.shape[-2:], dtype=torch.bool)
    visible = torch.tril(torch.triu(ones, diagonal=-window), diagonal=0)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sink_H is not None:
        column = sink_H.reshape(-1, 1, 1).expand(-1, scores.shape[1], 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : q.shape[1]]
    if keep is not None:
        probs = probs * keep / (1 - P)
    return (probs @ v).transpose(0, 1)


def _keep(n, doc_id):
    pos = torch.arange(n)
    base = key_base(ATTENTION, SEED, ITERATION, LAYER)
    return attention_keep(base, torch.arange(HEADS), torch.full((n,), doc_id), pos, pos, P)


def _inputs(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    heads = (HEADS, GROUPS, GROUPS, HEADS)
    docs = [
        [torch.randn(n, h, DIM, generator=gen, dtype=torch.float64) for h in heads] for n in lengths
    ]
    sink = 2.0 * torch.randn(HEADS, generator=gen, dtype=torch.float64)
    return docs, sink


def _body(rank, world_size, rounds):
    results = []
    for round_id, (rings, lengths, window, drop, with_sink) in enumerate(rounds):
        ((ring_id, ring),) = [(i, r) for i, r in enumerate(rings) if rank in r]
        docs, sink0 = _inputs(lengths, seed=round_id)
        doc_ids = [7 * d + 1 for d in range(len(lengths))]
        ref_sink = sink0.clone().requires_grad_() if with_sink else None
        want = []
        for (q, k, v, dout), n, doc in zip(docs, lengths, doc_ids, strict=True):
            qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
            out = reference(qf, kf, vf, window, ref_sink, _keep(n, doc) if drop else None)
            out.backward(dout)
            want.append((out.detach(), qf.grad, kf.grad, vf.grad))
        want_dsink = ref_sink.grad if with_sink else None
        if shard(lengths, len(ring))[ring.index(rank)].num_tokens == 0:
            results.append((round_id, ring_id, None, want_dsink))
            continue
        group = dist.group.WORLD if len(ring) > 1 else None
        spec = build_ring_spec(lengths, ring, rank=rank, group=group, backend="torch")
        pieces = spec.shards[spec.position].ranges()
        q, k, v, dout = (
            torch.cat([docs[d][i][s : s + n] for d, s, n in pieces]).requires_grad_(i < 3)
            for i in range(4)
        )
        dropout = None
        if drop:
            empty = torch.zeros(0, dtype=torch.int64)
            keys = MicroBatchKeys(SEED, ITERATION, tuple(doc_ids), empty, empty)
            dropout = keys.attention(P, LAYER)
        sink = sink0.clone().requires_grad_() if with_sink else None
        out = hdp_attention(
            q,
            k,
            v,
            spec,
            dropout=dropout,
            finalize=SINK if with_sink else None,
            finalize_params=(sink,) if with_sink else (),
            window=window,
        )
        out.backward(dout)
        assert_pieces_match(
            (("out", out, 0), ("dq", q.grad, 1), ("dk", k.grad, 2), ("dv", v.grad, 3)),
            want, pieces, f"rank {rank}, ring {ring}, {lengths}, window {window}",
        )  # fmt: skip
        results.append((round_id, ring_id, sink.grad if with_sink else None, want_dsink))
    return results


# Around window 4: documents of w, w + 1, w + 2, 2w + 1 tokens, 1-token ones, and one long
# enough that ring members skip steps (33 tokens: chunks of 4-5 on a ring of 4).
LAYOUTS = (
    [[0, 1, 2, 3]],
    [[2, 0, 3], [1]],
    [[3, 1], [0, 2]],
    [[0], [1], [2], [3]],
)
ROUNDS = [
    (rings, lengths, window, drop, sink)
    for window, lengths in ((4, [33, 4, 1, 5, 6, 9]), (0, [12, 1, 3]), (9, [2, 1]))
    for rings in LAYOUTS
    for drop, sink in ((True, False), (False, True), (True, True))
]


def test_window_with_dropout_and_sinks_in_rings_of_1_to_4_equal_dense_attention():
    per_rank = run_ranks(_body, 4, ROUNDS)
    shares = {}
    for results in per_rank:
        for round_id, ring_id, share, want in results:
            total, _ = shares.get((round_id, ring_id), (0.0, want))
            shares[round_id, ring_id] = (total if share is None else total + share, want)
    assert len(shares) == sum(len(r[0]) for r in ROUNDS)
    checked = 0
    for (round_id, ring_id), (total, want) in sorted(shares.items()):
        if not ROUNDS[round_id][4]:
            continue
        assert want.abs().max() > 1e-3  # a gradient that could be wrong
        torch.testing.assert_close(
            total, want, rtol=1e-10, atol=1e-10, msg=f"round {round_id}, ring {ring_id}"
        )
        checked += 1
    assert checked


def test_the_window_and_the_dropout_change_the_output():
    """The reference is not blind: without the window, the sink or the dropout it differs."""
    (q, k, v, _), sink = _inputs([20], seed=1)[0][0], _inputs([20], seed=1)[1]
    keep = _keep(20, 1)
    base = reference(q, k, v, 4, sink, keep)
    for other in (
        reference(q, k, v, 19, sink, keep),
        reference(q, k, v, 4, None, keep),
        reference(q, k, v, 4, sink, None),
    ):
        assert (other - base).abs().max() > 1e-2
