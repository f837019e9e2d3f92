"""One HDP training step on one rank: its micro-batches, one gradient sync, one update.

Loss normalisation (ByteScale Eq. 1-2): every rank scales its token losses by the *global*
number of loss tokens, gradients are summed over the pool (Megatron DDP with per-token
loss sums, it does not average), so the update equals single-process training on the
whole global batch, whatever the placement and the micro-batch counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_hdp.attention.ring import build_ring_spec
from megatron_hdp.attention.rope import RotaryTable
from megatron_hdp.batching import LocalBatch, TokenSource, gather_local_batch
from megatron_hdp.distributed.plan_check import check_plan_agreement
from megatron_hdp.distributed.ring_comm import CommStats
from megatron_hdp.megatron.core_attention import HDPPackedSeqParams
from megatron_hdp.megatron.engine import Engine
from megatron_hdp.megatron.model import GPTConfig
from megatron_hdp.scheduler.plan import StepPlan


@dataclass
class StepRuntime:
    """What stays fixed from step to step on one rank.

    Attributes:
        group: The HDP pool's process group (ring traffic and the gradient sync use it).
        cfg: The model shape (RoPE settings, dtype).
        backend: Attention block kernel (`attention.backends`).
        device: Where micro-batch tensors go.
        stats: Counters of attention traffic sent from this rank.
        check_plans: All-gather plan digests every step and fail on disagreement (debug).
    """

    group: dist.ProcessGroup
    cfg: GPTConfig
    backend: str = "torch"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    stats: CommStats = field(default_factory=CommStats)
    check_plans: bool = False


@dataclass(frozen=True)
class StepResult:
    """What one step did, seen from one rank (loss and token count are global)."""

    loss: float
    num_loss_tokens: int
    grad_norm: float | None
    update_successful: bool
    num_micro_batches: int
    attention_bytes_sent: int
    compute_seconds: float


def packed_seq_params(batch: LocalBatch, runtime: StepRuntime) -> HDPPackedSeqParams:
    """The THD parameters of one local batch, with its ring spec and RoPE table."""
    cu = batch.cu_seqlens()
    max_len = max(batch.shard.doc_lengths(), default=0)
    cfg = runtime.cfg
    rotary = None
    if cfg.position_embedding_type == "rope":
        rotary = RotaryTable.build(
            batch.position_ids[0],
            head_dim=cfg.head_dim,
            rotary_base=cfg.rotary_base,
            dtype=cfg.dtype,
        )
    return HDPPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
        local_cp_size=len(batch.ring),
        attention=build_ring_spec(
            batch.doc_lengths,
            batch.ring,
            rank=batch.rank,
            group=runtime.group,
            stats=runtime.stats,
            backend=runtime.backend,
        ),
        rotary=rotary,
    )


def local_batches(plan: StepPlan, source: TokenSource, runtime: StepRuntime) -> list[LocalBatch]:
    """This rank's micro-batches of `plan`, read from `source`, on the runtime's device.

    A ring member without tokens (a pack smaller than its ring) skips the micro-batch.
    """
    rank = dist.get_rank(runtime.group)
    batches = (gather_local_batch(plan, mb, rank, source) for mb in plan.for_rank(rank))
    return [batch.to(runtime.device) for batch in batches if batch.num_tokens > 0]


def _token_losses(model, batch: LocalBatch, runtime: StepRuntime) -> torch.Tensor:
    return model(
        batch.tokens,
        batch.position_ids,
        None,
        labels=batch.labels,
        packed_seq_params=packed_seq_params(batch, runtime),
    )


def forward_backward(
    model, batches: list[LocalBatch], runtime: StepRuntime, *, loss_scale: float
) -> float:
    """Run this rank's local batches in plan order; accumulate grads of `sum(loss) * loss_scale`.

    Ring micro-batches are collective over their rings. Returns the local token-loss sum.
    """
    loss_sum = 0.0
    for batch in batches:
        masked = (_token_losses(model, batch, runtime).float() * batch.loss_mask).sum()
        (masked * loss_scale).backward()
        loss_sum += float(masked.detach())
    return loss_sum


def train_step(
    engine: Engine, plan: StepPlan, source: TokenSource, runtime: StepRuntime
) -> StepResult:
    """Collective over `runtime.group` (the HDP pool): one optimizer step on the global batch.

    The plan is checked against the pool before any communication. This rank reads only
    its own tokens from `source`. The LR schedule advances by one step after a successful
    update.
    """
    group = runtime.group
    plan.validate(pool_size=dist.get_world_size(group))
    if runtime.check_plans:
        check_plan_agreement(plan, group)
    bytes_before = runtime.stats.bytes_sent
    batches = local_batches(plan, source, runtime)
    counts = torch.tensor([sum(float(b.loss_mask.sum()) for b in batches)], dtype=torch.float64)
    dist.all_reduce(counts, group=group)
    global_tokens = int(counts.item())
    if global_tokens == 0:
        raise ValueError("the global batch has no loss tokens (every loss mask is zero)")

    model = engine.model
    model.zero_grad_buffer()
    engine.optimizer.zero_grad()
    start = time.perf_counter()
    with model.no_sync():
        loss_sum = forward_backward(model, batches, runtime, loss_scale=1.0 / global_tokens)
    compute_seconds = time.perf_counter() - start
    model.finish_grad_sync()
    update_successful, grad_norm, _ = engine.optimizer.step()
    if update_successful:
        engine.scheduler.step(increment=1)

    loss = torch.tensor([loss_sum], dtype=torch.float64)
    dist.all_reduce(loss, group=group)
    return StepResult(
        loss=loss.item() / global_tokens,
        num_loss_tokens=global_tokens,
        grad_norm=None if grad_norm is None else float(grad_norm),
        update_successful=bool(update_successful),
        num_micro_batches=len(batches),
        attention_bytes_sent=runtime.stats.bytes_sent - bytes_before,
        compute_seconds=compute_seconds,
    )


def evaluate(model, plan: StepPlan, source: TokenSource, runtime: StepRuntime) -> tuple[float, int]:
    """Collective over `runtime.group`: forward only; return the global loss sum and tokens."""
    plan.validate(pool_size=dist.get_world_size(runtime.group))
    batches = local_batches(plan, source, runtime)
    totals = torch.zeros(2, dtype=torch.float64)
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                losses = _token_losses(model, batch, runtime).float()
                totals[0] += float((losses * batch.loss_mask).sum())
                totals[1] += float(batch.loss_mask.sum())
    finally:
        model.train()
    dist.all_reduce(totals, group=runtime.group)
    return totals[0].item(), int(totals[1].item())
