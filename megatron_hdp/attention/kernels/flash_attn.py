"""flash-attn 2.6-2.8's varlen kernels (`flash_attn.flash_attn_interface`), when installed.

`_flash_attn_varlen_forward` / `_flash_attn_varlen_backward` are private and change between
releases. From 2.7 they are `torch.library.custom_op` objects (with torch >= 2.4), whose
`inspect.signature` is `(*args, **kwargs)`: their parameter names are read from the
registered op schema (or the wrapped function) instead. 2.6 takes the sliding window as one
`window_size` tuple, 2.7 and 2.8 as `window_size_left` / `window_size_right`; both forms are
supported; sliding-window (banded) steps pass them per call (`kernels.windowed`: one call
per window, merged by log-sum-exp). Everything is passed by keyword, every argument the
adapter depends on included
(2.6.0 and 2.6.1 declare `window_size`, `softcap`, `alibi_slopes`, `return_softmax` and, in
2.6.0, `block_table` without defaults), after `signature_problem()` has checked once, at
start-up, that every keyword exists.

The forward's result differs by release: 2.6.x returns the 8-tuple
`(out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)` (v2.6.3
`flash_attn_interface.py:115`), 2.7 and 2.8 `(out, softmax_lse, S_dmask, rng_state)` (v2.7.0
:189). The varlen log-sum-exp is float32 `[H, Tq]`, checked on every call; the backward
fills `dq`, `dk`, `dv` in place and is deterministic when
`torch.are_deterministic_algorithms_enabled()`.
"""

from __future__ import annotations

import importlib
import inspect

import torch

from megatron_hdp.attention.kernels.base import VarlenBlocks, check_lse
from megatron_hdp.attention.kernels.device import DeviceFacts, flash_limits
from megatron_hdp.attention.kernels.windowed import WindowCall, banded_backward, banded_forward

FORWARD_KEYWORDS = (
    "q",
    "k",
    "v",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "dropout_p",
    "softmax_scale",
    "causal",
    "softcap",
    "alibi_slopes",
    "return_softmax",
    "block_table",
)
BACKWARD_KEYWORDS = (
    "dout",
    "q",
    "k",
    "v",
    "out",
    "softmax_lse",
    "dq",
    "dk",
    "dv",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "dropout_p",
    "softmax_scale",
    "causal",
    "softcap",
    "alibi_slopes",
    "deterministic",
)
#: The window arguments: 2.7/2.8 spell them apart, 2.6 as one tuple.
WINDOW_SPLIT = ("window_size_left", "window_size_right")
WINDOW_TUPLE = ("window_size",)
#: Where the forward's result holds the log-sum-exp, by the result's length.
LSE_INDEX = {8: 5, 4: 1}  # 2.6.x: (out, q, k, v, out_padded, lse, ...); 2.7+: (out, lse, ...)


def _interface():
    try:
        return importlib.import_module("flash_attn.flash_attn_interface")
    except ImportError:
        return None


def parameter_names(function) -> tuple[str, ...]:
    """The parameter names of a flash-attn entry point, whatever wraps it.

    A `torch.library.custom_op` (flash-attn >= 2.7 with torch >= 2.4) has the op's schema and
    the wrapped function; a plain function (2.6, or an older torch) has its own signature.
    """
    overload = getattr(function, "_opoverload", None)
    if overload is not None:
        return tuple(a.name for a in overload._schema.arguments)
    wrapped = getattr(function, "_init_fn", function)
    return tuple(inspect.signature(wrapped).parameters)


def _window_keywords(names: tuple[str, ...]) -> tuple[str, ...] | None:
    for form in (WINDOW_SPLIT, WINDOW_TUPLE):
        if all(k in names for k in form):
            return form
    return None


def _window(names: tuple[str, ...], left: int = -1, right: int = -1) -> dict:
    """The window keywords in this release's spelling; (-1, -1) turns the window off."""
    if _window_keywords(names) == WINDOW_TUPLE:
        return {"window_size": (left, right)}
    return {"window_size_left": left, "window_size_right": right}


def _no_window(names: tuple[str, ...]) -> dict:
    """The keywords that turn the sliding window off, in this release's spelling."""
    return _window(names)


def forward_lse(result, q_THD):
    """The log-sum-exp in a forward result of any supported release, its shape checked."""
    index = LSE_INDEX.get(len(result))
    if index is None:
        raise RuntimeError(
            f"flash_attn's _flash_attn_varlen_forward returned {len(result)} values; "
            "2.6.x returns 8 and 2.7-2.8 return 4 (supported: 2.6-2.8)"
        )
    return check_lse(result[index], q_THD, "flash_attn's _flash_attn_varlen_forward")


def signature_problem(interface=None) -> str | None:
    """None if the installed flash-attn takes every keyword passed; otherwise what is wrong."""
    interface = interface or _interface()
    if interface is None:
        return "flash-attn is not installed (pip install flash-attn)"
    for name, keywords in (
        ("_flash_attn_varlen_forward", FORWARD_KEYWORDS),
        ("_flash_attn_varlen_backward", BACKWARD_KEYWORDS),
    ):
        function = getattr(interface, name, None)
        if function is None:
            return f"flash_attn.flash_attn_interface has no {name}"
        names = parameter_names(function)
        missing = [k for k in keywords if k not in names]
        if _window_keywords(names) is None:
            missing.append("window_size_left/window_size_right (2.7+) or window_size (2.6)")
        if missing:
            return f"flash_attn's {name} lacks arguments {missing} (supported: 2.6-2.8)"
    return None


