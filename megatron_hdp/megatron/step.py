"""One HDP training step on one rank: its micro-batches, one gradient sync, one update.

Loss normalisation (ByteScale Eq. 1-2): every rank scales its token losses by the *global*
number of loss tokens, gradients are summed over the pool (Megatron DDP with per-token
loss sums, it does not average), so the update equals single-process training on the
whole global batch, whatever the placement and the micro-batch counts.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads

from megatron_hdp.attention.dropout import PAD_DOC, MicroBatchKeys
from megatron_hdp.attention.kernels.registry import step_kernel
from megatron_hdp.attention.ring import build_ring_spec
from megatron_hdp.attention.rope import RotaryTable
from megatron_hdp.data.batching import LocalBatch, TokenSource, read_local
from megatron_hdp.distributed.plan_check import check_plan_agreement
from megatron_hdp.distributed.ring_comm import CommStats, RingComm
from megatron_hdp.host_copy import pack_int64, to_device, unpack
from megatron_hdp.megatron.core_attention import HDPPackedSeqParams
from megatron_hdp.megatron.engine import Engine
from megatron_hdp.megatron.ep_lockstep import padding_moe_info
from megatron_hdp.megatron.grad_sync import sync_in_backward
from megatron_hdp.megatron.model import GPTConfig
from megatron_hdp.megatron.moe import MoEMicroBatch, moe_micro_batch
from megatron_hdp.megatron.mtp import MTPShift, rescales_by_rolled_count, set_backward_scale
from megatron_hdp.megatron.pipeline import run_pipeline
from megatron_hdp.offload.hooks import OffloadManager
from megatron_hdp.scheduler.plan import StepPlan, lockstep_problems


@dataclass
class StepRuntime:
    """What stays fixed from step to step on one rank, besides the model.

    Attributes:
        group: The HDP pool's process group: ring traffic, and it must hold the same
            ranks as the data-parallel group the model's gradients are synced over.
        backend: Attention kernel (`attention.kernels.registry`). "auto", the default, is
            the CPU kernel `torch` on a CPU device; on any other device the job's resolved
            kernel must be given (`registry.job_kernel`), else construction raises
            ValueError: a CUDA runtime never falls back to a CPU kernel.
        device: Where micro-batch tensors go.
        stats: Counters of attention traffic sent from this rank.
        check_plans: All-gather plan digests every step and fail on disagreement (debug).
        offload: The activation offload manager installed on the model's layers; each
            micro-batch runs with its plan's offload ratio. None: no offloading.
        check_nonfinite: Compute the gradient norm before the update and skip the update
            (`StepResult.nonfinite`) if it or the global loss is not finite.
        progress: Called with a short description of what this rank starts next (a
            micro-batch, the gradient sync); the stall watchdog reports it.
        job_group: Every rank of the job (the pools of all TP ranks and stages); None: the
            pool alone (TP 1, PP 1). Plan agreement, checkpoints and the stop agreement run
            over it.
        pipeline_group: The stages of this rank's pipeline (the layout's `pp_group`); None:
            no pipeline parallelism. Only the Megatron-LM drop-in needs it.
        seed: The job's seed (`--seed`): keys the dropout masks (`attention.dropout`).
        iteration: The training iteration the next micro-batches belong to (steps completed
            before them): keys the dropout masks. `pretrain_hdp.py`'s loop and the
            Megatron-LM drop-in set it before each step; `schedule.hdp_forward_backward`
            advances it after each training call (a loop of your own that resumes sets it).
        mtp_depth: Multi-token prediction depths of the model (`--mtp-num-layers`; 0: none):
            micro-batches are read with their shifted targets (`LocalBatch.shifted`).
        mtp_mask_scale: Per MTP depth, the factor of its loss mask this step (`mtp.py`):
            set by `mtp_mask_scale` where Megatron-Core rescales by rolled token counts.
    """

    group: dist.ProcessGroup
    backend: str = "auto"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    stats: CommStats = field(default_factory=CommStats)
    check_plans: bool = False
    offload: OffloadManager | None = None
    check_nonfinite: bool = True
    progress: Callable[[str], None] | None = None
    job_group: dist.ProcessGroup | None = None
    pipeline_group: dist.ProcessGroup | None = None
    seed: int = 0
    iteration: int = 0
    mtp_depth: int = 0
    mtp_mask_scale: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        """Resolve "auto" for the device, or refuse a kernel that cannot run there."""
        self.device = torch.device(self.device)
        self.backend = step_kernel(self.backend, self.device)

    @property
    def all_ranks(self) -> dist.ProcessGroup:
        """The group of every rank of the job (`job_group`, or the pool with TP 1)."""
        return self.job_group if self.job_group is not None else self.group

    def mark(self, what: str) -> None:
        """Tell the progress listener (if any) what this rank starts now."""
        if self.progress is not None:
            self.progress(what)


@dataclass(frozen=True)
class StepResult:
    """What one step did, seen from one rank (loss, token count and grad norm are global)."""

    loss: float
    num_loss_tokens: int
    grad_norm: float | None
    update_successful: bool
    num_micro_batches: int
    attention_bytes_sent: int
    compute_seconds: float
    nonfinite: bool = False
    """The global loss or the gradient norm was not finite; the update was not applied."""
    moe_aux_loss: float = 0.0
    """The MoE load-balancing loss of the global batch, summed over layers (included in
    the gradients, not in `loss`)."""
    attention_bytes_total: int = 0
    """Ring attention bytes sent in this step by every rank of the job (all TP ranks and
    stages), from the step's loss all-reduce."""
    offload_bytes_total: int = 0
    """Activation bytes copied to host memory in this step by every rank of the job
    (offloading), from the same all-reduce."""
    micro_batch_times: tuple[tuple[float, float], ...] = ()
    """`(start, end)` of each micro-batch this rank ran, in run order: seconds since this
    rank began its micro-batches (right after the step's token-count all-reduce). Empty
    with pipeline parallelism (Megatron's 1F1B interleaves them)."""


