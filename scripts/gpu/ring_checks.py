"""Ring attention with k = 2..8 virtual ranks in one process, against one call over the docs.

Each virtual rank is a thread that runs the ring's own step logic (`ring._HDPAttention`'s
forward and backward, called directly with a plain context object) on its zigzag shard;
`ThreadRingComm` replaces the process group's point-to-point messages with in-process
queues. On one GPU every thread queues its kernels on the same stream, so a tensor handed
over is complete before the receiver's copy runs. The gathered outputs and gradients are
compared with one kernel call over the whole documents and with a float64 reference.

A member that fails sets the ring's stop event; its peers, waiting for a message in short
polls, see it and end within `POLL_S` (not after the receive timeout), and the member's own
error is what the section reports.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from common import Mode, reference_attention, relative_error, tolerance

from megatron_hdp.attention import ring
from megatron_hdp.attention.kernels import registry
from megatron_hdp.attention.kernels.base import VarlenBlocks
from megatron_hdp.sharding import shard

RECEIVE_TIMEOUT_S = 120.0
"""Longest wait for one message when no member failed (a lost message, not a slow one)."""
POLL_S = 0.05
"""How often a waiting member looks at the ring's stop event."""


class RingAbortedError(RuntimeError):
    """A member stopped waiting because another member of its ring failed."""


class _Pending:
    def __init__(self, receive) -> None:
        self._receive = receive

    def wait(self) -> torch.Tensor:
        return self._receive()


class ThreadRingComm:
    """`RingComm.exchange` between threads: send to the next member, receive from the previous."""

    def __init__(
        self,
        mailboxes: dict,
        ring_positions: tuple[int, ...],
        me: int,
        stop: threading.Event | None = None,
    ) -> None:
        self.stop = stop or threading.Event()
        self.ring, self.size = ring_positions, len(ring_positions)
        self.position = ring_positions.index(me)
        self.me = me
        self.next_rank = ring_positions[(self.position + 1) % self.size]
        self.prev_rank = ring_positions[(self.position - 1) % self.size]
        self._mailboxes = mailboxes

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> _Pending:
        """Post `send` to the next member; `wait()` copies the previous member's into `recv`."""
        self._mailboxes[(self.me, self.next_rank, tag)].put(send)

        def receive():
            return recv.copy_(self._receive(self._mailboxes[(self.prev_rank, self.me, tag)]))

        return _Pending(receive)

    def transfer(self, send, recv, tag: int) -> _Pending | None:
        """`RingComm.transfer`: either side may be absent (the sliding window's hops)."""
        if send is not None and recv is not None:
            return self.exchange(send, recv, tag)
        if send is None and recv is None:
            return None
        if send is not None:
            self._mailboxes[(self.me, self.next_rank, tag)].put(send)
            return _Pending(lambda: None)

        def receive():
            return recv.copy_(self._receive(self._mailboxes[(self.prev_rank, self.me, tag)]))

        return _Pending(receive)

    def _receive(self, box: queue.Queue) -> torch.Tensor:
        """The next message in `box`; RingAbortedError as soon as the stop event is set."""
        deadline = time.monotonic() + RECEIVE_TIMEOUT_S
        while not self.stop.is_set():
            try:
                return box.get(timeout=POLL_S)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"ring member {self.me}: no message from {self.prev_rank} in "
                        f"{RECEIVE_TIMEOUT_S:.0f} s"
                    ) from None
        raise RingAbortedError(f"ring member {self.me}: another member failed")


class _Context:
    """What `torch.autograd.Function.forward` gets as `ctx`, enough for `_HDPAttention`."""

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


def _local_rows(lengths, shard_of_rank) -> list[int]:
    """Rows of the packed documents this rank holds, in its local order."""
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    return [starts[d] + start + i for d, start, n in shard_of_rank.ranges() for i in range(n)]


#: Message tags of the ring (11-13) and of the windowed ring (21-23).
TAGS = (11, 12, 13, 21, 22, 23)


