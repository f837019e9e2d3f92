"""Ring messages matched by order only, as NCCL matches them: a reordering fails on CPU.

gloo matches point-to-point messages by tag, so ring members that post their exchanges in
different orders still pass every CPU test, and would mix messages up under NCCL. The ring's
order-only mode (`ring_comm.order_only_messages`) sends every message with one tag and a
header; these tests show that it catches a deliberately reordered exchange that gloo's tag
matching hides, and that the ring attention and MoE's expert-count hops keep one order.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_hdp.distributed.ring_comm import RingComm, RingOrderError, order_only_messages
from tests.dist import run_ranks
from tests.distributed.test_ring_attention import ROUNDS, _body_rings


def _body_two_exchanges(rank, world_size, reorder, order_only):
    """Exchanges A (tag 1, ones) and B (tag 2, twos) over a ring of 2; rank 1 posts them in
    the other order when `reorder`. Returns what each receive got, or the error."""
    comm = RingComm(dist.group.WORLD, [0, 1])
    a, b = torch.ones(8), torch.full((8,), 2.0)
    with order_only_messages(order_only):
        if reorder and rank == 1:
            pending_b = comm.exchange(b, torch.empty(8), tag=2)
            pending_a = comm.exchange(a, torch.empty(8), tag=1)
        else:
            pending_a = comm.exchange(a, torch.empty(8), tag=1)
            pending_b = comm.exchange(b, torch.empty(8), tag=2)
        # Wait for both (a check fails only after its transfer is done), so that no rank
        # leaves while its peer still reads from it.
        got, errors = [], []
        for pending in (pending_a, pending_b):
            try:
                got.append(pending.wait().tolist())
            except RingOrderError as err:
                errors.append(str(err))
        return errors[0] if errors else tuple(got)


def test_gloo_tag_matching_hides_a_reordered_exchange():
    """The reason for the mode: on gloo's tags the reordered exchange simply works."""
    for got in run_ranks(_body_two_exchanges, 2, True, False):
        assert got == ([1.0] * 8, [2.0] * 8)


def test_order_only_mode_catches_a_reordered_exchange_on_every_rank():
    results = run_ranks(_body_two_exchanges, 2, True, True, timeout_s=60)
    assert results[0].startswith(
        "ring (0, 1): group rank 0 expected tag 1 (8 elements) from group rank 1, but its next "
        "message was tag 2 (8 elements): the members posted their exchanges in different orders"
    )
    assert results[1].startswith(
        "ring (0, 1): group rank 1 expected tag 1 (8 elements) from group rank 0"
    )


def test_order_only_mode_delivers_exchanges_posted_in_one_order():
    for got in run_ranks(_body_two_exchanges, 2, False, True):
        assert got == ([1.0] * 8, [2.0] * 8)


def _body_rings_by_order(rank, world_size, rounds, backend):
    with order_only_messages():
        return _body_rings(rank, world_size, rounds, backend)


def test_ring_attention_keeps_one_order_on_every_member():
    """Forward K/V hops, backward K/V and dK/dV hops, rings of 1 to 5 in any rank order:
    exact against the reference with messages matched by order only."""
    assert all(b > 0 for b in run_ranks(_body_rings_by_order, 5, ROUNDS, "torch"))


def _body_moe_by_order(rank, world_size, cfg, pool, kind):
    from tests.megatron.test_moe import _body_hdp

    with order_only_messages():
        return _body_hdp(rank, world_size, cfg, pool, kind)


@pytest.mark.parametrize("pool", [3])
def test_moe_expert_count_hops_keep_one_order(pool):
    """MoE's per-sequence expert counts hop around the rings of sequences split over 2 and 3
    replicas, between the attention hops: the same losses as tag matching, bit for bit."""
    from tests.megatron.test_moe import CFG, _body_hdp

    cfg = dataclasses.replace(CFG, moe_token_dispatcher_type="allgather")
    by_tag = run_ranks(_body_hdp, pool, cfg, pool, "mixed", timeout_s=240)
    by_order = run_ranks(_body_moe_by_order, pool, cfg, pool, "mixed", timeout_s=240)
    assert any(len(ring) > 2 for ring in by_order[0]["rings"])
    for a, b in zip(by_tag, by_order, strict=True):
        assert a["losses"] == b["losses"] and a["aux"] == b["aux"]
        for name, grad in a["grads"].items():
            assert torch.equal(grad, b["grads"][name]), name