def packed_seq_params(
    batch: LocalBatch, cfg: GPTConfig, runtime: StepRuntime
) -> HDPPackedSeqParams:
    """The THD parameters of one local batch, with its ring spec and RoPE table."""
    cu = batch.cu_seqlens()
    max_len = max(batch.shard.local_doc_lengths(), default=0)
    rotary = positions = None
    if cfg.multi_latent_attention:  # MLA rotates itself, at these positions (`megatron.mla`)
        positions = batch.position_ids[0]
    elif cfg.position_embedding_type == "rope":
        rotary = RotaryTable.build(
            batch.position_ids[0],
            head_dim=cfg.head_dim,
            rotary_base=cfg.rotary_base,
            rotary_percent=cfg.rotary_percent,
            interleaved=cfg.rotary_interleaved,
            dtype=cfg.dtype,
        )
    return HDPPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
        attention=build_ring_spec(
            batch.full_doc_lengths,
            batch.ring,
            rank=batch.rank,
            group=runtime.group,
            stats=runtime.stats,
            backend=runtime.backend,
            steps=batch.attention_steps(),
        ),
        rotary=rotary,
        dropout=dropout_keys(batch, cfg, runtime),
        mtp=mtp_shift(batch, cfg, runtime),
        positions=positions,
    )


def mtp_shift(batch: LocalBatch, cfg: GPTConfig, runtime: StepRuntime) -> MTPShift | None:
    """The shifted targets Megatron-Core's MTP rolls take for `batch` (`mtp.py`).

    None without MTP. Raises ValueError if the batch was read without them (or for another
    depth).
    """
    if cfg.mtp_num_layers is None:
        return None
    depth = batch.shifted.depth if batch.shifted is not None else 0
    if depth != cfg.mtp_num_layers:
        raise ValueError(
            f"the model has {cfg.mtp_num_layers} MTP layers but the micro-batch was read with "
            f"shifted targets for {depth} (read it with mtp_depth={cfg.mtp_num_layers}: "
            "StepRuntime.mtp_depth, HDPDataIterator(mtp_depth=...))"
        )
    return MTPShift(
        targets=batch.shifted.padded(sequence_parallel_pad(batch, cfg)),
        mask_scale=runtime.mtp_mask_scale,
    )


