"""Carrying out the scaling policy inside the planner actor (between batches).

`Scaling` is the planner's part that measures its loaders, asks `autoscale.Autoscaler`
what to change, and changes it; it runs in the planner actor's process, in `batch()`
after each new batch, and never waits on a busy loader:

- **Measure** every `interval_s`: each serving loader's `stats` is asked without waiting
  and read at the next measurement; a loader whose answer has not come by then was busy
  all along (its answer queues behind its reads) and counts as busy 1.0. The ranks' data
  wait comes with their batch requests (`note_wait`), attributed to the source whose
  reads arrived last in their fetches.
- **Scale up**: the source's warm shadow (opened on the whole source, idle) is promoted at
  once into the new slot (a shadow still opening, after a recent promotion, joins once
  open) and a new shadow is started; the source is cut into one more
  token-balanced range (`sources.token_partition`).
- **Scale down**: one range fewer; the loader left over is retired.
- **Repartition**: each new range is served by a current loader that holds its documents
  (any loader, unless the source is JSONL tokenized when opened, whose loaders hold only
  their part), else by the promoted shadow, else by a new loader opened on that range;
  when new loaders are needed the new routing waits until they have opened their part
  (the old one serves meanwhile, and the source is not decided on again until then).
  Either way the routing changes, never the tokens: a
  range is read the same whoever serves it.
- Retired loaders live `keep` more batches (a rank may still be fetching with the
  routing before) and are then ended.

Every decision is logged with its reason and kept, with the measurements, in `log()`
(the trainer writes it to the metrics file as `data_scaling`).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from megatron_hdp.data.service.autoscale import Autoscaler, Measurement
from megatron_hdp.data.sources import token_partition
from megatron_hdp.data.spec import PlaneSpec

logger = logging.getLogger(__name__)


class Scaling:
    """The planner's scaling state: measurements, pending layouts, retired loaders, log."""

    def __init__(self, planner, plane: PlaneSpec) -> None:
        self.p, self.plane = planner, plane
        self.policy = Autoscaler(planner.sources, plane)
        n = len(planner.sources)
        self.shadow_ready = [None] * n  # the shadows opened at start are ready
        self.pending: list[tuple | None] = [None] * n
        self.retired: list[tuple[int, object]] = []
        self.asked: dict[str, tuple[int, object]] = {}  # actor id -> (source, stats ref)
        self.last: dict[str, tuple[float, float]] = {}  # actor id -> (busy_s, alive_s)
        self.waits, self.period = [0.0] * n, 0.0
        self.started = None  # the first batch: the log's clock starts there
        self.next_tick = float("inf")
        self.samples: list[dict] = []
        self.decisions: list[dict] = []

    def note_wait(self, report: dict) -> None:
        """Add a rank's report: `wait_s` waited over `period_s`, `last` fetches per source."""
        self.period += float(report.get("period_s", 0.0))
        last = {int(k): int(v) for k, v in report.get("last", {}).items()}
        total = sum(last.values())
        for source, count in last.items():
            if 0 <= source < len(self.waits) and total:
                self.waits[source] += float(report.get("wait_s", 0.0)) * count / total

    def between_batches(self) -> None:
        """Settle what is pending, end retired loaders, and measure and decide when due."""
        if self.started is None:
            self.started = time.perf_counter()
            self.next_tick = self.started + self.plane.interval_s
        for k in range(len(self.pending)):
            self._settle(k)
        while self.retired and self.retired[0][0] + self.p.keep <= self.p.produced:
            _, handle = self.retired.pop(0)
            self.p._ray.kill(handle, no_restart=True)
        now = time.perf_counter()
        if now < self.next_tick or not self.policy.scales:
            return
        self.next_tick = now + self.plane.interval_s
        measured = self._measure(now)
        free = self.p._ray.available_resources().get("CPU")
        # a source still opening the loaders of its last change is not decided on again
        measured = [None if self.pending[k] else m for k, m in enumerate(measured)]
        counts = [len(g) for g in self.p.loaders]
        for decision in self.policy.decide(measured, counts=counts, free_cpus=free):
            self._record(decision.as_record(), now)

    def apply(self, source: str, count: int, reason: str) -> None:
        """Move `source` to `count` loaders for `reason` (not the policy's: an operator's).

        ValueError naming the source or the count if it is none of the spec's sources or
        outside its `loaders` range.
        """
        names = [s.name for s in self.p.sources]
        if source not in names:
            raise ValueError(f"no data source {source!r} (sources: {', '.join(names)})")
        low, high = self.p.sources[names.index(source)].loader_range
        if not low <= count <= high:
            raise ValueError(f"data source {source!r} takes {low} to {high} loaders, not {count}")
        before = len(self.p.loaders[names.index(source)])
        record = {"tick": None, "source": source, "before": before, "after": count,
                  "reason": reason, "busy": None, "wait": None}  # fmt: skip
        if self.started is None:
            self.started = time.perf_counter()
        self._record(record, time.perf_counter())

    def _record(self, record: dict, now: float) -> None:
        """Log and keep a decision, and carry it out."""
        record = {**record, "t": now - self.started, "step": self.p.produced}
        self.decisions.append(record)
        name, before, after = record["source"], record["before"], record["after"]
        if after == before:
            logger.info("data plane: %r stays at %d loaders: %s", name, before, record["reason"])
            return
        logger.info("data plane: %r %d -> %d loaders: %s", name, before, after, record["reason"])
        self._scale([s.name for s in self.p.sources].index(name), after)

    def _measure(self, now: float) -> list[Measurement | None]:
        """Each source's busy share and attributable wait since the last measurement."""
        ray, busy = self.p._ray, [[] for _ in self.p.sources]
        if self.asked:
            refs = [ref for _, ref in self.asked.values()]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            ready = set(ready)
            for actor, (source, ref) in self.asked.items():
                if ref not in ready:
                    busy[source].append(1.0)  # still serving reads queued before the question
                    continue
                try:
                    stats = ray.get(ref)
                except ray.exceptions.RayError:
                    continue
                before = self.last.get(actor)
                self.last[actor] = (stats["busy_s"], stats["alive_s"])
                if before is None:  # its first answer (a promoted shadow's idle life before)
                    continue
                span = stats["alive_s"] - before[1]
                if span > 0:
                    busy[source].append(min(1.0, (stats["busy_s"] - before[0]) / span))
        self.asked = {
            h._actor_id.hex(): (k, h.stats.remote())
            for k, group in enumerate(self.p.loaders)
            for h in group
        }
        shares = [w / self.period if self.period > 0 else 0.0 for w in self.waits]
        self.waits, self.period = [0.0] * len(self.waits), 0.0
        measured = [
            Measurement(len(group), float(np.mean(b)), share) if b else None
            for group, b, share in zip(self.p.loaders, busy, shares, strict=True)
        ]
        self.samples.append({
            "t": now - self.started,
            "step": self.p.produced,
            "loaders": {s.name: len(g) for s, g in zip(self.p.sources, self.p.loaders)},
            "busy": {s.name: m.busy for s, m in zip(self.p.sources, measured) if m},
            "wait": {s.name: w for s, w in zip(self.p.sources, shares)},
        })  # fmt: skip
        return measured

    def take_shadow(self, k: int):
        """Source `k`'s shadow, for a slot; a new shadow is started in its place."""
        shadow = self.p.shadows[k]
        self.p.shadows[k] = self.p._start(k)
        self.shadow_ready[k] = self.p.shadows[k].ready.remote()
        return shadow

    def _shadow_is_ready(self, k: int) -> bool:
        ref = self.shadow_ready[k]
        if ref is None:
            return True
        ready, _ = self.p._ray.wait([ref], timeout=0)
        if ready:
            self.shadow_ready[k] = None
        return bool(ready)

    def _scale(self, k: int, count: int) -> None:
        """Move source `k` to `count` loaders (at once, or when its new loaders are open)."""
        source = self.p.sources[k]
        if self.pending[k] is not None:
            logger.info("data plane: %r is still opening loaders; no change", source.name)
            self.decisions[-1]["after"] = self.decisions[-1]["before"]
            self.decisions[-1]["reason"] += " (not made: the last change is still opening)"
            return
        bounds = token_partition(self.p.lengths[k], count)
        ranges = [(int(bounds[i]), int(bounds[i + 1])) for i in range(len(bounds) - 1)]
        free = list(zip(self.p.loaders[k], self.p.holds[k], strict=True))
        handles, holds, waiting = [], [], []

        def covers(held, want) -> bool:
            whole = not source.holds_tokens or held is None
            return whole or held[0] <= want[0] <= want[1] <= held[1]

        promote = count > len(free)  # a scale-up: the warm shadow takes a slot
        for want in ranges:
            match = next((i for i, (_, held) in enumerate(free) if covers(held, want)), None)
            if match is not None:
                handle, held = free.pop(match)
            elif promote:  # the warm shadow serves at once (or once it has opened)
                ready = self._shadow_is_ready(k)
                handle, held, promote = self.take_shadow(k), None, False
                if not ready:
                    waiting.append(handle.ready.remote())
            else:
                handle, held = self.p._start(k, want), want
                waiting.append(handle.ready.remote())
            handles.append(handle)
            holds.append(held)
        self.pending[k] = (bounds, handles, holds, waiting, [h for h, _ in free])
        self._settle(k)

    def _settle(self, k: int) -> None:
        """Switch source `k` to its pending routing once every new loader has opened."""
        if self.pending[k] is None:
            return
        bounds, handles, holds, waiting, left = self.pending[k]
        if waiting:
            opened, _ = self.p._ray.wait(waiting, num_returns=len(waiting), timeout=0)
            if len(opened) < len(waiting):
                return
        self.p.loaders[k], self.p.holds[k], self.p.bounds[k] = handles, holds, bounds
        self.p.routing += 1
        self.retired.extend((self.p.produced, h) for h in left)
        self.pending[k] = None

    def log(self, since: int = 0) -> dict:
        """`{"samples": [...], "decisions": [...], "next": n}` from sample/decision `since` on.

        A sample: seconds since the first batch was planned (`t`), batches planned (`step`), and
        per source its loaders, their busy share and the ranks' data-wait share on it.
        A decision: `autoscale.Decision` with `t` and `step`. `since` counts both lists
        together (the caller passes the previous call's `next`).
        """
        entries = [("sample", e) for e in self.samples] + [("decision", e) for e in self.decisions]
        entries.sort(key=lambda e: e[1]["t"])
        new = entries[since:]
        return {
            "samples": [e for kind, e in new if kind == "sample"],
            "decisions": [e for kind, e in new if kind == "decision"],
            "next": len(entries),
        }
