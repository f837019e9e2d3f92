"""Offloading as a choice: a long sequence's (width, offload ratio) priced against widening (pure).

With `plan_step(..., offload=True)` the balanced planner makes two plans of the batch and
keeps the one with the shorter predicted step (`placement.plan_balanced`):

- *widen*: the plan without offloading (every ring at least `ceil(s / C)` ranks, wider
  where that shortens the step);
- *offload*: every long sequence may take any width from Eq. 3's fewest ranks `D(s)`
  (`offload_rule`, host link and host budget included) upwards; at width `k` it offloads
  the least ratio that fits a member's `ceil(s / k)` tokens in `C` (`least_ratio`, 0 from
  `ceil(s / C)` on), and its time is the ring's `CostModel.time(s, k)` plus the copies'
  exposed seconds `CostModel.offload_copy_time` (priced with the host link's bandwidth,
  shared with the NIC where the profile says so). `OffloadRingCosts` gives the ring-sizing
  search these times, so it weighs narrower offloading rings against wider ones per ring.

The offload plan is kept only when it offloads at least one ring and its predicted step is
shorter; ties go to the plan that moves no bytes. `OffloadDecision` records what was
chosen and why (`StepPlan.offload_decision`), for the step's log line and the run summary.

Why widening usually wins: compute divides evenly over any ring, so a narrower ring only
gains where the wider one exposes ring traffic (slow network, or very wide rings with small
chunks) or where the pool is too small for the minimal rings to run side by side; the
copies then cost host-link time. `docs/offloading.md` has the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_hdp.scheduler.offload_rule import least_ratio
from megatron_hdp.scheduler.ring_sizing import RingCosts

#: The offload plan must shorten the predicted step by this share to replace the plan
#: without offloading: a smaller gain is within the cost model's error and would move
#: host bytes (and hold pinned host memory and PCIe time) for nothing measurable.
MIN_GAIN = 0.01


class OffloadRingCosts(RingCosts):
    """`RingCosts` whose rings below `ceil(s / C)` ranks offload, with their copies priced.

    `time(idx, k)` is `CostModel.time(s, k)` plus `CostModel.offload_copy_time(s, k, r)` at
    `r = least_ratio(ceil(s / k))` (0 at `k >= ceil(s / C)`). `min_widths` are the offload
    rule's ring sizes `D(s)`: every width from there up fits the device with a ratio the
    rule admits (the least ratio falls as the ring widens).
    """

    def __init__(self, seqlens, cost_model, pool_size: int, min_widths, capacity: int, compute):
        self.capacity = int(capacity)
        self.layers = int(cost_model.model.num_layers)
        s = np.asarray(seqlens, dtype=np.float64)
        self._lengths = np.asarray(seqlens, dtype=np.int64)
        self.s = s
        self.cost_model = cost_model
        k = np.asarray(min_widths, dtype=np.int64)
        super().__init__(
            seqlens,
            cost_model,
            pool_size,
            k,
            min_time=self._priced(np.arange(len(s)), k),
            compute=compute,
        )

    def ratio(self, idx, k) -> np.ndarray:
        """Offload ratio of sequences `idx` on rings of `k` ranks (broadcasts)."""
        lengths = self._lengths[idx]
        k = np.maximum(np.asarray(k, dtype=np.int64), 1)
        tokens = -(-lengths // k)
        if self.layers <= 2:
            return np.zeros(np.broadcast(lengths, k).shape)
        return np.where(
            (k > 1) & (tokens > self.capacity), least_ratio(tokens, self.capacity, self.layers), 0.0
        )

    def _priced(self, idx, k) -> np.ndarray:
        s = self.s[idx]
        ring = self.cost_model.time(s, k)
        copies = self.cost_model.offload_copy_time(s, k, self.ratio(idx, k))
        return np.asarray(ring + copies, dtype=np.float64)

    def time(self, idx, k) -> np.ndarray:
        """Per-member seconds of sequences `idx` on `k` ranks, copies included (broadcasts)."""
        return self._priced(idx, k)


@dataclass(frozen=True)
class OffloadDecision:
    """What `plan_step(..., offload=True)` chose for one step, and why.

    Attributes:
        rings: Ring micro-batches (sequences longer than `C`) of the chosen plan.
        offloaded: Those that offload (ratio > 0).
        host_bytes: Predicted bytes copied to the host in the step, all ranks (one way;
            the same bytes come back in the backward pass).
        step_offload: Predicted step of the best plan with offloading (None: none made,
            no sequence could shrink its ring).
        step_widen: Predicted step of the plan without offloading.
        reason: Why the other rings do not offload ('' when every ring does).
    """

    rings: int
    offloaded: int
    host_bytes: float
    step_offload: float | None
    step_widen: float
    reason: str

    @property
    def chose_offload(self) -> bool:
        """Whether the plan with offloading was taken."""
        return self.offloaded > 0

    def message(self) -> str:
        """One line: rings offloaded, bytes, the predicted gain, and why the rest do not."""
        head = f"offload: {self.offloaded} of {self.rings} rings offloaded"
        if self.chose_offload:
            gain = 1.0 - self.step_offload / self.step_widen if self.step_widen > 0 else 0.0
            head += (
                f", {_bytes(self.host_bytes)} to host, predicted step "
                f"{self.step_offload:.4g} s, {100 * gain:.1f}% faster than without"
            )
            rest = self.rings - self.offloaded
            return head + (f"; {rest} not: {self.reason}" if rest else "")
        return head + (f": {self.reason}" if self.reason else "")

    def as_record(self) -> dict:
        """The step record's fields (`offload_rings`, `offload_rings_total`, ...)."""
        return {
            "offload_rings": self.offloaded,
            "offload_rings_total": self.rings,
            "offload_bytes_predicted": self.host_bytes,
            "offload_reason": self.reason,
        }