def mtp_mask_scale(batches: list[LocalBatch], runtime: StepRuntime) -> tuple[float, ...]:
    """Per MTP depth `k`, the global loss tokens over the global depth-`k` loss tokens.

    Collective over the pool where Megatron-Core rescales MTP losses by rolled token counts
    (0.19); else no communication and `()`. 0.0 where a depth has no token. Counted on the
    host.
    """
    if not runtime.mtp_depth or not rescales_by_rolled_count():
        return ()
    local = [0.0] * (runtime.mtp_depth + 1)
    for batch in batches:
        if batch.shifted is not None:
            counts = [batch.loss_tokens(), *batch.shifted.loss_tokens()]
            local = [a + b for a, b in zip(local, counts, strict=True)]
    counts = torch.tensor(local, dtype=torch.float64, device=runtime.device)
    dist.all_reduce(counts, group=runtime.group)
    total, *per_depth = counts.tolist()
    return tuple(total / n if n > 0 else 0.0 for n in per_depth)


def dropout_keys(batch: LocalBatch, cfg: GPTConfig, runtime: StepRuntime) -> MicroBatchKeys | None:
    """What identifies `batch`'s tokens for keyed dropout; None if the model has no dropout.

    A token is (its document's index in the global batch, its position in the document);
    the sequence-parallel pad tokens get `PAD_DOC`. Built on the host, one device copy.
    """
    if not (cfg.hidden_dropout or cfg.attention_dropout):
        return None
    return token_keys(batch, cfg, runtime)


def token_keys(batch: LocalBatch, cfg: GPTConfig, runtime: StepRuntime) -> MicroBatchKeys:
    """What identifies `batch`'s tokens whatever the placement.

    For keyed dropout (`dropout_keys`) and the MoE routers' keyed random logits
    (`moe.SequenceAuxLossRouter`). No communication.
    """
    if len(batch.doc_ids) != len(batch.full_doc_lengths):
        raise ValueError("keyed dropout needs the batch's document ids (LocalBatch.doc_ids)")
    pad = sequence_parallel_pad(batch, cfg)
    docs = torch.repeat_interleave(
        torch.tensor(batch.doc_ids, dtype=torch.int64),
        torch.tensor(batch.shard.local_doc_lengths(), dtype=torch.int64),
    )
    positions = torch.tensor(batch.shard.positions(), dtype=torch.int64)
    if pad:
        docs = torch.nn.functional.pad(docs, (0, pad), value=PAD_DOC)
        positions = torch.nn.functional.pad(positions, (0, pad))
    host, lengths = pack_int64([docs, positions])
    docs, positions = unpack(to_device(host, batch.tokens.device), lengths)
    return MicroBatchKeys(
        seed=runtime.seed,
        iteration=runtime.iteration,
        doc_ids=batch.doc_ids,
        token_docs=docs,
        token_positions=positions,
    )


def check_plan_fits(plan: StepPlan, engine: Engine, group: dist.ProcessGroup) -> None:
    """Raise ValueError (before any communication) if the plan cannot run on this pool/model."""
    plan.check_pool(dist.get_world_size(group))
    cfg = engine.cfg
    longest = int(plan.lengths.max())
    if cfg.position_embedding_type == "learned_absolute" and longest > cfg.max_position_embeddings:
        raise ValueError(
            f"a sequence of {longest} tokens exceeds the model's {cfg.max_position_embeddings} "
            "learned position embeddings"
        )
    if engine.pp_size > 1:
        problems = lockstep_problems(plan)
        if problems:
            raise ValueError(
                f"the {plan.policy!r} plan cannot run on pipelines in lock step: {problems[0]}"
                + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            )
    sync_ranks = dist.get_process_group_ranks(engine.model.dp_cp_group)
    pool_ranks = dist.get_process_group_ranks(group)
    if sorted(sync_ranks) != sorted(pool_ranks):
        raise ValueError(
            f"the pool group holds ranks {pool_ranks}, but the model syncs gradients over "
            f"{sync_ranks}; they must be the same ranks"
        )


