"""flash-attn's private varlen entry points as each release defines them, computing on CPU.

`release(version)` is a stand-in for `flash_attn.flash_attn_interface` of flash-attn
`version` (2.6.0, 2.6.1, 2.6.2, 2.6.3, 2.7.0 or 2.8.3): `_flash_attn_varlen_forward` and
`_flash_attn_varlen_backward` with that tag's exact parameter list (names, order, which have
defaults) and that tag's return value, computed with the project's `math` kernel so that an
adapter's results can be compared with it; with a sliding window, dense attention under the
C++ code's window mask (`flash_window`, written out from `flash_api.cpp` and `mask.h`).
Each definition names the file and line of the tag it copies (flash-attention
`flash_attn/flash_attn_interface.py`; the C++ results from `csrc/flash_attn/flash_api.cpp`
`mha_varlen_fwd` / `mha_varlen_bwd`).

Differences from the real ones, none visible to the adapter: no CUDA (any dtype, CPU
tensors), the 2.7/2.8 custom ops are registered for every device instead of
`device_types="cuda"` and under their own namespace (`hdp_fake_fa270`, `hdp_fake_fa283`)
so they never shadow a real installation. Like the real backward (which checks only the
device of `softmax_lse`), the fake reads the first `H * Tq` values of whatever it is given
as the log-sum-exp. Every call is recorded in `calls` as `(entry point, arguments)`.
"""

from __future__ import annotations

import types
from typing import Optional

import torch

from megatron_hdp.attention.kernels.base import VarlenBlocks
from megatron_hdp.attention.kernels.cpu import MATH

RELEASES = ("2.6.0", "2.6.1", "2.6.2", "2.6.3", "2.7.0", "2.8.3")
_CACHE: dict[str, types.SimpleNamespace] = {}
_CALLS: dict[str, list] = {version: [] for version in RELEASES}


def _blocks(q, cu_seqlens_q, cu_seqlens_k, causal) -> VarlenBlocks:
    return VarlenBlocks.build(
        torch.diff(cu_seqlens_q).tolist(),
        torch.diff(cu_seqlens_k).tolist(),
        causal=causal,
        device=q.device,
    )


def flash_window(lq, lk, *, window, causal, max_seqlen_k) -> torch.Tensor | None:
    """flash-attn 2's visible `[lq, lk]` pairs of one sequence with a window; None: no mask.

    `mha_varlen_fwd` / `mha_varlen_bwd` (`csrc/flash_attn/flash_api.cpp`): causal sets the
    right window to 0, a window >= `max_seqlen_k` becomes -1; `set_params_fprop`: one side
    -1 and the other >= 0 makes the -1 side `max_seqlen_k`; `kernels/mask.h`: row r sees
    column c iff `r + lk - lq - left <= c < r + 1 + lk - lq + right` (bottom-right aligned).
    """
    left, right = window
    if causal:
        right = 0
    left = -1 if left >= max_seqlen_k else left
    right = -1 if right >= max_seqlen_k else right
    if left < 0 and right < 0:
        return None
    left = max_seqlen_k if left < 0 else left
    right = max_seqlen_k if right < 0 else right
    r = torch.arange(lq).unsqueeze(1)
    c = torch.arange(lk).unsqueeze(0)
    return (c >= r + lk - lq - left) & (c < r + 1 + lk - lq + right)


def _pieces(cu_seqlens_q, cu_seqlens_k):
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        yield slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])


