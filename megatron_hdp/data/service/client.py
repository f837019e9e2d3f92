"""A trainer rank's side of the Ray data service.

`RayDataService.connect` joins the Ray cluster and finds (or, on the first rank to ask,
starts) the job's planner actor, which starts the source loaders. Then, per step, a rank:

1. takes the step's batch and plan from the planner (`RemoteBatches.next_batch`, the
   sampler that `data.prefetch.Prefetcher` draws from, so this runs ahead of training);
2. works out which token ranges its own micro-batches need (the same reading code as the
   in-process loader, run once against a recorder) and fetches exactly those from the
   loaders that own them (each loader owns a contiguous, token-balanced range of its
   source's documents): every request of every source is sent at once, and the rank
   waits once for all of them (`RayDataService.tokens`);
3. reads its micro-batches from what was fetched.

A loader that dies mid-fetch is replaced by its source's shadow (`PlannerActor.
replace_loader`) and the fetch is retried there; the batch and its units do not change,
so every document is still used exactly once per epoch. A planner that dies is restarted
by Ray (`actors.PLANNER_RESTARTS`): every call to it (`_ask`) waits for the restart and
asks again, and each request for a batch carries the sampler state of the oldest batch
the rank keeps, from which the restarted planner resumes. No collective runs here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_hdp.data.batching import IndexedTokens
from megatron_hdp.data.service.actors import PLANNER_RESTARTS, PlannerActor
from megatron_hdp.data.service.sentinel import Sentinel, speaks_for_this_node
from megatron_hdp.errors import DataServiceError

logger = logging.getLogger(__name__)

#: Ray namespace of the service's named actors.
NAMESPACE = "megatron_hdp"
#: Fetch attempts per micro-batch read before a loader failure is raised.
ATTEMPTS = 3
#: Calls to the planner that find it dead (not restarting) before the rank gives up.
PLANNER_ATTEMPTS = 3
#: Seconds between asking a planner that is being restarted again.
RESTART_POLL_S = 0.2
#: Seconds `ray.init` may take to join the cluster before the rank gives up.
CONNECT_TIMEOUT_S = 60.0


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


def _first_line(err: BaseException) -> str:
    cause = getattr(err, "cause", None)  # a task's own exception inside Ray's RayTaskError
    if isinstance(cause, BaseException):
        err = cause
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0].strip() if lines else ''}"


def _init(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Join the Ray cluster at `address`; DataServiceError naming it if that fails or hangs.

    `ray.init` retries for ever on a port where something other than a Ray head answers;
    it runs in a thread here so that the rank gives up after `timeout_s`.
    """
    import ray

    if ray.is_initialized():
        return
    failure: list[BaseException] = []

    def join() -> None:
        try:
            ray.init(
                address=address,
                namespace=NAMESPACE,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            failure.append(err)

    thread = threading.Thread(target=join, name="hdp-ray-init", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise DataServiceError(
            f"the Ray cluster at {address} did not let this rank join within {timeout_s:g} s "
            "(is a Ray head of this Ray version listening there?)"
        )
    if failure:
        raise DataServiceError(
            f"could not join the Ray cluster at {address}: {_first_line(failure[0])}"
        ) from failure[0]


def _join(address: str, save: str | None) -> Sentinel | None:
    """`_init`, then this node's sentinel (`sentinel.py`): Ray may end the rank from now on."""
    _init(address)
    return Sentinel(address, save=save) if speaks_for_this_node() else None


def _ask(planner, method: str, *args, timeout_s: float, what: str):
    """`planner.method(*args)`, through a restart of the planner actor.

    While Ray restarts the planner its calls fail as unavailable: they are sent again
    until `timeout_s`. A call that finds it dead (or an answer lost with it) is sent again
    up to `PLANNER_ATTEMPTS` times: a planner Ray no longer restarts fails every one of
    them at once, and that is a DataServiceError saying `what` failed, not a hang.
    An answer that is a `[ref]` list (`PlannerActor.batch`) is resolved here too, so that
    a planner dying between handing out a batch and its fetch is asked again.
    """
    import ray

    deadline, died = time.monotonic() + timeout_s, 0
    while True:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise ray.exceptions.GetTimeoutError(what)
            answer = ray.get(getattr(planner, method).remote(*args), timeout=left)
            if method == "batch":
                answer = ray.get(answer[0], timeout=max(deadline - time.monotonic(), 1e-3))
            return answer
        except ray.exceptions.GetTimeoutError as err:
            raise DataServiceError(f"{what}: no answer within {timeout_s:g} s") from err
        except ray.exceptions.ActorUnavailableError:
            time.sleep(RESTART_POLL_S)  # being restarted: ask again
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as err:
            died += 1
            if died >= PLANNER_ATTEMPTS:
                raise DataServiceError(
                    f"{what}: the actor died ({_first_line(err)}); Ray restarts it at most "
                    f"{PLANNER_RESTARTS} time(s) and it is not coming back"
                ) from err
            logger.warning("%s: the actor died (%s); asking again", what, _first_line(err))
            time.sleep(RESTART_POLL_S)
        except ray.exceptions.RayError as err:
            raise DataServiceError(f"{what}: {_first_line(err)}") from err


def ray_remote(cls):
    """`ray.remote(cls)` (Ray imported here, not at module import)."""
    import ray

    return ray.remote(cls)


class RemoteBatches:
    """The planner actor's batches in order, as a sampler for `Prefetcher`.

    `state_dict()` is the sampler state after the last batch fetched, in the in-process
    sampler's format, so checkpoints and resumes do not depend on the data service.
    """

    def __init__(self, planner, state: dict, *, timeout_s: float, window: int = 8) -> None:
        self._planner, self._state, self._timeout_s = planner, state, timeout_s
        self._step = int(state["steps"])
        # The sampler states of the last `window` batches (a restarted planner resumes
        # from the oldest: ranks behind this one by fewer batches still get theirs).
        self._window = max(1, int(window))
        self._history: dict[int, dict] = {self._step: state}

    def next_batch(self) -> PlannedBatch:
        """The next batch and its plan (blocks until the planner has made it)."""
        self._step += 1
        what = f"the data service's planner actor, asked for batch {self._step}"
        oldest = min(self._history)
        units, plan, state = _ask(
            self._planner,
            "batch",
            self._step,
            (oldest, self._history[oldest]),
            timeout_s=self._timeout_s,
            what=what,
        )
        self._state = state
        self._history[self._step] = state
        self._history.pop(self._step - self._window, None)
        return PlannedBatch(units, plan)

    def state_dict(self) -> dict:
        """The sampler state after the last batch handed out by `next_batch`."""
        return self._state


class RayDataService:
    """This rank's handle on the job's planner actor and source loaders."""

    def __init__(self, planner, *, timeout_s: float, sentinel: Sentinel | None = None) -> None:
        self.planner, self.timeout_s, self.sentinel = planner, timeout_s, sentinel
        what = "the data service's planner actor, starting its source loaders"
        self.loaders = _ask(planner, "loader_handles", timeout_s=timeout_s, what=what)
        bounds = _ask(planner, "partitions", timeout_s=timeout_s, what=what)
        self.keep = int(_ask(planner, "status", timeout_s=timeout_s, what=what)["keep"])
        self.bounds = [np.asarray(b, dtype=np.int64) for b in bounds]

    def check_sources(self, names: Sequence[str], digests: Sequence[str]) -> None:
        """ValueError naming a source whose loaders opened other documents than this rank.

        A loader opens its source on its own node (the embedded corpus is built from that
        node's Python, JSONL is tokenized there): its document lengths must be the ones
        this rank planned with.
        """
        theirs = _ask(
            self.planner,
            "source_digests",
            timeout_s=self.timeout_s,
            what="the data service's planner actor, asked what its loaders opened",
        )
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
        lengths: Sequence,
        timeout_s: float = 300.0,
        save: str | None = None,
    ) -> RayDataService:
        """Join the cluster at `address` and start the job's planner (one rank does this).

        `lengths`: each source's document lengths, which the planner cuts into its loaders'
        parts (the rank's readers' `sequence_lengths`).

        Returns once the planner's loaders have opened their sources. The planner actor is
        named after `job_key`, so one job never uses another's; the other ranks `attach`.
        `save` (the job's --save) is what the rank's sentinel names if Ray ends the rank.
        """
        sentinel = _join(address, save)
        actor = ray_remote(PlannerActor).options(
            name=f"planner-{job_key}", num_cpus=0, max_restarts=PLANNER_RESTARTS
        )
        lengths = [np.asarray(n, dtype=np.int64) for n in lengths]
        planner = actor.remote(sampler, plan, list(sources), open_args, keep, lengths)
        return cls(planner, timeout_s=timeout_s, sentinel=sentinel)

    @classmethod
    def attach(
        cls, address: str, *, job_key: str, timeout_s: float = 300.0, save: str | None = None
    ) -> RayDataService:
        """Join the cluster at `address` and the planner another rank started (`start`)."""
        import ray

        sentinel = _join(address, save)
        try:
            planner = ray.get_actor(f"planner-{job_key}", namespace=NAMESPACE)
        except ValueError as err:  # Ray's way of saying the named actor is not there
            raise DataServiceError(
                f"the data service's planner actor planner-{job_key} is gone from the Ray "
                f"cluster at {address} (rank 0 started it)"
            ) from err
        return cls(planner, timeout_s=timeout_s, sentinel=sentinel)

    def close(self) -> None:
        """Leave the cluster (the planner and its loaders end with the rank that started them)."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self.sentinel is not None:
            self.sentinel.close()
            self.sentinel = None

    def loader_stats(self) -> list[dict]:
        """Every source loader's and shadow's measurements (`PlannerActor.loader_stats`)."""
        return _ask(
            self.planner,
            "loader_stats",
            timeout_s=self.timeout_s,
            what="the data service's planner actor, asked for its loaders' measurements",
        )

    def batches(self, state: dict) -> RemoteBatches:
        """The batches after the sampler state `state` (what a resume restored)."""
        return RemoteBatches(self.planner, state, timeout_s=self.timeout_s, window=self.keep)

    def tokens(self, batch: PlannedBatch, rank: int, collect: Callable, **kwargs) -> IndexedTokens:
        """A token source holding what pool rank `rank` reads of `batch`, fetched remotely.

        `collect(plan, source, rank)` is the reading function (`batching.read_local`): it runs
        once on a recorder to learn which ranges this rank's micro-batches read. `kwargs`
        go to `IndexedTokens` (the vocabulary check).
        """
        recorders = [_Recorder() for _ in self.loaders]
        collect(batch.plan, IndexedTokens(recorders, batch.units), rank)
        fetched = self._fetch([list(r.requests) for r in recorders])
        return IndexedTokens([_Fetched(f) for f in fetched], batch.units, **kwargs)

    def _shares(self, requests: list[list]) -> dict[tuple[int, int], list]:
        """Each source's requests grouped by the loader that owns their document."""
        shares: dict[tuple[int, int], list] = {}
        for source, wanted in enumerate(requests):
            if not wanted:
                continue
            docs = np.asarray([doc for doc, _, _ in wanted], dtype=np.int64)
            owners = np.searchsorted(self.bounds[source], docs, side="right") - 1
            for request, slot in zip(wanted, owners.tolist(), strict=True):
                shares.setdefault((source, slot), []).append(request)
        return shares

    def _fetch(self, requests: list[list]) -> list[dict]:
        """Per source, the token ranges `requests` name, from the loaders that own them.

        Every share is sent before any answer is awaited, and the rank waits once for all.
        A share whose loader died is sent again to the loader the planner puts in its
        place (its source's shadow), up to `ATTEMPTS` times.
        """
        import ray

        ranges: list[dict] = [{} for _ in requests]
        pending = self._shares(requests)
        for attempt in range(ATTEMPTS):
            sent = {
                key: (self.loaders[key[0]][key[1]], self.loaders[key[0]][key[1]].read.remote(share))
                for key, share in pending.items()
            }
            refs = [ref for _, ref in sent.values()]
            _, late = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
            if late:
                (source, slot) = next(k for k, (_, r) in sent.items() if r in late)
                raise DataServiceError(
                    f"source loader {slot} of source {source} of the data service: no "
                    f"answer within {self.timeout_s:g} s"
                )
            retry = {}
            for (source, slot), (loader, ref) in sent.items():
                try:
                    tokens, sizes = ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    if attempt == ATTEMPTS - 1:
                        raise DataServiceError(
                            f"source loader {slot} of source {source} of the data service "
                            f"failed {ATTEMPTS} times ({_first_line(err)})"
                        ) from err
                    logger.warning("source loader %d of source %d died: %s", slot, source, err)
                    self.loaders[source][slot] = _ask(
                        self.planner,
                        "replace_loader",
                        source,
                        slot,
                        loader._actor_id.hex(),
                        timeout_s=self.timeout_s,
                        what="the data service's planner actor, asked to replace a dead loader",
                    )
                    retry[(source, slot)] = pending[(source, slot)]
                    continue
                share = pending[(source, slot)]
                pieces = np.split(tokens, np.cumsum(sizes)[:-1])
                for request, piece in zip(share, pieces, strict=True):
                    ranges[source][request] = piece
            pending = retry
            if not pending:
                break
        return ranges