def local_batches(plan: StepPlan, source: TokenSource, runtime: StepRuntime) -> list[LocalBatch]:
    """This rank's micro-batches of `plan`, read from `source`, on the runtime's device."""
    rank = dist.get_rank(runtime.group)
    batches = read_local(plan, source, rank, mtp_depth=runtime.mtp_depth)
    return [batch.to(runtime.device) for batch in batches]


def read_and_count(
    plan: StepPlan, source: TokenSource, runtime: StepRuntime, prepared=None
) -> tuple[list[LocalBatch], int]:
    """Collective: read the local batches, then all-reduce the loss-token count.

    `prepared`: `(batches, error)` already read by `read_local` (ahead of the step), in
    place of reading from `source` now. A read error on any rank is folded into the same
    all-reduce, so every rank raises it together instead of the others waiting forever in
    a ring.
    """
    host, error = [], None
    if prepared is not None:
        read, error = prepared
        host = [] if error is not None else read
    else:
        try:
            host = read_local(
                plan, source, dist.get_rank(runtime.group), mtp_depth=runtime.mtp_depth
            )
        except ValueError as err:
            error = err
    # Counted on the host, before the copies: no device read per micro-batch.
    local = sum(b.loss_tokens() for b in host)
    batches = [b.to(runtime.device) for b in host]
    counts = torch.tensor([local, 1.0 if error else 0.0], dtype=torch.float64)
    counts = counts.to(runtime.device)
    dist.all_reduce(counts, group=runtime.group)
    if error is not None:
        raise error
    total, failed = counts.tolist()
    if failed > 0:
        raise ValueError("another rank could not read its share of the global batch (see its log)")
    return batches, int(total)


#: Tokens an FP8 GEMM's token dimension must be a multiple of (Transformer Engine's FP8
#: kernels need dimensions divisible by 16).
FP8_TOKEN_MULTIPLE = 16


def token_multiple(cfg: GPTConfig) -> int:
    """What every micro-batch's token count is padded to a multiple of.

    TP under sequence parallelism (Megatron splits the tokens evenly over the TP ranks),
    FP8's 16 with `cfg.fp8`, the least common multiple of both; else 1. The padding has
    loss mask 0 and HDP attention skips it, so it changes no loss and no gradient.
    """
    multiple = cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1
    if cfg.fp8:
        multiple = math.lcm(multiple, FP8_TOKEN_MULTIPLE)
    return multiple


def sequence_parallel_pad(batch: LocalBatch, cfg: GPTConfig) -> int:
    """Pad tokens that make `batch` a multiple of `token_multiple(cfg)`.

    TP under sequence parallelism, FP8's 16, or both; 0 when nothing is padded.
    """
    return -batch.num_tokens % token_multiple(cfg)


def _model_inputs(
    engine: Engine, batch: LocalBatch, runtime: StepRuntime, global_tokens: int
) -> tuple[tuple, dict, int, MoEMicroBatch | None]:
    """The model's arguments for one local batch, its real token count, and its MoE info.

    With sequence parallelism Megatron splits the tokens evenly over the TP ranks, so they
    are padded to a multiple of TP here (HDP attention skips the pad rows); the losses of
    the first `n` (real) tokens are the batch's. `global_tokens` (all tokens of the global
    batch) normalises the MoE load-balancing loss (`moe.py`).
    """
    n = batch.num_tokens
    pad = sequence_parallel_pad(batch, engine.cfg)

    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, pad)) if pad else x

    params = packed_seq_params(batch, engine.cfg, runtime)
    moe = None
    if engine.cfg.num_experts is not None:
        moe = moe_batch_info(batch, params, pad=pad, global_batch_tokens=global_tokens)
    args = (padded(batch.tokens), padded(batch.position_ids), None)
    kwargs = {"labels": padded(batch.labels), "packed_seq_params": params}
    return args, kwargs, n, moe


