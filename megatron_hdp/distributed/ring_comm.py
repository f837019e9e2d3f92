"""Point-to-point exchange between neighbours of a ring (comm layer).

A ring is an ordered tuple of ranks of an *existing* process group (the HDP pool); no
process group is created per ring or per step (architecture decision 1). Each exchange
sends one tensor to the next member and receives one from the previous member.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


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
        ops = [
            dist.P2POp(dist.isend, send, group=self.group, tag=tag, group_peer=self.next_rank),
            dist.P2POp(dist.irecv, recv, group=self.group, tag=tag, group_peer=self.prev_rank),
        ]
        works = dist.batch_isend_irecv(ops)
        if self.stats is not None:
            self.stats.bytes_sent += send.numel() * send.element_size()
            self.stats.messages_sent += 1
        return PendingExchange(works, send, recv)
