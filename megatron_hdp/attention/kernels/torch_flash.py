"""PyTorch's own CUDA flash-attention varlen kernels (no extra package), and FA3/FA4 through them.

`aten::_flash_attention_forward` / `_flash_attention_backward` are private ops. Their leading
positional arguments have kept their order and types across releases while names changed
(the backward's `philox_seed, philox_offset` became `rng_state, unused`) and keyword-only
arguments were appended, so the adapter passes the positional core by position and only
`scale` by keyword. `schema_problem()` checks exactly that against this torch's registered
schemas (the ops are registered in CPU builds too, so the check runs everywhere; the kernels
need CUDA). Tensors are `[T, heads, D]` with native GQA; the log-sum-exp is float32 `[H, Tq]`.

Where this torch offers another flash implementation behind the same ops
(`torch.nn.attention.activate_flash_attention_impl("FA3" | "FA4")`: FA3 from the
`flash_attn_interface` module of flash-attention's hopper build, FA4 from the `flash-attn-4`
package's `flash_attn.cute.interface`), the `torch_flash_fa3` / `torch_flash_fa4` kernels
activate it once, process-wide, and then call the same ops.

Sliding-window (banded) steps pass the ops' `window_size_left` / `window_size_right`
(flash-attn 2's meaning) per call (`kernels.windowed`); only the built-in kernels take them.
"""

from __future__ import annotations

import importlib
import logging

import torch

from megatron_hdp.attention.kernels.base import VarlenBlocks, check_lse
from megatron_hdp.attention.kernels.device import DeviceFacts, fa4_limits, flash_limits
from megatron_hdp.attention.kernels.windowed import WindowCall, banded_backward, banded_forward

logger = logging.getLogger(__name__)

# Leading positional arguments: (what the adapter passes there, the accepted schema types).
_TENSOR, _OPT_TENSOR, _INT, _FLOAT, _BOOL = (
    ("Tensor",),
    ("Tensor", "Optional[Tensor]"),
    ("int", "SymInt"),
    ("float",),
    ("bool",),
)
FORWARD_POSITIONAL = (
    ("query", _TENSOR),
    ("key", _TENSOR),
    ("value", _TENSOR),
    ("cum_seq_q", _OPT_TENSOR),
    ("cum_seq_k", _OPT_TENSOR),
    ("max_q", _INT),
    ("max_k", _INT),
    ("dropout_p", _FLOAT),
    ("is_causal", _BOOL),
    ("return_debug_mask", _BOOL),
)
BACKWARD_POSITIONAL = (
    ("grad_out", _TENSOR),
    ("query", _TENSOR),
    ("key", _TENSOR),
    ("value", _TENSOR),
    ("out", _TENSOR),
    ("logsumexp", _TENSOR),
    ("cum_seq_q", _TENSOR),
    ("cum_seq_k", _TENSOR),
    ("max_q", _INT),
    ("max_k", _INT),
    ("dropout_p", _FLOAT),
    ("is_causal", _BOOL),
    ("rng_state (philox_seed in older torch)", _TENSOR),
    ("unused (philox_offset in older torch)", _TENSOR),
)


def _schema(op_name: str):
    op = getattr(torch.ops.aten, op_name, None)
    return None if op is None else op.default._schema


