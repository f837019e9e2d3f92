"""HDP's model of the interleaved schedule is Megatron-Core's own (installed release).

`scheduler.interleaved` restates `forward_backward_pipelining_with_interleaving`'s op order
and its count checks; here they are held to Megatron-Core's functions: its schedule table
(`get_schedule_table`) and warm-up count (`get_pp_rank_microbatches`, given a stand-in
communicator with the stage and the sizes).
"""

from types import SimpleNamespace

import pytest
from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

from megatron_hdp.scheduler.interleaved import count_problem, interleaved_order


def _communicator(d, stage, v):
    group = SimpleNamespace(size=lambda: d, rank=lambda: stage)
    return SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=v)


def _megatron_order(m, stage, d, v, n):
    """Megatron's ops on `stage`: forward k = table[k], backward k = table[k] mirrored."""
    table = get_schedule_table(m, v, n)
    total, _, warmup, _ = get_pp_rank_microbatches(
        m, v, n, p2p_communicator=_communicator(d, stage, v)
    )
    fwd = [(u, c, 0) for u, c in table]
    bwd = [(u, v - 1 - c, 1) for u, c in table]
    ops = fwd[:warmup]
    for k in range(total - warmup):
        ops += [fwd[warmup + k], bwd[k]]
    return ops + bwd[total - warmup :]


@pytest.mark.parametrize(("d", "v", "n"), [(2, 2, 2), (4, 2, 4), (3, 3, 5), (2, 4, 3)])
def test_order_is_megatrons(d, v, n):
    checked = 0
    for m in range(1, 3 * n + 2):
        if count_problem(m, d, n) is not None:
            continue
        for stage in range(d):
            assert interleaved_order(m, stage, d, v, n) == _megatron_order(m, stage, d, v, n)
            checked += 1
    assert checked >= 3 * d
