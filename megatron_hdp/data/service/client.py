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

Each batch carries the planner's routing version (which loader serves which document
range); a rank with an older routing takes the new one before fetching (scale events,
`scaling.py`), and reports its data wait with its batch requests (`WaitReport`).
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
from megatron_hdp.data.spec import PlaneSpec
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
    """A global batch as the planner actor made it: its units, its plan, the routing version.

    `routing`: the version of the planner's loader routing when it handed the batch out
    (a rank whose routing is older asks for the new one before fetching).
    """

    units: list
    plan: object
    routing: int = 0


class WaitReport:
    """What a rank tells the planner of its data wait, for the scaling policy (thread-safe).

    The trainer's loop adds the seconds each step waited for its batch (`add_wait`); each
    fetch adds which source's reads arrived last (`add_last`); `take` hands the sums since
    the last `take`, with the seconds they cover, to the next batch request.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since = time.perf_counter()
        self._wait, self._last = 0.0, {}

    def add_wait(self, seconds: float) -> None:
        """Add seconds the training loop waited for a batch."""
        with self._lock:
            self._wait += float(seconds)

    def add_last(self, source: int) -> None:
        """Count a fetch whose slowest reads were `source`'s."""
        with self._lock:
            self._last[source] = self._last.get(source, 0) + 1

    def take(self) -> dict:
        """`{wait_s, period_s, last}` since the previous take (and start afresh)."""
        with self._lock:
            now = time.perf_counter()
            out = {"wait_s": self._wait, "period_s": now - self._since, "last": dict(self._last)}
            self._since, self._wait, self._last = now, 0.0, {}
        return out


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
    An answer that is a `[ref, routing]` list (`PlannerActor.batch`) is resolved here too
    (returned as `(batch, routing)`), so that a planner dying between handing out a batch
    and its fetch is asked again.
    """
    import ray

    deadline, died = time.monotonic() + timeout_s, 0
    while True:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise ray.exceptions.GetTimeoutError(what)
            answer = ray.get(getattr(planner, method).remote(*args), timeout=left)
            if method == "batch":  # [ref, routing]: the batch itself, and the routing
                batch = ray.get(answer[0], timeout=max(deadline - time.monotonic(), 1e-3))
                answer = (batch, answer[1])
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

    def __init__(
        self,
        planner,
        state: dict,
        *,
        timeout_s: float,
        window: int = 8,
        report: WaitReport | None = None,
    ) -> None:
        self._planner, self._state, self._timeout_s = planner, state, timeout_s
        self._step = int(state["steps"])
        # The sampler states of the last `window` batches (a restarted planner resumes
        # from the oldest: ranks behind this one by fewer batches still get theirs).
        self._window = max(1, int(window))
        self._history: dict[int, dict] = {self._step: state}
        self._report = report

    def next_batch(self) -> PlannedBatch:
        """The next batch and its plan (blocks until the planner has made it).

        The request carries this rank's data wait since its last one (`WaitReport`).
        """
        self._step += 1
        what = f"the data service's planner actor, asked for batch {self._step}"
        oldest = min(self._history)
        report = self._report.take() if self._report is not None else None
        (units, plan, state), routing = _ask(
            self._planner,
            "batch",
            self._step,
            (oldest, self._history[oldest]),
            report,
            timeout_s=self._timeout_s,
            what=what,
        )
        self._state = state
        self._history[self._step] = state
        self._history.pop(self._step - self._window, None)
        return PlannedBatch(units, plan, routing)

    def state_dict(self) -> dict:
        """The sampler state after the last batch handed out by `next_batch`."""
        return self._state


class RayDataService:
    """This rank's handle on the job's planner actor and source loaders."""

    def __init__(self, planner, *, timeout_s: float, sentinel: Sentinel | None = None) -> None:
        self.planner, self.timeout_s, self.sentinel = planner, timeout_s, sentinel
        what = "the data service's planner actor, starting its source loaders"
        self.keep = int(_ask(planner, "status", timeout_s=timeout_s, what=what)["keep"])
        self.report = WaitReport()
        self._scaling_next = 0
        self._refresh("starting its source loaders")

    def _refresh(self, why: str = "asked who serves what") -> None:
        """Take the planner's current routing (`PlannerActor.route`)."""
        self.routing, self.loaders, bounds = _ask(
            self.planner,
            "route",
            timeout_s=self.timeout_s,
            what=f"the data service's planner actor, {why}",
        )
        self.bounds = [np.asarray(b, dtype=np.int64) for b in bounds]

    def note_wait(self, seconds: float) -> None:
        """Add seconds this rank's training loop waited for data (reported to the planner)."""
        self.report.add_wait(seconds)

    def scaling_log(self) -> dict:
        """The planner's scaling timeline since this rank last asked (`Scaling.log`)."""
        log = _ask(
            self.planner,
            "scaling_log",
            self._scaling_next,
            timeout_s=self.timeout_s,
            what="the data service's planner actor, asked for its scaling timeline",
        )
        self._scaling_next = log.pop("next")
        return log

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
        plane: PlaneSpec | None = None,
    ) -> RayDataService:
        """Join the cluster at `address` and start the job's planner (one rank does this).

        `lengths`: each source's document lengths, which the planner cuts into its loaders'
        parts (the rank's readers' `sequence_lengths`). `plane`: the spec's `data_plane`
        (CPU budget, scaling knobs). DataServiceError before any actor starts if the
        loaders' and shadows' CPUs at start are more than the cluster has.

        Returns once the planner's loaders have opened their sources. The planner actor is
        named after `job_key`, so one job never uses another's; the other ranks `attach`.
        `save` (the job's --save) is what the rank's sentinel names if Ray ends the rank.
        """
        sentinel = _join(address, save)
        check_cpus(list(sources), address)
        actor = ray_remote(PlannerActor).options(
            name=f"planner-{job_key}", num_cpus=0, max_restarts=PLANNER_RESTARTS
        )
        lengths = [np.asarray(n, dtype=np.int64) for n in lengths]
        planner = actor.remote(sampler, plan, list(sources), open_args, keep, lengths, plane)
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
        return RemoteBatches(
            self.planner, state, timeout_s=self.timeout_s, window=self.keep, report=self.report
        )

    def tokens(self, batch: PlannedBatch, rank: int, collect: Callable, **kwargs) -> IndexedTokens:
        """A token source holding what pool rank `rank` reads of `batch`, fetched remotely.

        `collect(plan, source, rank)` is the reading function (`batching.read_local`): it runs
        once on a recorder to learn which ranges this rank's micro-batches read. `kwargs`
        go to `IndexedTokens` (the vocabulary check).
        """
        if batch.routing != self.routing:  # a scale event, or a restarted planner's routing
            self._refresh()
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

        Every share is sent before any answer is awaited, and the rank waits once for all;
        the source whose reads arrived last is noted for the planner (`WaitReport`). A
        share whose loader died (or was retired by a scale event) is reported to the
        planner, which puts the source's shadow in its place; the rank then takes the
        current routing and sends the share's requests again, up to `ATTEMPTS` times.
        """
        import ray

        ranges: list[dict] = [{} for _ in requests]
        pending = requests
        for attempt in range(ATTEMPTS):
            shares = self._shares(pending)
            sent = {
                key: (self.loaders[key[0]][key[1]], self.loaders[key[0]][key[1]].read.remote(share))
                for key, share in shares.items()
            }
            self._await(sent)
            failed: list[list] = [[] for _ in requests]
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
                    _ask(
                        self.planner,
                        "replace_loader",
                        source,
                        slot,
                        loader._actor_id.hex(),
                        timeout_s=self.timeout_s,
                        what="the data service's planner actor, asked to replace a dead loader",
                    )
                    failed[source].extend(shares[(source, slot)])
                    continue
                pieces = np.split(tokens, np.cumsum(sizes)[:-1])
                for request, piece in zip(shares[(source, slot)], pieces, strict=True):
                    ranges[source][request] = piece
            if not any(failed):
                break
            self._refresh("asked who serves what after a loader died")
            pending = failed
        return ranges

    def _await(self, sent: dict) -> None:
        """Wait for every read in `sent`; note the source whose reads arrived last."""
        import ray

        owner = {ref: key for key, (_, ref) in sent.items()}
        left, last = list(owner), None
        deadline = time.perf_counter() + self.timeout_s
        while left:
            done, left = ray.wait(
                left, num_returns=1, timeout=max(0.0, deadline - time.perf_counter())
            )
            if not done:
                source, slot = owner[left[0]]
                raise DataServiceError(
                    f"source loader {slot} of source {source} of the data service: no "
                    f"answer within {self.timeout_s:g} s"
                )
            last = owner[done[0]][0]
        if last is not None:
            self.report.add_last(last)


def check_cpus(sources: Sequence, address: str) -> None:
    """DataServiceError if the loaders and shadows at start ask for more CPUs than Ray has.

    Each source starts its `loaders` (its `min`) and one shadow, each asking Ray for the
    source's `cpus`; Ray would otherwise leave them waiting for ever.
    """
    import ray

    need = sum((s.loaders + 1) * getattr(s, "cpus", 0.0) for s in sources)
    have = float(ray.cluster_resources().get("CPU", 0.0))
    if need > have + 1e-9:
        raise DataServiceError(
            f"the data service's loaders ask for {need:g} CPUs at start (each source's loaders "
            f"and its shadow, times its cpus), but the Ray cluster at {address} has {have:g}: "
            "lower the sources' cpus or loaders in the data spec, or add CPUs to the cluster"
        )
