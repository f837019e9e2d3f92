"""Banded (sliding-window) ring steps on flash kernels through their own window arguments (ops).

A flash varlen call takes one window `(left, right)` for all its blocks, bottom-right
aligned: query row r of a block of `Lq` queries and `Lk` keys sees key column c iff
`r + Lk - Lq - left <= c <= r + Lk - Lq + right` (flash-attn's `flash_api.cpp`
`set_params_fprop`, `kernels/mask.h`; -1: no limit on that side). A banded step
(`base.Band`) has, per document, up to two runs of consecutive query positions (its zigzag
chunks) and up to two of key positions. `split_band` cuts it into sub-blocks of one query run
and one key run, trimmed to the rows that meet, where the window is exactly such a band:
for query positions `q0 ..` and key positions `k0 ..`, `right = q0 - k0 - (Lk - Lq)` and
`left = w - right`, both >= 0 after trimming. A side that cannot bind within the sub-block is
passed as -1, and `max_seqlen_k` is passed at least as large as every window and query
block, so that the kernel's own clamping (`window >= max_seqlen_k` -> -1) and its reading of
-1 (as `max_seqlen_k`) change nothing.

Sub-blocks with equal windows share one kernel call, provided no query row appears twice in
it; `banded_forward` merges the calls' partial results by log-sum-exp, `banded_backward` adds
their gradients (each call's backward takes the step's merged output and log-sum-exp, exact
as for ring steps). The split is host work, done once per step and cached on its band.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_hdp.attention.kernels.base import Band, VarlenBlocks, accumulation_dtype

logger = logging.getLogger(__name__)
_warned: set[str] = set()


@dataclass(frozen=True)
class WindowCall:
    """One kernel call of a banded step: its rows, blocks and window (flash's convention).

    `q_index` / `k_index` are the step's packed query / key rows it takes (on the device);
    `blocks` are its sub-blocks, packed in that order, without a band; `max_seqlen_k` is the
    value to pass (see the module).
    """

    q_index: torch.Tensor
    k_index: torch.Tensor
    blocks: VarlenBlocks
    left: int
    right: int
    max_seqlen_k: int


def _runs(positions: torch.Tensor, starts: list[int], lengths: list[int]):
    """Per document: `(row, position, length)` of each run of consecutive positions."""
    out = []
    pos = positions.tolist()
    for start, length in zip(starts, lengths, strict=True):
        runs = []
        for i in range(start, start + length):
            if i == start or pos[i] != pos[i - 1] + 1:
                runs.append([i, pos[i], 0])
            runs[-1][2] += 1
        out.append([tuple(r) for r in runs])
    return out


def _sub_blocks(band: Band, blocks: VarlenBlocks):
    """`(q_row, q_len, k_row, k_len, left, right)` of every sub-block that meets, in order."""
    w = band.window
    q_starts = [0, *torch.tensor(blocks.lengths_q).cumsum(0).tolist()[:-1]]
    k_starts = [0, *torch.tensor(blocks.lengths_k).cumsum(0).tolist()[:-1]]
    q_runs = _runs(band.host_q, q_starts, list(blocks.lengths_q))
    k_runs = _runs(band.host_k, k_starts, list(blocks.lengths_k))
    out = []
    for doc_q, doc_k in zip(q_runs, k_runs, strict=True):
        for q_row, a, n_q in doc_q:
            for k_row, c, n_k in doc_k:
                b, d = a + n_q, c + n_k  # positions [a, b) and [c, d)
                qa, qb = max(a, c), min(b, d + w)  # queries that see a key of the run
                ka, kb = max(c, a - w), min(d, b)  # keys some query of the run sees
                if qa >= qb or ka >= kb:
                    continue
                lq, lk = qb - qa, kb - ka
                right = qa - ka - (lk - lq)
                left = w - right
                right = -1 if right >= lq - 1 else right  # the upper edge never binds
                left = -1 if left >= lk - 1 else left  # the lower edge never binds
                out.append((q_row + qa - a, lq, k_row + ka - c, lk, left, right))
    return out


def split_band(blocks: VarlenBlocks) -> list[WindowCall]:
    """The kernel calls of a banded step (host work; cached on `blocks.band`)."""
    band = blocks.band
    cache = band._calls
    if "calls" in cache:
        return cache["calls"]
    groups: dict[tuple[int, int], list[list]] = {}
    for sub in _sub_blocks(band, blocks):
        rounds = groups.setdefault(sub[4:], [])
        rows = set(range(sub[0], sub[0] + sub[1]))
        for chosen, taken in rounds:
            if not rows & taken:
                chosen.append(sub)
                taken |= rows
                break
        else:
            rounds.append(([sub], rows))
    device = band.positions_q.device
    if device.type == "cuda" and "cuda" not in _warned:
        _warned.add("cuda")
        logger.warning(
            "sliding-window steps on the GPU pass the flash kernels' window arguments, "
            "verified against fakes of the kernels and by tests/gpu/test_window_gpu.py only"
        )
    calls = []
    for (left, right), rounds in groups.items():
        for subs, _ in rounds:
            q_index = torch.cat([torch.arange(r, r + n) for r, n, *_ in subs])
            k_index = torch.cat([torch.arange(r, r + n) for _, _, r, n, *_ in subs])
            lengths_q = [s[1] for s in subs]
            lengths_k = [s[3] for s in subs]
            call_blocks = VarlenBlocks.build(lengths_q, lengths_k, causal=False, device=device)
            max_k = max([*lengths_k, *lengths_q, left + 1, right + 1])
            calls.append(
                WindowCall(q_index.to(device), k_index.to(device), call_blocks, left, right, max_k)
            )
    cache["calls"] = calls
    return calls


#: `(q, k, v, call, scale) -> (out, lse)` of one windowed kernel call.
WindowForward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
#: `(dout, q, k, v, out, lse, call, scale) -> (dq, dk, dv)` of one windowed kernel call.
WindowBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def banded_forward(call_forward: WindowForward, q_THD, k_TGD, v_TGD, blocks, *, scale):
    """`(out, lse)` of a banded step from windowed kernel calls, merged by log-sum-exp."""
    acc = accumulation_dtype(q_THD.dtype)
    heads, rows = q_THD.shape[1], q_THD.shape[0]
    out = torch.zeros(q_THD.shape, dtype=acc, device=q_THD.device)
    lse = torch.full((heads, rows), float("-inf"), dtype=acc, device=q_THD.device)
    for call in split_band(blocks):
        out_c, lse_c = call_forward(
            q_THD.index_select(0, call.q_index),
            k_TGD.index_select(0, call.k_index),
            v_TGD.index_select(0, call.k_index),
            call,
            scale,
        )
        lse_c = lse_c.to(acc)
        old = lse[:, call.q_index]
        new = torch.logaddexp(old, lse_c)
        out[call.q_index] = out[call.q_index] * torch.exp(old - new).T.unsqueeze(-1) + out_c.to(
            acc
        ) * torch.exp(lse_c - new).T.unsqueeze(-1)
        lse[:, call.q_index] = new
    return out.to(q_THD.dtype), lse


def banded_backward(
    call_backward: WindowBackward, dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_HT, blocks, *, scale
):
    """`(dq, dk, dv)` of a banded step: the windowed calls' gradients added up."""
    acc = accumulation_dtype(q_THD.dtype)
    dq = torch.zeros(q_THD.shape, dtype=acc, device=q_THD.device)
    dk = torch.zeros(k_TGD.shape, dtype=acc, device=k_TGD.device)
    dv = torch.zeros(v_TGD.shape, dtype=acc, device=v_TGD.device)
    for call in split_band(blocks):
        dq_c, dk_c, dv_c = call_backward(
            dout_THD.index_select(0, call.q_index),
            q_THD.index_select(0, call.q_index),
            k_TGD.index_select(0, call.k_index),
            v_TGD.index_select(0, call.k_index),
            out_THD.index_select(0, call.q_index),
            lse_HT[:, call.q_index].contiguous(),
            call,
            scale,
        )
        dq.index_add_(0, call.q_index, dq_c.to(acc))
        dk.index_add_(0, call.k_index, dk_c.to(acc))
        dv.index_add_(0, call.k_index, dv_c.to(acc))
    return dq.to(q_THD.dtype), dk.to(k_TGD.dtype), dv.to(v_TGD.dtype)
