"""Lock-step slots of expert parallelism across replicas (`megatron.ep_lockstep`), no ranks.

The dispatcher's all-to-all pairs the i-th micro-batch of every EP rank, so a ring's members
must hold it in the same slot, and each rank must keep its own order; a padding batch must
add no loss token and mark every router token as padding.
"""

from __future__ import annotations

import torch

from megatron_hdp.megatron.ep_lockstep import aligned_slots, padding_batch, padding_moe_info
from megatron_hdp.scheduler.plan import MicroBatch, StepPlan


def _plan() -> StepPlan:
    # Rank 1's first micro-batch is a ring with rank 0, which runs a pack before it; rank 2's
    # ring with rank 1 comes after rank 2's own pack.
    mbs = [
        MicroBatch(order=0, ring=(0,), seq_indices=(0,)),
        MicroBatch(order=1, ring=(0, 1), seq_indices=(1,)),
        MicroBatch(order=2, ring=(2,), seq_indices=(2,)),
        MicroBatch(order=3, ring=(1, 2), seq_indices=(3,)),
    ]
    return StepPlan.from_micro_batches([4, 8, 4, 8], 3, 16, "greedy", mbs)


def test_ring_members_share_a_slot_and_each_rank_keeps_its_order():
    plan = _plan()
    slots = {rank: aligned_slots(plan, rank) for rank in range(3)}
    # Slot of each of a rank's micro-batches, in its own order.
    where = {r: [i for i, used in enumerate(s) if used] for r, s in slots.items()}
    for rank in range(3):
        assert len(where[rank]) == len(plan.for_rank(rank))
        assert where[rank] == sorted(where[rank])
    position = {r: {mb.order: where[r][i] for i, mb in enumerate(plan.for_rank(r))} for r in where}
    for mb in plan.micro_batches:
        assert len({position[r][mb.order] for r in mb.ring}) == 1, (mb, slots)
    # Worked by hand: rank 1 waits a slot for rank 0's pack, rank 2 one for the ring.
    assert slots == {0: [True, True], 1: [False, True, True], 2: [True, False, True]}


def test_padding_batch_counts_nothing():
    batch = padding_batch(0, torch.device("cpu"))
    assert batch.num_tokens == 1 and batch.loss_tokens() == 0
    assert float(batch.loss_mask.sum()) == 0
    info = padding_moe_info(batch, global_tokens=100, tracker_scale=None)
    # A token whose segment id is len(doc_lengths) is a pad token to the router.
    assert info.doc_lengths == () and info.segment_ids.tolist() == [len(info.doc_lengths)]


def test_padding_batch_with_mtp_carries_empty_targets_at_every_depth():
    """With multi-token prediction a padding slot runs the MTP layers too: every depth's
    shifted loss mask is 0 (the one-token document has no next token)."""
    batch = padding_batch(0, torch.device("cpu"), mtp_depth=2)
    assert batch.shifted is not None and batch.shifted.depth == 2
    assert batch.shifted.loss_tokens() == [0.0, 0.0]
    assert batch.shifted.loss_mask.shape == (2, 1) and float(batch.shifted.loss_mask.sum()) == 0
    assert padding_batch(0, torch.device("cpu")).shifted is None
