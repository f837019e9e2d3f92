"""HDP micro-batches through Megatron-Core's 1F1B pipeline schedule (host layer).

With pipeline parallelism an HDP replica is a whole pipeline. Every stage of a pipeline
reads the same local batches (the plan is identical everywhere), so each stage knows each
micro-batch's token layout, ring and RoPE positions; stage 0 embeds the tokens, the last
stage computes the token losses, and the stages in between exchange hidden states through
Megatron's P2P communication with variable shapes (micro-batches hold different token
counts).

Replicas run different numbers of micro-batches. A ring micro-batch runs on the same stage
of all its member pipelines at once; the plan guarantees it by being lock-step
(`scheduler.plan.lockstep_problems`): ring members run equally many micro-batches and hold
the ring at the same position, so Megatron's 1F1B gives their stages identical sequences
of forward and backward passes.

With virtual pipeline stages (`engine.chunks`) Megatron-Core's interleaved 1F1B runs the
same micro-batches through every chunk; the list is padded with one-token micro-batches of
loss mask 0 to a count it accepts (`schedule.interleaved_padding`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_hdp.data.batching import LocalBatch
from megatron_hdp.megatron.engine import Engine
from megatron_hdp.megatron.ep_lockstep import padding_batch
from megatron_hdp.scheduler.interleaved import padded_count


def interleaved_padding(batches: list[LocalBatch], pp: int, group: int, rank: int, device):
    """`batches` padded at the end to a count Megatron's interleaved schedule accepts.

    `group` is `microbatch_group_size_per_vp_stage`. Padding batches are one token with
    loss mask 0 (`ep_lockstep.padding_batch`, a local micro-batch of pool rank `rank`);
    their ids are returned too. Ring members run equally many micro-batches (lock step), so
    they pad equally. No communication.
    """
    missing = padded_count(len(batches), pp, group) - len(batches)
    pads = [padding_batch(rank, device) for _ in range(missing)]
    return batches + pads, {id(b) for b in pads}


def run_pipeline(
    engine: Engine,
    batches: list[LocalBatch],
    *,
    stage_inputs: Callable[[LocalBatch], tuple[tuple, dict, int, AbstractContextManager]],
    loss_scale: float,
    forward_only: bool = False,
    sync_in_last_backward: bool = False,
) -> torch.Tensor | float:
    """Collective over the pipeline (and the rings): run `batches` through 1F1B.

    `stage_inputs(batch, padding)` returns the model's positional and keyword arguments for
    one micro-batch, the number of real tokens (the rest is sequence-parallel padding) and a
    context to run its forward pass in (the MoE routers' micro-batch); `padding` is True for
    the padding micro-batches of interleaved stages (their router info must count nothing,
    `ep_lockstep.padding_moe_info`).
    Gradients of `sum(token loss * loss mask) * loss_scale` accumulate in the model
    (unless `forward_only`). Returns the unscaled masked loss sum of this rank's
    micro-batches on the last stage, a float64 device scalar that the caller reads (once
    per step: nothing here waits for the device), and 0.0 on the other stages.

    Every backward runs under the DDP's `no_sync()`; with `sync_in_last_backward` (an
    overlapped reduce, `grad_sync.sync_in_backward`) Megatron's 1F1B leaves it for the last
    backward (the last micro-batch: 1F1B runs the backwards in forward order), whose hooks
    start the gradient reduce over the pool. With several chunks every backward runs under
    `no_sync()` and `finalize_model_grads` starts the reduces.
    """
    if not batches:
        return 0.0
    is_last = engine.is_last_stage
    loss_sum = None

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        args, kwargs, num_tokens, context = stage_inputs(batch, id(batch) in pads)
        if not is_last:
            kwargs = dict(kwargs, labels=None)
        with context:
            output = model(*args, **kwargs)

        def loss_func(losses: torch.Tensor):
            nonlocal loss_sum
            masked = (losses[:, :num_tokens].float() * batch.loss_mask).sum()
            # Summed on the device in float64 (a host float's arithmetic, without a read);
            # the count is the host's, taken when the batch was read.
            total = masked.detach().double()
            loss_sum = total if loss_sum is None else loss_sum + total
            count = torch.tensor(int(batch.loss_tokens()), dtype=torch.int)
            return masked * loss_scale, count, {}

        return output, loss_func

    chunks = engine.chunks
    interleaved = len(chunks) > 1
    pads: set[int] = set()
    if interleaved:
        sync_in_last_backward = False
        batches, pads = interleaved_padding(
            batches,
            engine.pp_size,
            engine.model.config.microbatch_group_size_per_vp_stage,
            engine.replica,
            batches[0].tokens.device,
        )
    schedule = get_forward_backward_func(
        pp_size=engine.pp_size, vp_size=len(chunks) if interleaved else None
    )
    config = engine.model.config
    held = config.no_sync_func
    config.no_sync_func = engine.model.no_sync if sync_in_last_backward else None
    try:
        with contextlib.ExitStack() as stack:
            if not sync_in_last_backward:
                for chunk in chunks:
                    stack.enter_context(chunk.no_sync())
            schedule(
                forward_step_func=forward_step,
                data_iterator=[iter(batches) for _ in chunks] if interleaved else iter(batches),
                model=list(chunks),
                num_microbatches=len(batches),
                seq_length=1,  # shapes travel with every tensor (variable_seq_lengths)
                micro_batch_size=1,
                forward_only=forward_only,
            )
    finally:
        config.no_sync_func = held
    return loss_sum if is_last and loss_sum is not None else 0.0
