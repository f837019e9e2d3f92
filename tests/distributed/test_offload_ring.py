"""Offloading inside a ring of 3 ranks: outputs and gradients bitwise equal to no offloading."""

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_hdp.attention.ring import build_ring_spec, hdp_attention
from megatron_hdp.offload.engines import HostCopyEngine
from megatron_hdp.offload.hooks import OffloadManager
from tests.dist import run_ranks

HEADS, GROUPS, DIM, HIDDEN, NUM_LAYERS = 4, 2, 8, 32, 4
DOC_LENGTHS, RING = [40, 7, 64], (2, 0, 1)
RATIOS = [0.0, 0.25, 0.5, 1.0]


class RingBlock(nn.Module):
    """x + proj(hdp_attention(qkv(x))), then x + MLP(x); the spec is set per micro-batch."""

    def __init__(self):
        super().__init__()
        f64 = torch.float64
        self.qkv = nn.Linear(HIDDEN, (HEADS + 2 * GROUPS) * DIM, dtype=f64)
        self.proj = nn.Linear(HEADS * DIM, HIDDEN, dtype=f64)
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN, dtype=f64)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN, dtype=f64)
        self.spec = None

    def forward(self, x):
        tokens = x.shape[0]
        qkv = self.qkv(x).view(tokens, HEADS + 2 * GROUPS, DIM)
        q, k, v = qkv.split([HEADS, GROUPS, GROUPS], dim=1)
        x = x + self.proj(hdp_attention(q, k, v, self.spec).reshape(tokens, HEADS * DIM))
        return x + self.fc2(F.gelu(self.fc1(x)))


def _run(model, x_local, w_local, rank, ctx):
    spec = build_ring_spec(DOC_LENGTHS, RING, rank=rank, group=dist.group.WORLD)
    for layer in model:
        layer.spec = spec
    model.zero_grad(set_to_none=True)
    x = x_local.clone().requires_grad_()
    with ctx:
        out = model(x)
        (out * w_local).sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


def _body_offload_ring(rank, world_size):
    torch.manual_seed(0)  # same weights on every rank
    model = nn.Sequential(*[RingBlock() for _ in range(NUM_LAYERS)])
    gen = torch.Generator().manual_seed(1)
    # Per document: the layer-stack input and the loss weights, identical on every rank.
    docs = [
        [torch.randn(n, HIDDEN, generator=gen, dtype=torch.float64) for _ in range(2)]
        for n in DOC_LENGTHS
    ]
    spec = build_ring_spec(DOC_LENGTHS, RING, rank=rank, group=dist.group.WORLD)
    pieces = spec.shards[spec.position].ranges()
    x_local, w_local = (torch.cat([docs[d][i][s : s + n] for d, s, n in pieces]) for i in (0, 1))

    want_out, want_xg, want_grads = _run(model, x_local, w_local, rank, nullcontext())
    engine = HostCopyEngine(1 << 30)
    manager = OffloadManager(engine, num_layers=NUM_LAYERS, min_offload_bytes=256)
    manager.install(list(model))
    moved = {}
    for ratio in RATIOS:
        out, xg, grads = _run(model, x_local, w_local, rank, manager.micro_batch(ratio))
        assert torch.equal(out, want_out), f"output differs on rank {rank}, ratio {ratio}"
        assert torch.equal(xg, want_xg), f"input grad differs on rank {rank}, ratio {ratio}"
        for (name, _), g, want in zip(model.named_parameters(), grads, want_grads):
            assert torch.equal(g, want), f"grad of {name} differs on rank {rank}, ratio {ratio}"
        stats = manager.stats()
        assert stats["bytes_to_device"] == stats["bytes_to_host"]
        assert stats["resident_bytes"] == 0
        moved[ratio] = (stats["bytes_to_host"], stats["offloadable_bytes"])
    assert engine.host_bytes_in_use == 0
    return moved


def test_ring_of_3_bitwise_equal_with_offloading():
    results = run_ranks(_body_offload_ring, 3)
    for moved in results:
        off = moved[0.0][1]
        assert off > 0 and moved[0.0][0] == 0
        assert 0 < moved[0.25][0] < moved[0.5][0] < moved[1.0][0] == off
