"""Selective offloading's capacity rule (ByteScale Eq. 3, closed form; pure).

For a sequence of `s > C` tokens, with `l` layers per rank, per-layer activation bytes
`Act(s)` and per-layer forward compute time `T(s)` (both of the whole sequence, from the
cost model), and host link bandwidth `B`:

    r_max  = min(1, T(s) * B / Act(s))               # a layer's D2H copy hides under compute
    r_host = H l / ((l - 2) (l Act(C) + H))          # offloaded bytes fit the host budget H
    r_min  = min(1, l * Act(C) / ((l - 2) * Act(s)))  # offloading must free one rank's budget
    r      = min(r_max, r_host) if that is >= r_min else 0
    D(s)   = ceil((2 + (1 - r)(l - 2)) * Act(s) / (l * Act(C)))   (+1 if a member's
             ceil(s / D) tokens would not fit)
    then r is lowered to the least ratio that still fits D (the same D, fewer bytes moved),
    and to 0 where D = ceil(s / C) (no rank saved).

Two layers always stay resident (the one computing and a staging buffer); the other
`l - 2` keep a `1 - r` share. Splitting the sequence over `D` ranks divides both compute
and bytes by `D`, so `r_max` does not depend on `D`, and since `D` falls as `r` grows the
best `D` comes from the largest admissible ratio: no search. The ratio actually used is
then the least one that reaches that `D`.

Edge cases, decided here:
- `s <= C`: packed with other short sequences on one rank, never offloaded (`r = 0`, `D = 1`).
- `r_max < r_min`: offloading cannot free a whole rank; `r = 0`, `D = ceil(s / C)`.
- `l <= 2`: nothing can be offloaded; `r = 0`.
- `D` never exceeds `ceil(s / C)` and never falls below 2 for `s > C`: a one-rank
  micro-batch is a pack, and packs never offload. (So a sequence just above `C` keeps a
  ring of 2.)
- `D` larger than the pool: offloading shrinks rings but does not raise the longest
  sequence the pool accepts (`N x C`); longer sequences are refused as without offloading.
- Host memory: a rank of the ring holds `r (l - 2) Act(s) / D` offloaded bytes. With
  `D = (2 + (1 - r)(l - 2)) Act(s) / (l Act(C))` (before rounding up, which only lowers
  the bytes) that is at most `H` exactly when `r <= r_host`, so the ratio is capped there.
  A budget of zero or less with offloading asked for is refused with a ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_hdp.scheduler.cost import CostModel


def layer_forward_time(cost_model: CostModel, s):
    """Forward seconds of one layer for a whole sequence (the compute a D2H copy hides under)."""
    layers = cost_model.model.num_layers
    return (cost_model.linear_time(s) / 3.0 + cost_model.attention_time(s) / 3.5) / layers


def layer_activation_bytes(cost_model: CostModel, s):
    """Saved activation bytes of one layer for `s` tokens."""
    return cost_model.activation_bytes_per_token() / cost_model.model.num_layers * s


def resident_fraction(ratio, num_layers: int):
    """Share of a micro-batch's activations that stays on the device with offload `ratio`."""
    if num_layers <= 2:
        return np.ones_like(np.asarray(ratio, dtype=np.float64))
    return (2.0 + (1.0 - np.asarray(ratio, dtype=np.float64)) * (num_layers - 2)) / num_layers


