"""Check that every rank of the pool holds the same plan (comm layer, debug aid)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_hdp.scheduler.plan import StepPlan


def check_plan_agreement(
    plan: StepPlan, group: dist.ProcessGroup, device: torch.device | None = None
) -> None:
    """Collective over `group`: raise RuntimeError if any rank's plan digest differs.

    Costs one all-gather of 8 bytes per rank; meant for debug runs and tests.
    """
    digest = int(plan.digest()[:15], 16)
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    values = [int(t.item()) for t in gathered]
    if len(set(values)) != 1:
        raise RuntimeError(
            f"ranks disagree on the step plan: digests {[f'{v:015x}' for v in values]}"
        )
