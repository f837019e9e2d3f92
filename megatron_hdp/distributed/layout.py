"""The one owner of the parallel layout: which rank is which part of which replica.

    world = PP stages x pool (N replicas) x TP ranks     (EP folded onto the TP ranks)
    global rank = (stage * N + replica) * TP + tp_rank     (Megatron's tp-cp-ep-dp-pp order)
    ring of a long sequence = the same (stage, TP rank) of k member replicas, P2P in the
        pool group of that (stage, TP rank)
    gradient sync = the pool group of each (stage, TP rank) (Megatron's data-parallel group)

With pipeline parallelism a replica is a whole pipeline, and ring micro-batches run in lock
step on the same stage of their member pipelines (`scheduler.plan.lockstep_problems`).

`ParallelDims` is pure (no torch import): the start-up validation uses it before any heavy
import, and `layout_problems` names every bad value. `ParallelDims.initialize()` is
collective over the world: it sets up Megatron's `parallel_state` and returns the
`ParallelLayout`, which hands out the groups. Nothing else in the package reads Megatron's
parallel-state globals or assumes the pool is the whole world. (torchtitan's `ParallelDims`
is the model.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DISPATCHERS = ("allgather", "alltoall")


def moe_problems(
    *,
    num_experts: int | None,
    topk: int,
    ep: int,
    tp: int,
    sequence_parallel: bool,
    dispatcher: str = "allgather",
    pp: int = 1,
    bias: bool = False,
    across_replicas: bool = False,
) -> list[str]:
    """What is wrong with an MoE set-up (empty: nothing), one message per bad value.

    `bias`: the linear layers have biases (Megatron's default), which Megatron's experts
    support only whole on one rank (expert TP = TP / EP = 1). `across_replicas`: TP 1 and
    the experts split over pool ranks (the drop-in's lock-step padding, `ep_lockstep`).
    """
    problems = []
    if ep < 1:
        problems.append(f"expert_model_parallel_size must be >= 1, got {ep}")
        return problems
    if num_experts is None:
        if ep > 1:
            problems.append(f"expert_model_parallel_size {ep} needs num_experts (an MoE model)")
        return problems
    if num_experts < 1:
        problems.append(f"num_experts must be >= 1, got {num_experts}")
        return problems
    if not 1 <= topk <= num_experts:
        problems.append(f"moe_router_topk {topk} must lie in [1, num_experts={num_experts}]")
    if across_replicas and tp != 1:
        problems.append(f"experts across replicas need tensor_model_parallel_size 1, got {tp}")
    elif tp % ep and not across_replicas:
        problems.append(
            f"expert_model_parallel_size {ep} must divide tensor_model_parallel_size {tp}: "
            "experts are parallel inside one replica (EP folded onto its TP ranks), because "
            "replicas run different numbers of micro-batches and an all-to-all across "
            "replicas would have to run in lock step"
        )
    elif num_experts % ep:
        problems.append(
            f"num_experts {num_experts} is not divisible by expert_model_parallel_size {ep}"
        )
    elif bias and tp // ep > 1:
        problems.append(
            f"an MoE model with linear biases (Megatron's default) needs each expert whole on "
            f"one rank, but tensor_model_parallel_size {tp} / expert_model_parallel_size {ep} "
            f"splits it over {tp // ep}: set expert_model_parallel_size {tp}, or "
            "disable_bias_linear"
        )
    if tp > 1 and not sequence_parallel:
        problems.append(
            f"an MoE model with tensor_model_parallel_size {tp} needs sequence parallelism "
            "(--sequence-parallel), as Megatron-Core requires for training"
        )
    if dispatcher not in DISPATCHERS:
        problems.append(f"moe_token_dispatcher_type {dispatcher!r} is not one of {DISPATCHERS}")
    elif pp > 1 and dispatcher != "alltoall":
        problems.append(
            f"num_experts with pipeline_model_parallel_size {pp} needs "
            "moe_token_dispatcher_type alltoall (Megatron's allgather dispatcher refuses the "
            "variable sequence lengths of pipelined HDP micro-batches)"
        )
    return problems


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The validated shape of the job: world size and the model-parallel degrees."""

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers: int | None = None
    """Transformer layers of the model (checked against the pipeline stages when given)."""
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_token_dispatcher_type: str = "allgather"

    def __post_init__(self) -> None:
        problems = layout_problems(**dataclasses.asdict(self))
        if problems:
            raise ValueError(problems[0])

    @property
    def tp(self) -> int:
        """Tensor-parallel ranks per replica."""
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        """Pipeline stages per replica."""
        return self.pipeline_model_parallel_size

    @property
    def ep(self) -> int:
        """Expert-parallel ranks per replica (a divisor of `tp`)."""
        return self.expert_model_parallel_size

    @property
    def pool_size(self) -> int:
        """Model replicas in the HDP pool: N = world / (TP x PP)."""
        return self.world_size // (self.tp * self.pp)

    @classmethod
    def of_world(cls, **degrees) -> ParallelDims:
        """The dims of the running job (`torch.distributed` initialised) with `degrees`."""
        import torch.distributed as dist

        return cls(world_size=dist.get_world_size(), **degrees)

    def replica_of(self, rank: int) -> int:
        """The replica (pool rank) of global rank `rank`."""
        return (rank // self.tp) % self.pool_size

    def stage_of(self, rank: int) -> int:
        """The pipeline stage of global rank `rank`."""
        return rank // (self.tp * self.pool_size)

    def tp_rank_of(self, rank: int) -> int:
        """The TP rank of global rank `rank` inside its replica."""
        return tp_rank_of(rank, self.tp)

    def pool_ranks(self, tp_rank: int, stage: int = 0) -> list[int]:
        """Global ranks of the pool of (`stage`, `tp_rank`): that place of every replica."""
        first = stage * self.tp * self.pool_size + tp_rank
        return list(range(first, first + self.tp * self.pool_size, self.tp))

    def pipeline_ranks(self, rank: int) -> list[int]:
        """Global ranks of the pipeline of `rank`: its (replica, TP rank) on every stage."""
        first = rank % (self.tp * self.pool_size)
        return list(range(first, self.world_size, self.tp * self.pool_size))

    def check_initialized(self) -> None:
        """Raise RuntimeError if Megatron's parallel state was set up for another layout.

        A model built for these dims in another layout would silently get other shards
        (for example all experts on every rank when Megatron's EP size is 1).
        """
        from megatron_hdp.megatron import parallel_state

        found = parallel_state.sizes()
        if found is None:
            raise RuntimeError(
                "Megatron's parallel state is not initialised (ParallelDims.initialize)"
            )
        wrong = {k: v for k, v in found.items() if getattr(self, k) != v}
        if wrong:
            detail = ", ".join(
                f"{k} {v} (the model wants {getattr(self, k)})" for k, v in wrong.items()
            )
            raise RuntimeError(f"Megatron's parallel state was initialised with {detail}")

    def initialize(self, *, timeout_minutes: float = 10.0) -> ParallelLayout:
        """Collective over the world: set up Megatron's groups; return this rank's layout.

        `torch.distributed` must be initialised with `world_size` ranks. Megatron's
        data-parallel group of each TP rank is its HDP pool; expert parallelism uses
        `expert_tensor_parallel_size = TP / EP`, which puts every EP group inside one
        replica. `timeout_minutes` bounds the collectives of Megatron's groups.
        """
        import torch.distributed as dist

        from megatron_hdp.megatron import parallel_state

        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"the process group has {dist.get_world_size()} ranks, the layout {self.world_size}"
            )
        groups = parallel_state.initialize(
            tp=self.tp, pp=self.pp, ep=self.ep, timeout_minutes=timeout_minutes
        )
        layout = ParallelLayout(
            dims=self,
            rank=dist.get_rank(),
            **groups,
            world_group=dist.group.WORLD,
        )
        layout.check()
        return layout


def tp_rank_of(rank: int, tensor_model_parallel_size: int) -> int:
    """The TP rank of global rank `rank`: replicas are consecutive blocks of TP ranks."""
    return rank % tensor_model_parallel_size


def layout_problems(
    *,
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    num_layers: int | None = None,
    expert_model_parallel_size: int = 1,
    sequence_parallel: bool = False,
    num_experts: int | None = None,
    moe_router_topk: int = 2,
    moe_token_dispatcher_type: str = "allgather",
    add_bias_linear: bool = False,
) -> list[str]:
    """What is wrong with a layout (empty: nothing), one message per bad value."""
    tp, pp, world = tensor_model_parallel_size, pipeline_model_parallel_size, world_size
    if world < 1:
        return [f"the world size must be >= 1, got {world}"]
    if tp < 1:
        return [f"tensor_model_parallel_size must be >= 1, got {tp}"]
    if pp < 1:
        return [f"pipeline_model_parallel_size must be >= 1, got {pp}"]
    problems = []
    if world % (tp * pp):
        problems.append(
            f"the world size {world} is not divisible by tensor_model_parallel_size {tp} x "
            f"pipeline_model_parallel_size {pp} = {tp * pp}"
        )
    problems += pipeline_problems(num_layers=num_layers, pp=pp)
    if sequence_parallel and tp == 1:
        problems.append("sequence_parallel needs tensor_model_parallel_size > 1")
    problems += moe_problems(
        num_experts=num_experts,
        topk=moe_router_topk,
        ep=expert_model_parallel_size,
        tp=tp,
        sequence_parallel=sequence_parallel,
        dispatcher=moe_token_dispatcher_type,
        pp=pp,
        bias=add_bias_linear,
    )
    return problems


def pipeline_problems(*, num_layers: int | None, pp: int) -> list[str]:
    """What is wrong with splitting `num_layers` layers into `pp` pipeline stages."""
    if pp < 1:
        return [f"pipeline_model_parallel_size must be >= 1, got {pp}"]
    if pp == 1:
        return []
    problems = []
    if num_layers is not None:
        if num_layers < pp:
            problems.append(
                f"pipeline_model_parallel_size {pp} needs at least one layer per stage; the "
                f"model has only {num_layers} layers"
            )
        elif num_layers % pp:
            problems.append(
                f"num_layers {num_layers} is not divisible by pipeline_model_parallel_size {pp} "
                "(every stage holds the same number of layers)"
            )
    return problems


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in an initialised layout, and the process groups it uses.

    Attributes:
        dims: The job's shape.
        rank: This process's global rank.
        pool_group: The HDP pool of this rank's (stage, TP rank) (Megatron's data-parallel
            group):
            rings, the loss-token count and the gradient sync run in it.
        tp_group: The TP ranks of this rank's replica.
        pp_group: The stages of this rank's pipeline (this rank alone without PP).
        world_group: Every rank of the job: plan agreement, checkpoints, stop agreement.
    """

    dims: ParallelDims
    rank: int
    pool_group: object
    tp_group: object
    pp_group: object
    world_group: object

    @property
    def pool_rank(self) -> int:
        """This rank's replica: its rank in the pool group."""
        return self.dims.replica_of(self.rank)

    @property
    def tp_rank(self) -> int:
        """This rank's TP rank inside its replica."""
        return self.dims.tp_rank_of(self.rank)

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.dims.stage_of(self.rank)

    def check(self) -> None:
        """Raise RuntimeError if Megatron's groups are not the layout's (a wiring bug)."""
        import torch.distributed as dist

        pool = dist.get_process_group_ranks(self.pool_group)
        want = self.dims.pool_ranks(self.tp_rank, self.stage)
        if pool != want or dist.get_rank(self.pool_group) != self.pool_rank:
            raise RuntimeError(
                f"rank {self.rank}: Megatron's data-parallel group {pool} is not the HDP pool "
                f"{want} of the layout"
            )
        pipeline = dist.get_process_group_ranks(self.pp_group)
        if pipeline != self.dims.pipeline_ranks(self.rank):
            raise RuntimeError(
                f"rank {self.rank}: Megatron's pipeline group {pipeline} is not the pipeline "
                f"{self.dims.pipeline_ranks(self.rank)} of the layout"
            )

    def destroy(self) -> None:
        """Undo `ParallelDims.initialize` (Megatron keeps its groups in module globals)."""
        from megatron_hdp.megatron import parallel_state

        parallel_state.destroy()
