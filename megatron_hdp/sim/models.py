"""The models of ByteScale's Table 1 as simulator inputs (pure).

Source of the table: bytescale-paper.md section 6.1 (layers, heads, KV groups = 8 for all,
hidden size, GPUs of Fig. 17). The paper gives no FFN size, vocabulary, TP or PP; every
other constant below is either a published config or a stated choice:

- FFN sizes: LLaMA-7B 11008, 13B 13824, 30B 17920 (LLaMA-1 configs, Touvron et al. 2023,
  Table 2 / the released `params.json` rule `ffn = 256 * ceil(8h/3 / 256)`, with the 30B's
  published 17920); LLaMA-70B 28672 (LLaMA-2 70B config); Mixtral-8x7B 14336 per expert
  and Mixtral-8x22B 16384 per expert (Mistral AI's released `config.json`).
- Vocabulary 32000 for all (LLaMA's; Mixtral-8x7B's is 32000, 8x22B's 32768 is rounded to
  the same value as a stated choice; it changes the output layer by < 1%).
- MoE compute uses ACTIVE parameters (the cost model's MoE fields, as the training job
  uses them): top-2 routing runs two SwiGLU experts per token, plus the router (h x 8 per
  layer). That gives 12.9B (8x7B) and 38.9B (8x22B) active parameters against the paper's
  13B / 39B. The gradient sync uses TOTAL parameters (all 8 experts; no expert
  parallelism is assumed, an upper bound on its bytes): 46.6B and 140.5B (paper 47B / 141B).
- LLaMA-30B: Table 1 says 56 heads with hidden 6656, which does not divide (LLaMA-1 33B
  has 52); we keep the paper's 56 and the cost model's integer head dim 6656 // 56 = 118.
- TP and PP (not given): TP = 2 for 7B is the paper's case study as derived in
  bytescale-paper.md section 6.3 (1024 GPUs, d_hdp = 512). For the others we choose the
  smallest TP x PP inside one 8-GPU NVLink node (TP <= 8) that holds the weights and
  optimizer state with room for activations, and PP > 1 exactly for the models the paper
  runs with PP-Balance (70B and the two MoEs). With the paper's GPU counts this makes every
  pool 512 HDP ranks, the case study's d_hdp; Mixtral-8x22B uses 16,384 GPUs (the SIGCOMM
  title; the paper says "> 12K").

An HDP rank is one model replica: TP x PP GPUs. The cost model prices micro-batches on one
stage's TP group (the GPU's speeds times TP, `clusters.py`); with PP > 1 each stage takes
`1 / PP` of that time for its `layers_per_stage` layers, and the simulator runs the stages
through Megatron's 1F1B schedule (`scheduler.pipeline_timeline`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_hdp.scheduler.cost import ModelShape
from megatron_hdp.scheduler.windows import check_window, window_problems, windowed_layers

K = 1024


@dataclass(frozen=True)
class SimModel:
    """One model of Table 1 with its parallel layout."""

    name: str
    shape: ModelShape
    total_params: float
    tp: int
    pp: int
    gpus: int
    experts: int = 1
    top_k: int = 1

    @property
    def gpus_per_rank(self) -> int:
        """GPUs in one HDP rank (one model replica): TP x PP."""
        return self.tp * self.pp

    @property
    def layers_per_stage(self) -> int:
        """Transformer layers on one pipeline stage."""
        return self.shape.num_layers // self.pp

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies (the cost model's `params_per_token`)."""
        return self.shape.params_per_token

    def pool_size(self, gpus: int | None = None) -> int:
        """HDP ranks on `gpus` GPUs (default: the paper's GPU count for this model)."""
        return (gpus or self.gpus) // self.gpus_per_rank


