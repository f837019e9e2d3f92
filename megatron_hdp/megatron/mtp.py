"""Multi-token prediction (`--mtp-num-layers`) on HDP micro-batches (host layer).

Megatron-Core's MTP block (`MultiTokenPredictionBlock`) runs as it is, with HDP attention
in its transformer layers. What it cannot do on HDP micro-batches is its shift: at depth
`k` it rolls the input ids and position ids (in each MTP layer) and the labels and loss
mask (in the loss) one place to the left per depth with `roll_tensor`, which for packed
(THD) batches rolls within each local piece and, with context parallelism, exchanges the
boundary with Megatron's fixed CP neighbours. An HDP rank holds two zigzag chunks of a
ring's documents, so the values after a chunk's end are on another rank of *its* ring.

HDP reads those few values with the batch instead (`data.mtp_targets`): every local token's
next `D` tokens, labels, mask values and positions travel with the micro-batch
(`LocalBatch.shifted`), and `install_shift()` makes Megatron-Core's `roll_tensor` take them
from there (`MTPShift.roll`) whenever the micro-batch's `packed_seq_params` carries them.
No MTP communication; everything else (the MTP layers, the output layer, the loss) is
Megatron-Core's.

Loss normalisation. HDP trains with `calculate_per_token_loss`; Megatron-Core attaches
`mtp_loss_scaling_factor / D` times each depth's masked token losses to the main loss's
graph (`MTPLossAutoScaler`), back-propagated with the main loss's scale, and the gradients
are then divided by the global number of (main) loss tokens. Megatron-Core 0.16 stops
there: depth `k` contributes `factor / D * sum_k / N`. From 0.17 on (0.19 here) it also
multiplies each micro-batch's depth-`k` loss by its `original / rolled` token counts, so
that depth `k` is a mean over its own tokens; per micro-batch that would depend on how
documents are packed, so HDP uses the global counts: `factor / D * sum_k / N_k`, which is
what Megatron-Core computes for a batch of one micro-batch. There HDP's depth-`k` loss
mask carries the factor `N / N_k` and the roll reports `original` as the rolled count, so
Megatron-Core's own ratio is 1 (`MTPShift`); the model is called without a loss mask
(`original` is then the micro-batch's token count, never 0).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from dataclasses import dataclass, field

import torch
from megatron.core.models.gpt import gpt_model as _gpt_model
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer import multi_token_prediction as _mtp
from megatron.core.transformer.multi_token_prediction import (
    MTPLossAutoScaler,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_hdp.data.mtp_targets import ShiftedTargets

logger = logging.getLogger(__name__)

#: The order in which Megatron-Core (0.16 and 0.19) first rolls each stream of a micro-batch:
#: the first MTP layer rolls the input ids, then the position ids; the loss rolls the labels,
#: then the loss mask. Later rolls take the previous roll's output (tracked by identity).
_STREAMS = ("tokens", "position_ids", "labels", "loss_mask")


@dataclass(eq=False)
class MTPShift:
    """One micro-batch's shifted values, handed to Megatron-Core's rolls (`roll`).

    Attributes:
        targets: The micro-batch's `ShiftedTargets` on its device, padded like its tokens.
        mask_scale: Per depth `k`, the factor of its loss mask: `N / N_k` (global loss
            tokens of the step over its global depth-`k` loss tokens) where Megatron-Core
            rescales by rolled counts (`rescales_by_rolled_count`), else none (1.0).
    """

    targets: ShiftedTargets
    mask_scale: tuple[float, ...] = ()
    _outputs: dict = field(default_factory=dict, repr=False)
    _roots: list = field(default_factory=list, repr=False)

    def roll(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`tensor` rolled one more place within its documents, and the roll's sum.

        The sum is what Megatron-Core reads from the roll (for the loss mask, a token count).
        A tensor this object returned is rolled one depth further; any other is the start
        of the next stream in `_STREAMS` order. Raises RuntimeError on a fifth stream or a
        roll past depth `D` (a Megatron-Core release that rolls otherwise than 0.16/0.19).
        """
        known = self._outputs.get(id(tensor))
        if known is not None and known[2] is tensor:
            stream, depth, _ = known
        else:
            if len(self._roots) == len(_STREAMS):
                raise RuntimeError(
                    "Megatron-Core rolled a fifth tensor for multi-token prediction; HDP "
                    f"expects only {_STREAMS} (megatron_hdp.megatron.mtp)"
                )
            stream, depth = _STREAMS[len(self._roots)], 0
            self._roots.append(tensor)  # kept alive: ids stay unique
        if tensor.shape[-1] != self.targets.tokens.shape[-1]:
            raise RuntimeError(
                f"Megatron-Core rolled a {stream} tensor of {tensor.shape[-1]} tokens for a "
                f"micro-batch of {self.targets.tokens.shape[-1]}"
            )
        if depth >= self.targets.depth:
            raise RuntimeError(f"{stream} rolled past the MTP depth {self.targets.depth}")
        out = getattr(self.targets, stream)[depth : depth + 1]
        if stream == "loss_mask":
            if self.mask_scale:
                out = out * self.mask_scale[depth]
        else:
            out = out.to(tensor.dtype)
        out = out.reshape(tensor.shape)
        self._outputs[id(out)] = (stream, depth + 1, out)
        if stream == "loss_mask" and rescales_by_rolled_count():
            # Megatron-Core scales the depth's loss by original / this count, with original
            # the sum of the mask it was given: reporting original makes that 1.
            return out, self._roots[3].sum().to(out.dtype)
        return out, out.sum()


