"""A trainer rank's side of the Ray data service.

`RayDataService.connect` joins the Ray cluster and finds (or, on the first rank to ask,
starts) the job's planner actor, which starts the source loaders. Then, per step, a rank:

1. takes the step's batch and plan from the planner (`RemoteBatches.next_batch`, the
   sampler that `data.prefetch.Prefetcher` draws from, so this runs ahead of training);
2. works out which token ranges its own micro-batches need (the same reading code as the
   in-process loader, run once against a recorder) and fetches exactly those from the
   source loaders, spread over each source's loaders (`RayDataService.tokens`);
3. reads its micro-batches from what was fetched.

A loader that dies mid-fetch is replaced by its source's shadow (`PlannerActor.
replace_loader`) and the fetch is retried there; the batch and its units do not change,
so every document is still used exactly once per epoch. No collective runs here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_hdp.data.batching import IndexedTokens
from megatron_hdp.data.service.actors import PlannerActor

logger = logging.getLogger(__name__)

#: Ray namespace of the service's named actors.
NAMESPACE = "megatron_hdp"
#: Fetch attempts per micro-batch read before a loader failure is raised.
ATTEMPTS = 3


@dataclass(frozen=True)
class PlannedBatch:
    """A global batch as the planner actor made it: its units and its plan."""

    units: list
    plan: object


class _Recorder:
    """An `IndexedReader` that records what is read and returns zeros of that length."""

    def __init__(self) -> None:
        self.requests: dict[tuple[int, int, int], None] = {}

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        self.requests[(int(idx), int(offset), int(length))] = None
        return np.zeros(length, dtype=np.int64)


class _Fetched:
    """An `IndexedReader` over token ranges fetched from a source loader."""

    def __init__(self, ranges: dict[tuple[int, int, int], np.ndarray]) -> None:
        self.ranges = ranges

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        return self.ranges[(int(idx), int(offset), int(length))]


def _init(address: str) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(
            address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING
        )


def ray_remote(cls):
    """`ray.remote(cls)` (Ray imported here, not at module import)."""
    import ray

    return ray.remote(cls)


class RemoteBatches:
    """The planner actor's batches in order, as a sampler for `Prefetcher`.

    `state_dict()` is the sampler state after the last batch fetched, in the in-process
    sampler's format, so checkpoints and resumes do not depend on the data service.
    """

    def __init__(self, planner, state: dict, *, timeout_s: float) -> None:
        self._planner, self._state, self._timeout_s = planner, state, timeout_s
        self._step = int(state["steps"])

    def next_batch(self) -> PlannedBatch:
        """The next batch and its plan (blocks until the planner has made it)."""
        import ray

        self._step += 1
        (ref,) = ray.get(self._planner.batch.remote(self._step), timeout=self._timeout_s)
        units, plan, state = ray.get(ref, timeout=self._timeout_s)
        self._state = state
        return PlannedBatch(units, plan)

    def state_dict(self) -> dict:
        """The sampler state after the last batch handed out by `next_batch`."""
        return self._state


class RayDataService:
    """This rank's handle on the job's planner actor and source loaders."""

    def __init__(self, planner, *, timeout_s: float) -> None:
        import ray

        self.planner, self.timeout_s = planner, timeout_s
        self.loaders = ray.get(planner.loader_handles.remote(), timeout=timeout_s)

    def check_sources(self, names: Sequence[str], digests: Sequence[str]) -> None:
        """ValueError naming a source whose loaders opened other documents than this rank.

        A loader opens its source on its own node (the embedded corpus is built from that
        node's Python, JSONL is tokenized there): its document lengths must be the ones
        this rank planned with.
        """
        import ray

        theirs = ray.get(self.planner.source_digests.remote(), timeout=self.timeout_s)
        for name, mine, found in zip(names, digests, theirs, strict=True):
            if found != [mine]:
                raise ValueError(
                    f"data source {name!r}: the Ray source loaders opened documents of other "
                    f"lengths than this rank (digests {found} vs {mine}); the cluster's nodes "
                    "must see the same files, Python (for the embedded corpus) and tokenizer"
                )

    @classmethod
    def start(
        cls,
        address: str,
        *,
        job_key: str,
        sampler,
        plan: Callable,
        sources: Sequence,
        open_args: dict,
        keep: int,
        timeout_s: float = 300.0,
    ) -> RayDataService:
        """Join the cluster at `address` and start the job's planner (one rank does this).

        Returns once the planner's loaders have opened their sources. The planner actor is
        named after `job_key`, so one job never uses another's; the other ranks `attach`.
        """
        _init(address)
        actor = ray_remote(PlannerActor).options(
            name=f"planner-{job_key}", num_cpus=0, max_restarts=0
        )
        planner = actor.remote(sampler, plan, list(sources), open_args, keep)
        return cls(planner, timeout_s=timeout_s)

    @classmethod
    def attach(cls, address: str, *, job_key: str, timeout_s: float = 300.0) -> RayDataService:
        """Join the cluster at `address` and the planner another rank started (`start`)."""
        import ray

        _init(address)
        planner = ray.get_actor(f"planner-{job_key}", namespace=NAMESPACE)
        return cls(planner, timeout_s=timeout_s)

    def close(self) -> None:
        """Leave the cluster (the planner and its loaders end with the rank that started them)."""
        import ray

        if ray.is_initialized():
            ray.shutdown()

    def batches(self, state: dict) -> RemoteBatches:
        """The batches after the sampler state `state` (what a resume restored)."""
        return RemoteBatches(self.planner, state, timeout_s=self.timeout_s)

    def tokens(self, batch: PlannedBatch, rank: int, collect: Callable, **kwargs) -> IndexedTokens:
        """A token source holding what pool rank `rank` reads of `batch`, fetched remotely.

        `collect(plan, source, rank)` is the reading function (`batching.read_local`): it runs
        once on a recorder to learn which ranges this rank's micro-batches read. `kwargs`
        go to `IndexedTokens` (the vocabulary check).
        """
        recorders = [_Recorder() for _ in self.loaders]
        collect(batch.plan, IndexedTokens(recorders, batch.units), rank)
        fetched = [self._fetch(k, list(r.requests)) for k, r in enumerate(recorders)]
        return IndexedTokens([_Fetched(f) for f in fetched], batch.units, **kwargs)

    def _fetch(self, source: int, requests: list) -> dict:
        """Token ranges of one source, spread over its loaders (slot i takes every n-th)."""
        import ray

        slots = len(self.loaders[source])
        shares = {slot: requests[slot::slots] for slot in range(slots) if requests[slot::slots]}
        ranges: dict = {}
        for slot, share in shares.items():
            for attempt in range(ATTEMPTS):
                loader = self.loaders[source][slot]
                try:
                    tokens, sizes = ray.get(loader.read.remote(share), timeout=self.timeout_s)
                    break
                except ray.exceptions.RayActorError as err:
                    if attempt == ATTEMPTS - 1:
                        raise RuntimeError(
                            f"source loader {slot} of source {source} failed {ATTEMPTS} times"
                        ) from err
                    logger.warning("source loader %d of source %d died: %s", slot, source, err)
                    self.loaders[source][slot] = ray.get(
                        self.planner.replace_loader.remote(source, slot, loader._actor_id.hex()),
                        timeout=self.timeout_s,
                    )
            for request, piece in zip(share, np.split(tokens, np.cumsum(sizes)[:-1]), strict=True):
                ranges[request] = piece
        return ranges