def run_members(lengths, k, kernel_name, device, work) -> list:
    """`work(spec, rows)` on each member of a ring of `k` threads over documents `lengths`.

    `rows`: the member's rows of the packed documents (local order). Returns
    `[(rows, work's result)]` of the active members; a member's own error is raised (its
    peers end within `POLL_S`).
    """
    shards = tuple(shard(lengths, k))
    active = ring.active_positions(shards)
    kernel = registry.get_kernel(kernel_name)
    mailboxes = {(a, b, tag): queue.Queue() for a in active for b in active for tag in TAGS}
    stop = threading.Event()

    def member(position):
        try:
            return _member(position)
        except BaseException:
            stop.set()  # the peers waiting for this member's messages end now
            raise

    def _member(position):
        rows = torch.tensor(_local_rows(lengths, shards[position]), device=device)
        comm = ThreadRingComm(mailboxes, active, position, stop) if len(active) > 1 else None
        spec = ring.RingAttentionSpec(
            doc_lengths=tuple(lengths),
            shards=shards,
            position=position,
            active=active,
            comm=comm,
            backend=kernel,
        )
        return rows, work(spec, rows)

    with ThreadPoolExecutor(max_workers=len(active)) as pool:
        futures = [pool.submit(member, position) for position in active]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:  # the first member's own error, not a peer's RingAbortedError
        raise next((e for e in errors if not isinstance(e, RingAbortedError)), errors[0])
    return [future.result() for future in futures]


def run_ring(kernel_name, lengths, k, q, kv_k, kv_v, dout, scale):
    """Outputs and gradients of the whole documents, computed by a ring of `k` threads."""
    out, dq = torch.empty_like(q), torch.empty_like(q)
    dk, dv = torch.empty_like(kv_k), torch.empty_like(kv_v)

    def work(spec, rows):
        ctx = _Context()
        with torch.no_grad():
            local_out = ring._HDPAttention.forward(
                ctx, q[rows], kv_k[rows], kv_v[rows], spec, scale
            )
            grads = ring._HDPAttention.backward(ctx, dout[rows])
        return local_out, grads[:3]

    for rows, (local_out, (gq, gk, gv)) in run_members(lengths, k, kernel_name, q.device, work):
        out[rows], dq[rows], dk[rows], dv[rows] = local_out, gq, gk, gv
    return out, dq, dk, dv


def run(mode: Mode, say, kernel_name: str) -> dict:
    """Rings of 2..8 on `kernel_name` in each dtype; returns the section's JSON."""
    results = []
    s = mode.scale_tokens
    for dtype in mode.dtypes:
        for k in range(2, 9):
            lengths = (512 * s, 75 * s, 2 * k + 1, 194 * s + 3)
            gen = torch.Generator(device=mode.device).manual_seed(k)
            total = sum(lengths)

            def rand(h, total=total, gen=gen, dtype=dtype):
                return torch.randn(total, h, mode.head_dim, generator=gen, device=mode.device).to(
                    dtype
                )

            q, kk, vv = rand(mode.heads), rand(mode.groups), rand(mode.groups)
            dout = rand(mode.heads)
            scale = mode.head_dim**-0.5
            got = run_ring(kernel_name, lengths, k, q, kk, vv, dout, scale)
            blocks = VarlenBlocks.build(lengths, lengths, causal=True, device=mode.device)
            kernel = registry.get_kernel(kernel_name)
            one_out, one_lse = kernel.forward(q, kk, vv, blocks, scale=scale)
            one = (
                one_out,
                *kernel.backward(dout, q, kk, vv, one_out, one_lse, blocks, scale=scale),
            )
            leaves = [t.double().requires_grad_() for t in (q, kk, vv)]
            ref_out, _ = reference_attention(*leaves, lengths, lengths, True, scale)
            ref_out.backward(dout.double())
            reference = (ref_out.detach(), *(leaf.grad for leaf in leaves))
            names = ("out", "dq", "dk", "dv")
            vs_one = {
                n: relative_error(a, b.double()) for n, a, b in zip(names, got, one, strict=True)
            }
            vs_ref = {
                n: relative_error(a, b) for n, a, b in zip(names, got, reference, strict=True)
            }
            limit = tolerance(dtype)
            # Ring and one call round differently in 16 bits; both must be near float64.
            ok = max(vs_ref.values()) <= limit and max(vs_one.values()) <= 2 * limit
            results.append(
                {
                    "kernel": kernel_name,
                    "dtype": str(dtype).removeprefix("torch."),
                    "ring_size": k,
                    "lengths": list(lengths),
                    "error_vs_one_call": vs_one,
                    "error_vs_float64": vs_ref,
                    "tolerance": limit,
                    "ok": ok,
                }
            )
            say(
                f"ring     {kernel_name:16s} {results[-1]['dtype']:8s} k={k} "
                f"vs one call {max(vs_one.values()):.2e}, vs float64 {max(vs_ref.values()):.2e} "
                f"{'ok' if ok else 'FAILED'}"
            )
    return {"results": results, "ok": all(r["ok"] for r in results)}
