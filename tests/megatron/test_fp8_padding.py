"""FP8's token multiple: every micro-batch padded to 16 tokens (with sequence parallelism,
to lcm(16, TP)), the padding masked out of the loss and skipped by HDP attention.

On CPU the layers do not compute in FP8 (Transformer Engine needs a GPU); what is tested is
that the padding FP8 needs contributes nothing: the padded micro-batches give the loss and
gradients of single-process training on the unpadded batch.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_hdp.distributed.layout import ParallelDims
from megatron_hdp.megatron.cpu_shim import cpu_shims
from megatron_hdp.megatron.model import GPTConfig
from megatron_hdp.megatron.schedule import HDPGlobalBatch, hdp_forward_backward
from megatron_hdp.megatron.step import StepRuntime, token_multiple
from megatron_hdp.scheduler import plan_step
from tests.dist import run_ranks
from tests.megatron.test_dropin import megatron_lm_engine, pretrain_gpt_forward_step
from tests.megatron.test_model_equivalence import (
    CAPACITY,
    CFG,
    SEED,
    assert_close_rel,
    make_batch,
    reference_run,
    source_of,
)


@pytest.mark.parametrize(
    "tp,sp,fp8,want", [(1, False, False, 1), (1, False, True, 16), (2, True, False, 2),
                       (2, True, True, 16), (3, True, True, 48), (3, False, True, 16)],
)  # fmt: skip
def test_the_token_multiple_is_fp8s_and_tps_lcm(tp, sp, fp8, want):
    cfg = GPTConfig(
        hidden_size=48, ffn_hidden_size=96, num_attention_heads=12, num_query_groups=6,
        vocab_size=384, tensor_model_parallel_size=tp, sequence_parallel=sp, fp8=fp8,
    )  # fmt: skip
    assert token_multiple(cfg) == want


def _body_padded(rank, world_size):
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            engine = megatron_lm_engine(CFG, seed=SEED)  # the same weights as the reference
            source = source_of(make_batch(world_size, 0))
            plan = plan_step(
                source.seqlens, pool_size=world_size, capacity=CAPACITY, policy="greedy"
            )
            schedule = hdp_forward_backward(
                StepRuntime(group=dist.group.WORLD), dataclasses.replace(CFG, fp8=True)
            )
            shapes = []

            def forward_step(data_iterator, model):
                batch = next(data_iterator)
                shapes.append((batch["tokens"].shape[-1], int(batch["loss_mask"].sum())))
                return pretrain_gpt_forward_step(iter([batch]), model)

            engine.model.zero_grad_buffer()
            reports = schedule(
                forward_step_func=forward_step,
                data_iterator=iter([HDPGlobalBatch(plan=plan, source=source)]),
                model=[engine.model],
                num_microbatches=1,
                seq_length=None,
                micro_batch_size=1,
                forward_only=False,
            )
            grads = {n: p.main_grad.clone() for n, p in engine.model.module.named_parameters()}
            sums = torch.stack([r["lm loss"] for r in reports]).sum(0) if reports else None
            padded, shapes[:] = list(shapes), []
            hdp_forward_backward(StepRuntime(group=dist.group.WORLD), CFG)(
                forward_step_func=forward_step,
                data_iterator=iter([HDPGlobalBatch(plan=plan, source=source)]),
                model=[engine.model],
                num_microbatches=1,
                seq_length=None,
                micro_batch_size=1,
                forward_only=True,
            )  # the same micro-batches unpadded: their real token counts
            return grads, None if sums is None else sums.tolist(), list(zip(padded, shapes))
        finally:
            layout.destroy()


def test_fp8_padded_micro_batches_give_the_single_process_loss_and_gradients():
    per_rank = run_ranks(_body_padded, 2)
    pairs = [pair for _, _, rank_pairs in per_rank for pair in rank_pairs]
    assert pairs, per_rank
    for (padded, padded_mask), (real, real_mask) in pairs:
        assert padded == -(-real // 16) * 16 and padded_mask == real_mask, pairs
    assert any(padded != real for (padded, _), (real, _) in pairs), pairs  # padding happened
    ref_losses, _, ref_grads, _ = reference_run(2, CFG, "mixed")
    loss_sum = sum(s[0] for _, s, _ in per_rank if s is not None)
    tokens = sum(s[1] for _, s, _ in per_rank if s is not None)
    assert abs(loss_sum / tokens - ref_losses[0]) <= 1e-5 * ref_losses[0]
    for rank, (grads, _, _) in enumerate(per_rank):
        for name, want in ref_grads.items():
            assert_close_rel(grads[name], want, f"rank {rank} grad {name}")
