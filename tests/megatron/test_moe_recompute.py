"""A recomputed MoE layer routes in the backward with its own micro-batch's documents.

`--recompute-modules moe` (and full recompute) runs HDP's router again in the backward. On
CUDA PyTorch runs that backward on an autograd thread of its own, where the forward's
context variable is not set; under pipeline parallelism Megatron's schedule runs it outside
the forward's block. Both are reproduced on CPU: the backward runs on a fresh thread, after
another micro-batch's forward, through Megatron's own pipeline calls
(`deallocate_output_tensor`, `custom_backward`). The reference is the same router without
recompute, its backward inside the forward's block (the load-balancing loss and the z-loss
send their gradients to the router's weight).
"""

from __future__ import annotations

import threading

import torch

from tests.dist import run_ranks

TOKENS, EXPERTS, HIDDEN = 9, 4, 8


def _on_fresh_thread(fn):
    """Run `fn` on a new thread (empty context variables, as autograd's device threads)."""
    failure = []

    def target():
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            failure.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the backward hung"
    return failure[0] if failure else None


def _body(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import custom_backward, deallocate_output_tensor
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hdp.megatron.cpu_shim import cpu_shims
    from megatron_hdp.megatron.moe import MoEMicroBatch, SequenceAuxLossRouter
    from megatron_hdp.megatron.moe_context import (
        carry_into_backward,
        current_micro_batch,
        moe_micro_batch,
    )

    with cpu_shims():
        parallel_state.initialize_model_parallel()
        config = TransformerConfig(
            num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, num_moe_experts=EXPERTS,
            moe_router_topk=2, moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.3,
            use_cpu_initialization=True,
        )  # fmt: skip
        groups = ProcessGroupCollection.use_mpu_process_groups()
        torch.manual_seed(0)
        router = SequenceAuxLossRouter(config=config, pg_collection=groups)
        router.train()
        x = torch.randn(TOKENS, 1, HIDDEN, requires_grad=True)
        weights = torch.arange(1.0, 1 + EXPERTS)
        # Two documents of 5 and 4 tokens, in a global batch of 20 tokens.
        batch = MoEMicroBatch(
            segment_ids=torch.tensor([0] * 5 + [1] * 4), doc_lengths=[5, 4], global_tokens=20
        )
        other = MoEMicroBatch(  # the micro-batch whose forward runs in between
            segment_ids=torch.zeros(TOKENS, dtype=torch.int64), doc_lengths=[TOKENS],
            global_tokens=20,
        )  # fmt: skip

        def routed(hidden):
            return router(hidden)[0] * weights

        def reference():
            router.weight.grad, x.grad = None, None
            with moe_micro_batch(batch):
                routed(x).sum().backward()
            return router.weight.grad.clone(), x.grad.clone()

        def recomputed(carry: bool):
            """Forward under reentrant recompute, another forward, backward on a new thread."""
            router.weight.grad, x.grad = None, None
            with moe_micro_batch(batch):
                out = torch.utils.checkpoint.checkpoint(routed, x, use_reentrant=True)
            if carry:
                out = carry_into_backward(out, batch)
            with moe_micro_batch(other):
                routed(x.detach())  # the next micro-batch's forward (1F1B)
            grad = torch.ones_like(out)
            deallocate_output_tensor(out, deallocate_pipeline_outputs=True)
            failure = _on_fresh_thread(lambda: custom_backward(out, grad))
            return failure, router.weight.grad, x.grad

        want_weight, want_x = reference()
        failure, got_weight, got_x = recomputed(carry=True)
        assert failure is None, failure
        try:
            current_micro_batch("check")
            left_set = True
        except RuntimeError:
            left_set = False
        uncarried, _, _ = recomputed(carry=False)
        return want_weight, want_x, got_weight, got_x, left_set, repr(uncarried)


def test_recomputed_router_routes_with_the_carried_micro_batch():
    want_weight, want_x, got_weight, got_x, left_set, uncarried = run_ranks(_body, 1)[0]
    assert want_weight.abs().sum() > 0  # the router's losses send a gradient to its weight
    torch.testing.assert_close(got_weight, want_weight, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(got_x, want_x, rtol=1e-6, atol=1e-8)
    assert not left_set  # the carried batch ends with its backward
    # Without the carrier the recompute cannot know its micro-batch (what CUDA hit).
    assert "outside an HDP micro-batch" in uncarried
