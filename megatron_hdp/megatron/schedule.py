"""Drop-in pieces for an existing Megatron-LM `pretrain_gpt.py`-style job (host layer).

Megatron-LM's loop (`megatron.training.pretrain`) is not in the megatron-core wheel, so it
cannot be run here; these pieces follow its contracts and are tested against a
`forward_step` written the way `pretrain_gpt.py` writes it, with Megatron-Core's own
`finalize_model_grads`:

- `HDPDataIterator` (from `data.iterator`, re-exported here): an "external" data loader
  (`--dataloader-type external`): one `HDPGlobalBatch` (the step's plan, a token source and
  this rank's micro-batches read ahead) per training step.
- `hdp_forward_backward(runtime)`: a function with the keyword signature of Megatron's
  `get_forward_backward_func()` schedules. It runs this rank's micro-batches of the step's
  plan, calls your `forward_step_func(data_iterator, model)` once per micro-batch with a
  one-batch iterator (a Megatron-style batch dict whose `packed_seq_params` carries HDP
  attention), back-propagates the per-token loss sum (times the optimizer's loss scale,
  `config.grad_scale_func`, as Megatron's schedules do: `--fp16`), and calls
  `config.finalize_model_grads_func(model, num_tokens)`, which all-reduces the gradients
  and the token count over the pool and divides by it. Needs `calculate_per_token_loss`.
  With pipeline parallelism (experts too) it hands this rank's micro-batches to
  Megatron-Core's own 1F1B schedule instead (every stage gets the same batch dicts; the
  plan must be lock-step, `scheduler.plan.lockstep_problems`), which calls the finish
  itself. Your `forward_step`
  must pass `packed_seq_params` to the model on every stage (HDP attention needs the
  token layout and the ring on each), unlike Megatron-LM's stock `get_batch`, which
  returns nothing on the middle stages.
  With virtual pipeline stages (a list of model chunks, `--num-layers-per-virtual-pipeline-
  stage`) it runs Megatron-Core's interleaved 1F1B; every chunk reads the same batch
  dicts, and the list is padded with one-token micro-batches of loss mask 0 to a count
  the interleaved schedule accepts (`scheduler.interleaved.padded_count`).
  With multi-token prediction (`megatron.mtp`) it must
  not pass the loss mask to the model (the MTP masks travel in `packed_seq_params`;
  Megatron-Core 0.19 would rescale the MTP losses by the given mask's local sum), as
  `megatron_lm.hooks.hdp_forward_step` does.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from megatron_hdp.data.batching import LocalBatch
from megatron_hdp.data.iterator import HDPDataIterator, HDPGlobalBatch
from megatron_hdp.megatron.ep_lockstep import lockstep_slots, padding_batch, padding_moe_info
from megatron_hdp.megatron.grad_sync import OrderedGradSync, sync_in_backward
from megatron_hdp.megatron.model import GPTConfig
from megatron_hdp.megatron.moe_context import carry_into_backward, moe_micro_batch
from megatron_hdp.megatron.mtp import set_backward_scale
from megatron_hdp.megatron.pipeline import interleaved_padding
from megatron_hdp.megatron.step import (
    StepRuntime,
    local_batches,
    moe_batch_info,
    mtp_mask_scale,
    packed_seq_params,
    read_and_count,
    sequence_parallel_pad,
    token_keys,
)
from megatron_hdp.scheduler.plan import lockstep_problems

__all__ = ["HDPDataIterator", "HDPGlobalBatch", "hdp_forward_backward", "megatron_batch"]


def _local(step: HDPGlobalBatch, runtime: StepRuntime) -> list[LocalBatch]:
    """This rank's micro-batches of `step` on the device: the ones read ahead, or read now."""
    if step.local is None:
        return local_batches(step.plan, step.source, runtime)
    if step.rank != torch.distributed.get_rank(runtime.group):
        raise ValueError(
            f"the batch was read ahead for pool rank {step.rank}, but this is pool rank "
            f"{torch.distributed.get_rank(runtime.group)}: give HDPDataIterator this rank's "
            "pool_rank (ParallelLayout.pool_rank)"
        )
    if step.read_error is not None:
        raise step.read_error
    return [batch.to(runtime.device) for batch in step.local]