def _bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def predicted_step(plan) -> float:
    """The plan's predicted step: the latest predicted end of a micro-batch."""
    if len(plan.order) == 0:
        return 0.0
    return float(np.max(plan.predicted_start + plan.predicted_cost))


def host_bytes(plan, cost_model) -> float:
    """Bytes the plan's offloading rings copy to the host (all members, one way).

    A ring of `s` tokens at ratio `r` offloads `r` of the `l - 2` offloadable layers'
    activations of all its tokens: `r (l - 2) / l * s * activation_bytes_per_token`.
    """
    layers = cost_model.model.num_layers
    if layers <= 2:
        return 0.0
    per_token = cost_model.activation_bytes_per_token() * (layers - 2) / layers
    tokens = (
        np.add.reduceat(plan.lengths[plan.seq_ids], plan.seq_offsets[:-1])
        if len(plan.order)
        else np.zeros(0)
    )
    return float(np.sum(plan.offload_ratio * tokens) * per_token)


def decide(widen, offload, cost_model):
    """The plan to run and its `OffloadDecision`.

    `widen` is the plan without offloading, `offload` the best plan with offloading (None
    where no sequence's ring can shrink).
    """
    step_widen = predicted_step(widen)
    rings_widen = int(np.sum(np.diff(widen.ring_offsets) > 1))
    if offload is None:
        reason = (
            "no sequence is longer than the capacity C"
            if rings_widen == 0
            else "no ring can shrink: Eq. 3 leaves every long sequence its ceil(s / C) ranks "
            "(a ring of 2 never shrinks; else the host link or host budget is too small)"
        )
        decision = OffloadDecision(rings_widen, 0, 0.0, None, step_widen, reason)
        return widen, decision
    step_offload = predicted_step(offload)
    offloading = int(np.sum(offload.offload_ratio > 0))
    if offloading > 0 and step_offload < (1.0 - MIN_GAIN) * step_widen:
        rings = int(np.sum(np.diff(offload.ring_offsets) > 1))
        reason = "wider ring faster (at ceil(s / C) ranks or more)" if rings > offloading else ""
        decision = OffloadDecision(
            rings, offloading, host_bytes(offload, cost_model), step_offload, step_widen, reason
        )
        return offload, decision
    slower = step_offload / step_widen - 1.0 if step_widen > 0 else 0.0
    if offloading == 0:
        reason = "wider rings faster (the best plan with offloading keeps every ring wide)"
    elif slower >= 0:
        reason = f"wider rings faster by {100 * slower:.1f}%"
    else:
        reason = (
            f"offloading would gain only {100 * -slower:.2f}% (< {100 * MIN_GAIN:.0f}%), "
            "not worth its copies"
        )
    decision = OffloadDecision(rings_widen, 0, 0.0, step_offload, step_widen, reason)
    return widen, decision


__all__ = ["OffloadDecision", "OffloadRingCosts", "decide", "host_bytes", "predicted_step"]
