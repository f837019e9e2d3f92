"""The door to Megatron-Core's parallel state: its module-global process groups (host layer).

`distributed.layout.ParallelDims` owns the layout and calls these; nothing else touches
Megatron's globals.
"""

from __future__ import annotations


def initialize(*, tp: int, pp: int, ep: int, timeout_minutes: float) -> dict:
    """Collective over the world: set up Megatron's groups once; return the pool, TP and PP.

    Megatron's data-parallel group of each TP rank is the HDP pool; expert parallelism uses
    `expert_tensor_parallel_size = tp / ep`, which keeps every EP group inside one replica.
    """
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=tp // ep,
            distributed_timeout_minutes=timeout_minutes,
        )
    return {
        "pool_group": parallel_state.get_data_parallel_group(),
        "tp_group": parallel_state.get_tensor_model_parallel_group(),
        "pp_group": parallel_state.get_pipeline_model_parallel_group(),
    }


def set_model_chunks(chunks: int) -> None:
    """Tell Megatron's schedules how many model chunks each stage holds (None for one).

    Megatron-LM sets it from `--num-layers-per-virtual-pipeline-stage` at start-up; its
    interleaved schedule reads it (which chunk is the pipeline's first or last).
    """
    from megatron.core import parallel_state

    parallel_state.set_virtual_pipeline_model_parallel_world_size(chunks if chunks > 1 else None)


def sizes() -> dict | None:
    """The TP, PP and EP sizes Megatron was initialised with; None if it was not."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
    }


#: Globals holding process groups that Megatron's `destroy_model_parallel` leaves set
#: (0.16.1 to 0.19.2), with their initial values.
_LEFT_SET_BY_DESTROY = {
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": None,
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": None,
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": None,
    "_HYBRID_DP_CP_GROUPS": {},
}


def destroy() -> None:
    """Forget Megatron's groups (they live in module globals), all of them.

    Megatron's own destroy keeps a few groups alive; a process forked afterwards would free
    its parent's groups when it initialises Megatron again, and crash (SIGSEGV).
    """
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    for name, initial in _LEFT_SET_BY_DESTROY.items():
        if hasattr(parallel_state, name):
            setattr(parallel_state, name, type(initial)() if initial is not None else None)