def schema_problem(schemas: dict | None = None) -> str | None:
    """None if both aten ops take the adapter's arguments; otherwise what differs.

    `schemas` maps op name to a `torch.FunctionSchema` (tests pass older releases' schemas,
    parsed with `torch._C.parse_schema`); default: this torch's registered ones.
    """
    for op_name, positional in (
        ("_flash_attention_forward", FORWARD_POSITIONAL),
        ("_flash_attention_backward", BACKWARD_POSITIONAL),
    ):
        schema = (schemas or {}).get(op_name) if schemas is not None else _schema(op_name)
        if schema is None:
            return f"this torch {torch.__version__} has no aten::{op_name}"
        leading = [a for a in schema.arguments if not a.kwarg_only]
        if len(leading) < len(positional):
            return (
                f"aten::{op_name} takes {len(leading)} positional arguments, "
                f"expected {len(positional)}"
            )
        for index, ((what, types), arg) in enumerate(zip(positional, leading)):
            if str(arg.type) not in types:
                return (
                    f"aten::{op_name}'s argument {index} ({arg.name}: {arg.type}) is not "
                    f"{what}: {' or '.join(types)}"
                )
        if not any(a.name == "scale" and a.kwarg_only for a in schema.arguments):
            return f"aten::{op_name} has no keyword argument 'scale'"
    return None


#: Where each alternative implementation's kernels come from (the module torch imports).
IMPL_MODULES = {"FA3": "flash_attn_interface", "FA4": "flash_attn.cute.interface"}
#: Compute capabilities (major) each implementation supports (torch's `_fa3.py`, `_fa4.py`).
IMPL_MAJORS = {"FA3": (9,), "FA4": (9, 10)}


def impl_problem(impl: str) -> str | None:
    """None if this torch can activate flash implementation `impl` ("FA3", "FA4") here."""
    attention = torch.nn.attention
    if not hasattr(attention, "activate_flash_attention_impl"):
        return f"this torch {torch.__version__} cannot switch flash implementations"
    if impl not in attention.list_flash_attention_impls():
        return f"this torch {torch.__version__} does not list {impl}"
    try:
        importlib.import_module(IMPL_MODULES[impl])
    except ImportError as err:
        package = "flash-attn-4" if impl == "FA4" else "flash-attention's hopper build"
        return f"{IMPL_MODULES[impl]} does not import ({err}); install {package}"
    return None


class TorchFlashKernel:
    """`aten::_flash_attention_{forward,backward}`: one varlen call per ring step.

    Args:
        impl: None for torch's built-in kernels (FlashAttention-2), "FA3" or "FA4" to run
            that implementation behind the same ops.
    """

    def __init__(self, impl: str | None = None) -> None:
        self.impl = impl
        self.name = "torch_flash" if impl is None else f"torch_flash_{impl.lower()}"

    def unavailable_reason(self, facts: DeviceFacts, *, dtype, head_dim) -> str | None:
        """Needs CUDA (sm80+), 16-bit tensors, a head dim of 8k <= 256 and matching schemas.

        FA3 needs Hopper; FA4 Hopper or Blackwell, with Blackwell's head dims (`fa4_limits`).
        Deterministic mode is honoured by the aten ops themselves.
        """
        if self.impl is None:
            problem = flash_limits(facts, dtype=dtype, head_dim=head_dim)
            if problem is None and not facts.flash_built:
                problem = f"this torch {torch.__version__} was built without flash attention"
        elif self.impl == "FA4":
            problem = fa4_limits(facts, dtype=dtype, head_dim=head_dim)
            problem = problem or impl_problem(self.impl)
        else:
            problem = flash_limits(
                facts, dtype=dtype, head_dim=head_dim, capability_majors=IMPL_MAJORS[self.impl]
            )
            problem = problem or impl_problem(self.impl)
        return problem or schema_problem()

    def activate(self) -> None:
        """Route the aten flash ops to FA3/FA4 (process-wide); nothing for the built-in one."""
        if self.impl is not None:
            current = torch.nn.attention.current_flash_attention_impl()
            if current != self.impl:
                torch.nn.attention.activate_flash_attention_impl(self.impl)
                logger.info("aten flash-attention ops now run %s", self.impl)

    def window_reason(self) -> str | None:
        """None where banded steps can pass the ops' window arguments (`kernels.windowed`).

        The built-in kernels (FlashAttention-2) take `window_size_left` / `window_size_right`
        with flash-attn 2's meaning; FA3 and FA4 behind the same ops are not verified with
        them, so a window is refused there.
        """
        if self.impl is not None:
            return f"{self.name}'s window arguments are unverified; use torch_flash or flash_attn"
        return window_schema_problem()

    def forward(self, q_THD, k_TGD, v_TGD, blocks: VarlenBlocks, *, scale):
        """See `base.VarlenKernel.forward` (banded steps: `windowed.banded_forward`)."""
        if blocks.band is not None:
            return banded_forward(_window_forward, q_THD, k_TGD, v_TGD, blocks, scale=scale)
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q_THD,
            k_TGD,
            v_TGD,
            blocks.cu_seqlens_q,
            blocks.cu_seqlens_k,
            blocks.max_seqlen_q,
            blocks.max_seqlen_k,
            0.0,
            blocks.causal,
            False,
            scale=scale,
        )
        return out, check_lse(lse, q_THD, "aten::_flash_attention_forward")

    def backward(self, dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_HT, blocks, *, scale):
        """See `base.VarlenKernel.backward` (no dropout: the RNG state is never read)."""
        if blocks.band is not None:
            return banded_backward(
                _window_backward,
                dout_THD,
                q_THD,
                k_TGD,
                v_TGD,
                out_THD,
                lse_HT,
                blocks,
                scale=scale,
            )
        # What torch's own varlen attention passes without dropout (torch/nn/attention/varlen.py).
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q_THD.device)
        unused = torch.empty(0, device=q_THD.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout_THD.contiguous(),
            q_THD,
            k_TGD,
            v_TGD,
            out_THD.contiguous(),
            lse_HT.to(torch.float32).contiguous(),
            blocks.cu_seqlens_q,
            blocks.cu_seqlens_k,
            blocks.max_seqlen_q,
            blocks.max_seqlen_k,
            0.0,
            blocks.causal,
            rng_state,
            unused,
            scale=scale,
        )
        return dq, dk, dv