def megatron_batch(batch: LocalBatch, cfg: GPTConfig, runtime: StepRuntime) -> dict:
    """The batch dict a `pretrain_gpt.py`-style `get_batch` returns, for one HDP micro-batch.

    With tensor parallelism `runtime.group` must be the layout's `pool_group`. With sequence
    parallelism the tokens are padded to a multiple of TP (Megatron splits them evenly);
    the pad positions have loss mask 0 and HDP attention skips them.
    """
    pad = sequence_parallel_pad(batch, cfg)

    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, pad)) if pad else x

    return {
        "tokens": padded(batch.tokens),
        "labels": padded(batch.labels),
        "loss_mask": padded(batch.loss_mask),
        "position_ids": padded(batch.position_ids),
        "attention_mask": None,
        "packed_seq_params": packed_seq_params(batch, cfg, runtime),
    }


#: Pool groups warmed up in this process (`warm_up_pool` runs once per group).
_WARMED_UP: weakref.WeakSet = weakref.WeakSet()


def warm_up_pool(runtime: StepRuntime) -> None:
    """Collective over `runtime.group`: one tiny all-reduce over the whole pool, once.

    The first ring exchange of a step involves only the ring's members, and torch leaves a
    group's first `batch_isend_irecv` undefined unless every rank of the group takes part
    (NCCL sets the group's communicator up on first use). One collective over the pool
    first sets it up on every rank. Later calls for the same group do nothing (on every
    rank alike, so the collectives still line up).
    """
    if runtime.group in _WARMED_UP:
        return
    torch.distributed.all_reduce(torch.zeros(1, device=runtime.device), group=runtime.group)
    _WARMED_UP.add(runtime.group)


def _overlapped(model_chunk) -> bool:
    """Whether `model_chunk` (Megatron-LM's DDP) overlaps its gradient reduce.

    If so, its reduces are put in one order on every rank (`grad_sync.OrderedGradSync`,
    installed on the first call).
    """
    ddp_config = getattr(model_chunk, "ddp_config", None)
    if ddp_config is None or not ddp_config.overlap_grad_reduce:
        return False
    OrderedGradSync.install(model_chunk)
    return True


def gather_params_if_idle(model_chunk) -> None:
    """The parameter all-gathers a forward pass would have run, for a rank with no micro-batch.

    Collective over the data-parallel group of `model_chunk`'s distributed optimizer.
    With the distributed optimizer and `--overlap-param-gather`, Megatron-Core's optimizer
    step does not all-gather the updated parameters: the forward pre-hooks of the next
    forward do (`DistributedDataParallel._make_forward_pre_hook`: each one finishes the
    all-gather of its parameters' bucket group, starting it first if it was not, and starts
    the next group's). A pool rank with no micro-batch in a step runs no forward, so it
    would skip those all-gathers, go straight to the gradient reduce-scatter while the
    busy ranks wait in their all-gather, and the job would hang (and its parameters would
    stay stale). This runs the same pre-hook over the model's modules in their order, as
    a forward does. Does nothing unless the pre-hooks are installed (Megatron-LM takes
    them off for the first step, evaluation and checkpointing, and all-gathers
    synchronously on every rank then).
    """
    if not getattr(model_chunk, "use_forward_hook", False):
        return
    if not getattr(model_chunk, "remove_forward_pre_hook_handles", None):
        return  # hooks off: Megatron-LM all-gathers on every rank itself
    hook = model_chunk._make_forward_pre_hook()  # noqa: SLF001 - the forward's own logic
    for module in model_chunk.module.modules():
        hook(module)


@contextlib.contextmanager
def _interleaved_grad_sync(chunks: list):
    """The overlapped reduce in Megatron's interleaved 1F1B: after the last backward.

    Megatron's interleaved schedule starts each chunk's reduce in that chunk's last backward,
    which may be a ring micro-batch's (`grad_sync.py` says why that is unsafe); here every
    chunk stays in `no_sync()` through the schedule and `finalize_model_grads` starts the
    reduces, chunk by chunk, in the same order on every rank.
    """
    if not any([_overlapped(chunk) for chunk in chunks]):
        yield
        return
    config = get_model_config(chunks[0])
    held = config.no_sync_func, config.grad_sync_func
    config.no_sync_func = config.grad_sync_func = None
    try:
        with contextlib.ExitStack() as stack:
            for chunk in chunks:
                stack.enter_context(chunk.no_sync())
            yield
    finally:
        config.no_sync_func, config.grad_sync_func = held