def _windowed_probs(q, k, rows, cols, mask, scale, lse=None):
    heads = q.shape[1]
    kk = k[cols].repeat_interleave(heads // k.shape[1], dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q[rows].double(), kk) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)), lse


def _attend_windowed(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, window, max_seqlen_k):
    heads = q.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(heads, q.shape[0], dtype=torch.float32)
    for rows, cols in _pieces(cu_seqlens_q, cu_seqlens_k):
        lq, lk = rows.stop - rows.start, cols.stop - cols.start
        mask = flash_window(lq, lk, window=window, causal=causal, max_seqlen_k=max_seqlen_k)
        mask = torch.ones(lq, lk, dtype=torch.bool) if mask is None else mask
        probs, lse_b = _windowed_probs(q, k, rows, cols, mask, scale)
        vv = v[cols].repeat_interleave(heads // v.shape[1], dim=1).double()
        out[rows] = torch.einsum("hqk,khd->qhd", probs, vv).to(q.dtype)
        lse[:, rows] = lse_b.float()
    return out, lse


def _check_head_size(q, k, v) -> None:
    """`mha_varlen_fwd`/`_bwd`'s `CHECK_SHAPE(k|v, total_k, num_heads_k, head_size)`: k and v
    must have q's head size in every 2.x release (no separate value head dim)."""
    head_size = q.shape[-1]
    if k.shape[-1] != head_size or v.shape[-1] != head_size:
        raise RuntimeError(f"{'k' if k.shape[-1] != head_size else 'v'} must have shape (total_k, "
                           f"num_heads_k, {head_size})")  # fmt: skip


def _attend(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window, max_seqlen_k=None):
    """`(out, softmax_lse)`: the math kernel's, the lse float32 `[H, total_q]` as flash gives.

    With a sliding window: dense attention under `flash_window`'s mask, in float64.
    """
    _check_head_size(q, k, v)
    if window != (-1, -1):
        return _attend_windowed(
            q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window, max_seqlen_k
        )
    blocks = _blocks(q, cu_seqlens_q, cu_seqlens_k, causal)
    out, lse = MATH.forward(q, k, v, blocks, scale=softmax_scale)
    return out, lse.float()


def _gradients(args: dict, window) -> torch.Tensor:
    """Fill `dq`, `dk`, `dv` from the math kernel; returns `softmax_d` (`mha_varlen_bwd`'s
    `[num_heads, total_q + 128 * batch_size]` float32)."""
    assert args["softcap"] == 0.0 and args["alibi_slopes"] is None
    assert args["dropout_p"] == 0.0
    q = args["q"]
    _check_head_size(q, args["k"], args["v"])
    total_q, heads = q.shape[0], q.shape[1]
    # mha_varlen_bwd checks only the lse's device and reads heads * total_q floats.
    lse = args["softmax_lse"].reshape(-1)[: heads * total_q].view(heads, total_q)
    if window != (-1, -1):
        _windowed_gradients(args, window, lse)
        batch = args["cu_seqlens_q"].numel() - 1
        return torch.zeros(heads, total_q + 128 * batch, dtype=torch.float32)
    blocks = _blocks(q, args["cu_seqlens_q"], args["cu_seqlens_k"], args["causal"])
    grads = MATH.backward(
        args["dout"], q, args["k"], args["v"], args["out"], lse, blocks,
        scale=args["softmax_scale"],
    )  # fmt: skip
    for target, value in zip((args["dq"], args["dk"], args["dv"]), grads, strict=True):
        target.copy_(value)
    batch = args["cu_seqlens_q"].numel() - 1
    return torch.zeros(heads, total_q + 128 * batch, dtype=torch.float32)


def _windowed_gradients(args: dict, window, lse) -> None:
    """`dq`, `dk`, `dv` under `flash_window`'s mask, from the given out and lse (float64)."""
    q, k, v, dout, out = args["q"], args["k"], args["v"], args["dout"], args["out"]
    heads, groups = q.shape[1], k.shape[1]
    for rows, cols in _pieces(args["cu_seqlens_q"], args["cu_seqlens_k"]):
        lq, lk = rows.stop - rows.start, cols.stop - cols.start
        mask = flash_window(
            lq, lk, window=window, causal=args["causal"], max_seqlen_k=args["max_seqlen_k"]
        )
        mask = torch.ones(lq, lk, dtype=torch.bool) if mask is None else mask
        scale = args["softmax_scale"]
        probs, _ = _windowed_probs(q, k, rows, cols, mask, scale, lse[:, rows].double())
        vv = v[cols].repeat_interleave(heads // groups, dim=1).double()
        kk = k[cols].repeat_interleave(heads // groups, dim=1).double()
        do, o, qq = dout[rows].double(), out[rows].double(), q[rows].double()
        dv = torch.einsum("hqk,qhd->khd", probs, do)
        dp = torch.einsum("qhd,khd->hqk", do, vv)
        delta = (do * o).sum(-1).transpose(0, 1).unsqueeze(-1)
        ds = probs * (dp - delta)
        dq = torch.einsum("hqk,khd->qhd", ds, kk) * scale
        dk = torch.einsum("hqk,qhd->khd", ds, qq) * scale
        args["dq"][rows] = dq.to(q.dtype)
        args["dk"][cols] = dk.view(lk, groups, heads // groups, -1).sum(2).to(k.dtype)
        args["dv"][cols] = dv.view(lk, groups, heads // groups, -1).sum(2).to(v.dtype)


def _forward_26(calls: list, args: dict) -> tuple:
    """2.6.x's `return out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state`.

    With a head dim that is a multiple of 8, `q_padded` is `q` and `out_padded` is `out`; the
    undefined `p` (no `return_softmax`) reaches Python as None; `rng_state` is int64 `[2]`.
    """
    calls.append(("_flash_attn_varlen_forward", args))
    q, k, v = args["q"], args["k"], args["v"]
    out, lse = _attend(
        q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"], args["softmax_scale"],
        args["causal"], tuple(args["window_size"]), args["max_seqlen_k"],
    )  # fmt: skip
    return out, q, k, v, out, lse, None, torch.zeros(2, dtype=torch.int64)


def _backward_26(calls: list, args: dict) -> tuple:
    """2.6.x's `return dq, dk, dv, softmax_d`."""
    calls.append(("_flash_attn_varlen_backward", args))
    softmax_d = _gradients(args, tuple(args["window_size"]))
    return args["dq"], args["dk"], args["dv"], softmax_d


def _forward_27(calls: list, args: dict) -> tuple:
    """2.7/2.8's `return out, softmax_lse, S_dmask, rng_state` (`p` is `torch::empty({0})`)."""
    calls.append(("_flash_attn_varlen_forward", args))
    out, lse = _attend(
        args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
        args["softmax_scale"], args["causal"],
        (args["window_size_left"], args["window_size_right"]), args["max_seqlen_k"],
    )  # fmt: skip
    return out, lse, torch.empty(0, dtype=out.dtype), torch.zeros(2, dtype=torch.int64)


def _backward_27(calls: list, args: dict) -> torch.Tensor:
    """2.7/2.8's `return softmax_d` (dq, dk, dv are filled in place)."""
    calls.append(("_flash_attn_varlen_backward", args))
    return _gradients(args, (args["window_size_left"], args["window_size_right"]))


def _release_260(calls):
    # v2.6.0 flash_attn/flash_attn_interface.py:69 (return at :112): no defaults at all.
    def _flash_attn_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax, block_table,
    ):  # fmt: skip
        return _forward_26(calls, dict(locals()))

    # v2.6.0 flash_attn/flash_attn_interface.py:166 (return at :225).
    def _flash_attn_varlen_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, rng_state=None,
    ):  # fmt: skip
        return _backward_26(calls, dict(locals()))

    return _flash_attn_varlen_forward, _flash_attn_varlen_backward


def _release_261(calls):
    # v2.6.1 flash_attn/flash_attn_interface.py:69 (return at :114): window_size, softcap,
    # alibi_slopes, return_softmax without defaults.
    def _flash_attn_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax,
        block_table=None, leftpad_k=None,
    ):  # fmt: skip
        return _forward_26(calls, dict(locals()))

    # v2.6.1 flash_attn/flash_attn_interface.py:168 (return at :227).
    def _flash_attn_varlen_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, rng_state=None,
    ):  # fmt: skip
        return _backward_26(calls, dict(locals()))

    return _flash_attn_varlen_forward, _flash_attn_varlen_backward


def _release_262_263(calls):
    # v2.6.2 and v2.6.3 flash_attn/flash_attn_interface.py:70 (return at :115).
    def _flash_attn_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
        return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None,
    ):  # fmt: skip
        return _forward_26(calls, dict(locals()))

    # v2.6.2 and v2.6.3 flash_attn/flash_attn_interface.py:168 (return at :226).
    def _flash_attn_varlen_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, rng_state=None,
    ):  # fmt: skip
        return _backward_26(calls, dict(locals()))

    return _flash_attn_varlen_forward, _flash_attn_varlen_backward