class FlashAttnKernel:
    """flash-attn 2.x varlen: one call per ring step, native GQA."""

    name = "flash_attn"

    def unavailable_reason(self, facts: DeviceFacts, *, dtype, head_dim) -> str | None:
        """Needs CUDA (sm80+), 16-bit tensors, a head dim of 8k <= 256 and flash-attn 2.6-2.8.

        The private entry points take no padding of the head dim (the public
        `flash_attn_varlen_func` pads it), hence the multiple of 8.
        """
        return flash_limits(facts, dtype=dtype, head_dim=head_dim) or signature_problem()

    def activate(self) -> None:
        """Nothing to set up."""

    def window_reason(self) -> str | None:
        """None: banded steps pass flash-attn's window arguments (`kernels.windowed`)."""
        return None

    def forward(self, q_THD, k_TGD, v_TGD, blocks: VarlenBlocks, *, scale):
        """See `base.VarlenKernel.forward` (banded steps: `windowed.banded_forward`)."""
        if blocks.band is not None:
            return banded_forward(self._window_forward, q_THD, k_TGD, v_TGD, blocks, scale=scale)
        return _forward_call(q_THD, k_TGD, v_TGD, blocks, blocks.max_seqlen_k, blocks.causal, scale)

    def backward(self, dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_HT, blocks, *, scale):
        """See `base.VarlenKernel.backward` (deterministic in torch's deterministic mode)."""
        if blocks.band is not None:
            return banded_backward(
                self._window_backward,
                dout_THD,
                q_THD,
                k_TGD,
                v_TGD,
                out_THD,
                lse_HT,
                blocks,
                scale=scale,
            )
        check_lse(lse_HT, q_THD, "the log-sum-exp handed to flash_attn's backward")
        return _backward_call(
            (dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_HT),
            blocks,
            blocks.max_seqlen_k,
            blocks.causal,
            scale,
        )

    def _window_forward(self, q_THD, k_TGD, v_TGD, call: WindowCall, scale):
        """One windowed call of a banded step (`kernels.windowed`)."""
        window = (call.left, call.right)
        return _forward_call(
            q_THD, k_TGD, v_TGD, call.blocks, call.max_seqlen_k, False, scale, window
        )

    def _window_backward(self, dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_HT, call, scale):
        tensors = (dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_HT)
        window = (call.left, call.right)
        return _backward_call(tensors, call.blocks, call.max_seqlen_k, False, scale, window)


def _window_keywords_of(function, window) -> dict:
    """The release's window keywords: `window = (left, right)`, or None for no window."""
    names = parameter_names(function)
    return _no_window(names) if window is None else _window(names, *window)


def _varlen_keywords(function, blocks, max_seqlen_k, causal, scale, window) -> dict:
    """The keywords the varlen forward and backward share (no dropout, softcap or ALiBi)."""
    return {
        "cu_seqlens_q": blocks.cu_seqlens_q,
        "cu_seqlens_k": blocks.cu_seqlens_k,
        "max_seqlen_q": blocks.max_seqlen_q,
        "max_seqlen_k": max_seqlen_k,
        "dropout_p": 0.0,
        "softmax_scale": scale,
        "causal": causal,
        "softcap": 0.0,
        "alibi_slopes": None,
        **_window_keywords_of(function, window),
    }


def _forward_call(q_THD, k_TGD, v_TGD, blocks, max_seqlen_k, causal, scale, window=None):
    """`(out, lse)` of one `_flash_attn_varlen_forward` call (window: `(left, right)`)."""
    function = _interface()._flash_attn_varlen_forward
    result = function(
        q=q_THD,
        k=k_TGD,
        v=v_TGD,
        **_varlen_keywords(function, blocks, max_seqlen_k, causal, scale, window),
        return_softmax=False,
        block_table=None,
    )
    return result[0], forward_lse(result, q_THD)


def _backward_call(tensors, blocks, max_seqlen_k, causal, scale, window=None):
    """`(dq, dk, dv)` of one `_flash_attn_varlen_backward` call.

    Deterministic in torch's deterministic mode; `tensors` = `(dout, q, k, v, out, lse)`.
    """
    dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_HT = tensors
    function = _interface()._flash_attn_varlen_backward
    dq, dk, dv = torch.empty_like(q_THD), torch.empty_like(k_TGD), torch.empty_like(v_TGD)
    function(
        dout=dout_THD.contiguous(),
        q=q_THD,
        k=k_TGD,
        v=v_TGD,
        out=out_THD.contiguous(),
        softmax_lse=lse_HT.to(torch.float32).contiguous(),
        dq=dq,
        dk=dk,
        dv=dv,
        **_varlen_keywords(function, blocks, max_seqlen_k, causal, scale, window),
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )
    return dq, dk, dv
