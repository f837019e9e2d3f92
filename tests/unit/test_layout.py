"""The pure layout math: which global rank is which (stage, replica, TP rank), and its rules.

The reference is an explicit enumeration in Megatron's rank order (TP fastest, then the
data-parallel pool, then pipeline stages); the distributed tests check the same layout
against the groups Megatron-Core itself creates (`ParallelLayout.check`).
"""

import itertools

import pytest

from megatron_hdp.distributed.layout import ParallelDims, layout_problems


@pytest.mark.parametrize("tp, pp, pool", [(1, 1, 4), (2, 1, 3), (1, 2, 3), (2, 2, 2), (4, 2, 1)])
def test_ranks_enumerate_stage_then_replica_then_tp_rank(tp, pp, pool):
    dims = ParallelDims(
        world_size=tp * pp * pool,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        num_layers=2 * pp,
    )
    assert dims.pool_size == pool
    order = list(itertools.product(range(pp), range(pool), range(tp)))
    for rank, (stage, replica, tp_rank) in enumerate(order):
        assert (dims.stage_of(rank), dims.replica_of(rank), dims.tp_rank_of(rank)) == (
            stage,
            replica,
            tp_rank,
        )
        pool_ranks = dims.pool_ranks(tp_rank, stage)
        assert pool_ranks == [order.index((stage, r, tp_rank)) for r in range(pool)]
        pipeline = dims.pipeline_ranks(rank)
        assert pipeline == [order.index((s, replica, tp_rank)) for s in range(pp)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=6, pipeline_model_parallel_size=4), "not divisible by"),
        (
            dict(world_size=4, pipeline_model_parallel_size=2, num_layers=3),
            "num_layers 3 is not divisible by pipeline_model_parallel_size 2",
        ),
        (
            dict(world_size=4, pipeline_model_parallel_size=4, num_layers=2),
            "needs at least one layer per stage; the model has only 2 layers",
        ),
        (dict(world_size=4, pipeline_model_parallel_size=0), "must be >= 1, got 0"),
    ],
)
def test_bad_pipeline_layouts_are_named(kwargs, message):
    problems = layout_problems(**kwargs)
    assert problems and message in problems[0]
    with pytest.raises(ValueError, match=message.split(";")[0]):
        ParallelDims(**kwargs)


@pytest.mark.parametrize("pp", [0, -1])
def test_a_model_config_refuses_a_stage_count_below_one(pp):
    from megatron_hdp.megatron.model import GPTConfig

    with pytest.raises(ValueError, match=f"pipeline_model_parallel_size must be >= 1, got {pp}"):
        GPTConfig(pipeline_model_parallel_size=pp)