def _release_270(calls):
    # v2.7.0 flash_attn/flash_attn_interface.py:142-143 (return at :189), a custom op.
    @torch.library.custom_op("hdp_fake_fa270::_flash_attn_varlen_forward", mutates_args=())
    def _flash_attn_varlen_forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int = -1,
        window_size_right: int = -1,
        softcap: float = 0.0,
        alibi_slopes: Optional[torch.Tensor] = None,  # noqa: UP045 (upstream's spelling)
        return_softmax: bool = False,
        block_table: Optional[torch.Tensor] = None,  # noqa: UP045
        leftpad_k: Optional[torch.Tensor] = None,  # noqa: UP045
        seqused_k: Optional[torch.Tensor] = None,  # noqa: UP045
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _forward_27(calls, dict(locals()))

    # v2.7.0 flash_attn/flash_attn_interface.py:327-328 (return at :387), a custom op.
    @torch.library.custom_op(
        "hdp_fake_fa270::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv")
    )
    def _flash_attn_varlen_backward(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        softmax_lse: torch.Tensor,
        dq: Optional[torch.Tensor],  # noqa: UP045
        dk: Optional[torch.Tensor],  # noqa: UP045
        dv: Optional[torch.Tensor],  # noqa: UP045
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: Optional[torch.Tensor],  # noqa: UP045
        deterministic: bool,
        rng_state: Optional[torch.Tensor] = None,  # noqa: UP045
    ) -> torch.Tensor:
        return _backward_27(calls, dict(locals()))

    return _flash_attn_varlen_forward, _flash_attn_varlen_backward


