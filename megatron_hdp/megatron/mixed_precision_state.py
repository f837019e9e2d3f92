"""The checkpoint state of Megatron's mixed-precision optimizer with float32 norms (host layer).

HDP's model keeps its norms' weights in float32 under `--bf16` and `--fp16` (`model.py`,
`hdp_norm`); Megatron-LM's `Float16Module` casts every parameter to 16 bits. Megatron-Core's
non-distributed mixed-precision optimizer (`Float16OptimizerWithFloat16Params`, 0.16 to
0.19) builds its `sharded_state_dict` for the all-16-bit case only: it numbers the 16-bit
parameters alone (`float16_groups`) while torch's Adam state numbers every parameter of its
groups, the float32 ones (`fp32_from_fp32_groups`) in between, so the save stops with "Param
id N does not match any model sharded param" (or, were the ids to fall in range, would file
Adam moments under another parameter's key).

`map_float32_params` gives such an optimizer a `sharded_state_dict` that numbers the
parameters as torch does, so every Adam moment goes under its own model parameter's key, and
files each float32 parameter also as its own main parameter (`optimizer.state.fp32_param.*`,
the entry Megatron-LM writes for every parameter): the checkpoint holds the keys a
Megatron-LM run of the same model writes and reads. Its `load_state_dict` copies those
main parameters back into the float32 parameters (the same values for HDP's checkpoints;
Megatron-LM's float32 main weights rather than their 16-bit model copies for its
checkpoints). The distributed optimizer maps its parameters by buffer and needs none of this.
"""

from __future__ import annotations

import types
from itertools import chain

from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

#: The optimizer state-dict entry of the float32 parameters' main copies (ours: Megatron's
#: `load_state_dict` ignores it).
FP32_FROM_FP32 = "fp32_from_fp32_params"

_FP32_PARAM_PREFIX = "optimizer.state.fp32_param"


def map_float32_params(optimizer) -> None:
    """Fix the checkpoint methods of `optimizer`'s mixed-precision members with float32 params.

    Each such member gets this module's `sharded_state_dict` / `load_state_dict`
    (idempotent; local, no collective).

    `optimizer` is Megatron's optimizer as built (a `ChainedOptimizer` calls its members'
    methods, so the instances' methods are the ones replaced). Optimizers without float32
    parameters, and the distributed optimizer, are left as they are.
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(inner, Float16OptimizerWithFloat16Params):
            continue
        if getattr(inner, "is_stub_optimizer", False) or not any(inner.fp32_from_fp32_groups):
            continue
        inner.sharded_state_dict = types.MethodType(_sharded_state_dict, inner)
        inner.load_state_dict = types.MethodType(_load_state_dict, inner)


def _model_params_in_torch_order(optimizer) -> list:
    """The model parameter of each entry of torch's param groups, in torch's numbering.

    A 16-bit parameter's entry is its float32 main copy; a float32 parameter is its own.
    """
    model_of = {
        id(main): param
        for params, mains in zip(
            optimizer.float16_groups, optimizer.fp32_from_float16_groups, strict=True
        )
        for param, main in zip(params, mains, strict=True)
    }
    entries = chain.from_iterable(g["params"] for g in optimizer.optimizer.param_groups)
    return [model_of.get(id(p), p) for p in entries]


def _sharded_state_dict(self, model_sharded_state_dict, is_loading=False, metadata=None):
    """Megatron-Core's `Float16OptimizerWithFloat16Params.sharded_state_dict`, fixed.

    The parameters numbered as torch's Adam numbers them, float32 ones included, and a main
    weight entry for every parameter (see the module docstring). Local, no collective.
    """
    if is_loading:
        self.init_state_fn(self.optimizer, self.config)
    state_dict = self.state_dict()
    model_params = _model_params_in_torch_order(self)
    id_to_sharded = get_param_id_to_sharded_param_map(model_sharded_state_dict, model_params)
    missing = [i for i in range(len(model_params)) if i not in id_to_sharded]
    if missing:
        raise ValueError(
            f"optimizer parameters {missing} are not in the model's sharded state dict"
        )
    index = {id(p): i for i, p in enumerate(model_params)}

    def main_entries(groups):
        # by group index, empty groups left out: `dist_checkpointing` cannot load an empty
        # list inside a list (its split into sharded and common parts drops the positions)
        return {
            i: [
                make_sharded_optimizer_tensor(
                    id_to_sharded[index[id(param)]], main, prefix=_FP32_PARAM_PREFIX
                )
                for param, main in zip(params, mains, strict=True)
            ]
            for i, (params, mains) in enumerate(groups)
            if params
        }

    state_dict["fp32_from_fp16_params"] = main_entries(
        zip(self.float16_groups, self.fp32_from_float16_groups, strict=True)
    )
    state_dict[FP32_FROM_FP32] = main_entries(
        zip(self.fp32_from_fp32_groups, self.fp32_from_fp32_groups, strict=True)
    )
    step = self._extract_common_per_param_step(state_dict["optimizer"])
    # Adam's step is one per optimizer, saved apart (as Megatron-Core does)
    optim_state_to_sharding_state(state_dict["optimizer"], id_to_sharded, exclude_keys="step")
    if step:
        state_dict["optimizer"]["state"]["common_step"] = step
    return state_dict


def _load_state_dict(self, state_dict):
    """Megatron-Core's load, then the float32 parameters from their saved main copies.

    Local, no collective.
    """
    mains = _as_groups(state_dict.pop(FP32_FROM_FP32, None), self.fp32_from_fp32_groups)
    key = "fp32_from_fp16_params"
    state_dict[key] = _as_groups(state_dict[key], self.fp32_from_float16_groups)
    Float16OptimizerWithFloat16Params.load_state_dict(self, state_dict)
    if mains is None:
        return
    for params, saved in zip(self.fp32_from_fp32_groups, mains, strict=True):
        for param, value in zip(params, saved, strict=True):
            param.data.copy_(value.data)


def _as_groups(saved, groups: list):
    """Saved main parameters as a list of one entry per group of `groups`.

    `saved` is by group index (this module's) or already a list (Megatron's own, kept);
    None stays None.
    """
    if not isinstance(saved, dict):
        return saved
    return [saved.get(i, []) for i in range(len(groups))]
