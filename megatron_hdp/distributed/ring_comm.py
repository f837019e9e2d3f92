"""Point-to-point exchange between neighbours of a ring (comm layer).

A ring is an ordered tuple of ranks of an *existing* process group (the HDP pool); no
process group is created per ring or per step (architecture decision 1). Each exchange
sends one tensor to the next member and receives one from the previous member.

**Order-only mode** (opt-in, for tests: `order_only_messages()` or `HDP_RING_ORDER_ONLY=1`).
NCCL matches point-to-point messages between two ranks by the order they were posted and
ignores tags; gloo, which every CPU test runs on, matches by tag, so members that post
their exchanges in different orders work on CPU and mix messages up on GPUs. In this mode
every message travels with one tag, so gloo too matches by order, and carries a 16-byte
header with the tag and element count it was meant to have; the receiver checks it and
raises `RingOrderError` naming both, instead of using another message's data.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: The one tag of every message in order-only mode.
ORDER_ONLY_TAG = 0
_HEADER_BYTES = 16  # int64 tag, int64 element count
_order_only = os.environ.get("HDP_RING_ORDER_ONLY", "0") not in ("0", "")


class RingOrderError(RuntimeError):
    """In order-only mode: the next message from a ring neighbour is not the one expected."""


@contextlib.contextmanager
def order_only_messages(enabled: bool = True) -> Iterator[None]:
    """Within the block, ring exchanges match by order only, as NCCL's do (see the module)."""
    global _order_only
    before, _order_only = _order_only, enabled
    try:
        yield
    finally:
        _order_only = before


@dataclass
class CommStats:
    """Counts what the attention rings sent from this rank."""

    bytes_sent: int = 0
    messages_sent: int = 0

    def reset(self) -> None:
        """Set the counters back to zero."""
        self.bytes_sent = 0
        self.messages_sent = 0


class PendingExchange:
    """An exchange in flight; `wait()` returns the received tensor."""

    def __init__(self, works: list, send: torch.Tensor, recv: torch.Tensor) -> None:
        self._works = works
        self._send = send  # kept alive until the send completes
        self._recv = recv

    def wait(self) -> torch.Tensor:
        """Block until both the send and the receive are done; return the received tensor."""
        for work in self._works:
            work.wait()
        self._works = []
        self._send = None
        return self._recv


