"""A recomputed MoE layer routes in the backward with its own micro-batch's documents.

`--recompute-modules moe` (and full recompute) runs HDP's router again in the backward. On
CUDA PyTorch runs that backward on an autograd thread of its own, where the forward's
context variable is not set; under pipeline parallelism Megatron's schedule runs it outside
the forward's block. Both are reproduced on CPU by the GPU check's own code
(`scripts/gpu/moe_checks.py`): the backward runs on a fresh thread, after another
micro-batch's forward, through Megatron's own pipeline calls (`deallocate_output_tensor`,
`custom_backward`). The reference is the same router without recompute, its backward inside
the forward's block (the load-balancing loss and the z-loss send their gradients to the
router's weight).
"""

from __future__ import annotations

import torch

from tests.dist import run_ranks
from tests.unit.scripts_loader import load_script


def _body(rank, world_size):
    from megatron.core import parallel_state

    from megatron_hdp.megatron.cpu_shim import cpu_shims

    checks = load_script("scripts/gpu/moe_checks.py", "moe_checks")
    with cpu_shims():
        parallel_state.initialize_model_parallel()
        carried = checks.recompute_gradients(torch.device("cpu"))
        uncarried = checks.recompute_gradients(torch.device("cpu"), carry=False)
        verdict = checks.recompute_check(torch.device("cpu"), lambda line: None)
    return carried, repr(uncarried["failure"]), verdict


def test_recomputed_router_routes_with_the_carried_micro_batch():
    carried, uncarried, verdict = run_ranks(_body, 1)[0]
    assert carried["failure"] is None, carried["failure"]
    assert carried["want_weight"].abs().sum() > 0  # the router's losses reach its weight
    torch.testing.assert_close(carried["got_weight"], carried["want_weight"], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(carried["got_input"], carried["want_input"], rtol=1e-6, atol=1e-8)
    assert not carried["left_set"]  # the carried batch ends with its backward
    # Without the carrier the recompute cannot know its micro-batch (what CUDA hit).
    assert "outside an HDP micro-batch" in uncarried
    assert verdict["ok"] and verdict["error"] is None