def _release_283(calls):
    # v2.8.3 flash_attn/flash_attn_interface.py:142-143 (return at :190), a custom op;
    # 2.7.0's parameters plus zero_tensors.
    @torch.library.custom_op("hdp_fake_fa283::_flash_attn_varlen_forward", mutates_args=())
    def _flash_attn_varlen_forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int = -1,
        window_size_right: int = -1,
        softcap: float = 0.0,
        alibi_slopes: Optional[torch.Tensor] = None,  # noqa: UP045 (upstream's spelling)
        return_softmax: bool = False,
        block_table: Optional[torch.Tensor] = None,  # noqa: UP045
        leftpad_k: Optional[torch.Tensor] = None,  # noqa: UP045
        seqused_k: Optional[torch.Tensor] = None,  # noqa: UP045
        zero_tensors: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _forward_27(calls, dict(locals()))

    # v2.8.3 flash_attn/flash_attn_interface.py:329-330 (return at :390), a custom op.
    @torch.library.custom_op(
        "hdp_fake_fa283::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv")
    )
    def _flash_attn_varlen_backward(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        softmax_lse: torch.Tensor,
        dq: Optional[torch.Tensor],  # noqa: UP045
        dk: Optional[torch.Tensor],  # noqa: UP045
        dv: Optional[torch.Tensor],  # noqa: UP045
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: Optional[torch.Tensor],  # noqa: UP045
        deterministic: bool,
        rng_state: Optional[torch.Tensor] = None,  # noqa: UP045
        zero_tensors: bool = False,
    ) -> torch.Tensor:
        return _backward_27(calls, dict(locals()))

    return _flash_attn_varlen_forward, _flash_attn_varlen_backward


_BUILDERS = {
    "2.6.0": _release_260,
    "2.6.1": _release_261,
    "2.6.2": _release_262_263,
    "2.6.3": _release_262_263,
    "2.7.0": _release_270,
    "2.8.3": _release_283,
}


def release(version: str) -> types.SimpleNamespace:
    """The stand-in for `flash_attn.flash_attn_interface` of flash-attn `version`.

    Built once per process (custom ops register once); `calls` is emptied on every call.
    """
    calls = _CALLS[version]
    calls.clear()
    if version not in _CACHE:
        forward, backward = _BUILDERS[version](calls)
        _CACHE[version] = types.SimpleNamespace(
            __version__=version,
            _flash_attn_varlen_forward=forward,
            _flash_attn_varlen_backward=backward,
            calls=calls,
        )
    return _CACHE[version]
