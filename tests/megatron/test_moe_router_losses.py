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


def _plain_gating(self, input):
    """Megatron's router logits without Transformer Engine (`router_gating_linear`'s math)."""
    return torch.nn.functional.linear(input, self.weight, self.bias)


def _seq_aux_body(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hdp.megatron.cpu_shim import cpu_shims
    from megatron_hdp.megatron.moe import MoEMicroBatch, SequenceAuxLossRouter, moe_micro_batch

    class StockRouter(TopKRouter):
        """Megatron's router, its plain-torch gating (as HDP's; Megatron's asks for TE)."""

        gating = _plain_gating

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


def _forced_body(rank, world_size):
    import megatron.core.transformer.moe.router as router_module
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hdp.attention.dropout import MicroBatchKeys
    from megatron_hdp.megatron.cpu_shim import cpu_shims
    from megatron_hdp.megatron.moe import MoEMicroBatch, SequenceAuxLossRouter, moe_micro_batch

    class StockRouter(TopKRouter):
        gating = _plain_gating

    def run(router, x, docs, positions):
        keys = MicroBatchKeys(
            7, 2, tuple(sorted(set(docs))), torch.tensor(docs), torch.tensor(positions)
        )
        lengths = [docs.count(d) for d in sorted(set(docs))]
        segments = torch.tensor([sorted(set(docs)).index(d) for d in docs])
        batch = MoEMicroBatch(
            segment_ids=segments, doc_lengths=lengths, global_tokens=len(docs), keys=keys
        )
        with moe_micro_batch(batch):
            return router(x)

    with cpu_shims():
        parallel_state.initialize_model_parallel()
        config = TransformerConfig(
            num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, num_moe_experts=EXPERTS,
            moe_router_topk=2, moe_router_force_load_balancing=True, moe_aux_loss_coeff=0.0,
            use_cpu_initialization=True,
        )  # fmt: skip
        groups = ProcessGroupCollection.use_mpu_process_groups()
        torch.manual_seed(0)
        hdp = SequenceAuxLossRouter(config=config, pg_collection=groups)
        stock = StockRouter(config=config, pg_collection=groups)
        stock.load_state_dict(hdp.state_dict())
        hdp.set_layer_number(1), stock.set_layer_number(1)  # the MoE layer's call
        assert config.moe_router_force_load_balancing  # the shared config is left as it is
        docs, positions = [4, 4, 4, 9, 9], [0, 1, 2, 5, 6]
        x = torch.randn(5, 1, HIDDEN)
        probs, routing = run(hdp, x, docs, positions)
        (probs * torch.arange(1.0, 1 + EXPERTS)).sum().backward()
        # Another input, the tokens in another order (another packing): the same routes.
        order = [3, 4, 0, 1, 2]
        _, other = run(hdp, torch.randn(5, 1, HIDDEN)[order], [docs[i] for i in order],
                       [positions[i] for i in order])  # fmt: skip
        # Megatron's router given the same random logits (its RandomSTE, values injected).
        noise = {}

        def inject(logits):
            class STE(torch.autograd.Function):
                @staticmethod
                def forward(ctx, logits):
                    return noise["values"].to(logits.dtype).view(logits.shape)

                @staticmethod
                def backward(ctx, grad):
                    return grad

            return STE.apply(logits)

        from megatron_hdp.attention.dropout import key_base
        from megatron_hdp.megatron.moe import FORCED_ROUTING, keyed_normal

        base = key_base(FORCED_ROUTING, 7, 2, stock.layer_number)
        noise["values"] = keyed_normal(base, torch.tensor(docs), torch.tensor(positions), EXPERTS)
        original = router_module.apply_random_logits
        router_module.apply_random_logits = inject
        try:
            want_probs, want_routing = stock(x)
        finally:
            router_module.apply_random_logits = original
        (want_probs * torch.arange(1.0, 1 + EXPERTS)).sum().backward()
        sample = keyed_normal(base, torch.arange(2000), torch.zeros(2000, dtype=torch.int64), 8)
        back = other[[order.index(i) for i in range(5)]]  # in the first order
        grads = hdp.weight.grad, stock.weight.grad
        return routing, back, want_routing, probs.detach(), want_probs.detach(), *grads, sample


def test_forced_load_balancing_routes_by_keyed_random_logits_as_megatron():
    """`--moe-router-force-load-balancing`: Megatron's router with random logits (values,
    routing, straight-through gradient), the logits keyed by token: a token's route does not
    depend on its input or where it is packed, and the values are standard normal."""
    routing, other, want_routing, probs, want_probs, grad, want_grad, sample = run_ranks(
        _forced_body, 1
    )[0]
    assert torch.equal(routing, want_routing) and torch.equal(other, routing)
    torch.testing.assert_close(probs, want_probs)
    assert want_grad.abs().sum() > 0
    torch.testing.assert_close(grad, want_grad)
    assert abs(float(sample.mean())) < 0.03 and abs(float(sample.std()) - 1) < 0.03
