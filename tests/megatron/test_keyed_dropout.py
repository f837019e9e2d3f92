"""Megatron's hidden dropout sites, keyed: the arithmetic of Megatron's bias-dropout-add."""

import pytest
import torch
from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_unfused

from megatron_hdp.attention.dropout import ATTENTION_OUTPUT, MicroBatchKeys, hidden_keep
from megatron_hdp.megatron import dropout
from megatron_hdp.megatron.model import GPTConfig, build_gpt
from tests.dist import run_ranks


class Config:
    tensor_model_parallel_size = 1
    sequence_parallel = False


@pytest.fixture
def keys():
    docs = torch.tensor([3, 3, 3, 8, 8])
    keys = MicroBatchKeys(7, 2, (3, 8), docs, torch.tensor([0, 1, 2, 0, 1]))
    dropout.set_current(keys)
    yield keys
    dropout.set_current(None)


def test_bias_dropout_add_is_megatrons_with_a_keyed_mask(keys):
    gen = torch.Generator().manual_seed(0)
    x, bias, residual = (torch.randn(s, generator=gen) for s in ((5, 1, 16), (16,), (5, 1, 16)))
    bda = dropout.KeyedBiasDropoutAdd(4, ATTENTION_OUTPUT, Config())
    got = bda(True, True)((x, bias), residual, 0.25)
    keep = hidden_keep(
        keys.hidden_base(4, ATTENTION_OUTPUT), keys.token_docs, keys.token_positions, 16, 0.25
    )
    want = residual + (x + bias) * keep.unsqueeze(1) / 0.75
    torch.testing.assert_close(got, want)
    assert 0 < (~keep).sum() < keep.numel()
    # Eval, or p = 0: Megatron's own function.
    for training, p in ((False, 0.25), (True, 0.0)):
        stock = bias_dropout_add_unfused(training)((x, bias), residual, p)
        torch.testing.assert_close(bda(training, False)((x, bias), residual, p), stock)


def test_without_keys_the_dropout_refuses_to_guess():
    dropout.set_current(None)
    bda = dropout.KeyedBiasDropoutAdd(1, ATTENTION_OUTPUT, Config())
    x = torch.ones(2, 1, 4)
    with pytest.raises(RuntimeError, match="dropout keys"):
        bda(True, False)((x, None), x, 0.1)


def _body_sites(rank, world_size):
    from megatron_hdp.distributed.layout import ParallelDims
    from megatron_hdp.megatron.cpu_shim import cpu_shims

    cfg = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=32)
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            plain = build_gpt(cfg)
            model = build_gpt(GPTConfig(**{**cfg.__dict__, "hidden_dropout": 0.1}))
        finally:
            layout.destroy()
    assert isinstance(plain.embedding.embedding_dropout, torch.nn.Dropout)
    assert isinstance(model.embedding.embedding_dropout, dropout.KeyedEmbeddingDropout)
    for layer in model.decoder.layers:
        assert isinstance(layer.self_attn_bda, dropout.KeyedBiasDropoutAdd)
        assert isinstance(layer.mlp_bda, dropout.KeyedBiasDropoutAdd)
    return [layer.self_attn_bda.layer_number for layer in model.decoder.layers]


def test_the_model_builder_keys_every_hidden_dropout_site():
    assert run_ranks(_body_sites, 1) == [[1, 2]]