@contextlib.contextmanager
def _pipeline_grad_sync(model_chunk, batches: list[LocalBatch]):
    """The overlapped reduce in Megatron's 1F1B: in the last backward only if it is local.

    Megatron's 1F1B enables the reduce for the last backward; for a ring micro-batch it is
    kept off here, and the reduce starts after the backward (`grad_sync.py` says why).
    Megatron-LM sets `config.no_sync_func` for `--overlap-grad-reduce` (and, with
    `--align-grad-reduce`, its default, `config.grad_sync_func`); the schedule enters it
    first and leaves it before the last backward.
    """
    if not _overlapped(model_chunk):
        yield
        return
    config = get_model_config(model_chunk)
    held = config.no_sync_func, config.grad_sync_func
    if sync_in_backward([len(b.ring) for b in batches], True)[-1:] == [True]:
        config.no_sync_func = model_chunk.no_sync
        manager = contextlib.nullcontext()
    else:
        # The schedule's own enabling does nothing; finalize_model_grads starts the reduce.
        config.no_sync_func = config.grad_sync_func = None
        manager = model_chunk.no_sync()
    try:
        with manager:
            yield
    finally:
        config.no_sync_func, config.grad_sync_func = held


def _scaled(config, loss: torch.Tensor) -> torch.Tensor:
    """`loss` times the optimizer's loss scale, as Megatron's `backward_step` back-propagates it.

    Megatron-LM sets `config.grad_scale_func` to the optimizer's `scale_loss`: with `--fp16`
    the dynamic (or `--loss-scale`) scale, which the optimizer divides out of the gradients
    before its inf/nan check and step; 1 otherwise. The per-token loss sum is scaled, and
    `finalize_model_grads` divides by the global token count as without scaling.
    """
    return loss if config.grad_scale_func is None else config.grad_scale_func(loss)


def _loss_scale(config, device: torch.device) -> float:
    """The optimizer's loss scale (1 without `config.grad_scale_func`); reads it to the host."""
    if config.grad_scale_func is None:
        return 1.0
    return float(config.grad_scale_func(torch.ones(1, device=device)))


def _mtp_loss_scale(config, device: torch.device) -> float:
    """The MTP losses' backward scale, as Megatron's schedules take it.

    `config.mtp_grad_scale_func()` where Megatron-Core has it (0.19), else the optimizer's loss
    scale (`_loss_scale`).
    """
    func = getattr(config, "mtp_grad_scale_func", None)
    if func is not None:
        return float(torch.as_tensor(func()).reshape(-1)[0])
    return _loss_scale(config, device)


