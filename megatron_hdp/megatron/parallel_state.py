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


def destroy() -> None:
    """Forget Megatron's groups (they live in module globals)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
