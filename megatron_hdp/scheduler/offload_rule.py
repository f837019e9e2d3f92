"""Selective offloading's capacity rule (ByteScale Eq. 3, closed form; pure).

For a sequence of `s > C` tokens, with `l` layers per rank, per-layer activation bytes
`Act(s)` and per-layer forward compute time `T(s)` (both of the whole sequence, from the
cost model), and host link bandwidth `B`:

    r_max  = min(1, T(s) * B / Act(s))               # a layer's D2H copy hides under compute
    r_host = H l / ((l - 2) (l Act(C) + H))          # offloaded bytes fit the host budget H
    r_min  = min(1, l * Act(C) / ((l - 2) * Act(s)))  # offloading must free one rank's budget
    r      = min(r_max, r_host (1 - 1e-12)) if that is >= r_min else 0
    t_max  = floor(l C / (2 + (1 - r)(l - 2)))        # most tokens a member holds at ratio r
    D(s)   = ceil(s / t_max), clipped to [2, ceil(s / C)]
    then r is lowered to the least ratio that fits a member's ceil(s / D) tokens,
    r(t) = l (t - C) / ((l - 2) t), and to 0 where D = ceil(s / C) (no rank saved).

Two layers always stay resident (the one computing and a staging buffer); the other
`l - 2` keep a `1 - r` share. Splitting the sequence over `D` ranks divides both compute
and bytes by `D`, so `r_max` does not depend on `D`, and since `D` falls as `r` grows the
best `D` comes from the largest admissible ratio: no search. A ring member holds up to
`ceil(s / D)` tokens (zigzag), not `s / D`, so `D` is counted from whole tokens per member,
`t_max`; the ratio actually used is then the least one that reaches that `D`.

What the rule guarantees, per member of every ring it returns (`t = ceil(s / D)` tokens,
returned ratio `r` taken as the exact value of the float):
- resident activations `(2 + (1 - r)(l - 2)) / l * t <= C`, exactly;
- offloaded bytes `r (l - 2) Act(t) <= H`, exactly: `r <= r_host` with a relative margin
  of 1e-12, far above the float error of the bound, so rounding never overfills the host;
- `r <= r_max` as computed in floats;
- `D` is the fewest ranks (from 2) for which some ratio meets all three, once the gate
  `r >= r_min` is passed; a bound tied within 1e-12 may cost one rank more. The host bound
  is exact, not an average: at the least ratio a member's resident activations are exactly
  `C`, so it holds `l C / (2 + (1 - r)(l - 2))` tokens and offloads `l Act(t - C)` bytes,
  at most `H` exactly when `r <= r_host`.

Edge cases, decided here:
- `s <= C`: packed with other short sequences on one rank, never offloaded (`r = 0`, `D = 1`).
- `min(r_max, r_host) < r_min`: offloading cannot free a whole rank; `r = 0`,
  `D = ceil(s / C)`.
- `l <= 2`: nothing can be offloaded; `r = 0`.
- `D` never exceeds `ceil(s / C)` and never falls below 2 for `s > C`: a one-rank
  micro-batch is a pack, and packs never offload. (So a sequence just above `C` keeps a
  ring of 2.)
- `D` larger than the pool: offloading shrinks rings but does not raise the longest
  sequence the pool accepts (`N x C`); longer sequences are refused as without offloading.
- Float rounding: the ratio is the exact least ratio where a float holds it (1 at
  `t = l C / 2`) and at most two ulps above it otherwise, never below, so the activations
  surely fit. Where the least ratio ties `r_max` to an ulp or two (exactly 4/51 at
  `s = 73,984`, `C = 1,024`, 8 layers, 5 GB/s, where no float is both >= the one and <= the
  other), the rounded-up ratio misses the cap and the rule takes one rank more.
- A host budget of zero or less with offloading asked for is refused with a ValueError.

`tests/unit/test_offload_rule.py` checks all of this against a search over `D` in exact
arithmetic; `scripts/property_tests.sh` runs that check long and random.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_hdp.scheduler.cost import CostModel

# Relative margin kept below the host-budget bound r_host: far above its float error (~1e-16),
# so a rounded ratio never overfills the host, and far below any margin that matters.
_HOST_MARGIN = 1e-12


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
    those ranks, `least_ratio(ceil(s / D))`, which is never above the ratio without a limit.
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
    cap = np.minimum(r_max, r_host * (1.0 - _HOST_MARGIN))
    useful = (s > capacity) & (cap >= r_min)
    ring_sizes = base.copy()
    if useful.any():
        cap_u, s_u, base_u = cap[useful], s[useful], base[useful]
        most = _most_tokens(cap_u, capacity, layers)
        ring_sizes[useful] = np.clip(np.ceil(s_u / most), 2, base_u).astype(np.int64)
    if max_ring_time is not None:
        for i in np.nonzero(useful)[0]:
            ranks = int(ring_sizes[i])
            while ranks < base[i] and cost_model.time(s[i], ranks) > max_ring_time:
                ranks += 1
            ring_sizes[i] = ranks
    saved = useful & (ring_sizes < base)
    ratios[saved] = least_ratio(np.ceil(s[saved] / ring_sizes[saved]), capacity, layers)
    return ring_sizes, ratios


def least_ratio(tokens, capacity: int, layers: int) -> np.ndarray:
    """The least offload ratio with which a member's `tokens` fit in `capacity`.

    Solves `(2 + (1 - r)(l - 2)) / l * t <= C` for `r`: `r = l (t - C) / ((l - 2) t)`, 0 for
    `t <= C`. Numerator and denominator are integers; the float quotient is the exact ratio
    where that is representable (1 at `t = l C / 2`, for instance), and otherwise the
    rounded quotient is raised by one ulp: never below the exact ratio (at most two ulps
    above), so the activations surely fit. Needs `layers > 2`.
    """
    t = np.maximum(np.asarray(tokens, dtype=np.int64), capacity)
    num, den = layers * (t - capacity), (layers - 2) * t
    quotient = num / den
    odd = den // (den & -den)  # num / den is a float exactly when den's odd part divides num
    return np.where(num % odd == 0, quotient, np.nextafter(quotient, np.inf))


def _most_tokens(cap, capacity: int, layers: int) -> np.ndarray:
    """The most tokens a member may hold: the largest `t` with `least_ratio(t) <= cap`.

    Starts from `floor(l C / (2 + (1 - cap)(l - 2)))` and corrects float rounding of that
    estimate by whole tokens, so the decision is made by `least_ratio` itself (monotone in
    `t`): the ratio later taken for any `t` up to the result never exceeds `cap`.
    """
    most = np.floor(layers * capacity / (2.0 + (1.0 - cap) * (layers - 2)))
    most = np.maximum(most, capacity)  # cap >= 0 fits C tokens with no offloading
    while True:
        up = least_ratio(most + 1, capacity, layers) <= cap
        if not up.any():
            break
        most = most + up
    while True:
        down = least_ratio(most, capacity, layers) > cap
        if not down.any():
            break
        most = most - down
    return most


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