def _token_losses(
    engine: Engine, batch: LocalBatch, runtime: StepRuntime, global_tokens: int
) -> tuple[torch.Tensor, torch.Tensor | float]:
    """Per-token losses `[1, t]` of one local batch, and its MoE load-balancing loss.

    The load-balancing loss's gradient is already in the graph; its value is a float64
    device scalar (0.0 without experts), not read here.
    """
    args, kwargs, n, moe = _model_inputs(engine, batch, runtime, global_tokens)
    with moe_micro_batch(moe) if moe is not None else contextlib.nullcontext():
        losses = engine.model(*args, **kwargs)
    return losses[:, :n], (moe.aux_loss if moe is not None else 0.0)


def _pipelined(
    engine: Engine,
    batches: list[LocalBatch],
    runtime: StepRuntime,
    *,
    loss_scale: float,
    global_batch_tokens: int,
    forward_only: bool = False,
) -> tuple[float, float]:
    """This rank's stage of its pipeline's micro-batches (`pipeline.run_pipeline`).

    Returns the loss sum (last stage; 0.0 elsewhere) and this stage's share of the MoE
    load-balancing loss (its own layers' terms), read from the device together, once.
    """
    if runtime.offload is not None:
        raise ValueError("activation offloading with pipeline parallelism is not supported")
    routed: list[MoEMicroBatch] = []

    def stage_inputs(batch: LocalBatch, padding: bool):
        args, kwargs, n, moe = _model_inputs(engine, batch, runtime, global_batch_tokens)
        if moe is None:
            return args, kwargs, n, contextlib.nullcontext()
        if padding:  # interleaved stages' padding: no loss, no aux term, no count
            return (
                args,
                kwargs,
                n,
                moe_micro_batch(padding_moe_info(batch, global_batch_tokens, None)),
            )
        routed.append(moe)
        return args, kwargs, n, moe_micro_batch(moe)

    runtime.mark(f"1F1B over {len(batches)} micro-batches (stage {engine.stage})")
    starts_sync = sync_in_backward(
        [len(b.ring) for b in batches],
        engine.model.ddp_config.overlap_grad_reduce and not forward_only,
    )
    loss = run_pipeline(
        engine,
        batches,
        stage_inputs=stage_inputs,
        loss_scale=loss_scale,
        forward_only=forward_only,
        sync_in_last_backward=bool(starts_sync and starts_sync[-1]),
    )
    return read_sums(loss, sum(moe.aux_loss for moe in routed))


def read_sums(*values: torch.Tensor | float) -> tuple[float, ...]:
    """`values` (device scalars or plain numbers) as floats, in one device read.

    The step's sums are accumulated on the device (float64 where they were host floats
    before, so they are the same numbers); reading them together costs one host sync.
    """
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return tuple(float(v) for v in values)
    read = iter(torch.stack([t.reshape(()).double() for t in tensors]).tolist())
    return tuple(next(read) if isinstance(v, torch.Tensor) else float(v) for v in values)


