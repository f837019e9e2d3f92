"""Megatron's overlapped gradient reduce with HDP's uneven micro-batch counts (host layer).

Megatron-Core's `DistributedDataParallel(overlap_grad_reduce=True)` starts an asynchronous
all-reduce (reduce-scatter with the distributed optimizer) of each gradient bucket from the
backward hooks of the *last* micro-batch, the one run outside `no_sync()`, and waits for
them in `finish_grad_sync()` (`finalize_model_grads`). Megatron assumes every data-parallel
rank runs the same micro-batches; HDP replicas run different numbers, so here:

- Each rank starts the bucket reduces in the backward of its *own* last micro-batch, and
  only if that micro-batch is local (a ring of one). A ring micro-batch's backward still
  exchanges K/V gradients with the ring over the pool's communicator; a reduce started
  before them would sit in front of them on NCCL's one stream per communicator while the
  ring partner, which has not reached its own last micro-batch, waits for the exchange:
  a hang. A rank whose last micro-batch is a ring (or that runs none) starts its reduces
  after its backward, in `finish_grad_sync`. So no rank posts a ring P2P after its first
  gradient reduce (`sync_in_backward`).
- Every rank issues the bucket reduces in one fixed order, the DDP's bucket-group order,
  whether they start from the hooks or after the backward (`OrderedGradSync`): Megatron
  issues them in the order the hooks complete them, which a rank that starts after its
  backward would not reproduce.
- Each bucket is reduced exactly once per step: a bucket already started is not started
  again, and `finish_grad_sync` first starts the buckets no hook started.

The sums are those of the unoverlapped path: a bucket is reduced once all its parameters'
gradients of the last micro-batch were accumulated (Megatron's per-parameter counts of the
first step, `golden_per_param_grad_ready_counts`; as in Megatron, every backward must
accumulate each parameter's gradient equally often).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

ATTRIBUTE = "_hdp_ordered_grad_sync"


def sync_in_backward(ring_sizes: Sequence[int], overlap: bool) -> list[bool]:
    """For each micro-batch in run order: does its backward start the gradient reduce?

    True for at most one: the last, if the DDP overlaps its reduce (`overlap`) and the
    last micro-batch runs on this rank alone (`ring_sizes[-1] == 1`). Every other
    micro-batch runs under `no_sync()`.
    """
    flags = [False] * len(ring_sizes)
    if overlap and ring_sizes and ring_sizes[-1] == 1:
        flags[-1] = True
    return flags


class OrderedGradSync:
    """Makes a Megatron-Core DDP issue its bucket reduces in bucket-group order, once each.

    Installed on the DDP instance (`install`): it takes the place of each bucket group's
    `start_grad_sync` and of the DDP's `finish_grad_sync` and `zero_grad_buffer`. A bucket
    group whose hooks report it ready waits until every group before it is ready, then they
    start in order (asynchronously: `overlap_grad_reduce`).

    Attributes:
        started_before_finish: How many bucket groups this step started before
            `finish_grad_sync`: from the backward hooks or, in Megatron's pipeline
            schedule with a `grad_sync_func`, right after the backward.
    """

    def __init__(self, ddp) -> None:
        if not ddp.ddp_config.overlap_grad_reduce:
            raise ValueError("OrderedGradSync orders overlapped reduces: overlap_grad_reduce")
        self._groups = list(ddp.bucket_groups) + list(ddp.expert_parallel_bucket_groups)
        self._start = [group.start_grad_sync for group in self._groups]
        self._finish = ddp.finish_grad_sync
        self._zero = ddp.zero_grad_buffer
        self._ready = [False] * len(self._groups)
        self._force = [False] * len(self._groups)
        self._next = 0
        self._finishing = False
        self.started_before_finish = 0
        for index, group in enumerate(self._groups):
            group.start_grad_sync = functools.partial(self._group_ready, index)
        ddp.finish_grad_sync = self.finish_grad_sync
        ddp.zero_grad_buffer = self.zero_grad_buffer

    @property
    def num_groups(self) -> int:
        """The DDP's bucket groups (dense, then expert-parallel)."""
        return len(self._groups)

    @classmethod
    def install(cls, ddp) -> OrderedGradSync | None:
        """The ordering of `ddp` (installed now if not yet); None without overlap."""
        if not ddp.ddp_config.overlap_grad_reduce:
            return None
        existing = getattr(ddp, ATTRIBUTE, None)
        if existing is None:
            existing = cls(ddp)
            setattr(ddp, ATTRIBUTE, existing)
        return existing

    def _group_ready(self, index: int, force_all_reduce: bool | None = False) -> None:
        """Bucket group `index` may start; start every ready group in order (collective)."""
        if self._ready[index]:
            return  # started this step already (by its hooks, or a second request)
        self._ready[index] = True
        self._force[index] = bool(force_all_reduce)
        while self._next < len(self._groups) and self._ready[self._next]:
            self._issue(self._next)
            self._next += 1

    def _issue(self, index: int) -> None:
        if not self._finishing:
            self.started_before_finish += 1
        self._start[index](force_all_reduce=self._force[index])

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """Collective over the DDP's groups: start the groups not started yet, then wait.

        The groups start in order; the wait is Megatron's `finish_grad_sync`.
        """
        self._finishing = True
        for index in range(len(self._groups)):
            self._group_ready(index, force_all_reduce)
        self._finish(force_all_reduce=force_all_reduce)

    def zero_grad_buffer(self) -> None:
        """Megatron's `zero_grad_buffer`, and a new step for the ordering."""
        self._zero()
        self._ready = [False] * len(self._groups)
        self._force = [False] * len(self._groups)
        self._next = 0
        self._finishing = False
        self.started_before_finish = 0
