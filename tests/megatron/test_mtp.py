"""Multi-token prediction: HDP on packs, rings and TP replicas equals stock Megatron-Core.

The reference is Megatron-Core's own `GPTModel` with its own MTP block (`get_gpt_mtp_block_spec`),
its own RoPE and its own packed-sequence roll (`roll_tensor` over `cu_seqlens`), fed the whole
global batch as one packed micro-batch with its loss mask; its attention is a few lines of
causal SDPA per document written here. HDP splits the same documents over rings (zigzag
chunks shorter than the MTP depth included), and every rank reads the few tokens after its
chunks instead of receiving them.
"""

import dataclasses
import functools
import math

import pytest
import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

from megatron_hdp.distributed.layout import ParallelDims
from megatron_hdp.megatron.cpu_shim import cpu_shims
from megatron_hdp.megatron.engine import build_engine
from megatron_hdp.megatron.model import GPTConfig, build_gpt, transformer_config
from megatron_hdp.megatron.step import StepRuntime, train_step
from megatron_hdp.scheduler import plan_step
from tests.dist import run_ranks
from tests.megatron.reference import reference_optimizer
from tests.megatron.test_model_equivalence import (
    OPTIM,
    assert_close_rel,
    batch_of_lengths,
    snapshot_grads_before_update,
    source_of,
)
from tests.megatron.test_tensor_parallel import _tp_layout, unshard

CAPACITY = 16
SEED = 11
NUM_STEPS = 2
CFG = GPTConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=48,
    vocab_size=97,
    mtp_num_layers=2,
    mtp_loss_scaling_factor=0.5,
)
# Two documents over a ring of three, one of two, short ones packed; a 1-token document and
# one of 2 (shorter than the depth: no MTP label at all).
LENGTHS = ((33, 1, 5, 2, 12, 17), (40, 3, 9, 1, 16))


@dataclasses.dataclass(frozen=True)
class Case:
    pool_size: int
    policy: str = "greedy"
    cfg: GPTConfig = CFG
    capacity: int = CAPACITY


class PackedSDPACoreAttention(MegatronModule):
    """Causal attention within each document of a packed (THD) micro-batch."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **unused):
        super().__init__(config=config)

    def forward(self, query, key, value, attention_mask, packed_seq_params=None, **unused):
        cu = packed_seq_params.cu_seqlens_q.tolist()
        rep = query.shape[1] // key.shape[1]
        out = []
        for a, b in zip(cu[:-1], cu[1:]):
            q = query[a:b].transpose(0, 1)  # [h, s, d]
            k = key[a:b].repeat_interleave(rep, dim=1).transpose(0, 1)
            v = value[a:b].repeat_interleave(rep, dim=1).transpose(0, 1)
            scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
            probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            out.append((probs @ v).transpose(0, 1))  # [s, h, d]
        return torch.cat(out).reshape(cu[-1], -1)


def build_stock_reference(cfg: GPTConfig, state_dict: dict) -> GPTModel:
    """Stock GPTModel + stock MTP block (local spec), loaded with HDP's initial weights."""
    spec = get_gpt_layer_local_spec(normalization=cfg.normalization)
    spec.submodules.self_attention.submodules.core_attention = PackedSDPACoreAttention
    config = transformer_config(cfg)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type=cfg.position_embedding_type,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    )
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected, unexpected
    assert all("_extra_state" in k or "inv_freq" in k for k in missing), missing
    assert any(k.startswith(f"mtp.layers.{cfg.mtp_num_layers - 1}.") for k in state_dict)
    return model


def stock_step(model: GPTModel, seqs) -> float:
    """One forward/backward of the whole batch as ONE packed micro-batch, Megatron-LM's way:
    per-token loss sum over the loss tokens, MTP losses back-propagated with the same scale."""
    tokens = torch.cat([t for t, _, _ in seqs]).unsqueeze(0)
    labels = torch.cat([lab for _, lab, _ in seqs]).unsqueeze(0)
    mask = torch.cat([m for _, _, m in seqs]).unsqueeze(0)
    positions = torch.cat([torch.arange(len(t)) for t, _, _ in seqs]).unsqueeze(0)
    lengths = [len(t) for t, _, _ in seqs]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    total = float(mask.sum())
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0 / total))
    losses = model(tokens, positions, None, labels=labels, loss_mask=mask, packed_seq_params=params)
    loss = (losses.float() * mask).sum() / total
    loss.backward()
    return float(loss.detach())


def _body_reference(rank, world_size, cfg, lengths):
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            torch.manual_seed(SEED)
            model = build_stock_reference(cfg, build_gpt(cfg).state_dict())
            opt = reference_optimizer(
                model,
                lr=OPTIM.lr,
                weight_decay=OPTIM.weight_decay,
                betas=(OPTIM.adam_beta1, OPTIM.adam_beta2),
                eps=OPTIM.adam_eps,
            )
            losses, first_grads = [], None
            for step in range(NUM_STEPS):
                opt.zero_grad()
                losses.append(stock_step(model, batch_of_lengths(lengths[step], seed=step)))
                if step == 0:
                    first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
                torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.clip_grad)
                opt.step()
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            return losses, first_grads, params
        finally:
            layout.destroy()