def moe_batch_info(
    batch: LocalBatch,
    params: HDPPackedSeqParams,
    *,
    pad: int,
    global_batch_tokens: int,
    aux_grad_scale: float = 1.0,
    tracker_scale: float | None = None,
    keys: MicroBatchKeys | None = None,
) -> MoEMicroBatch:
    """What the MoE routers need to compute the per-sequence aux loss of `batch`.

    `pad` tokens were appended for sequence parallelism; `aux_grad_scale` multiplies the
    gradient of the aux loss (the drop-in's Megatron finish divides every gradient by the
    global loss-token count afterwards); `tracker_scale` (None: no logging) puts the losses
    into Megatron's MoE loss tracker (`moe.MoEMicroBatch`). The segment ids and document
    lengths are built on the host and reach the device in one non-blocking copy
    (`host_copy`).
    """
    local = batch.shard.local_doc_lengths()
    num_docs = len(batch.full_doc_lengths)
    segments = torch.repeat_interleave(
        torch.arange(num_docs), torch.tensor(local, dtype=torch.int64), output_size=sum(local)
    )
    if pad:
        segments = torch.nn.functional.pad(segments, (0, pad), value=num_docs)
    host, lengths = pack_int64([segments, batch.full_doc_lengths])
    segments, doc_lengths = unpack(to_device(host, batch.tokens.device), lengths)
    comm = params.attention.comm
    # A communicator of its own: the counts are not attention traffic.
    ring = RingComm(comm.group, comm.ring) if comm is not None else None
    return MoEMicroBatch(
        segment_ids=segments,
        doc_lengths=batch.full_doc_lengths,
        device_doc_lengths=doc_lengths,
        global_tokens=global_batch_tokens,
        ring=ring,
        aux_grad_scale=aux_grad_scale,
        tracker_scale=tracker_scale,
        keys=keys,
    )


def forward_backward(
    engine: Engine,
    batches: list[LocalBatch],
    runtime: StepRuntime,
    *,
    loss_scale: float,
    global_batch_tokens: int | None = None,
    times: list[tuple[float, float]] | None = None,
) -> tuple[float, float]:
    """Run this rank's local batches in plan order; accumulate grads of the objective.

    The objective is `sum(loss) * loss_scale` plus the MoE load-balancing loss.
    Ring micro-batches are collective over their rings. Every micro-batch runs under the
    DDP's `no_sync()`, except, with `overlap_grad_reduce`, a local last one, whose backward
    starts the gradient reduce (collective over the pool; `grad_sync.sync_in_backward`).
    `global_batch_tokens` (every token of the global batch; default: these batches'
    tokens) normalises the load-balancing loss.
    Returns the local token-loss sum and this rank's share of the load-balancing loss. With
    pipeline parallelism the batches run through Megatron's 1F1B schedule (collective over
    the pipeline) and only the last stage returns a loss sum (0.0 elsewhere).
    `times`: if given, each batch's `(start, end)` `time.perf_counter()` is appended to it
    (not with pipeline parallelism).
    """
    if global_batch_tokens is None:
        global_batch_tokens = sum(b.num_tokens for b in batches)
    if engine.pp_size > 1:
        return _pipelined(
            engine,
            batches,
            runtime,
            loss_scale=loss_scale,
            global_batch_tokens=global_batch_tokens,
        )
    if engine.cfg.mtp_num_layers is not None:
        set_backward_scale(loss_scale)  # Megatron's schedules: the main loss's scale
    aux_sum = 0.0  # on the device (float64) with experts
    loss_sums = []  # on the device: read once, after the last micro-batch
    model = engine.model
    starts_sync = sync_in_backward(
        [len(b.ring) for b in batches], model.ddp_config.overlap_grad_reduce
    )
    for i, batch in enumerate(batches):
        runtime.mark(f"micro-batch {i + 1} of {len(batches)} (ring {batch.ring})")
        started = time.perf_counter()
        offload = (
            runtime.offload.micro_batch(batch.offload_ratio)
            if runtime.offload is not None
            else contextlib.nullcontext()
        )
        with offload, contextlib.nullcontext() if starts_sync[i] else model.no_sync():
            losses, aux = _token_losses(engine, batch, runtime, global_batch_tokens)
            masked = (losses.float() * batch.loss_mask).sum()
            (masked * loss_scale).backward()
        loss_sums.append(masked.detach())
        aux_sum = aux_sum + aux
        if times is not None:
            times.append((started, time.perf_counter()))
    loss_sum = torch.stack(loss_sums).sum() if loss_sums else 0.0
    return read_sums(loss_sum, aux_sum)


