"""The Ray data service's actors: one planner for the job, source loaders per source.

Both are plain classes; `client.start_service` runs them as Ray actors. Imports Ray only
inside the planner's methods that start or hand out other actors and objects.

- `SourceLoader` opens one part of a source (`sources.open_source`: a contiguous range of
  its documents) and serves token ranges of it. It holds no stream position: which units
  a step reads is the planner's decision, so a replacement reads exactly what the dead
  one would have, and no document is skipped or read twice.
- `PlannerActor` owns the job's sampler: it draws each global batch and plans it once, for
  all ranks, and keeps the last few in Ray's object store for the ranks to fetch. It also
  supervises the loaders: `loaders` per source as the spec says, each owning one of the
  source's token-balanced document ranges (`sources.token_partition`), plus one warm
  *shadow* per source (opened on the whole source, idle) that takes over the part of a
  loader that dies, after which a new shadow is started. Sources with `loaders: {min,
  max}` are scaled between batches by measured cost (`scaling.Scaling`, the policy in
  `autoscale.py`); loaders ask Ray for their source's `cpus`. The service's resumable state
  is the sampler's (a few integers per stream): checkpoints store it, and a resumed job
  starts the planner from it.

Planner failover: the planner runs with `PLANNER_RESTARTS` restarts. Ray restarts a dead
planner under the same name (its handles stay valid) and runs `__init__` again, with the
sampler at the job's first batch: it starts new loaders and shadows (the old ones died
with it). The ranks' requests carry the sampler state of a recent batch
(`PlannerActor.batch`'s `since`), and a restarted planner that is behind it resumes from
there, so its loss costs the restart (seconds) and the batches are the ones it would have
made. A planner that dies once more is gone: the ranks stop with one line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from megatron_hdp.data.service.scaling import Scaling
from megatron_hdp.data.sources import lengths_digest, open_source, token_partition
from megatron_hdp.data.spec import PlaneSpec, SourceSpec

logger = logging.getLogger(__name__)

#: How often Ray restarts a dead planner actor (a second death after that stops the job).
PLANNER_RESTARTS = 1


class SourceLoader:
    """Reads token ranges of documents `[first, end)` of one source (runs as a Ray actor).

    `docs=None`: the whole source (a shadow, which can take over any part).
    """

    def __init__(self, source: SourceSpec, open_args: dict, docs=None) -> None:
        self.source, self.docs = source, docs
        self.reader = open_source(source, **open_args, docs=docs)
        self.started = time.perf_counter()
        self.counts = {"reads": 0, "tokens": 0, "cpu_s": 0.0, "busy_s": 0.0}

    def ready(self) -> np.ndarray:
        """The lengths of the documents it owns, once open (a start-up barrier)."""
        lengths = np.asarray(self.reader.sequence_lengths, dtype=np.int64)
        if self.docs is None or len(lengths) == self.docs[1] - self.docs[0]:
            return lengths  # the whole source, or a reader that holds only its part
        return lengths[self.docs[0] : self.docs[1]]

    def read(self, requests: Sequence[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """Tokens of `(doc, offset, length)` requests, concatenated, and each one's length."""
        wall, cpu = time.perf_counter(), time.process_time()
        parts = [
            np.asarray(self.reader.get(doc, offset=offset, length=length))
            for doc, offset, length in requests
        ]
        sizes = np.asarray([len(p) for p in parts], dtype=np.int64)
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        self.counts["reads"] += 1
        self.counts["tokens"] += len(tokens)
        self.counts["cpu_s"] += time.process_time() - cpu
        self.counts["busy_s"] += time.perf_counter() - wall
        return tokens, sizes

    def stats(self) -> dict:
        """What it has served and what it costs, measured in the actor's process.

        `reads` and `tokens` served, `cpu_s` (process CPU seconds spent in reads), `busy_s`
        (wall seconds in reads), `alive_s` (seconds since it opened its source) and
        `busy_share` (busy of alive), the documents it owns, and its process memory in
        bytes from psutil (`uss`, `pss` where the platform has them, `rss`; absent
        without psutil).
        """
        alive = time.perf_counter() - self.started
        out = {
            **self.counts,
            "alive_s": alive,
            "busy_share": self.counts["busy_s"] / alive if alive > 0 else 0.0,
            "docs": list(self.docs) if self.docs is not None else None,
        }
        out.update(process_memory())
        return out