@functools.cache
def reference_run(cfg: GPTConfig, lengths=LENGTHS):
    return run_ranks(_body_reference, 1, cfg, lengths)[0]


def _body_train(rank, world_size, case: Case, lengths):
    tp = case.cfg.tensor_model_parallel_size
    with cpu_shims():
        layout = ParallelDims.of_world(tensor_model_parallel_size=tp).initialize()
        try:
            engine = build_engine(case.cfg, OPTIM, seed=SEED)
            runtime = StepRuntime(
                group=layout.pool_group,
                job_group=dist.group.WORLD,
                check_plans=True,
                mtp_depth=case.cfg.mtp_num_layers,
            )
            pool = dist.get_world_size(layout.pool_group)
            results, rings = [], []
            for step in range(NUM_STEPS):
                source = source_of(batch_of_lengths(lengths[step], seed=step))
                plan = plan_step(
                    source.seqlens, pool_size=pool, capacity=case.capacity, policy=case.policy
                )
                rings += [mb.cp_size for mb in plan.micro_batches]
                grads = {}
                if step == 0:
                    snapshot_grads_before_update(engine, grads)
                result = train_step(engine, plan, source, runtime)
                results.append((result.loss, grads or None))
            named = list(engine.model.module.named_parameters())
            params = {n: p.detach().clone() for n, p in named}
            layouts = {n: _tp_layout(p) for n, p in named}
            return results, params, max(rings), layouts
        finally:
            layout.destroy()


def check_case(case: Case, min_ring: int, lengths=LENGTHS):
    tp = case.cfg.tensor_model_parallel_size
    per_rank = run_ranks(_body_train, case.pool_size * tp, case, lengths, timeout_s=240)
    reference_cfg = dataclasses.replace(
        case.cfg, tensor_model_parallel_size=1, sequence_parallel=False
    )
    ref_losses, ref_grads, ref_params = reference_run(reference_cfg, lengths)
    for rank, (results, _, widest, _) in enumerate(per_rank):
        assert widest >= min_ring, f"the widest ring had {widest} ranks"
        for step, (loss, _) in enumerate(results):
            assert loss == pytest.approx(ref_losses[step], rel=1e-5), (rank, step)
    for replica in range(case.pool_size):
        members = per_rank[replica * tp : (replica + 1) * tp]
        layouts = members[0][3]
        grads = [m[0][0][1] for m in members]
        assert set(grads[0]) == set(ref_grads)
        for name, want in ref_grads.items():
            got = unshard([g[name] for g in grads], layouts[name])
            assert_close_rel(got, want, f"replica {replica} grad {name}")
        for name, want in ref_params.items():
            got = unshard([m[1][name] for m in members], layouts[name])
            assert_close_rel(got, want, f"replica {replica} param {name}")


@pytest.mark.parametrize("depth", [1, 2])
def test_one_rank_matches_stock_megatron_mtp(depth):
    """Packs of whole documents on one rank (several micro-batches): no piece ends inside
    its document, nothing is read beyond the batch."""
    cfg = dataclasses.replace(CFG, mtp_num_layers=depth)
    check_case(Case(pool_size=1, cfg=cfg, capacity=48), 1)


def test_rings_of_three_match_stock_megatron_mtp():
    """A 33- and a 40-token document zigzag over three ranks (chunks of 5 to 7 tokens):
    the depth-1 and depth-2 targets after every chunk's end are read, not sent."""
    check_case(Case(pool_size=3), 3)


def test_static_mesh_chunks_shorter_than_the_depth_match_stock_megatron_mtp():
    """The static mesh shards every pack over all four ranks: documents of 1 to 5 tokens are
    cut into chunks of 0 or 1 token, shorter than the depth (2). Learned absolute positions:
    the MTP layers embed the shifted position ids too (zero past a document's end)."""
    cfg = dataclasses.replace(
        CFG, position_embedding_type="learned_absolute", max_position_embeddings=64
    )
    check_case(Case(pool_size=4, policy="static", cfg=cfg), 4)


def test_tensor_parallel_replicas_with_sequence_parallelism_match_stock_megatron_mtp():
    """TP 2 with sequence parallelism on a pool of 2 (rings of 2 replicas): the MTP
    projection is column-parallel, the MTP losses vocab-parallel, the shifted targets padded
    with the tokens; gathered, the gradients and weights are the one-process model's."""
    cfg = dataclasses.replace(
        CFG, vocab_size=98, tensor_model_parallel_size=2, sequence_parallel=True
    )
    lengths = ((30, 1, 5, 2, 12, 17), (25, 3, 9, 1, 16))
    check_case(Case(pool_size=2, cfg=cfg), 2, lengths)