def _check_job_group(engine: Engine, runtime: StepRuntime) -> None:
    """ValueError unless the runtime's job group holds every rank of a TP or PP job.

    The loss is summed over the job (one contribution per replica), so with TP or PP the
    pool alone would see only part of it.
    """
    if engine.tp_size * engine.pp_size > 1 and runtime.job_group is None:
        raise ValueError(
            f"with tensor_model_parallel_size {engine.tp_size} and pipeline_model_parallel_size "
            f"{engine.pp_size} the StepRuntime needs job_group (every rank of the job)"
        )


def _own_loss(engine: Engine, loss_sum: float) -> float:
    """This rank's share of the global loss sum over all ranks of the job.

    Every TP rank of the last stage computes the same (full-vocabulary) losses of its
    replica's tokens; one of them (TP rank 0) contributes them.
    """
    return loss_sum if engine.is_last_stage and engine.tp_rank == 0 else 0.0


def optimizer_loss_scale(engine: Engine) -> float:
    """The loss scale of a float16 model's optimizer (Megatron's grad scaler), else 1.

    The optimizer divides it out of the gradients before its inf/nan check, its clip and
    its step, skips a step that overflowed and updates a dynamic scale. Reads it to the host.
    """
    if engine.cfg.dtype != torch.float16:
        return 1.0
    return float(engine.optimizer.get_loss_scale())


