"""One norm class for every layer and the final norm, whatever Megatron finds installed."""

import megatron.core.models.backends as backends
import megatron.core.models.gpt.gpt_layer_specs as gpt_layer_specs
import megatron.core.transformer.transformer_block as transformer_block
import pytest
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_hdp.megatron import model
from megatron_hdp.megatron.model import GPTConfig, SequenceParallelNorm, hdp_block_spec
from tests.megatron.test_moe import CFG as MOE_CFG


class FakeApexNorm:
    """Stands for Apex's `FusedLayerNorm`, which Megatron's local layer spec picks with Apex."""


class FakeTENorm:
    """Stands for TE's `TENorm`, which Megatron's `LayerNormImpl` is with Transformer Engine."""


@pytest.fixture
def te_and_apex_installed(monkeypatch):
    """Megatron's module-level choices as they are with both TE and Apex installed."""
    monkeypatch.setattr(backends, "LNImpl", FakeApexNorm)
    monkeypatch.setattr(gpt_layer_specs, "LNImpl", FakeApexNorm)
    monkeypatch.setattr(transformer_block, "LayerNormImpl", FakeTENorm)
    monkeypatch.setattr(model, "LayerNormImpl", FakeTENorm, raising=False)


@pytest.mark.parametrize(
    "cfg, norm",
    [
        (GPTConfig(normalization="LayerNorm"), WrappedTorchNorm),
        (GPTConfig(normalization="RMSNorm"), WrappedTorchNorm),
        (MOE_CFG, WrappedTorchNorm),
        (GPTConfig(tensor_model_parallel_size=2, sequence_parallel=True), SequenceParallelNorm),
    ],
)
def test_the_final_norm_is_the_layers_norm_with_te_and_apex_installed(
    te_and_apex_installed, cfg, norm
):
    block = hdp_block_spec(cfg)
    layer = block.layer_specs[0].submodules
    assert block.layer_norm is norm
    assert layer.input_layernorm is norm and layer.pre_mlp_layernorm is norm