def hdp_forward_backward(
    runtime: StepRuntime,
    cfg: GPTConfig,
    *,
    empty_report: Callable[[], dict] | None = None,
    moe_tracker_scale: Callable[[], float] | None = None,
) -> Callable:
    """Collective: a forward/backward function for Megatron-LM's `train_step` (HDP plans).

    Use it where Megatron-LM calls `get_forward_backward_func()`; call it once at set-up,
    on every rank of `runtime.group`: it warms the pool up (`warm_up_pool`) before any
    ring exchange. The returned function is collective over `runtime.group` (rings within
    it, one gradient sync over all of it), and with pipeline parallelism over
    `runtime.pipeline_group` too (experts included: each forward of Megatron's 1F1B runs
    inside its micro-batch's router info, `moe.moe_micro_batch`).
    A rank that runs no micro-batch in a step (HDP allows it) returns `[empty_report()]`
    (default `{"lm loss": zeros(2)}`), since Megatron-LM's `train_step` reads the keys of
    the first report and all-reduces each; with `--overlap-param-gather` it first runs the
    parameter all-gathers its skipped forward would have run (`gather_params_if_idle`).
    With experts, `moe_tracker_scale()` (if given) is the factor the routers multiply their
    losses by in Megatron's MoE loss tracker (`moe.MoEMicroBatch.tracker_scale`): Megatron-LM
    passes its micro-batch count, which its `training_log` divides the tracked sums by.
    """
    warm_up_pool(runtime)

    def _experts_across_replicas() -> bool:
        """Whether an EP group spans pool ranks (its all-to-all needs lock step)."""
        if cfg.num_experts is None:
            return False
        ep = parallel_state.get_expert_model_parallel_world_size()
        etp = parallel_state.get_expert_tensor_parallel_world_size()
        return ep * etp > cfg.tensor_model_parallel_size

    def zero_report() -> dict:
        if empty_report is not None:
            return empty_report()
        return {"lm loss": torch.zeros(2, device=runtime.device)}

    def _with_padding(step, batches, padding: set[int]) -> list[LocalBatch]:
        """Collective over the EP group: `batches` in this rank's lock-step slots.

        Padding batches (`ep_lockstep`) fill the gaps; their ids go into `padding`.
        """
        rank = torch.distributed.get_rank(runtime.group)
        slots = lockstep_slots(
            step.plan, rank, parallel_state.get_expert_model_parallel_group(), runtime.device
        )
        if sum(slots) != len(batches):
            raise RuntimeError(
                f"pool rank {rank} has {len(batches)} micro-batches but {sum(slots)} plan slots"
            )
        real, out = iter(batches), []
        for used in slots:
            out.append(
                next(real) if used else padding_batch(rank, runtime.device, runtime.mtp_depth)
            )
            if not used:
                padding.add(id(out[-1]))
        return out

    def _moe_inputs(step, forward_only, config):
        """This rank's batches, and the factory of each one's `moe.MoEMicroBatch` (or None).

        Collective over `runtime.group` with experts in training (the loss-token count).
        Megatron's finish divides every gradient by the global loss-token count; the MoE
        load-balancing loss and z-loss are already normalised (`moe.py`), so their gradient
        is scaled up by that count and by the loss scale of `config.grad_scale_func`
        (`--fp16`), as the LM loss is on both paths.
        """
        if cfg.num_experts is None:
            return _local(step, runtime), None
        aux_grad_scale, tracker_scale = 1.0, None
        if forward_only:
            batches = _local(step, runtime)
        else:
            tracker_scale = None if moe_tracker_scale is None else float(moe_tracker_scale())
            prepared = None if step.local is None else (step.local, step.read_error)
            batches, loss_tokens = read_and_count(step.plan, step.source, runtime, prepared)
            # The LM loss is back-propagated times the optimizer's loss scale on both paths
            # (`_scaled` here, Megatron's 1F1B with PP): the MoE losses get it too.
            aux_grad_scale = float(loss_tokens) * _loss_scale(config, runtime.device)
        padding: set[int] = set()
        if _experts_across_replicas():
            batches = _with_padding(step, batches, padding)

        def info(batch, megatron_dict):
            if id(batch) in padding:
                return padding_moe_info(batch, step.plan.total_tokens(), tracker_scale)
            forced = getattr(config, "moe_router_force_load_balancing", False)
            return moe_batch_info(
                batch,
                megatron_dict["packed_seq_params"],
                pad=sequence_parallel_pad(batch, cfg),
                global_batch_tokens=step.plan.total_tokens(),
                aux_grad_scale=aux_grad_scale,
                tracker_scale=tracker_scale,
                keys=token_keys(batch, cfg, runtime) if forced else None,
            )

        return batches, info

    def _pipelined(step, chunks, forward_step_func, forward_only, force_all_reduce):
        if runtime.pipeline_group is None:
            raise ValueError(
                "with pipeline parallelism the StepRuntime needs pipeline_group (the layout's "
                "pp_group): the last stage must know it is last to report a loss"
            )
        problems = lockstep_problems(step.plan)
        if problems:
            raise ValueError(f"the plan cannot run on pipelines in lock step: {problems[0]}")
        config = get_model_config(chunks[0])
        batches, moe_info = _moe_inputs(step, forward_only, config)
        if not batches:
            for chunk in chunks:
                gather_params_if_idle(chunk)
        pads: set[int] = set()
        interleaved = len(chunks) > 1
        if interleaved and batches:
            batches, pads = interleaved_padding(
                batches,
                cfg.pipeline_model_parallel_size,
                config.microbatch_group_size_per_vp_stage,
                torch.distributed.get_rank(runtime.group),
                runtime.device,
            )
        dicts = [megatron_batch(b, cfg, runtime) for b in batches]
        if moe_info is not None:
            # Megatron's schedules call forward_step_func once per micro-batch and chunk, in
            # micro-batch order on each chunk: each call runs its forward inside its
            # micro-batch's router info.
            total = step.plan.total_tokens()
            infos = [
                padding_moe_info(b, total, None) if id(b) in pads else moe_info(b, d)
                for b, d in zip(batches, dicts, strict=True)
            ]
            per_chunk = {id(chunk): iter(infos) for chunk in chunks}
            user_forward_step = forward_step_func

            @functools.wraps(user_forward_step)
            def forward_step_func(data_iterator, model, *args, **kwargs):
                # Megatron runs this micro-batch's backward later, on its own: the output
                # carries the router info there for layers it recomputes.
                info = next(per_chunk[id(model)])
                with moe_micro_batch(info):
                    output, *rest = user_forward_step(data_iterator, model, *args, **kwargs)
                return (carry_into_backward(output, info), *rest)

        schedule = get_forward_backward_func(
            pp_size=cfg.pipeline_model_parallel_size,
            vp_size=len(chunks) if interleaved else None,
        )
        with contextlib.ExitStack() as stack:
            if forward_only:
                stack.enter_context(torch.no_grad())
            elif interleaved:
                stack.enter_context(_interleaved_grad_sync(chunks))
            else:
                stack.enter_context(_pipeline_grad_sync(chunks[0], batches))
            reports = schedule(
                forward_step_func=forward_step_func,
                data_iterator=[iter(dicts) for _ in chunks] if interleaved else iter(dicts),
                model=list(chunks),
                num_microbatches=len(batches),
                seq_length=1,  # shapes travel with every tensor (variable_seq_lengths)
                micro_batch_size=1,
                forward_only=forward_only,
                force_all_reduce=force_all_reduce,
            )
        last_stage = (
            torch.distributed.get_rank(runtime.pipeline_group)
            == torch.distributed.get_world_size(runtime.pipeline_group) - 1
        )
        return list(reports) or ([zero_report()] if last_stage else [])

    def forward_backward(
        *,
        forward_step_func,
        data_iterator,
        model,
        num_microbatches=None,
        seq_length=None,
        micro_batch_size=None,
        decoder_seq_length=None,
        forward_only=False,
        collect_non_loss_data=False,
        first_val_step=None,
        adjust_tensor_shapes_fn=None,
        p2p_communicator=None,
        pg_collection=None,
        force_all_reduce=False,
    ) -> list:
        chunks = model if isinstance(model, list) else [model]
        if len(chunks) != 1 and cfg.pipeline_model_parallel_size == 1:
            raise ValueError(
                f"{len(chunks)} model chunks without pipeline parallelism: virtual pipeline "
                "stages need --pipeline-model-parallel-size > 1"
            )
        model_chunk = chunks[0]
        config = get_model_config(model_chunk)
        if not config.calculate_per_token_loss:
            raise ValueError("HDP needs calculate_per_token_loss=True (token-level loss)")
        step = next(data_iterator)
        step.plan.check_pool(torch.distributed.get_world_size(runtime.group))
        reports = _run(step, chunks, config, forward_step_func, forward_only, force_all_reduce)
        if not forward_only:
            # The next training call is the next iteration (it keys the dropout masks); a loop
            # that resumes sets `runtime.iteration` itself, as the Megatron-LM drop-in does.
            runtime.iteration += 1
        return reports

    def _run(step, chunks, config, forward_step_func, forward_only, force_all_reduce):
        model_chunk = chunks[0]
        if cfg.pipeline_model_parallel_size > 1:
            return _pipelined(step, chunks, forward_step_func, forward_only, force_all_reduce)
        reports = []
        # Summed on the device as Megatron's own schedules do: no host read per micro-batch.
        num_tokens = torch.zeros((), dtype=torch.int64, device=runtime.device)
        batches, moe_info = _moe_inputs(step, forward_only, config)
        if cfg.mtp_num_layers is not None:
            # As Megatron's schedules with calculate_per_token_loss: the MTP losses go back
            # with the main loss's scale; finalize_model_grads divides both by the tokens.
            set_backward_scale(_mtp_loss_scale(config, runtime.device))
            runtime.mtp_mask_scale = mtp_mask_scale(batches, runtime)
        no_sync = config.no_sync_func or contextlib.nullcontext
        overlap = _overlapped(model_chunk) and not forward_only
        if overlap:
            no_sync = model_chunk.no_sync
        starts_sync = sync_in_backward([len(b.ring) for b in batches], overlap)
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            for batch, sync_here in zip(batches, starts_sync, strict=True):
                megatron_dict = megatron_batch(batch, cfg, runtime)
                info = None if moe_info is None else moe_info(batch, megatron_dict)
                routers = contextlib.nullcontext() if info is None else moe_micro_batch(info)
                with contextlib.nullcontext() if sync_here else no_sync(), routers:
                    output, loss_func = forward_step_func(iter([megatron_dict]), model_chunk)
                    # A recomputed MoE layer (--recompute-modules moe) routes again in the
                    # backward, which on CUDA runs on autograd's own thread: the output
                    # carries the router info there.
                    if info is not None:
                        output = carry_into_backward(output, info)
                    loss_sum, tokens, report = loss_func(output)
                    if not forward_only:
                        _scaled(config, loss_sum).backward()
                reports.append(report)
                num_tokens += tokens
        if not reports:
            gather_params_if_idle(model_chunk)
            reports.append(zero_report())
        if not forward_only and config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func(chunks, num_tokens, force_all_reduce=force_all_reduce)
        return reports

    return forward_backward