#: The ops' keyword-only window arguments (torch >= 2.6; flash-attn 2's meaning).
WINDOW_KEYWORDS = ("window_size_left", "window_size_right")


def window_schema_problem(schemas: dict | None = None) -> str | None:
    """None if both aten ops take the window keywords; otherwise which lacks them."""
    for op_name in ("_flash_attention_forward", "_flash_attention_backward"):
        schema = (schemas or {}).get(op_name) if schemas is not None else _schema(op_name)
        if schema is None:
            return f"this torch {torch.__version__} has no aten::{op_name}"
        names = {a.name for a in schema.arguments if a.kwarg_only}
        if not all(k in names for k in WINDOW_KEYWORDS):
            return f"this torch {torch.__version__}'s aten::{op_name} takes no window arguments"
    return None


def _window_forward(q_THD, k_TGD, v_TGD, call: WindowCall, scale):
    """One windowed call of a banded step (`kernels.windowed`)."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q_THD,
        k_TGD,
        v_TGD,
        call.blocks.cu_seqlens_q,
        call.blocks.cu_seqlens_k,
        call.blocks.max_seqlen_q,
        call.max_seqlen_k,
        0.0,
        False,
        False,
        scale=scale,
        window_size_left=call.left,
        window_size_right=call.right,
    )
    return out, check_lse(lse, q_THD, "aten::_flash_attention_forward")


def _window_backward(dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_HT, call: WindowCall, scale):
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q_THD.device)
    unused = torch.empty(0, device=q_THD.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout_THD.contiguous(),
        q_THD,
        k_TGD,
        v_TGD,
        out_THD.contiguous(),
        lse_HT.to(torch.float32).contiguous(),
        call.blocks.cu_seqlens_q,
        call.blocks.cu_seqlens_k,
        call.blocks.max_seqlen_q,
        call.max_seqlen_k,
        0.0,
        False,
        rng_state,
        unused,
        scale=scale,
        window_size_left=call.left,
        window_size_right=call.right,
    )
    return dq, dk, dv