def _total_params(h: int, layers: int, heads: int, groups: int, ffn: int, experts: int) -> float:
    """All weights: attention, every expert's SwiGLU MLP, input embedding and output layer."""
    kv = groups * (h // heads)
    attention = h * (h + 2 * kv) + h * h
    return float(layers * (attention + experts * 3 * h * ffn) + 2 * h * 32000)


def _dense(name, layers, heads, h, ffn, tp, pp, gpus) -> SimModel:
    shape = ModelShape(
        num_layers=layers,
        hidden_size=h,
        num_attention_heads=heads,
        num_query_groups=8,
        ffn_hidden_size=ffn,
        vocab_size=32000,
        swiglu=True,
    )
    return SimModel(name, shape, _total_params(h, layers, heads, 8, ffn, 1), tp, pp, gpus)


def _moe(name, layers, heads, h, expert_ffn, tp, pp, gpus) -> SimModel:
    shape = ModelShape(
        num_layers=layers,
        hidden_size=h,
        num_attention_heads=heads,
        num_query_groups=8,
        ffn_hidden_size=expert_ffn,
        vocab_size=32000,
        swiglu=True,
        num_experts=8,
        moe_router_topk=2,
    )
    total = _total_params(h, layers, heads, 8, expert_ffn, 8)
    return SimModel(name, shape, total, tp, pp, gpus, experts=8, top_k=2)


#: Table 1 of the paper, with the documented choices of the module docstring.
MODELS: dict[str, SimModel] = {
    m.name: m
    for m in (
        _dense("llama-7b", 32, 32, 4096, 11008, tp=2, pp=1, gpus=1024),
        _dense("llama-13b", 40, 40, 5120, 13824, tp=4, pp=1, gpus=2048),
        _dense("llama-30b", 60, 56, 6656, 17920, tp=8, pp=1, gpus=4096),
        _dense("llama-70b", 80, 64, 8192, 28672, tp=8, pp=2, gpus=8192),
        _moe("mixtral-8x7b", 32, 32, 4096, 14336, tp=4, pp=4, gpus=8192),
        _moe("mixtral-8x22b", 56, 48, 6144, 16384, tp=8, pp=4, gpus=16384),
    )
}


def _mla(base: SimModel) -> SimModel:
    """`base` with DeepSeek-V3's attention shape (config.json).

    Multi-latent attention, q/k 128 + 64 RoPE channels and v 128 per head, q rank 1536, kv
    rank 512; same heads, layers, MLP and layout. Not a model of the paper: an MLA variant
    to price, chosen by name (`--models llama-7b-mla`), outside the default list.
    """
    shape = dataclasses.replace(
        base.shape,
        num_query_groups=None,
        multi_latent_attention=True,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_head_dim=128,
        qk_pos_emb_head_dim=64,
        v_head_dim=128,
    )
    h, layers = shape.hidden_size, shape.num_layers
    mlp = 3 * h * (shape.ffn_hidden_size or 4 * h)
    total = float(layers * (shape.attention_params + mlp) + 2 * h * shape.vocab_size)
    return dataclasses.replace(base, name=f"{base.name}-mla", shape=shape, total_params=total)


#: MLA variants of Table 1's dense models, priced by the same cost model (by name only).
MLA_MODELS: dict[str, SimModel] = {
    m.name: m for m in (_mla(MODELS["llama-7b"]), _mla(MODELS["llama-70b"]))
}

#: The paper's capacity C in its examples (bytescale-paper.md section 8, claims 3, 4, 9).
PAPER_CAPACITY = 8 * K


def memory_capacity(
    model: SimModel, gpu_memory: float = 80e9, reserve: float = 8e9, pool: int | None = None
) -> int:
    """Tokens per HDP rank that fit the GPU memory (an estimate, reported next to the 8K).

    Per GPU: weights and state of `total_params / (TP x PP)` parameters at 6 bytes each
    (bf16 weights 2, fp32 main grads 4) plus fp32 master weights and Adam moments (12
    bytes) sharded over the `pool` replicas (Megatron's distributed optimizer),
    `reserve` bytes for workspace/NCCL, the rest for activations at
    34 h bytes per token per layer in bf16 (cost.py), divided by TP (sequence parallel) and
    holding `layers_per_stage` layers.
    """
    per_gpu_params = model.total_params / model.gpus_per_rank
    pool = pool or model.pool_size()
    free = gpu_memory - reserve - (6.0 + 12.0 / pool) * per_gpu_params
    per_token = model.layers_per_stage * 34.0 * model.shape.hidden_size / model.tp
    return max(0, int(free / per_token))


def with_window(model: SimModel, window_size, skip_freq) -> SimModel:
    """`model` with sliding-window attention priced (`scheduler.windows`); as is for None.

    ValueError naming the value for flags Megatron-Core would not take (`window_problems`).
    """
    if window_size is None and skip_freq is None:
        return model
    layers = model.shape.num_layers
    problems = window_problems(window_size, skip_freq, num_layers=layers)
    if problems:
        raise ValueError(f"{model.name}: {problems[0]}")
    shape = dataclasses.replace(
        model.shape,
        window=check_window(window_size),
        windowed_layers=sum(windowed_layers(layers, window_size, skip_freq)),
    )
    return dataclasses.replace(model, shape=shape)
