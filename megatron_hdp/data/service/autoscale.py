"""The data plane's scaling policy: how many loaders each source gets, by measured cost (pure).

The planner actor (`actors.PlannerActor`) measures every `interval_s` seconds and hands
each source's `Measurement` to `Autoscaler.decide`, which returns the changes to make and
why; the planner carries them out between batches. A decision never changes the tokens:
loaders serve document ranges, and a change only moves which loader serves which range.

The rules (knobs from the spec's `data_plane`, `spec.PlaneSpec`):

- **Up** by one loader (up to the source's `max`) when, for `patience` measurements in a
  row, its loaders were busy at least `scale_up_busy` of the time (they are its
  bottleneck), or the ranks waited for data at least `scale_up_wait` of their time and
  this source's reads were the last to arrive (the wait is attributable to it).
- **Down** by one (to its `min`) when, for `patience` measurements in a row, its loaders
  were busy under `scale_down_busy`, one fewer would stay under `scale_up_busy`, and no
  data wait was attributable to it.
- A source that just changed is left alone for `cooldown` measurements, so the next
  decision sees the new layout (hysteresis with the two thresholds apart).
- The CPU budget (`data_plane.cpus`, and what the cluster has free) bounds every up:
  loaders and shadows of all sources together ask Ray for at most that many CPUs. When
  several sources want more than the budget has, the one with the larger wait, then the
  busier, goes first. A source held at its `max` or by the budget is recorded once per
  streak, as a decision that changes nothing, with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from megatron_hdp.data.spec import PlaneSpec, SourceSpec


@dataclass(frozen=True)
class Measurement:
    """One source over one measurement interval.

    `loaders`: how many serve it now; `busy`: the mean share of the interval its serving
    loaders spent in reads; `wait`: the share of the ranks' time spent waiting for data
    while this source's reads were the last of their fetch to arrive.
    """

    loaders: int
    busy: float
    wait: float


@dataclass(frozen=True)
class Decision:
    """A scaling decision: `source` goes from `before` to `after` loaders, because `reason`."""

    tick: int
    source: str
    before: int
    after: int
    reason: str
    busy: float
    wait: float

    def as_record(self) -> dict:
        """The decision as a JSON-ready dict (the metrics file's scaling timeline)."""
        return asdict(self)


class Autoscaler:
    """Turns measurements into scaling decisions, with streaks, cooldown and a CPU budget."""

    def __init__(self, sources: Sequence[SourceSpec], plane: PlaneSpec) -> None:
        self.sources, self.plane = list(sources), plane
        self.up = [0] * len(self.sources)
        self.down = [0] * len(self.sources)
        self.quiet = [0] * len(self.sources)
        self.held = [False] * len(self.sources)
        self.tick = 0

    @property
    def scales(self) -> bool:
        """Whether any source may change its loader count (else the planner skips measuring)."""
        return any(lo < hi for lo, hi in (s.loader_range for s in self.sources))

    def decide(
        self,
        measured: Sequence[Measurement | None],
        *,
        counts: Sequence[int] | None = None,
        free_cpus: float | None = None,
    ) -> list[Decision]:
        """This measurement's decisions (at most one per source).

        `measured[k]` is None for a source not measured this time (its streaks stop).
        `counts`: every source's loaders now (default: the measured ones'), for the budget;
        each source also has one shadow. `free_cpus`: what the cluster has unclaimed,
        besides the budget (None: no limit).
        """
        self.tick += 1
        plane, out = self.plane, []
        if counts is None:
            counts = [m.loaders if m is not None else 0 for m in measured]
        used = sum((n + 1) * s.cpus for s, n in zip(self.sources, counts, strict=True))
        room = float("inf") if plane.cpus is None else plane.cpus - used
        if free_cpus is not None:
            room = min(room, free_cpus)
        wanting = []
        for k, (source, m) in enumerate(zip(self.sources, measured, strict=True)):
            if m is None:
                self.up[k] = self.down[k] = 0
                continue
            if self.quiet[k] > 0:
                self.quiet[k] -= 1
                self.up[k] = self.down[k] = 0
                continue
            busy_up = m.busy >= plane.scale_up_busy
            wait_up = m.wait >= plane.scale_up_wait
            fewer = m.busy * m.loaders / (m.loaders - 1) if m.loaders > 1 else float("inf")
            idle = m.busy < plane.scale_down_busy and fewer < plane.scale_up_busy and not wait_up
            self.up[k] = self.up[k] + 1 if busy_up or wait_up else 0
            self.down[k] = self.down[k] + 1 if idle else 0
            if not (busy_up or wait_up):
                self.held[k] = False
            low, high = source.loader_range
            if self.up[k] >= plane.patience:
                why = []
                if wait_up:
                    why.append(
                        f"the ranks waited {m.wait:.0%} of their time on its reads "
                        f"(>= {plane.scale_up_wait:.0%})"
                    )
                if busy_up:
                    why.append(f"its loaders were busy {m.busy:.0%} (>= {plane.scale_up_busy:.0%})")
                reason = " and ".join(why) + f" for {self.up[k]} measurements"
                if m.loaders >= high:
                    self._hold(k, m, out, f"{reason}, but it has its max of {high} loaders")
                else:
                    wanting.append((m.wait, m.busy, k, reason))
            elif self.down[k] >= plane.patience and m.loaders > low:
                reason = (
                    f"its loaders were busy {m.busy:.0%} (< {plane.scale_down_busy:.0%}; "
                    f"{m.loaders - 1} would be {fewer:.0%} < {plane.scale_up_busy:.0%}) "
                    f"for {self.down[k]} measurements, with no data wait on it"
                )
                out.append(self._change(k, m, m.loaders - 1, reason))
                room += source.cpus
        for _, _, k, reason in sorted(wanting, reverse=True):
            m, cpus = measured[k], self.sources[k].cpus
            if cpus > room + 1e-9:
                self._hold(
                    k, m, out, f"{reason}, but the CPU budget has {max(room, 0):g} of the "
                    f"{cpus:g} CPUs one more loader asks for",
                )  # fmt: skip
                continue
            room -= cpus
            out.append(self._change(k, m, m.loaders + 1, reason))
        return out

    def _change(self, k: int, m: Measurement, after: int, reason: str) -> Decision:
        self.up[k] = self.down[k] = 0
        self.quiet[k] = self.plane.cooldown
        self.held[k] = False
        return Decision(self.tick, self.sources[k].name, m.loaders, after, reason, m.busy, m.wait)

    def _hold(self, k: int, m: Measurement, out: list, reason: str) -> None:
        if not self.held[k]:
            self.held[k] = True
            out.append(
                Decision(self.tick, self.sources[k].name, m.loaders, m.loaders, reason, m.busy,
                         m.wait)
            )  # fmt: skip