def offload_rule(
    seqlens: Sequence[int],
    capacity: int,
    cost_model: CostModel,
    *,
    host_budget_bytes: float | None = None,
    max_ring_time: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Ranks `D(s)` and offload ratios `r` for every sequence (see the module docstring).

    Returns `(ring_sizes, ratios)` as numpy arrays. `host_budget_bytes` is the host memory
    one rank may fill with offloaded activations (default: the device profile's).

    `max_ring_time` (seconds per member) keeps offloading from making a sequence the
    critical path: Eq. 3 alone minimises ranks (memory), so a very long sequence could end
    up on so few ranks that its ring outlasts every other rank's work. With a limit, a ring
    gets at least the fewest ranks that finish it within the limit (never more than
    `ceil(s / C)`), and the ratio drops to the least that still fits the activations on
    those ranks: `r = 1 - (l Act(C) D / Act(s) - 2) / (l - 2)`, clipped to `[0, r]`.
    """
    s = np.asarray(seqlens, dtype=np.float64)
    layers = cost_model.model.num_layers
    base = np.maximum(1, np.ceil(s / capacity)).astype(np.int64)
    ratios = np.zeros_like(s)
    if host_budget_bytes is None:
        host_budget_bytes = cost_model.device.host_memory_bytes
    if not host_budget_bytes > 0:
        raise ValueError(
            f"offloading asked for, but the host memory budget is {host_budget_bytes} bytes"
        )
    if layers <= 2:
        return base, ratios
    act = layer_activation_bytes(cost_model, s)
    act_c = layer_activation_bytes(cost_model, float(capacity))
    bandwidth = cost_model.device.host_bandwidth
    r_max = np.minimum(1.0, layer_forward_time(cost_model, s) * bandwidth / act)
    r_host = host_budget_bytes * layers / ((layers - 2) * (layers * act_c + host_budget_bytes))
    r_min = np.minimum(1.0, layers * act_c / ((layers - 2) * act))
    r = np.minimum(r_max, r_host)
    useful = (s > capacity) & (r >= r_min)
    ratios = np.where(useful, r, 0.0)
    fraction = resident_fraction(ratios, layers)
    shrunk = np.ceil(fraction * act / act_c - 1e-9).astype(np.int64)
    # A member holds up to ceil(s / D) tokens (zigzag), not s / D: add ranks until that fits.
    for _ in range(4):
        over = fraction * np.ceil(s / np.maximum(shrunk, 1)) > capacity * (1 + 1e-12)
        if not over.any():
            break
        shrunk = shrunk + over
    ring_sizes = np.where(useful, np.clip(shrunk, 2, base), base)
    ratios = _least_ratio(s, ring_sizes, base, ratios, capacity, layers)
    if max_ring_time is not None:
        for i in np.nonzero(useful)[0]:
            ranks = int(ring_sizes[i])
            while ranks < base[i] and cost_model.time(s[i], ranks) > max_ring_time:
                ranks += 1
            ring_sizes[i] = ranks
        ratios = _least_ratio(s, ring_sizes, base, ratios, capacity, layers)
    return ring_sizes, ratios


def _least_ratio(s, ring_sizes, base, ratios, capacity: int, layers: int) -> np.ndarray:
    """The smallest ratio that still fits each ring's activations; 0 where no rank is saved.

    A member holds up to `ceil(s / D)` tokens, so `(2 + (1 - r)(l - 2)) / l * ceil(s / D)`
    must not exceed `C`. Any ratio that reaches the same `D` is as good for memory, and the
    least one moves the fewest bytes over the host link. (+1e-9 rounds towards more
    offloading, so the activations surely fit.)
    """
    tokens = np.ceil(s / np.maximum(ring_sizes, 1))
    needed = 1.0 - (layers * capacity / tokens - 2.0) / (layers - 2) + 1e-9
    return np.where(ring_sizes < base, np.clip(needed, 0.0, ratios), 0.0)


def planned_offload(
    seqlens: Sequence[int], *, pool_size: int, capacity: int, cost_model: CostModel
) -> tuple[np.ndarray, np.ndarray]:
    """The planner's use of the rule: ring time limited to the average work per rank.

    The limit is the makespan bound without offloading (total work / pool size), so no
    ring made smaller by offloading outlasts what every rank has to do anyway.
    """
    s = np.asarray(seqlens, dtype=np.float64)
    base = np.maximum(1, np.ceil(s / capacity))
    _, local, ring = cost_model.cost_arrays(seqlens, capacity)
    work = float(np.where(base > 1, ring * base, local).sum()) / pool_size
    return offload_rule(seqlens, capacity, cost_model, max_ring_time=work)
