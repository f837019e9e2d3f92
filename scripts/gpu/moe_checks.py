"""A recomputed MoE router in the backward, on the device: the `train` section's MoE check.

`--recompute-modules moe` runs HDP's router again in the backward, where it needs its
micro-batch's documents (`megatron_hdp.megatron.moe_context`). On CUDA PyTorch runs that
backward on an autograd thread of its own, where the forward's context variable is not set;
the micro-batch's output carries it there (`carry_into_backward`). This check runs HDP's
router (Megatron's `TopKRouter` with the per-sequence load-balancing loss and the z-loss)
under reentrant recompute, runs another micro-batch's forward in between (as 1F1B does),
frees the output as Megatron's pipeline does and runs the backward with Megatron's
`custom_backward`; the router's and the input's gradients must equal those of the same
router without recompute. On CPU (`--cpu`, the unit test) the backward runs on a fresh
thread instead, which is what CUDA's autograd thread does to context variables.

Needs megatron-core and Megatron's parallel state of one rank (`train_checks.one_rank_job`).
"""

from __future__ import annotations

import threading

import torch

TOKENS, EXPERTS, HIDDEN = 9, 4, 8
#: The documents of the micro-batch (5 + 4 tokens) and of the global batch it is part of.
DOCS, GLOBAL_TOKENS = (5, 4), 20


def _on_fresh_thread(fn) -> BaseException | None:
    """Run `fn` on a new thread (empty context variables, as autograd's device threads)."""
    failure: list[BaseException] = []

    def target():
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            failure.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=120)
    if thread.is_alive():
        return TimeoutError("the backward did not finish in 120 s")
    return failure[0] if failure else None


def recompute_gradients(device: torch.device, *, carry: bool = True) -> dict:
    """The router's and the input's gradients with and without recompute (see the module).

    Returns `want_weight`, `want_input` (no recompute), `got_weight`, `got_input`
    (recomputed; None where the backward failed), `failure` (its error, or None) and
    `left_set` (whether a micro-batch was still set after the backward).
    """
    from megatron.core.pipeline_parallel.schedules import custom_backward, deallocate_output_tensor
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hdp.megatron.moe import MoEMicroBatch, SequenceAuxLossRouter
    from megatron_hdp.megatron.moe_context import (
        carry_into_backward,
        current_micro_batch,
        moe_micro_batch,
    )

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, num_moe_experts=EXPERTS,
        moe_router_topk=2, moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.3,
        use_cpu_initialization=True,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    router = SequenceAuxLossRouter(config=config, pg_collection=groups)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
    router.to(device).train()
    x = torch.randn(TOKENS, 1, HIDDEN, generator=generator).to(device).requires_grad_()
    weights = torch.arange(1.0, 1 + EXPERTS, device=device)
    segments = torch.repeat_interleave(torch.arange(len(DOCS)), torch.tensor(DOCS))
    batch = MoEMicroBatch(
        segment_ids=segments.to(device), doc_lengths=list(DOCS), global_tokens=GLOBAL_TOKENS
    )
    other = MoEMicroBatch(  # the micro-batch whose forward runs in between
        segment_ids=torch.zeros(TOKENS, dtype=torch.int64, device=device),
        doc_lengths=[TOKENS],
        global_tokens=GLOBAL_TOKENS,
    )

    def routed(hidden):
        return router(hidden)[0] * weights

    router.weight.grad = None
    with moe_micro_batch(batch):
        routed(x).sum().backward()
    want_weight, want_input = router.weight.grad.clone(), x.grad.clone()

    router.weight.grad, x.grad = None, None
    with moe_micro_batch(batch):
        out = torch.utils.checkpoint.checkpoint(routed, x, use_reentrant=True)
    if carry:
        out = carry_into_backward(out, batch)
    with moe_micro_batch(other):
        routed(x.detach())  # the next micro-batch's forward (1F1B)
    grad = torch.ones_like(out)
    deallocate_output_tensor(out, deallocate_pipeline_outputs=True)
    if device.type == "cuda":  # autograd runs it on its device thread
        try:
            custom_backward(out, grad)
            failure = None
        except Exception as exc:  # noqa: BLE001 - reported
            failure = exc
        torch.cuda.synchronize(device)
    else:
        failure = _on_fresh_thread(lambda: custom_backward(out, grad))
    try:
        current_micro_batch("check")
        left_set = True
    except RuntimeError:
        left_set = False
    done = failure is None
    return {
        "want_weight": want_weight.cpu(),
        "want_input": want_input.cpu(),
        "got_weight": router.weight.grad.cpu() if done else None,
        "got_input": x.grad.cpu() if done else None,
        "failure": failure,
        "left_set": left_set,
    }


def _relative(got: torch.Tensor | None, want: torch.Tensor) -> float:
    if got is None:
        return float("inf")
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def recompute_check(device: torch.device, say) -> dict:
    """The check's figures and verdict (float32; tolerance 1e-5 relative, as a norm)."""
    grads = recompute_gradients(device)
    weight = _relative(grads["got_weight"], grads["want_weight"])
    inputs = _relative(grads["got_input"], grads["want_input"])
    ok = (
        grads["failure"] is None
        and not grads["left_set"]
        and float(grads["want_weight"].abs().sum()) > 0
        and max(weight, inputs) <= 1e-5
    )
    result = {
        "ok": ok,
        "thread": "autograd's device thread" if device.type == "cuda" else "a fresh thread",
        "router_weight_grad_relative_difference": weight,
        "input_grad_relative_difference": inputs,
        "micro_batch_left_set_after_backward": grads["left_set"],
        "error": None if grads["failure"] is None else repr(grads["failure"]),
    }
    say(
        f"train    MoE router recomputed in the backward ({result['thread']}): weight/input "
        f"grad rel diff {weight:.1e}/{inputs:.1e}"
        + (f", error {result['error']}" if result["error"] else "")
        + f": {'ok' if ok else 'FAILED'}"
    )
    return result