def train_step(
    engine: Engine,
    plan: StepPlan,
    source: TokenSource,
    runtime: StepRuntime,
    prepared=None,
    *,
    schedule_increment: int = 1,
) -> StepResult:
    """Collective over the job (`runtime.all_ranks`): one optimizer step on the global batch.

    The plan is checked against the pool and the model before any communication. This
    rank reads only its own tokens from `source`, or takes them from `prepared`
    (`read_and_count`'s `(batches, error)`, read ahead by the prefetch thread). The LR
    schedule advances by `schedule_increment` after a successful update (1 step, or the
    step's samples when it counts Megatron-LM's samples). With `runtime.check_nonfinite`,
    a step whose global loss or gradient norm is not finite applies no update and returns
    `nonfinite=True` on every rank.
    """
    group = runtime.group
    _check_job_group(engine, runtime)
    if runtime.check_plans:
        # Over every rank, so that the TP ranks and stages of a replica are compared too;
        # first, so that ranks with different plans fail together here.
        check_plan_agreement(plan, runtime.all_ranks, runtime.device)
    check_plan_fits(plan, engine, group)
    bytes_before = runtime.stats.bytes_sent
    offload_before = runtime.offload.engine.bytes_to_host if runtime.offload is not None else 0
    batches, global_tokens = read_and_count(plan, source, runtime, prepared)
    if global_tokens == 0:
        raise ValueError("the global batch has no loss tokens (every loss mask is zero)")
    runtime.mtp_mask_scale = mtp_mask_scale(batches, runtime)

    for chunk in engine.chunks:
        chunk.zero_grad_buffer()
    engine.optimizer.zero_grad()
    times: list[tuple[float, float]] = []
    start = time.perf_counter()
    loss_sum, aux_sum = forward_backward(
        engine,
        batches,
        runtime,
        loss_scale=optimizer_loss_scale(engine) / global_tokens,
        global_batch_tokens=plan.total_tokens(),
        times=times,
    )
    compute_seconds = time.perf_counter() - start
    runtime.mark("gradient sync")
    # Megatron's own finish: the pool's gradient sync (started already in the backward of a
    # local last micro-batch with overlap_grad_reduce) plus the TP all-reduce of the grads of
    # parameters replicated over a sequence-parallel region (the norms).
    finalize_model_grads(list(engine.chunks))
    checked_norm = None
    if runtime.check_nonfinite:
        # Megatron's step computes the norm, clips and updates in one call; the norm is
        # needed before the update to refuse it. prepare_grads() is idempotent and
        # get_grad_norm() is collective for the distributed optimizer, identical everywhere.
        engine.optimizer.prepare_grads()
        checked_norm = float(engine.optimizer.get_grad_norm())
    bad_norm = checked_norm is not None and not math.isfinite(checked_norm)
    bytes_sent = runtime.stats.bytes_sent - bytes_before
    offloaded = (
        runtime.offload.engine.bytes_to_host - offload_before if runtime.offload is not None else 0
    )
    # The attention and offload bytes ride along (exact in float64 below 2**53).
    totals = torch.tensor(
        [
            _own_loss(engine, loss_sum),
            1.0 if bad_norm else 0.0,
            float(bytes_sent),
            float(offloaded),
        ],
        dtype=torch.float64,
        device=runtime.device,
    )
    dist.all_reduce(totals, group=runtime.all_ranks)
    loss = totals[0].item() / global_tokens
    aux_loss = 0.0
    if engine.cfg.num_experts is not None:
        # Each TP rank holds the aux terms of its own tokens (sequence parallelism).
        aux = torch.tensor([aux_sum], dtype=torch.float64, device=runtime.device)
        dist.all_reduce(aux, group=runtime.all_ranks)
        aux_loss = aux.item()
    nonfinite = runtime.check_nonfinite and (not math.isfinite(loss) or totals[1].item() > 0)
    update_successful, grad_norm = False, checked_norm
    if not nonfinite:
        runtime.mark("optimizer step")
        update_successful, step_norm, _ = engine.optimizer.step()
        # Megatron reports no norm (or 0.0) without clipping; the guard's is the same norm.
        grad_norm = checked_norm if checked_norm is not None else step_norm
        if update_successful:
            engine.scheduler.step(increment=schedule_increment)
    return StepResult(
        loss=loss,
        num_loss_tokens=global_tokens,
        grad_norm=None if grad_norm is None else float(grad_norm),
        update_successful=bool(update_successful),
        num_micro_batches=len(batches),
        attention_bytes_sent=bytes_sent,
        compute_seconds=compute_seconds,
        nonfinite=nonfinite,
        moe_aux_loss=aux_loss,
        attention_bytes_total=int(totals[2].item()),
        offload_bytes_total=int(totals[3].item()),
        micro_batch_times=tuple((a - start, b - start) for a, b in times),
    )


def evaluate(
    engine: Engine, plan: StepPlan, source: TokenSource, runtime: StepRuntime, prepared=None
) -> tuple[float, int]:
    """Collective over the job: forward only; return the global loss sum and loss tokens.

    `prepared`: `(batches, error)` already read, as `read_and_count` takes it.
    """
    _check_job_group(engine, runtime)
    check_plan_fits(plan, engine, runtime.group)
    batches, num_tokens = read_and_count(plan, source, runtime, prepared)
    batch_tokens = plan.total_tokens()
    loss_sum = torch.zeros(1, dtype=torch.float64, device=runtime.device)
    for chunk in engine.chunks:
        chunk.eval()
    try:
        with torch.no_grad():
            if engine.pp_size > 1:
                loss_sum += _pipelined(
                    engine,
                    batches,
                    runtime,
                    loss_scale=1.0,
                    global_batch_tokens=batch_tokens,
                    forward_only=True,
                )[0]
            else:
                for batch in batches:
                    losses = _token_losses(engine, batch, runtime, batch_tokens)[0].float()
                    loss_sum += (losses * batch.loss_mask).sum().double()
    finally:
        for chunk in engine.chunks:
            chunk.train()
    loss_sum.fill_(_own_loss(engine, loss_sum.item()))
    dist.all_reduce(loss_sum, group=runtime.all_ranks)
    return loss_sum.item(), num_tokens
