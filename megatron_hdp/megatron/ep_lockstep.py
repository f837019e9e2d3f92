"""Expert parallelism across HDP replicas: micro-batches in lock step per EP group (host layer).

Megatron's token dispatchers (`alltoall`, `allgather`) exchange tokens over the expert
parallel group in every MoE layer of every micro-batch: the i-th micro-batch of each EP
rank meets the i-th of the others. HDP's plan gives pool ranks different numbers of
micro-batches, and a ring's members may hold it at different positions of their lists
(one member in the ring's attention exchange while an EP peer waits in an all-to-all
would deadlock). So, when the EP group spans pool ranks:

- `aligned_slots` gives every pool rank one slot per micro-batch in a common timeline:
  micro-batches by increasing global order, each in the first slot after the previous
  micro-batch of every member (a ring's members share its slot); a rank's gaps are
  padding slots. The same on every rank, from the plan alone (no communication).
- each EP group then runs the longest of its members' slot lists (one all-reduce of MAX),
  padding at the end too.
- a padding slot runs `padding_batch`: one token with loss mask 0, whose router info
  (`padding_moe_info`) marks it a pad token, so it adds nothing to the loss, the gradients,
  the loss-token count, the load-balancing loss, the z-loss or the expert-bias counts; its
  tokens still go through the dispatcher's exchanges, as its peers' need. With
  multi-token prediction it carries shifted targets of loss mask 0 at every depth (its
  MTP layers' MoE exchanges run in the same slot as its peers').
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_hdp.data.batching import InMemoryTokens, LocalBatch, gather_local_batch
from megatron_hdp.megatron.moe import MoEMicroBatch
from megatron_hdp.scheduler.plan import MicroBatch, StepPlan
from megatron_hdp.sharding import shard


def aligned_slots(plan: StepPlan, rank: int) -> list[bool]:
    """Pool rank `rank`'s slots in the plan's common timeline (True: its next micro-batch).

    True slots take its micro-batches in the order `read_local` returns them; False slots
    are padding.

    A ring member that gets no token of its ring's sequences does not run it (as in
    `read_local`) and is no member of its slot. Pure function of the plan.
    """
    next_free = [0] * plan.pool_size
    mine: list[int] = []
    for mb in sorted(plan.micro_batches, key=lambda m: m.order):
        shards = shard([plan.seqlens[i] for i in mb.seq_indices], mb.cp_size)
        members = [r for r, s in zip(mb.ring, shards, strict=True) if s.num_tokens > 0]
        if not members:
            continue
        slot = max(next_free[r] for r in members)
        for r in members:
            next_free[r] = slot + 1
        if rank in members:
            mine.append(slot)
    slots = [False] * next_free[rank]
    for slot in mine:
        slots[slot] = True
    return slots


def lockstep_slots(plan: StepPlan, rank: int, ep_group, device) -> list[bool]:
    """Collective over `ep_group` (one all-reduce): `aligned_slots` padded to lock step.

    Padded at the end to the longest slot list of the EP group.
    """
    slots = aligned_slots(plan, rank)
    longest = torch.tensor([len(slots)], dtype=torch.int64, device=device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=ep_group)
    return slots + [False] * (int(longest.item()) - len(slots))


def padding_batch(rank: int, device, mtp_depth: int = 0) -> LocalBatch:
    """A local micro-batch of one token (id 0) with loss mask 0, on `device`.

    `mtp_depth` (`--mtp-num-layers`): its shifted targets too, all past the end of its
    one-token document (zero, loss mask 0 at every depth), so multi-token prediction runs
    on it and adds nothing either.
    """
    zero = torch.zeros(1, dtype=torch.int64)
    source = InMemoryTokens([zero], [zero], [torch.zeros(1, dtype=torch.float32)])
    plan = SimpleNamespace(seqlens=[1])
    mb = MicroBatch(order=-1, ring=(rank,), seq_indices=(0,))
    return gather_local_batch(plan, mb, rank, source, mtp_depth=mtp_depth).to(device)


def padding_moe_info(batch: LocalBatch, global_tokens: int, tracker_scale) -> MoEMicroBatch:
    """Router info for a padding batch: nothing counts (module docstring).

    Every token is a pad token of a micro-batch of no document.
    """
    device = batch.tokens.device
    return MoEMicroBatch(
        segment_ids=torch.zeros(batch.num_tokens, dtype=torch.int64, device=device),
        doc_lengths=(),
        device_doc_lengths=torch.zeros(0, dtype=torch.int64, device=device),
        global_tokens=global_tokens,
        tracker_scale=tracker_scale,
    )