def hdp_roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
    """Megatron-Core's `roll_tensor`, with HDP's shifted values where the micro-batch has them.

    They come from its `packed_seq_params.mtp`; without them it is Megatron-Core's own roll.
    """
    shift = getattr(packed_seq_params, "mtp", None)
    if shift is None or tensor is None:
        return _ORIGINAL_ROLL(
            tensor, shifts=shifts, dims=dims, cp_group=cp_group, packed_seq_params=packed_seq_params
        )
    if shifts != -1 or dims not in (-1, tensor.dim() - 1):
        raise RuntimeError(f"HDP's MTP roll shifts by -1 along the tokens, not {shifts} on {dims}")
    return shift.roll(tensor)


_ORIGINAL_ROLL = _mtp.roll_tensor


@functools.cache
def rescales_by_rolled_count() -> bool:
    """Whether the installed Megatron-Core rescales MTP losses by rolled token counts.

    Under `calculate_per_token_loss` 0.19 multiplies each micro-batch's depth-`k` loss by its
    original over its rolled token count; 0.16 does not. Read from its source where it is
    installed with one (the change came with 0.17), else from its version.
    """
    process = getattr(_mtp, "process_mtp_loss", None)
    if process is None:
        return False
    try:
        return "original_num_tokens" in inspect.getsource(process)
    except (OSError, TypeError):  # no source files installed
        from megatron.core.package_info import __version__

        return tuple(int(p) for p in __version__.split(".")[:2]) >= (0, 17)


def install_shift() -> None:
    """Make Megatron-Core's MTP rolls use HDP's shifted values (idempotent, this process).

    Replaces `roll_tensor` in the two Megatron-Core modules that call it (the MTP layers' and,
    in 0.16, `GPTModel`'s loss); micro-batches without HDP's values roll as before.
    """
    for module in (_mtp, _gpt_model):
        if getattr(module, "roll_tensor", None) is _ORIGINAL_ROLL:
            module.roll_tensor = hdp_roll_tensor


def set_backward_scale(scale: float | torch.Tensor) -> None:
    """Set the scale the MTP losses are back-propagated with.

    The main loss's, as Megatron's schedules set it with `calculate_per_token_loss`.
    """
    MTPLossAutoScaler.set_loss_scale(torch.as_tensor(scale, dtype=torch.float32))


def mtp_block_spec(layer_spec: ModuleSpec, norm: type, depth: int, linear: type | None = None):
    """The MTP block of `depth` layers around `layer_spec` (HDP attention).

    As Megatron-Core's `get_gpt_mtp_block_spec` builds it, with `norm` for its three norms and
    `linear` (default the local `ColumnParallelLinear`) for its projection.
    """
    fields = {f.name for f in dataclasses.fields(MultiTokenPredictionLayerSubmodules)}
    # The layer's field is `transformer_layer` in 0.16 and `mtp_model_layer` in 0.19.
    inner = "mtp_model_layer" if "mtp_model_layer" in fields else "transformer_layer"
    layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm,
            hnorm=norm,
            eh_proj=linear or ColumnParallelLinear,
            layer_norm=norm,
            **{inner: layer_spec},
        ),
    )
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * depth)
