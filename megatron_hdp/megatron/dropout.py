"""Megatron's hidden dropout, keyed by token identity (host layer).

Megatron-Core applies `--hidden-dropout` in three places of a GPT: after the embedding
(`LanguageModelEmbedding.embedding_dropout`, a `torch.nn.Dropout`) and in every layer's
two bias-dropout-adds (`TransformerLayer.self_attn_bda` / `mlp_bda`), all drawing from the
torch / CUDA RNG stream of the rank that runs them. `install_keyed_dropout` replaces the
three by keyed dropout (`attention.dropout.hidden_keep`): the mask of a value depends on
(seed, iteration, global layer, site, document, position, hidden index) only, so any HDP
placement, TP / SP split or pipeline layout gives the single-process masks. Probabilities,
scaling, the training/eval switch and the bias-add / residual-add arithmetic stay
Megatron's (the stock unfused bias-dropout-add runs after the keyed mask, with probability
0).

The tokens' keys (`MicroBatchKeys`) travel in the micro-batch's `HDPPackedSeqParams`. The
bias-dropout-adds do not see those, so the keys of the micro-batch being computed are held
here (`set_current`): set by a forward pre-hook on the `GPTModel` (before the embedding)
and again by `HDPCoreAttention` on every forward, so that a layer recomputed in the backward
pass (activation recomputation, 1F1B) drops with its own micro-batch's keys.
"""

from __future__ import annotations

import torch
from megatron.core.fusions.fused_bias_dropout import _bias_dropout_add_func
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_hdp.attention.dropout import (
    ATTENTION_OUTPUT,
    EMBEDDING,
    MLP_OUTPUT,
    MicroBatchKeys,
    hidden_keep,
    keyed_dropout,
)

_CURRENT: list[MicroBatchKeys | None] = [None]


def set_current(keys: MicroBatchKeys | None) -> None:
    """The keys of the micro-batch whose layers run next on this process."""
    _CURRENT[0] = keys


def current_keys() -> MicroBatchKeys:
    """The keys `set_current` holds; RuntimeError if none (the model ran without them)."""
    keys = _CURRENT[0]
    if keys is None:
        raise RuntimeError(
            "keyed hidden dropout needs the micro-batch's dropout keys (HDPPackedSeqParams."
            "dropout, built by step.packed_seq_params when the model has dropout)"
        )
    return keys


def tensor_parallel_rank(config) -> int:
    """This rank's TP rank (0 without tensor parallelism)."""
    if config.tensor_model_parallel_size == 1:
        return 0
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


def _drop_hidden(x: torch.Tensor, p: float, layer: int, site: int, config) -> torch.Tensor:
    """Keyed dropout of hidden states `[s, b, h]` of this rank's tokens (b = 1).

    Under sequence parallelism `s` is this TP rank's slice of the (padded) tokens.
    """
    keys = current_keys()
    docs, positions = keys.token_docs, keys.token_positions
    tokens = x.shape[0]
    if tokens != docs.shape[0]:
        if not config.sequence_parallel or x.shape[0] * config.tensor_model_parallel_size != len(
            docs
        ):
            raise RuntimeError(
                f"keyed dropout got {tokens} tokens; the micro-batch's keys hold {len(docs)}"
            )
        start = tensor_parallel_rank(config) * tokens
        docs, positions = docs[start : start + tokens], positions[start : start + tokens]
    keep = hidden_keep(keys.hidden_base(layer, site), docs, positions, x.shape[-1], p)
    return keyed_dropout(x, keep.unsqueeze(1), p)


class KeyedBiasDropoutAdd:
    """A layer's `self_attn_bda` / `mlp_bda`: Megatron's call signature, keyed dropout.

    Called as `bda(training, fused)(x_with_bias, residual, prob)`, as `TransformerLayer`
    calls `get_bias_dropout_add`; `fused` is ignored (same arithmetic, unfused).
    """

    def __init__(self, layer_number: int, site: int, config) -> None:
        self.layer_number, self.site, self.config = layer_number, site, config

    def __call__(self, training: bool, fused: bool = False):
        """The bias-dropout-add function for `training` (Megatron's `get_bias_dropout_add`)."""

        def bias_dropout_add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if training and prob > 0:
                if bias is not None:
                    x, bias = x + bias, None
                x = _drop_hidden(x, prob, self.layer_number, self.site, self.config)
            return _bias_dropout_add_func((x, bias), residual, 0.0, training)

        return bias_dropout_add


class KeyedEmbeddingDropout(torch.nn.Module):
    """`LanguageModelEmbedding.embedding_dropout` with keyed masks (site 0 of layer 0)."""

    def __init__(self, p: float, config) -> None:
        super().__init__()
        self.p, self.config = p, config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Keyed dropout of `[s, b, h]` embeddings in training with p > 0; else `x`."""
        if not self.training or self.p == 0:
            return x
        return _drop_hidden(x, self.p, 0, EMBEDDING, self.config)


def _set_keys_from_call(module, args, kwargs):
    params = kwargs.get("packed_seq_params")
    keys = getattr(params, "dropout", None)
    if keys is not None:
        set_current(keys)


def install_keyed_dropout(model: torch.nn.Module) -> None:
    """Replace the hidden dropouts of a `GPTModel` (stage) by keyed ones, if it has any.

    Does nothing with `hidden_dropout` 0. Bias-dropout-adds that are modules (not
    Megatron's `get_bias_dropout_add`) are left as they are.
    """
    config = getattr(model, "config", None)
    if config is None or not config.hidden_dropout:
        return
    for module in model.modules():
        if isinstance(module, TransformerLayer):
            for name, site in (("self_attn_bda", ATTENTION_OUTPUT), ("mlp_bda", MLP_OUTPUT)):
                if not isinstance(getattr(module, name), torch.nn.Module):
                    setattr(module, name, KeyedBiasDropoutAdd(module.layer_number, site, config))
        elif isinstance(module, LanguageModelEmbedding):
            module.embedding_dropout = KeyedEmbeddingDropout(module.embedding_dropout.p, config)
    model.register_forward_pre_hook(_set_keys_from_call, with_kwargs=True)