class PlannerActor:
    """Plans each global batch once for every rank and supervises the source loaders.

    Args:
        sampler: The job's training sampler, at the position to start from.
        plan: Plans one batch from its sequence lengths (the trainer's own planner).
        sources: The data spec's sources (or one per dataset of a `--data-path` blend).
        open_args: How loaders open a source (`open_source` keywords).
        keep: Batches kept for ranks that are behind (older ones are dropped).
        lengths: Each source's document lengths (what the ranks planned with): they cut
            the sources into the loaders' token-balanced parts.
        plane: The spec's `data_plane` (CPU budget and scaling knobs; default: none).

    Sources with `loaders: {min, max}` are scaled between batches by `Scaling` (the
    policy in `autoscale.py`); the *routing* (which loader serves which document range)
    has a version that every batch carries, so ranks refresh theirs when it changes.
    """

    def __init__(
        self,
        sampler,
        plan: Callable,
        sources: Sequence[SourceSpec],
        open_args: dict,
        keep: int,
        lengths: Sequence,
        plane: PlaneSpec | None = None,
    ) -> None:
        import ray

        self._ray = ray
        self.sampler, self.plan, self.keep = sampler, plan, keep
        self.sources, self.open_args = list(sources), open_args
        self.lengths = [np.asarray(n, dtype=np.int64) for n in lengths]
        self.produced = sampler.state.steps
        self.first = self.produced
        self.batches: dict[int, object] = {}
        self.replacements = 0
        self.resumed_from: int | None = None
        self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        if self.restarted:
            logger.warning(
                "the data service's planner actor was restarted: new source loaders open "
                "their parts; it resumes from the sampler position the ranks send"
            )
        self.routing = 0
        self.bounds = [
            token_partition(n, s.loaders) for n, s in zip(self.lengths, self.sources, strict=True)
        ]
        self.holds = [[(int(b[i]), int(b[i + 1])) for i in range(len(b) - 1)] for b in self.bounds]
        self.loaders = [[self._start(k, d) for d in held] for k, held in enumerate(self.holds)]
        self.shadows = [self._start(k) for k in range(len(sources))]
        self.digests = []
        for group, shadow in zip(self.loaders, self.shadows, strict=True):
            parts = ray.get([h.ready.remote() for h in group])
            whole = ray.get(shadow.ready.remote())
            self.digests.append(sorted({lengths_digest(_Lengths(np.concatenate(parts))),
                                        lengths_digest(_Lengths(whole))}))  # fmt: skip
        self.scaling = Scaling(self, plane or PlaneSpec())

    def _start(self, source: int, docs=None):
        """A new loader of `source` on documents `docs` (None: all, a shadow)."""
        cpus = self.sources[source].cpus
        loader = self._ray.remote(SourceLoader).options(num_cpus=cpus, max_restarts=0)
        return loader.remote(self.sources[source], self.open_args, docs)

    def batch(
        self, step: int, since: tuple[int, dict] | None = None, report: dict | None = None
    ) -> list:
        """`[ref, routing]`: `ref` to `(units, plan, sampler state after it)` of batch `step`.

        Batches are drawn in order, so every rank gets the same batch for the same step;
        the reference is wrapped in a list so that Ray hands it over unresolved. `routing`
        is the loaders' routing version when it was handed out.
        `since = (k, state)`: the sampler state after batch `k`, the oldest a rank keeps.
        A planner behind it (restarted: it began again at the job's first batch) resumes
        from that state instead of drawing every batch since the job's first again; the
        batches are the same either way (the sampler is deterministic from its state).
        `report`: the asking rank's data wait since its last report (`client.WaitReport`),
        for the scaling policy; the policy runs here, between batches.
        """
        if since is not None and since[0] > self.produced:
            self._resume(int(since[0]), since[1])
        if step <= self.first or step <= self.produced - self.keep:
            raise ValueError(
                f"batch {step} is no longer kept by the planner (it has planned up to "
                f"{self.produced} and keeps {self.keep}): a rank fell too far behind"
            )
        if report:
            self.scaling.note_wait(report)
        while self.produced < step:
            units = self.sampler.next_batch()
            plan = self.plan([u.length for u in units])
            self.produced += 1
            self.batches[self.produced] = self._ray.put((units, plan, self.sampler.state_dict()))
            self.batches.pop(self.produced - self.keep, None)
            self.scaling.between_batches()
        return [self.batches[step], self.routing]

    def route(self) -> tuple[int, list[list], list[list[int]]]:
        """`(version, loaders per source, document boundaries per source)`: who serves what."""
        return self.routing, self.loaders, [b.tolist() for b in self.bounds]

    def _resume(self, k: int, state: dict) -> None:
        """Continue after batch `k` from its sampler `state` (the older batches it kept go)."""
        self.sampler.load_state_dict(state)
        if self.sampler.state.steps != k:
            raise ValueError(f"a sampler state of batch {self.sampler.state.steps}, sent as {k}")
        logger.warning(
            "the data service's planner actor resumes after batch %d (it had planned up to %d)",
            k,
            self.produced,
        )
        self.batches.clear()
        self.produced = self.first = k
        self.resumed_from = k

    def loader_handles(self) -> list[list]:
        """The serving loaders of every source (a list per source)."""
        return self.loaders

    def partitions(self) -> list[list[int]]:
        """Per source, the document boundaries of its loaders' parts (`token_partition`)."""
        return [b.tolist() for b in self.bounds]

    def replace_loader(self, source: int, slot: int, dead_id: str):
        """The loader now serving `slot` of `source`, after one that died (`dead_id`).

        The first rank to report a dead loader promotes the source's shadow into its slot
        and starts a new shadow; later reports of the same death (or of a loader that a
        scale event has retired) get the slot's current loader. The routing version moves
        on, so every rank refreshes its routing.
        """
        ids = [h._actor_id.hex() for h in self.loaders[source]]
        if dead_id not in ids:
            return self.loaders[source][min(slot, len(ids) - 1)]
        slot = ids.index(dead_id)
        replacement = self.scaling.take_shadow(source)
        self.loaders[source][slot] = replacement
        self.holds[source][slot] = None
        self.replacements += 1
        self.routing += 1
        logger.warning(
            "source loader %d of %r died; its shadow took over (%d replacements so far)",
            slot,
            self.sources[source].name,
            self.replacements,
        )
        return replacement

    def loader_stats(self) -> list[dict]:
        """Every loader's and shadow's `SourceLoader.stats`, with its source, slot and role.

        A serving loader's `docs` is the range it serves now. A loader that does not answer
        (dead, not yet replaced) is listed with `error`.
        """
        ray = self._ray
        actors = [
            (s.name, slot, "loader", h)
            for s, group in zip(self.sources, self.loaders, strict=True)
            for slot, h in enumerate(group)
        ] + [(s.name, None, "shadow", h) for s, h in zip(self.sources, self.shadows, strict=True)]
        out = []
        for (name, slot, role, _), ref in zip(
            actors, [a[3].stats.remote() for a in actors], strict=True
        ):
            record = {"source": name, "slot": slot, "role": role}
            try:
                record.update(ray.get(ref, timeout=30))
            except ray.exceptions.RayError as err:
                record["error"] = type(err).__name__
            if role == "loader":
                b = self.bounds[[s.name for s in self.sources].index(name)]
                record["docs"] = [int(b[slot]), int(b[slot + 1])]
            out.append(record)
        return out

    def scale(self, source: str, count: int, reason: str = "asked by the operator") -> None:
        """Move `source` to `count` loaders now (within its min and max), logged with `reason`.

        The policy's own changes go the same way (`Scaling.apply`).
        """
        self.scaling.apply(source, count, reason)

    def scaling_log(self, since: int = 0) -> dict:
        """The scaling timeline from entry `since` on (`Scaling.log`)."""
        return self.scaling.log(since)

    def source_digests(self) -> list[list[str]]:
        """Per source, the distinct length digests its loaders and its shadow opened.

        The loaders' parts are put together: one digest when they all agree.
        """
        return self.digests

    def status(self) -> dict:
        """Batches planned, the first kept, replacements, batches kept, routing, loaders.

        Also whether this planner is a restart (`restarted`) and the batch it resumed
        after (`resumed_from`, None if it did not).
        """
        return {
            "produced": self.produced,
            "first": self.first,
            "replaced": self.replacements,
            "keep": self.keep,
            "restarted": self.restarted,
            "resumed_from": self.resumed_from,
            "routing": self.routing,
            "loaders": {s.name: len(g) for s, g in zip(self.sources, self.loaders, strict=True)},
        }


class _Lengths:
    """Document lengths in the shape `lengths_digest` reads."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.sequence_lengths = lengths


def process_memory() -> dict:
    """This process's memory in bytes (`uss`, `pss`, `rss`, as psutil reports; {} without it)."""
    try:
        import psutil
    except ImportError:
        return {}
    info = psutil.Process().memory_full_info()
    return {k: int(getattr(info, k)) for k in ("uss", "pss", "rss") if hasattr(info, k)}