class RingComm:
    """Sends to the next and receives from the previous member of `ring` inside `group`.

    Args:
        group: The pool's process group; ring entries are ranks of this group.
        ring: Group ranks in ring order; must contain this process's group rank.
        stats: Optional counters; every send adds its bytes.
    """

    def __init__(
        self, group: dist.ProcessGroup, ring: Sequence[int], stats: CommStats | None = None
    ) -> None:
        self.group = group
        self.ring = tuple(ring)
        me = dist.get_rank(group)
        if me not in self.ring:
            raise ValueError(f"rank {me} is not a member of ring {self.ring}")
        self.position = self.ring.index(me)
        self.size = len(self.ring)
        self.next_rank = self.ring[(self.position + 1) % self.size]
        self.prev_rank = self.ring[(self.position - 1) % self.size]
        self.stats = stats

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> PendingExchange:
        """Start sending `send` to the next member and receiving into `recv` from the previous.

        Point-to-point, not collective: the previous member must post a matching exchange
        with the same `tag`. Never called on a ring of one (gloo cannot send to itself).
        """
        if self.size == 1:
            raise RuntimeError("a ring of one rank must not communicate")
        send = send.contiguous()
        if self.stats is not None:
            self.stats.bytes_sent += send.numel() * send.element_size()
            self.stats.messages_sent += 1
        if _order_only:
            return self._exchange_by_order(send, recv, tag)
        ops = [
            dist.P2POp(dist.isend, send, group=self.group, tag=tag, group_peer=self.next_rank),
            dist.P2POp(dist.irecv, recv, group=self.group, tag=tag, group_peer=self.prev_rank),
        ]
        works = dist.batch_isend_irecv(ops)
        return PendingExchange(works, send, recv)

    def transfer(
        self, send: torch.Tensor | None, recv: torch.Tensor | None, tag: int
    ) -> PendingExchange | None:
        """`exchange` where either side may be absent: nothing to send, or nothing to receive.

        For rings whose messages differ per hop (sliding-window attention): the previous
        member posts a send exactly where this one posts a receive. None when both are absent.
        """
        if send is not None and recv is not None:
            return self.exchange(send, recv, tag)
        if send is None and recv is None:
            return None
        if self.size == 1:
            raise RuntimeError("a ring of one rank must not communicate")
        if send is not None:
            send = send.contiguous()
            if self.stats is not None:
                self.stats.bytes_sent += send.numel() * send.element_size()
                self.stats.messages_sent += 1
        if _order_only:
            return self._one_side_by_order(send, recv, tag)
        if send is not None:
            op = dist.P2POp(dist.isend, send, group=self.group, tag=tag, group_peer=self.next_rank)
        else:
            op = dist.P2POp(dist.irecv, recv, group=self.group, tag=tag, group_peer=self.prev_rank)
        return PendingExchange(dist.batch_isend_irecv([op]), send, recv)

    def _one_side_by_order(self, send, recv, tag: int):
        if send is not None:
            header = torch.tensor([tag, send.numel()], dtype=torch.int64, device=send.device)
            framed = torch.cat([header.view(torch.uint8), send.view(-1).view(torch.uint8)])
            op = dist.P2POp(
                dist.isend, framed, group=self.group, tag=ORDER_ONLY_TAG, group_peer=self.next_rank
            )
            return PendingExchange(dist.batch_isend_irecv([op]), framed, None)
        inbox = torch.empty(
            _HEADER_BYTES + recv.numel() * recv.element_size(),
            dtype=torch.uint8,
            device=recv.device,
        )
        op = dist.P2POp(
            dist.irecv, inbox, group=self.group, tag=ORDER_ONLY_TAG, group_peer=self.prev_rank
        )
        return _CheckedExchange(dist.batch_isend_irecv([op]), None, recv, inbox, tag, self)

    def _exchange_by_order(self, send: torch.Tensor, recv: torch.Tensor, tag: int):
        header = torch.tensor([tag, send.numel()], dtype=torch.int64, device=send.device)
        framed = torch.cat([header.view(torch.uint8), send.view(-1).view(torch.uint8)])
        inbox = torch.empty(
            _HEADER_BYTES + recv.numel() * recv.element_size(),
            dtype=torch.uint8,
            device=recv.device,
        )
        ops = [
            dist.P2POp(
                dist.isend, framed, group=self.group, tag=ORDER_ONLY_TAG, group_peer=self.next_rank
            ),
            dist.P2POp(
                dist.irecv, inbox, group=self.group, tag=ORDER_ONLY_TAG, group_peer=self.prev_rank
            ),
        ]
        return _CheckedExchange(dist.batch_isend_irecv(ops), framed, recv, inbox, tag, self)


class _CheckedExchange(PendingExchange):
    """An order-only exchange: `wait()` checks the header, then fills the receive tensor."""

    def __init__(self, works, framed, recv, inbox, tag: int, comm: RingComm) -> None:
        super().__init__(works, framed, recv)
        self._inbox, self._tag, self._comm = inbox, tag, comm

    def wait(self) -> torch.Tensor:
        """Block until done; RingOrderError if the message is not the one this call expected."""
        super().wait()
        got_tag, got_numel = self._inbox[:_HEADER_BYTES].view(torch.int64).tolist()
        if (got_tag, got_numel) != (self._tag, self._recv.numel()):
            comm = self._comm
            raise RingOrderError(
                f"ring {comm.ring}: group rank {comm.ring[comm.position]} expected tag "
                f"{self._tag} ({self._recv.numel()} elements) from group rank {comm.prev_rank}, "
                f"but its next message was tag {got_tag} ({got_numel} elements): the members "
                "posted their exchanges in different orders, which NCCL (matching by order, "
                "not by tag) would mix up"
            )
        self._recv.view(-1).view(torch.uint8).copy_(self._inbox[_HEADER_BYTES:])
        return self._recv
