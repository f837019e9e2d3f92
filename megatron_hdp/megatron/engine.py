"""Megatron-Core set-up for HDP training: DDP wrapper, optimizer, schedule (host layer).

The process groups come from `distributed.layout` (initialise it first): the HDP pool is
Megatron's data-parallel group with context parallelism 1, every HDP rank is a model
replica, rings are formed per micro-batch by HDP attention itself, and Megatron's gradient
sync over the data-parallel group is the one sync over the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_hdp.megatron.grad_sync import OrderedGradSync
from megatron_hdp.megatron.model import (
    GPTConfig,
    build_gpt,
    model_parallel_dims,
    transformer_config,
)
from megatron_hdp.megatron.parallel_state import set_model_chunks
from megatron_hdp.offload.host_budget import HostBudget, host_budget


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Optimizer settings (Megatron flag names in parentheses)."""

    lr: float = 1e-3
    """Peak learning rate (--lr)."""
    weight_decay: float = 0.01
    """Decoupled weight decay (--weight-decay)."""
    adam_beta1: float = 0.9
    """(--adam-beta1)."""
    adam_beta2: float = 0.95
    """(--adam-beta2)."""
    adam_eps: float = 1e-8
    """(--adam-eps)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables (--clip-grad)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over the pool, reduce-scatter grads (--use-distributed-optimizer)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (--min-lr)."""
    lr_warmup_iters: int = 0
    """Linear warm-up steps (--lr-warmup-iters)."""
    lr_decay_iters: int | None = None
    """Step at which the decay ends, counted from step 0 like Megatron's --lr-decay-iters
    (warm-up included); None = constant learning rate."""
    schedule_in_samples: bool = False
    """The schedule counts Megatron-LM's samples (--train-samples, --lr-*-samples,
    --rampup-batch-size): `lr_warmup_iters` / `lr_decay_iters` are then sample counts and
    each step advances it by its samples (`train_step`'s `schedule_increment`)."""
    lr_decay_style: str = "constant"
    """"constant", "linear", "cosine" or "inverse-square-root" (--lr-decay-style)."""
    override_scheduler: bool = False
    """On load, take this schedule, not the checkpoint's (--override-opt_param-scheduler)."""
    use_checkpoint_scheduler: bool = False
    """On load, keep the checkpoint's schedule (--use-checkpoint-opt_param-scheduler); with
    neither flag, loading a checkpoint of another schedule fails."""
    overlap_grad_reduce: bool = False
    """Start the bucketed gradient reduce in the backward of each rank's last micro-batch
    when it is local (`grad_sync.py`), else right after the backward (--overlap-grad-reduce)."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and reduce gradients in float32 (Megatron-LM's setting for bf16 parameters,
    --accumulate-allreduce-grads-in-fp32); False: in the parameters' dtype
    (--grad-reduce-in-bf16)."""
    ddp_bucket_size: int | None = None
    """Elements per gradient bucket of the overlapped reduce (--ddp-bucket-size); None:
    Megatron's default, max(4e7, 1e6 x pool size). Without overlap one bucket per dtype."""
    fp16: bool = False
    """Float16 parameters: Megatron's mixed-precision optimizer scales the loss (--fp16)."""
    loss_scale: float | None = None
    """A constant loss scale; None: dynamic (--loss-scale)."""
    initial_loss_scale: float = 2.0**32
    """(--initial-loss-scale)."""
    min_loss_scale: float = 1.0
    """(--min-loss-scale)."""
    loss_scale_window: float = 1000
    """(--loss-scale-window)."""
    hysteresis: int = 2
    """(--hysteresis)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr {self.min_lr} must lie in [0, lr={self.lr}]")
        if self.lr_decay_style not in ("constant", "linear", "cosine", "inverse-square-root"):
            raise ValueError(f"unknown lr_decay_style {self.lr_decay_style!r}")
        if self.lr_warmup_iters < 0:
            raise ValueError(f"lr_warmup_iters must be >= 0, got {self.lr_warmup_iters}")
        if self.lr_decay_iters is not None and self.lr_decay_iters <= self.lr_warmup_iters:
            raise ValueError(
                f"lr_decay_iters {self.lr_decay_iters} must exceed lr_warmup_iters "
                f"{self.lr_warmup_iters}"
            )
        if self.ddp_bucket_size is not None and self.ddp_bucket_size <= 0:
            raise ValueError(f"ddp_bucket_size must be > 0, got {self.ddp_bucket_size}")
        if self.ddp_bucket_size is not None and not self.overlap_grad_reduce:
            raise ValueError(
                f"ddp_bucket_size {self.ddp_bucket_size} needs overlap_grad_reduce (without it "
                "Megatron reduces one bucket per dtype)"
            )


@dataclass
class Engine:
    """The trainable state of one rank: DDP-wrapped model, optimizer, LR/WD schedule.

    With virtual pipeline stages the rank holds several model chunks (`chunks`, in
    Megatron's order); `model` is the first.
    """

    cfg: GPTConfig
    model: DistributedDataParallel
    optimizer: object
    scheduler: OptimizerParamScheduler
    optimizer_is_distributed: bool = False
    tp_rank: int = 0
    """This rank's position in its replica's tensor-parallel group."""
    stage: int = 0
    """This rank's pipeline stage."""
    replica: int = 0
    """This rank's replica: its HDP pool rank."""
    grad_sync: OrderedGradSync | None = None
    """The overlapped reduce's ordering (`grad_sync.py`); None without overlap."""
    schedule_in_samples: bool = False
    """The scheduler counts Megatron-LM's samples (`OptimConfig.schedule_in_samples`)."""
    chunks: list = field(default_factory=list)
    """Every model chunk of this rank (DDP-wrapped); `[model]` without virtual stages."""

    def __post_init__(self) -> None:
        if not self.chunks:
            self.chunks = [self.model]

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks per replica."""
        return self.cfg.tensor_model_parallel_size

    @property
    def pp_size(self) -> int:
        """Pipeline stages per replica."""
        return self.cfg.pipeline_model_parallel_size

    @property
    def is_first_stage(self) -> bool:
        """This rank embeds the tokens (pipeline stage 0)."""
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        """This rank computes the losses (the last pipeline stage)."""
        return self.stage == self.pp_size - 1


def build_engine(cfg: GPTConfig, optim: OptimConfig, *, seed: int = 1234) -> Engine:
    """Collective over the job: the HDP GPT in Megatron DDP, its optimizer and LR schedule.

    (Megatron's DDP and optimizer set-up use the pool and model-parallel groups; a tied
    embedding with PP is copied from the first to the last stage over Megatron's embedding
    group.)

    Every rank seeds torch with `seed` first, so all replicas start from equal weights.
    Megatron's scheduler also applies the weight-decay groups (no decay on biases and 1-D
    parameters), so it is part of the engine even for a constant learning rate.
    """
    dims = model_parallel_dims(cfg, dist.get_world_size())
    dims.check_initialized()
    rank = dist.get_rank()
    tp_rank, stage = dims.tp_rank_of(rank), dims.stage_of(rank)
    set_model_chunks(cfg.num_chunks)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=optim.grad_reduce_in_fp32,
        overlap_grad_reduce=optim.overlap_grad_reduce,
        bucket_size=optim.ddp_bucket_size,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    chunks = []
    for chunk in range(cfg.num_chunks):
        # Every chunk from the same seed: its layers draw from seeds of their global numbers.
        torch.manual_seed(seed)
        if torch.cuda.is_available():
            # Sequence-parallel regions fork Megatron's model-parallel CUDA RNG state.
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        # Initialised on the CPU: equal weights on every replica, and in every layout.
        model = build_gpt(cfg, stage=stage, tp_rank=tp_rank, chunk=chunk)
        if torch.cuda.is_available():
            model = model.cuda(torch.cuda.current_device())
        chunks.append(
            DistributedDataParallel(
                transformer_config(cfg), ddp_config, model, disable_bucketing=chunk > 0
            )
        )
    ddp_model = chunks[0]
    grad_sync = OrderedGradSync.install(ddp_model)
    for other in chunks[1:]:
        OrderedGradSync.install(other)
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=cfg.dtype == torch.bfloat16,
        fp16=cfg.dtype == torch.float16,
        loss_scale=optim.loss_scale,
        initial_loss_scale=optim.initial_loss_scale,
        min_loss_scale=optim.min_loss_scale,
        loss_scale_window=optim.loss_scale_window,
        hysteresis=optim.hysteresis,
        params_dtype=cfg.dtype,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(optimizer_config, chunks)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.lr_warmup_iters else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_iters,
        lr_decay_steps=optim.lr_decay_iters or optim.lr_warmup_iters + 1,
        lr_decay_style=optim.lr_decay_style if optim.lr_decay_iters else "constant",
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=optim.use_checkpoint_scheduler,
        override_opt_param_scheduler=optim.override_scheduler,
    )
    return Engine(
        cfg=cfg,
        model=ddp_model,
        optimizer=optimizer,
        scheduler=scheduler,
        optimizer_is_distributed=optim.use_distributed_optimizer,
        tp_rank=tp_rank,
        stage=stage,
        replica=dims.replica_of(rank),
        grad_sync=grad_sync,
        schedule_in_samples=optim.schedule_in_samples,
        chunks=chunks,
    )


def agreed_host_budget(
    flag_gb: float | None, group: dist.ProcessGroup, device: torch.device
) -> HostBudget:
    """Collective over `group`: the offload pool size every process of the job uses.

    With `--hdp-host-memory-gb` that value; without it each process works out the default
    share of its own machine's available memory (`offload.host_budget`), and the job takes
    the smallest: the planner prices offloading with this number, and its plans must be
    the same on every rank.
    """
    budget = host_budget(flag_gb)
    if flag_gb is not None:
        return budget
    smallest = torch.tensor([budget.nbytes], dtype=torch.int64, device=device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=group)
    nbytes = int(smallest.item())
    if nbytes == budget.nbytes:
        return budget
    return HostBudget(nbytes, budget.why + " (the smallest over the job's machines)")


def offload_manager(
    engine: Engine,
    host_budget_bytes: float,
    device: torch.device,
    *,
    min_offload_bytes: int | None = None,
):
    """An activation offload manager installed on the engine's transformer layers.

    The copy engine follows the device: CUDA streams and pinned buffers on GPU, a host
    store that really moves and counts the bytes on CPU. `min_offload_bytes` overrides the
    manager's threshold below which saved tensors stay on the device.
    """
    from megatron_hdp.offload.engines import CudaCopyEngine, HostCopyEngine
    from megatron_hdp.offload.hooks import OffloadManager

    if device.type == "cuda":
        copy_engine = CudaCopyEngine(device, host_budget_bytes)
    else:
        copy_engine = HostCopyEngine(host_budget_bytes)
    extra = {} if min_offload_bytes is None else {"min_offload_bytes": min_offload_bytes}
    manager = OffloadManager(copy_engine, num_layers=engine.cfg.num_layers, **extra)
    manager.install(list(engine.model.module.decoder.layers))
    return manager
