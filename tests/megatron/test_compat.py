"""megatron/compat.py against the installed megatron-core's real layer specs (0.16: ModuleSpec;
0.17+: functools.partial), and the spec HDP builds from them."""

import dataclasses
import functools

import pytest
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_hdp.megatron import compat
from megatron_hdp.megatron.model import hdp_layer_spec
from megatron_hdp.megatron.moe import GlobalIndexSequentialMLP, SequenceAuxLossRouter
from tests.megatron.test_moe import CFG as MOE_CFG


def test_megatrons_moe_spec_is_read_whatever_its_form():
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    mlp = spec.submodules.mlp
    assert compat.module_of(mlp) is MoELayer
    moe = compat.submodules_of(mlp)
    assert moe.router is TopKRouter
    assert compat.submodules_of(moe.experts) is not None  # the experts' linear layers


def test_hdp_layer_spec_swaps_router_and_experts_and_keeps_their_submodules():
    megatron_spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    megatron_moe = compat.submodules_of(megatron_spec.submodules.mlp)
    megatron_experts = compat.submodules_of(megatron_moe.experts)
    moe = compat.submodules_of(hdp_layer_spec(MOE_CFG).submodules.mlp)
    assert moe.router is SequenceAuxLossRouter
    assert compat.module_of(moe.experts) is GlobalIndexSequentialMLP
    assert compat.submodules_of(moe.experts) == megatron_experts


@pytest.mark.parametrize("form", ["module_spec", "partial"])
def test_with_module_keeps_the_arguments_in_the_same_form(form):
    @dataclasses.dataclass
    class Sub:
        size: int

    class A:
        pass

    class B:
        pass

    if form == "module_spec":
        builder = ModuleSpec(module=A, params={"p": 1}, submodules=Sub(3))
    else:
        builder = functools.partial(A, 7, submodules=Sub(3), p=1)
    swapped = compat.with_module(builder, B)
    assert type(swapped) is type(builder)
    assert compat.module_of(swapped) is B and compat.submodules_of(swapped) == Sub(3)
    if form == "module_spec":
        assert swapped is builder and swapped.params == {"p": 1}
    else:
        assert swapped.args == (7,) and swapped.keywords == {"submodules": Sub(3), "p": 1}
        assert builder.func is A  # a partial is not changed in place


def test_module_names_are_passed_only_when_megatron_gave_one():
    assert compat.name_kwargs(None) == {}
    assert compat.name_kwargs("decoder.layers.0.mlp.experts") == {
        "name": "decoder.layers.0.mlp.experts"
    }
