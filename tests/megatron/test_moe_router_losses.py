"""HDP's MoE router: the z-loss over the global batch and the expert-bias counts without pads.

One process, Megatron's own `TopKRouter` machinery with HDP's `SequenceAuxLossRouter`; the
expected values come from the formulas (`megatron_hdp/megatron/moe.py`), computed here with
plain torch on the same router weights: the z-loss `coeff / T * sum_t logsumexp(l_t)^2`
over the real tokens (its gradient), and the expert-bias counts of the real tokens only.
"""

from __future__ import annotations

import torch

from tests.dist import run_ranks

TOKENS, PAD, EXPERTS, HIDDEN, COEFF = 7, 2, 4, 8, 0.3
GLOBAL_TOKENS = 20  # the global batch holds more tokens than this micro-batch


def _body(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hdp.megatron.cpu_shim import cpu_shims
    from megatron_hdp.megatron.moe import MoEMicroBatch, SequenceAuxLossRouter, moe_micro_batch

    with cpu_shims():
        parallel_state.initialize_model_parallel()
        config = TransformerConfig(
            num_layers=1,
            hidden_size=HIDDEN,
            num_attention_heads=1,
            num_moe_experts=EXPERTS,
            moe_router_topk=2,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_z_loss_coeff=COEFF,
            moe_aux_loss_coeff=0.0,
            use_cpu_initialization=True,
        )
        torch.manual_seed(0)
        groups = ProcessGroupCollection.use_mpu_process_groups()
        router = SequenceAuxLossRouter(config=config, pg_collection=groups)
        router.train()
        # Two documents (4 + 3 tokens here) and PAD sequence-parallel pad tokens (row 2).
        segments = torch.tensor([0] * 4 + [1] * 3 + [2] * PAD)
        batch = MoEMicroBatch(segment_ids=segments, doc_lengths=[4, 3], global_tokens=GLOBAL_TOKENS)
        x = torch.randn(TOKENS + PAD, 1, HIDDEN)
        with moe_micro_batch(batch):
            probs, routing_map = router(x)
        (probs * 0).sum().backward()  # only the z-loss sends a gradient
        got_grad = router.weight.grad.clone()
        got_counts = router.local_tokens_per_expert.clone()

        weight = router.weight.detach().clone().requires_grad_()
        bias = router.bias.detach()  # Megatron's router has one (add_bias_linear)
        logits = torch.nn.functional.linear(x[:TOKENS, 0], weight, bias)
        z_loss = COEFF / GLOBAL_TOKENS * torch.logsumexp(logits, dim=-1).square().sum()
        z_loss.backward()
        want_counts = routing_map[:TOKENS].sum(dim=0).to(got_counts.dtype)
        return got_grad, weight.grad, got_counts, want_counts, routing_map[TOKENS:].sum()


def test_z_loss_and_expert_bias_counts_cover_the_real_tokens_only():
    got_grad, want_grad, got_counts, want_counts, pad_routes = run_ranks(_body, 1)[0]
    assert pad_routes > 0  # the pad tokens were routed: leaving them out is tested
    assert torch.equal(got_counts, want_counts)
    assert want_grad.abs().sum() > 0
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-7)


SEQ, BATCH, SEQ_COEFF = 5, 3, 0.01


def _seq_aux_body(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hdp.megatron.cpu_shim import cpu_shims
    from megatron_hdp.megatron.moe import MoEMicroBatch, SequenceAuxLossRouter, moe_micro_batch

    class StockRouter(TopKRouter):
        """Megatron's router, its plain-torch gating (as HDP's; Megatron's asks for TE)."""

        gating = SequenceAuxLossRouter.gating

    with cpu_shims():
        parallel_state.initialize_model_parallel()
        config = TransformerConfig(
            num_layers=1,
            hidden_size=HIDDEN,
            num_attention_heads=1,
            num_moe_experts=EXPERTS,
            moe_router_topk=2,
            moe_router_score_function="sigmoid",
            moe_router_load_balancing_type="seq_aux_loss",
            moe_aux_loss_coeff=SEQ_COEFF,
            use_cpu_initialization=True,
        )
        groups = ProcessGroupCollection.use_mpu_process_groups()
        torch.manual_seed(0)
        stock = StockRouter(config=config, pg_collection=groups)
        hdp = SequenceAuxLossRouter(config=config, pg_collection=groups)
        hdp.load_state_dict(stock.state_dict())
        stock.train(), hdp.train()
        x = torch.randn(SEQ, BATCH, HIDDEN)  # Megatron's [s, b] micro-batch of BATCH sequences
        probs, _ = stock(x)
        (probs * 0).sum().backward()  # only the aux loss sends a gradient
        # HDP: the same tokens as BATCH documents of SEQ tokens, packed in THD order.
        packed = x.transpose(0, 1).reshape(SEQ * BATCH, 1, HIDDEN)
        segments = torch.arange(BATCH).repeat_interleave(SEQ)
        batch = MoEMicroBatch(
            segment_ids=segments, doc_lengths=[SEQ] * BATCH, global_tokens=SEQ * BATCH
        )
        with moe_micro_batch(batch):
            probs, _ = hdp(packed)
        (probs * 0).sum().backward()
        return stock.weight.grad, hdp.weight.grad, float(batch.aux_loss)


def test_seq_aux_loss_is_megatrons_with_each_document_a_sequence():
    """Megatron's `seq_aux_loss` of a [s, b] micro-batch (the mean of each sequence's switch
    loss) has the gradient of HDP's per-document loss over the same b sequences packed as
    documents (the global batch: T = s x b, so HDP's T_s / T weight is Megatron's 1 / b)."""
    want, got, aux = run_ranks(_seq_aux_body, 1)[0]
    assert aux > 0
    assert want.abs().sum() > 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
