"""The ring step bookkeeping as it was before `attention/ring_index.py`: per-row Python lists.

Kept as the reference the vectorised builder must equal bitwise (tests/unit/test_ring_index.py)
and as the "before" of scripts/bench/bench_ring_bookkeeping.py. It builds the rows for packs
too, where they are never used.
"""

from __future__ import annotations

import itertools

import torch

from megatron_hdp.attention.kernels.base import VarlenBlocks
from megatron_hdp.attention.ring import RingAttentionSpec, _segments
from megatron_hdp.attention.ring_index import StepBlocks
from megatron_hdp.host_copy import pack_int64, to_device, unpack


def list_step_blocks(spec: RingAttentionSpec, device: torch.device) -> dict[int, StepBlocks]:
    """`ring._step_blocks` before the vectorised builder (list comprehensions per row)."""
    plans = []
    for source in spec.active:
        segments = _segments(spec, source)
        if not segments:
            continue
        causal = {seg[4] for seg in segments}
        assert len(causal) == 1, "a ring step mixes causal and full blocks"
        lengths_q, lengths_k = [seg[1] for seg in segments], [seg[3] for seg in segments]
        q_rows = [r for q0, ql, _, _, _ in segments for r in range(q0, q0 + ql)]
        kv_rows = [r for _, _, k0, kl, _ in segments for r in range(k0, k0 + kl)]
        parts = [
            q_rows,
            kv_rows,
            [0, *itertools.accumulate(lengths_q)],
            [0, *itertools.accumulate(lengths_k)],
        ]
        plans.append((source, lengths_q, lengths_k, causal.pop(), parts))
    host, lengths = pack_int64([part for *_, parts in plans for part in parts])
    views = iter(unpack(to_device(host, device), lengths))
    steps = {}
    for source, lengths_q, lengths_k, causal, _ in plans:
        q_rows, kv_rows, cu_q, cu_k = (next(views) for _ in range(4))
        steps[source] = StepBlocks(
            q_rows=q_rows,
            kv_rows=kv_rows,
            blocks=VarlenBlocks(
                lengths_q=tuple(lengths_q),
                lengths_k=tuple(lengths_k),
                causal=causal,
                cu_seqlens_q=cu_q.to(torch.int32),
                cu_seqlens_k=cu_k.to(torch.int32),
            ),
        )
    return steps
