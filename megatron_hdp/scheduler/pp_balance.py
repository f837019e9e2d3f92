"""PP-Balance: ByteScale's balance scheduler for pipelines (Alg. 2, PP mode; Insight 1).

With pipeline parallelism every HDP rank is a pipeline of `d` stages running Megatron's 1F1B
schedule, and a plan must be *lock-step* (`plan.lockstep_problems`): the members of a ring
run equally many micro-batches and hold the ring at the same position. DP-Balance
(`balance.py`) is not: it lets ranks take rings at different positions, which deadlocks
1F1B pipelines in a large share of batches (`pipeline_timeline`). This module plans
pipelines directly in lock-step form. The paper gives Insight 1 and no algorithm; decided
here (bytescale-paper.md, section 7, items 7 and 8):

1. *Items.* As in DP-Balance: a sequence longer than the capacity `C` is a ring item of at
   least its minimal `k = ceil(s / C)` pipelines (or the given ring size, e.g. offloading's);
   shorter ones are packed best-fit decreasing into packs of at most `C` tokens (one local
   micro-batch each). Costs come from the cost model: `c`, the per-member forward +
   backward time of the whole model on one stage's devices, so `t = c / d` per stage
   (`pipeline_timeline`).
2. *The estimate.* A pipeline whose micro-batches run heaviest first, with per-stage times
   `t_1 >= t_2 >= ...`, is priced `E = sum(t) + (d - 1) max(t)`, the 1F1B step of `M` equal
   micro-batches, `(M + d - 1) t`, generalised. With one forward share for all its
   micro-batches, `E` bounds the exact 1F1B step from above (the tests check it against
   `pipeline_timeline`); with the cost model's shares (1/3.5 to 1/3 per micro-batch) it can
   be a few percent short. For other orders it is no bound at all: a heavy micro-batch
   among light ones stalls the pipeline for about `(d - 1)` times the difference, once per
   such micro-batch. So every list runs heaviest first, and the `(d - 1) max(t)` term is
   the point of Insight 1: a pipeline pays its heaviest micro-batch's fill and drain once,
   whatever else it runs, so heavy items belong together. With `v` model chunks per stage
   (interleaved 1F1B, `interleaved.py`, `virtual_stages=v`) the fill term is
   `(d - 1) / v max(t)`: the interleaved step of `M` equal micro-batches (a multiple of
   `d`) is `M t + (d - 1) t / v`.
3. *Lock-step groups* ("length levels to groups of pipelines"). A group is consecutive
   pipelines that run the same rows; a row is one micro-batch per member. Rings are taken
   heaviest first (cost at the minimal width). A ring joins the current group if the
   group's estimate stays within the target: on a row of its own spanning the whole group
   when that costs at most `WIDEN_INFLATION` (10%) more work than its minimal ring (ring
   communication grows with the width), else side by side with other rings on a shelf row,
   as narrow as keeps the row within the group's heaviest row. Otherwise it opens a new
   group as wide as it runs efficiently (the widest width within the 10%), so the next
   rings of its level stack on rows of their own in it: a group of `m` stacked rings pays
   `(m + d - 1)` rows for `m` rings. Each shelf's free members are then given to its rings
   (in proportion to their widths, never past `s` members so every member holds a token,
   and only where that makes the ring faster); members still free get packs.
4. *Ring widths.* A ring may be wider than its minimal `k` (the paper keeps `k`; we allow
   more): a long sequence on `w` pipelines takes its whole `c(s, w)` from the start of its
   forward to the end of its backward (its stages run one after another), so a step is at
   least that long, and a wider ring is the only way below it. For a target `S` every ring
   is at least the narrowest width of a ladder (`k x {1, 1.125, ..., 2, 3, 4, ...}`, at
   most `min(N, s)`) whose cost fits `S` alone.
5. *Packs* (pipelines with heavier micro-batches get fewer): heaviest first into the free
   ring slots, then as pack rows into the groups while their estimate stays within `S`,
   then next-fit into the pipelines no ring uses, each filled up to `S` before the next:
   the first of them get the heaviest packs and few, the last many light ones. Extra
   bubbles appear only where a list steps down from one level to the next.
6. *Target.* `S` is the smallest target (bisection, relative tolerance 1e-3, from the lower
   bound up) for which all items fit. The pipelines without rings are then re-filled for
   the least target that holds their own packs, so none is left empty needlessly.
7. *Order.* Micro-batches are ordered by (position in the lists, first member): every
   member of a ring holds it at the same position, lists follow the global order, and
   members of a group run equally many micro-batches, so the plan is lock-step.
   `predicted_cost` is the per-member cost `c`; `predicted_start` is when the micro-batch's
   forward starts on the first stage in the exact 1F1B timeline (`pipeline_timeline`).
8. *Corner cases.* A pipeline cannot skip a position, so every position of a group needs a
   micro-batch with a token for every member. Free ring slots without packs are taken by
   widening rings, faster or not. When every pipeline belongs to a group and fewer packs
   are left than a row needs, the narrowest group takes them as one more row made whole by
   splitting packs of several sequences in two; else they go into ring micro-batches with
   room (a ring of `w` holds up to `w C` tokens; offloading rings take nothing); else they
   become ring micro-batches over a whole group. If none of this fits (tiny capacities),
   the plan is the static mesh's layout (`static_mesh.plan_static`, lock-step by
   construction); if that fails too, no lock-step plan gives every member a token (e.g.
   81 tokens filling all 9 x 9 slots of a 9-pipeline pool next to a 1-token sequence) and a
   ValueError says so.

Deterministic: every sort has an index tie-break and the arithmetic is numpy float64 in a
fixed order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from megatron_hdp.scheduler.balance import best_fit_decreasing
from megatron_hdp.scheduler.cost import forward_fraction
from megatron_hdp.scheduler.pipeline_timeline import (
    DEFAULT_FORWARD_SHARE,
    Execution,
    simulate_plan,
)
from megatron_hdp.scheduler.plan import MicroBatch, StepPlan, plan_from_rank_lists, validate_inputs
from megatron_hdp.scheduler.static_mesh import plan_static, simple_cost, static_cp_size

#: Ring widths tried, as multiples of the minimal width (the ladder of decision 4).
WIDTH_LADDER = (1.0, 1.125, 1.25, 1.375, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0)
#: A ring takes a whole row of its group when that costs at most this much more work
#: (ring communication grows with the width); otherwise it runs side by side with others.
WIDEN_INFLATION = 0.10
_TOLERANCE = 1e-3
_MAX_BISECTIONS = 40


class _Costs:
    """Per-member costs from a `cost.CostModel`, or `static_mesh.simple_cost`'s formula."""

    def __init__(self, cost_model, capacity: int) -> None:
        self.cm = cost_model
        self.capacity = capacity

    def ring(self, s, w) -> np.ndarray:
        """Per-member cost of single sequences `s` on rings of `w` (arrays, elementwise)."""
        s = np.asarray(s, dtype=np.float64)
        w = np.asarray(w, dtype=np.float64)
        if self.cm is not None:
            return np.asarray(self.cm.time(s, w), dtype=np.float64)
        return (s + s * s / (2.0 * self.capacity)) / w

    def compute(self, s) -> np.ndarray:
        """Cost of sequences on one rank without any communication (for lower bounds)."""
        s = np.asarray(s, dtype=np.float64)
        if self.cm is not None:
            return np.asarray(self.cm.linear_time(s) + self.cm.attention_time(s))
        return s + s * s / (2.0 * self.capacity)

    def micro_batch(self, lengths: Sequence[int], w: int) -> float:
        """Per-member cost of a micro-batch of packed sequences on a ring of `w`."""
        if self.cm is not None:
            return float(self.cm.micro_batch_time(lengths, w))
        return float(sum(s + s * s / (2.0 * self.capacity) for s in lengths)) / w


@dataclass
class _Group:
    """A lock-step group: `width` pipelines from `base`, their rows (see decision 3)."""

    width: int
    base: int = 0
    shelves: list = field(default_factory=list)  # [[(ring id, width), ...], ...]
    shelf_tau: list = field(default_factory=list)  # per shelf, per-stage time of the row
    shelf_used: list = field(default_factory=list)  # per shelf, members its rings take
    free_packs: list = field(default_factory=list)  # per shelf, pack ids of free members
    pack_rows: list = field(default_factory=list)  # [pack ids (len == width)]
    ring_packs: list = field(default_factory=list)  # [(seq ids, per-stage time)]
    split_rows: list = field(default_factory=list)  # [[(seq ids, cost)] * width], see _split
    merged: dict = field(default_factory=dict)  # ring id -> short seq ids it also holds
    estimate: float = 0.0
    top: float = 0.0  # the heaviest row's per-stage time while rings are placed


@dataclass
class _Layout:
    """One target's lock-step layout: groups, single pipelines, estimates."""

    target: float
    groups: list
    singles: list  # per single pipeline: pack ids (heaviest first)
    widths: np.ndarray  # per ring: width used
    estimate: float  # max estimate over pipelines


class _Planner:
    """The state shared by the layouts of one batch (items, costs, ladders)."""

    def __init__(
        self,
        seqlens,
        pool_size,
        capacity,
        stages,
        costs,
        ring_sizes,
        split_packs,
        offload=None,
        chunks=1,
    ):
        self.seqlens = [int(s) for s in seqlens]
        self.offload = None if offload is None else np.asarray(offload, dtype=np.float64)
        self.n = pool_size
        self.capacity = capacity
        self.d = stages
        # The fill and drain a pipeline pays once per step, in units of its heaviest
        # micro-batch's per-stage time: d - 1 for 1F1B, (d - 1) / v interleaved (decision 2).
        self.fill = (stages - 1) / chunks
        self.costs = costs
        s = np.asarray(self.seqlens, dtype=np.float64)
        if ring_sizes is None:
            k = np.maximum(1, np.ceil(s / capacity)).astype(np.int64)
        else:
            k = np.asarray(ring_sizes, dtype=np.int64)
        self.k = k
        ring_ids = [i for i in range(len(s)) if k[i] > 1]
        short = [i for i in range(len(s)) if k[i] <= 1]
        if split_packs:
            packs = [[i] for i in sorted(short, key=lambda i: (-self.seqlens[i], i))]
        else:
            packs = best_fit_decreasing(self.seqlens, short, capacity)
        local = costs.ring(s, 1.0) if len(s) else np.zeros(0)
        self.local = local.tolist()
        pack_cost = np.array([float(sum(local[i] for i in p)) for p in packs])
        order = sorted(range(len(packs)), key=lambda p: (-pack_cost[p], packs[p][0]))
        self.packs = [packs[p] for p in order]
        self.pack_cost = pack_cost[order] if len(packs) else np.zeros(0)
        self.pack_tau = self.pack_cost / self.d
        self.pack_cum = np.concatenate([[0.0], np.cumsum(self.pack_tau)])
        # Rings: ladder of widths and costs.
        self.ring_seq = np.asarray(ring_ids, dtype=np.int64)
        rs = s[self.ring_seq]
        rk = k[self.ring_seq].astype(np.float64)
        cap = np.minimum(float(pool_size), rs)
        ladder = np.ceil(rk[:, None] * np.asarray(WIDTH_LADDER)[None, :])
        ladder = np.minimum(np.concatenate([ladder, cap[:, None]], axis=1), cap[:, None])
        self.cap = cap.astype(np.int64)
        self.ladder = ladder.astype(np.int64)
        self.ladder_cost = costs.ring(rs[:, None], ladder) if len(rs) else np.zeros((0, 1))
        self.ring_s = rs
        base = costs.ring(rs, rk) if len(rs) else np.zeros(0)
        self.work_min = base * rk  # a ring's work at its minimal width
        self.wide = self._widest_efficient(rs, rk, self.cap, self.work_min)
        self._memo: dict[tuple[int, int], float] = {}
        # Heaviest first (decision 3): by cost at the minimal width, then sequence index.
        self.ring_order = np.lexsort((self.ring_seq, -base)) if len(rs) else np.zeros(0, int)

    def _widest_efficient(self, s, k, cap, work_min) -> np.ndarray:
        """Per ring, the widest width whose work is within `WIDEN_INFLATION` of the least.

        A ring's work `w c(s, w)` does not fall as `w` grows (its compute is fixed, its
        exposed communication per member times `w` does not shrink), so a bisection over
        the integers finds the boundary, for all rings at once.
        """
        lo = k.astype(np.int64)
        hi = cap.astype(np.int64)
        if len(lo) == 0:
            return lo
        limit = (1.0 + WIDEN_INFLATION) * work_min
        ok_hi = self.costs.ring(s, hi) * hi <= limit
        lo = np.where(ok_hi, hi, lo)
        while True:
            open_ = hi - lo > 1
            if not open_.any():
                break
            mid = (lo + hi) // 2
            ok = self.costs.ring(s, mid) * mid <= limit
            lo = np.where(open_ & ok, mid, lo)
            hi = np.where(open_ & ~ok, mid, hi)
        return lo

    # ------------------------------------------------------------------ layout

    def widths_for(self, target: float):
        """Per ring: the narrowest ladder width whose cost fits `target` (None: none does)."""
        if len(self.ring_seq) == 0:
            return np.zeros(0, dtype=np.int64)
        ok = self.ladder_cost <= target
        if not ok.any(axis=1).all():
            return None
        j = np.argmax(ok, axis=1)
        return self.ladder[np.arange(len(j)), j]

    def layout(self, target: float) -> _Layout | None:
        """The lock-step layout for `target`, or None if it does not fit."""
        need = self.widths_for(target)
        if need is None:
            return None
        groups: list[_Group] = []
        used = 0
        for r in self.ring_order:
            if groups and self._place(groups[-1], int(r), int(need[r]), target):
                continue
            # As wide as the ring runs efficiently: later rings stack in it (decision 3).
            width = max(int(need[r]), min(int(self.wide[r]), self.n - used))
            if used + width > self.n:
                return None
            g = _Group(width=width, base=used)
            used += width
            if not self._place(g, int(r), int(need[r]), target):
                return None
            groups.append(g)
        widths = np.zeros(len(self.ring_seq), dtype=np.int64)
        for g in groups:
            for shelf in g.shelves:
                for r, w in shelf:
                    widths[r] = w
        self._widen(groups, widths)
        return self._fill(target, groups, widths, used)

    def _place(self, g: _Group, r: int, need: int, target: float) -> bool:
        """Put ring `r` into group `g` (decision 3), if the group's estimate stays in `target`."""
        d, big = self.d, g.width
        if need > big:
            return False
        top = g.top
        lad, cost = self.ladder[r], self.ladder_cost[r]
        if big <= self.wide[r]:
            j = int(np.searchsorted(lad, big))
            if lad[j] == big:
                t = float(cost[j]) / d
            else:
                key = (r, big)
                if key not in self._memo:
                    self._memo[key] = float(self.costs.ring(self.ring_s[r], float(big)))
                t = self._memo[key] / d
            if self._new_shelf(g, r, big, t, target):
                return True
        # Side by side: the narrowest width from `need` that keeps the row within the top.
        ok = (lad >= need) & (lad <= big) & (cost <= top * d)
        j = int(np.argmax(ok)) if ok.any() else int(np.argmax(lad >= need))
        w = int(lad[j])
        t = float(cost[j]) / d
        if g.shelves and g.shelf_used[-1] + w <= big:
            new_tau = max(g.shelf_tau[-1], t)
            est = g.estimate - g.shelf_tau[-1] + new_tau + self.fill * max(0.0, new_tau - top)
            if est <= target:
                g.shelves[-1].append((r, w))
                g.shelf_used[-1] += w
                g.shelf_tau[-1] = new_tau
                g.estimate = est
                g.top = max(top, new_tau)
                return True
        return self._new_shelf(g, r, w, t, target)

    def _new_shelf(self, g: _Group, r: int, width: int, t: float, target: float) -> bool:
        """Open a row for ring `r` (`width` members, per-stage time `t`) if `target` allows."""
        est = g.estimate + t + self.fill * max(0.0, t - g.top)
        if est > target:
            return False
        g.shelves.append([(r, width)])
        g.shelf_used.append(width)
        g.shelf_tau.append(t)
        g.estimate = est
        g.top = max(g.top, t)
        return True

    def _widen(self, groups: list[_Group], widths: np.ndarray) -> None:
        """Give each shelf's free members to its rings where that makes them faster.

        Free members are shared in proportion to the rings' widths (the rest to the first
        ring), never past `min(N, s)` members; a ring keeps its width where the wider one
        would cost more (communication). All shelves at once.
        """
        d = self.d
        where, ids, old, shelf_of, big = [], [], [], [], []
        for g in groups:
            for si, shelf in enumerate(g.shelves):
                if g.shelf_used[si] >= g.width:
                    continue
                where.append((g, si))
                for r, w in shelf:
                    ids.append(r)
                    old.append(w)
                    shelf_of.append(len(where) - 1)
                big.append(g.width)
        if not where:
            return
        ids_a = np.asarray(ids, dtype=np.int64)
        old_a = np.asarray(old, dtype=np.int64)
        sh = np.asarray(shelf_of, dtype=np.int64)
        big_a = np.asarray(big, dtype=np.int64)
        taken = np.bincount(sh, old_a, minlength=len(where)).astype(np.int64)
        free = big_a - taken
        new = np.minimum(self.cap[ids_a], old_a + (free[sh] * old_a) // taken[sh])
        first = np.searchsorted(sh, np.arange(len(where)))
        rest = big_a - np.bincount(sh, new, minlength=len(where)).astype(np.int64)
        new[first] = np.minimum(self.cap[ids_a[first]], new[first] + rest)
        c_old = self.costs.ring(self.ring_s[ids_a], old_a)
        c_new = self.costs.ring(self.ring_s[ids_a], new)
        keep = c_new >= c_old
        new = np.where(keep, old_a, new)
        chosen = np.where(keep, c_old, c_new) / d
        row_tau = np.maximum.reduceat(chosen, first)
        widths[ids_a] = new
        used = np.bincount(sh, new, minlength=len(where))
        for x, (g, si) in enumerate(where):
            a, b = first[x], (first[x + 1] if x + 1 < len(where) else len(ids_a))
            g.shelves[si] = list(zip(ids_a[a:b].tolist(), new[a:b].tolist(), strict=True))
            g.shelf_used[si] = int(used[x])
            g.shelf_tau[si] = float(row_tau[x])
        for g in groups:
            g.estimate = sum(g.shelf_tau) + self.fill * max(g.shelf_tau)

    def _fill(self, target, groups, widths, used) -> _Layout | None:
        """Packs into free slots, group rows and single pipelines (decision 5)."""
        tau = self.pack_tau
        total = len(tau)
        p = 0
        if sum(g.width - u for g in groups for u in g.shelf_used) > total:
            self._force_widen(groups, widths, total)
        for g in groups:
            g.free_packs = []
            for si in range(len(g.shelves)):
                free = g.width - g.shelf_used[si]
                if free > total - p:
                    return None  # too few packs for the free members
                ids = list(range(p, p + free))
                g.free_packs.append(ids)
                if free:
                    g.shelf_tau[si] = max(g.shelf_tau[si], float(tau[p]))
                p += free
            g.estimate = sum(g.shelf_tau) + self.fill * max(g.shelf_tau)
        for g in groups:
            rows = (total - p) // g.width
            if rows == 0:
                continue
            row_tau = tau[p : p + rows * g.width : g.width]
            top = max(g.shelf_tau)
            extra = self.fill * max(0.0, float(row_tau[0]) - top)
            n_rows = int(np.searchsorted(np.cumsum(row_tau), target - g.estimate - extra, "right"))
            n_rows = min(n_rows, rows)
            for j in range(n_rows):
                g.pack_rows.append(list(range(p + j * g.width, p + (j + 1) * g.width)))
            if n_rows:
                g.estimate += float(np.sum(row_tau[:n_rows])) + extra
            p += n_rows * g.width
        singles_n = self.n - used
        singles: list[list[int]] = []
        if p < total and singles_n > 0:
            singles = self._next_fit(p, singles_n, target)
            if singles is None:
                return None
            p = total
        if p < total:
            if total - p >= min(g.width for g in groups):
                return None  # rows that do not fit the target
            if not self._split(groups, p, target):
                merged = self._merge(groups, p, target)
                if merged is None:
                    if not self._ring_pack(groups, p, target):
                        return None
                elif not merged:
                    return None
            p = total
        est = max([g.estimate for g in groups] + [self._single_estimate(x) for x in singles])
        return _Layout(target=target, groups=groups, singles=singles, widths=widths, estimate=est)

    def _single_estimate(self, ids: list[int]) -> float:
        if not ids:
            return 0.0
        t = self.pack_tau
        return float(self.pack_cum[ids[-1] + 1] - self.pack_cum[ids[0]]) + self.fill * float(
            t[ids[0]]
        )

    def _next_fit(self, p: int, count: int, target: float):
        """Packs `p ..` next-fit into `count` single pipelines up to `target` (None: no fit)."""
        total = len(self.pack_tau)
        cum, tau = self.pack_cum, self.pack_tau
        out = []
        for _ in range(count):
            if p >= total:
                out.append([])
                continue
            limit = cum[p] + target - self.fill * tau[p]
            q = int(np.searchsorted(cum, limit, "right")) - 1
            q = max(q, p + 1) if tau[p] * self.d <= target * (1 + 1e-12) else p
            if q <= p:
                return None
            q = min(q, total)
            out.append(list(range(p, q)))
            p = q
        return out if p >= total else None

    def _split(self, groups, p: int, target: float) -> bool:
        """Complete a pack row of a group with the packs from `p` by splitting packs.

        Fewer packs are left than any group is wide, and no single pipeline takes them: the
        narrowest group that can takes them as one more row, made whole by splitting its
        lightest packs of several sequences in two (each split adds a micro-batch).
        """
        left = list(range(p, len(self.pack_tau)))
        for g in sorted(groups, key=lambda x: (x.width, x.base)):
            pool = [pk for row in g.pack_rows for pk in row] + left
            need = g.width - len(left)
            splittable = [pk for pk in pool if len(self.packs[pk]) > 1]
            if len(splittable) < need:
                continue
            splittable.sort(key=lambda pk: (self.pack_cost[pk], pk))
            chosen = set(splittable[:need])
            items = []
            for pk in pool:
                if pk in chosen:
                    for half in self._halves(self.packs[pk]):
                        items.append((tuple(half), self._cost_of(half)))
                else:
                    items.append((tuple(self.packs[pk]), float(self.pack_cost[pk])))
            items.sort(key=lambda it: (-it[1], it[0][0]))
            rows = [items[j : j + g.width] for j in range(0, len(items), g.width)]
            base = sum(g.shelf_tau)
            top = max(g.shelf_tau)
            taus = [row[0][1] / self.d for row in rows]
            est = base + sum(taus) + self.fill * max(top, max(taus))
            if est > target:
                continue
            g.pack_rows = []
            g.split_rows = rows
            g.estimate = est
            return True
        return False

    def _force_widen(self, groups, widths: np.ndarray, packs: int) -> None:
        """Widen rings into free members, faster or not, until `packs` packs fill the rest."""
        free = sum(g.width - u for g in groups for u in g.shelf_used)
        for g in groups:
            for si, shelf in enumerate(g.shelves):
                for x, (r, w) in enumerate(shelf):
                    if free <= packs:
                        return
                    room = g.width - g.shelf_used[si]
                    more = min(room, int(self.cap[r]) - w, free - packs)
                    if more <= 0:
                        continue
                    shelf[x] = (r, w + more)
                    widths[r] = w + more
                    g.shelf_used[si] += more
                    free -= more
                    cost = float(self.costs.ring(self.ring_s[r], float(w + more))) / self.d
                    g.shelf_tau[si] = max(g.shelf_tau[si], cost)

    def _merge(self, groups, p: int, target: float) -> bool | None:
        """Put the packs from `p` into ring micro-batches that have room for them.

        A ring of `w` members holds up to `w C` tokens (zigzag puts at most `ceil(T / w)` on
        a member); rings that offload take nothing. Each pack goes whole into the ring with
        the most room; the row's time is then the ring's with the extra sequences. None
        (nothing changed) when some pack finds no room; else whether the target holds.
        """
        rings = []  # [room, group index, shelf, ring id, width]
        for gi, g in enumerate(groups):
            for si, shelf in enumerate(g.shelves):
                for r, w in shelf:
                    if self.offload is not None and self.offload[self.ring_seq[r]] > 0:
                        continue
                    held = self.ring_s[r] + sum(self.seqlens[i] for i in g.merged.get(r, ()))
                    rings.append([w * self.capacity - held, gi, si, r, w])
        plan = []
        for pk in range(p, len(self.pack_tau)):
            size = sum(self.seqlens[i] for i in self.packs[pk])
            best = max(rings, key=lambda x: (x[0], -x[3]), default=None)
            if best is None or best[0] < size:
                return None
            best[0] -= size
            plan.append((best, pk))
        touched = set()
        for best, pk in plan:
            groups[best[1]].merged.setdefault(best[3], []).extend(self.packs[pk])
            touched.add((best[1], best[2]))
        for gi, g in enumerate(groups):
            for si, shelf in enumerate(g.shelves):
                if (gi, si) not in touched:
                    continue
                for r, w in shelf:
                    extra = [self.seqlens[i] for i in g.merged.get(r, ())]
                    cost = self.costs.micro_batch([int(self.ring_s[r]), *extra], w) / self.d
                    g.shelf_tau[si] = max(g.shelf_tau[si], cost)
            g.estimate = sum(g.shelf_tau) + self.fill * max(g.shelf_tau)
        return all(g.estimate <= target for g in groups)

    def _halves(self, seqs: list[int]) -> list[list[int]]:
        """Split a pack's sequences in two with about equal tokens (longest first)."""
        a, b, ta, tb = [], [], 0, 0
        for i in sorted(seqs, key=lambda i: (-self.seqlens[i], i)):
            if ta <= tb:
                a.append(i)
                ta += self.seqlens[i]
            else:
                b.append(i)
                tb += self.seqlens[i]
        return [sorted(a), sorted(b)]

    def _cost_of(self, seqs) -> float:
        """Cost of a local micro-batch of `seqs` (the sum of its sequences', as for packs)."""
        return float(sum(self.local[i] for i in seqs))

    def _ring_pack(self, groups, p: int, target: float) -> bool:
        """Put the packs from `p` on as ring micro-batches over the narrowest group."""
        if not groups:
            return False
        g = min(groups, key=lambda x: (x.width, x.base))
        seqs = [i for pk in self.packs[p:] for i in pk]
        bins = best_fit_decreasing(self.seqlens, seqs, g.width * self.capacity)
        bins.sort(key=lambda b: sum(self.seqlens[i] for i in b))
        while len(bins) > 1 and sum(self.seqlens[i] for i in bins[0]) < g.width:
            small = bins.pop(0)
            room = [g.width * self.capacity - sum(self.seqlens[i] for i in b) for b in bins]
            best = int(np.argmax(room))
            if room[best] < sum(self.seqlens[i] for i in small):
                return False
            bins[best] = bins[best] + small
            bins.sort(key=lambda b: sum(self.seqlens[i] for i in b))
        if sum(self.seqlens[i] for i in bins[0]) < g.width:
            return False
        top = max(g.shelf_tau)
        for b in bins:
            t = self.costs.micro_batch([self.seqlens[i] for i in b], g.width) / self.d
            g.ring_packs.append((sorted(b), t))
            g.estimate += t + self.fill * max(0.0, t - top)
            top = max(top, t)
        return g.estimate <= target

    # ------------------------------------------------------------------ bounds

    def lower_bound(self) -> float:
        """max(best chain of any ring, per-stage work / N + fill): see `pipeline_lower_bound`."""
        return _bound_parts(self)["bound"]


def _bound_parts(planner: _Planner) -> dict:
    """The parts of the lower bound of `pipeline_lower_bound` for a prepared batch."""
    c, d, n = planner.costs, planner.d, planner.n
    s = np.asarray(planner.seqlens, dtype=np.float64)
    k = planner.k
    ring = k > 1
    work = np.where(ring, c.ring(s, np.maximum(k, 1)) * k, c.ring(s, 1.0))
    compute_floor = c.compute(s) / n  # no micro-batch is wider than the pool
    chain = 0.0
    if ring.any():
        rs, rk = s[ring], k[ring]
        rcap = np.full(len(rs), n, dtype=np.int64)
        # Exact minimum over every width k .. N for the rings whose floor matters.
        floor = c.compute(rs) / rcap
        order = np.argsort(-floor, kind="stable")
        best = 0.0
        for i in order:
            if floor[i] <= best:
                break
            w = np.arange(int(rk[i]), int(rcap[i]) + 1, dtype=np.float64)
            best = max(best, float(np.min(c.ring(np.full_like(w, rs[i]), w))))
        chain = best
    short = ~ring
    if short.any():
        chain = max(chain, float(np.max(compute_floor[short])))
    fill = planner.fill * float(np.min(compute_floor)) / d if len(s) else 0.0
    work_bound = float(work.sum()) / (n * d) + fill
    return {"bound": max(chain, work_bound), "chain": chain, "work": work_bound}


def pipeline_lower_bound(
    seqlens: Sequence[int],
    *,
    pool_size: int,
    capacity: int,
    pipeline_stages: int,
    cost_model=None,
    ring_sizes: Sequence[int] | None = None,
    virtual_stages: int = 1,
) -> dict:
    """A lower bound of the step on pipelines (1F1B, uniform stages) of the batch's plans.

    Valid for every plan in which a long sequence is a ring micro-batch of its own (PP-Balance,
    DP-Balance, greedy); the static mesh packs several sequences into one ring micro-batch,
    whose communication the bound does not cover (its steps are far above it anyway).
    `bound = max(chain, work)`:
    - `chain`: a micro-batch's forward runs through all `d` stages and its backward back,
      one after another, so a step lasts at least its cost `c`. For every ring, the least
      cost over every width from its minimal `k` to `N`; for a short sequence, its
      communication-free cost spread over `N` ranks.
    - `work`: every pipeline with micro-batches runs `sum(t) + (d - 1) (f_first + b_last)`
      at least (its last stage starts after the first forward crossed `d - 1` stages, and
      the last backward must cross them back), so some pipeline takes at least the
      per-stage work at minimal rings over `N` (wider rings only add ring communication)
      plus `d - 1` times the cheapest micro-batch's per-stage time (a communication-free
      sequence over `N` ranks, at the least).

    Returns:
        `{"bound", "chain", "work"}` in seconds (or `simple_cost` units without a cost model).
    """
    validate_inputs(seqlens, pool_size, capacity)
    planner = _Planner(
        seqlens,
        pool_size,
        capacity,
        pipeline_stages,
        _Costs(cost_model, capacity),
        ring_sizes,
        split_packs=False,
        chunks=_chunks(virtual_stages),
    )
    return _bound_parts(planner)


def _best_layout(planner: _Planner) -> _Layout | None:
    """The layout of the least feasible target (bisection, decision 6)."""
    lo = planner.lower_bound()
    if lo <= 0:
        lo = 1e-12
    hi = lo
    best = None
    for _ in range(60):
        best = planner.layout(hi)
        if best is not None:
            break
        lo, hi = hi, hi * 2.0
    if best is None:
        return None
    for _ in range(_MAX_BISECTIONS):
        if hi - lo <= _TOLERANCE * hi:
            break
        mid = 0.5 * (lo + hi)
        found = planner.layout(mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    return best


def _refill_singles(planner: _Planner, layout: _Layout) -> None:
    """Spread the single pipelines' packs over all of them for their own least target."""
    if len(layout.singles) <= 1:
        return
    ids = [i for x in layout.singles for i in x]
    if not ids:
        return
    p, count = ids[0], len(layout.singles)
    lo = max(planner._single_estimate(ids[: max(1, len(ids) // count)]), 1e-12) * 0.5
    hi = layout.target
    best = planner._next_fit(p, count, hi)
    if best is None:
        return
    for _ in range(_MAX_BISECTIONS):
        if hi - lo <= _TOLERANCE * hi:
            break
        mid = 0.5 * (lo + hi)
        found = planner._next_fit(p, count, mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    layout.singles = best


def plan_pp_balanced(
    seqlens: Sequence[int],
    *,
    pool_size: int,
    capacity: int,
    pipeline_stages: int,
    cost_model=None,
    ring_sizes: Sequence[int] | None = None,
    offload_ratios: Sequence[float] | None = None,
    num_layers: int = 0,
    policy: str = "balanced",
    virtual_stages: int = 1,
) -> StepPlan:
    """PP-Balance: a lock-step plan for `pool_size` pipelines of `pipeline_stages` stages.

    Args:
        seqlens: Length of every sequence of the global batch.
        pool_size: Pipelines `N` in the HDP pool.
        capacity: Tokens per pipeline per micro-batch `C`.
        pipeline_stages: Stages `d` of every pipeline (1 is allowed: plain HDP ranks).
        cost_model: A `cost.CostModel` (per-member time of the whole model on one stage's
            devices); None: `static_mesh.simple_cost`'s formula.
        ring_sizes: Minimal ranks per sequence (default `ceil(s / C)`; 1 = packed).
        offload_ratios: Offload ratio per sequence (rings keep their sequence's ratio).
        num_layers: Layers per rank for the plan's offload memory check.
        policy: Name recorded in the plan.
        virtual_stages: Model chunks per stage `v` (interleaved 1F1B,
            `--num-layers-per-virtual-pipeline-stage`): the fill term is `(d - 1) / v`.

    Returns:
        A lock-step `StepPlan` (see the module docstring for every decision).

    Raises:
        ValueError: Bad input, or a batch no lock-step layout can hold (decision 8).
    """
    validate_inputs(seqlens, pool_size, capacity)
    if isinstance(pipeline_stages, bool) or int(pipeline_stages) != pipeline_stages:
        raise ValueError(f"pipeline_stages must be an integer >= 1, got {pipeline_stages!r}")
    d = int(pipeline_stages)
    if d < 1:
        raise ValueError(f"pipeline_stages must be an integer >= 1, got {pipeline_stages!r}")
    costs = _Costs(cost_model, capacity)
    chunks = _chunks(virtual_stages)
    layout = None
    for split in (False, True):
        planner = _Planner(
            seqlens,
            pool_size,
            capacity,
            d,
            costs,
            ring_sizes,
            split,
            offload=offload_ratios,
            chunks=chunks,
        )
        layout = _best_layout(planner)
        if layout is not None:
            break
    if layout is None:
        return _static_fallback(seqlens, pool_size, capacity, d, cost_model, policy)
    _refill_singles(planner, layout)
    return _assemble(planner, layout, policy, offload_ratios, num_layers)


def _chunks(virtual_stages) -> int:
    """`virtual_stages` as an int >= 1 (ValueError naming the bad value)."""
    if isinstance(virtual_stages, bool) or int(virtual_stages) != virtual_stages:
        raise ValueError(f"virtual_stages must be an integer >= 1, got {virtual_stages!r}")
    if int(virtual_stages) < 1:
        raise ValueError(f"virtual_stages must be an integer >= 1, got {virtual_stages!r}")
    return int(virtual_stages)


def _static_fallback(seqlens, pool_size, capacity, d, cost_model, policy) -> StepPlan:
    """Decision 8's last resort: the static mesh's lock-step layout (ValueError if none)."""
    cost = cost_model.planner_cost if cost_model is not None else simple_cost
    try:
        plan = plan_static(
            seqlens,
            pool_size=pool_size,
            capacity=capacity,
            cp_size=static_cp_size(seqlens, pool_size, capacity),
            cost=cost,
            token_per_member=True,
        )
    except ValueError as err:
        raise ValueError(
            f"no lock-step layout of this batch on {pool_size} pipelines gives every position "
            "of every ring group a micro-batch with at least one token per member (decision "
            f"8 of scheduler/pp_balance.py; the static mesh's neither: {err})"
        ) from err
    return with_pipeline_predictions(plan.replace(policy=policy), d, cost_model=cost_model)


def _assemble(planner: _Planner, layout: _Layout, policy, offload_ratios, num_layers) -> StepPlan:
    """The `StepPlan` of a layout: positions, orders, predicted costs and starts."""
    d = planner.d
    seqlens = planner.seqlens
    entries = []  # (position, first member, ring, seq ids, cost)
    pack_cost = planner.pack_cost
    ring_cost = planner.costs.ring(planner.ring_s, layout.widths) if len(layout.widths) else []

    def ratio_of(seqs, ring):
        if offload_ratios is None or len(ring) == 1 or len(seqs) != 1:
            return 0.0
        return float(offload_ratios[seqs[0]])

    for g in layout.groups:
        rows = []  # (per-stage time, kind, payload)
        for si in range(len(g.shelves)):
            rows.append((g.shelf_tau[si], 0, si))
        for b, t in g.ring_packs:
            rows.append((t, 1, b))
        for j, row in enumerate(g.pack_rows):
            rows.append((float(planner.pack_tau[row[0]]), 2, j))
        for j, row in enumerate(g.split_rows):
            rows.append((row[0][1] / d, 3, j))
        rows.sort(key=lambda x: (-x[0], x[1], x[2] if x[1] != 1 else 0))
        for pos, (_, kind, payload) in enumerate(rows):
            if kind == 0:
                shelf = g.shelves[payload]
                offset = 0
                for r, w in shelf:
                    ring = tuple(range(g.base + offset, g.base + offset + w))
                    seqs = (int(planner.ring_seq[r]), *sorted(g.merged.get(r, ())))
                    cost = float(ring_cost[r])
                    if len(seqs) > 1:
                        cost = planner.costs.micro_batch([seqlens[i] for i in seqs], w)
                    entries.append((pos, ring[0], ring, seqs, cost))
                    offset += w
                for pk in g.free_packs[payload]:
                    member = g.base + offset
                    entries.append(
                        (pos, member, (member,), tuple(planner.packs[pk]), float(pack_cost[pk]))
                    )
                    offset += 1
            elif kind == 1:
                ring = tuple(range(g.base, g.base + g.width))
                cost = planner.costs.micro_batch([seqlens[i] for i in payload], g.width)
                entries.append((pos, ring[0], ring, tuple(payload), cost))
            else:
                if kind == 2:
                    row = [
                        (tuple(planner.packs[pk]), float(pack_cost[pk]))
                        for pk in g.pack_rows[payload]
                    ]
                else:
                    row = g.split_rows[payload]
                members = range(g.width) if pos % 2 == 0 else range(g.width - 1, -1, -1)
                for (seqs, cost), m in zip(row, members, strict=True):
                    member = g.base + m
                    entries.append((pos, member, (member,), seqs, cost))
    base = sum(g.width for g in layout.groups)
    for x, ids in enumerate(layout.singles):
        member = base + x
        for pos, pk in enumerate(ids):
            entries.append((pos, member, (member,), tuple(planner.packs[pk]), float(pack_cost[pk])))
    entries.sort(key=lambda e: (e[0], e[1]))
    micro_batches = [
        MicroBatch(
            order=n,
            ring=ring,
            seq_indices=seqs,
            predicted_cost=cost,
            offload_ratio=ratio_of(seqs, ring),
        )
        for n, (_, _, ring, seqs, cost) in enumerate(entries)
    ]
    plan = plan_from_rank_lists(
        seqlens, planner.n, planner.capacity, policy, micro_batches, num_layers=num_layers
    )
    return with_pipeline_predictions(plan, d, cost_model=planner.costs.cm)


def micro_batch_sequences(plan: StepPlan):
    """Sequence ids of all micro-batches concatenated, the micro-batch of each, and counts."""
    counts = np.diff(plan.seq_offsets)
    owner = np.repeat(np.arange(len(counts)), counts)
    return plan.seq_ids, owner, counts


def forward_shares(plan: StepPlan, cost_model=None) -> np.ndarray:
    """Per micro-batch forward share of its time (the cost model's split, else 1/3)."""
    n = plan.num_micro_batches
    if cost_model is None:
        return np.full(n, DEFAULT_FORWARD_SHARE)
    ids, owner, _ = micro_batch_sequences(plan)
    s = plan.lengths.astype(np.float64)[ids]
    linear = np.bincount(owner, cost_model.linear_time(s), minlength=n)
    attention = np.bincount(owner, cost_model.attention_time(s), minlength=n)
    return forward_fraction(linear, attention)


def micro_batch_costs(plan: StepPlan, cost_model=None) -> np.ndarray:
    """Per micro-batch per-member cost by the cost model (`micro_batch_time`), vectorised.

    Without a cost model: `static_mesh.simple_cost`'s formula.
    """
    n = plan.num_micro_batches
    ids, owner, counts = micro_batch_sequences(plan)
    s = plan.lengths.astype(np.float64)[ids]
    k = plan.ring_sizes().astype(np.float64)
    costs = _Costs(cost_model, plan.capacity)
    local = np.bincount(owner, costs.ring(s, 1.0), minlength=n)
    out = local / k
    single = (counts == 1) & (k > 1)
    if single.any():
        first = np.cumsum(counts) - counts
        out[single] = costs.ring(s[first[single]], k[single])
    for i in np.nonzero((counts > 1) & (k > 1))[0]:
        mb = plan.micro_batch(int(i))
        out[i] = costs.micro_batch([plan.seqlens[j] for j in mb.seq_indices], mb.cp_size)
    return out


def with_pipeline_predictions(plan: StepPlan, pipeline_stages: int, *, cost_model=None) -> StepPlan:
    """`plan` with each `predicted_start` set to its forward start on the first stage (1F1B).

    Costs are the plan's `predicted_cost`; the forward share is the cost model's. Plans that
    deadlock on pipelines keep their starts.
    """
    ex = simulate_plan(
        plan, pipeline_stages, forward_share=forward_shares(plan, cost_model), schedule="1f1b"
    )
    if not ex.completed:
        return plan
    return plan.replace(predicted_start=np.asarray(ex.forward_start, dtype=np.float64))


def pipeline_execution(
    plan: StepPlan,
    pipeline_stages: int,
    *,
    cost_model=None,
    flush_on_deadlock: bool = True,
) -> tuple[Execution, str]:
    """Run any plan's lists on pipelines; returns the execution and the schedule used.

    1F1B with ring synchronisation first (`pipeline_timeline`); a plan that deadlocks that
    way (possible when it is not lock-step) is run with a pipeline flush around every ring
    (`schedule="flush"`, deadlock-free for any plan) when `flush_on_deadlock`. Costs are the
    cost model's per-member times (else `predicted_cost`).
    """
    costs = None if cost_model is None else micro_batch_costs(plan, cost_model)
    shares = forward_shares(plan, cost_model)
    ex = simulate_plan(plan, pipeline_stages, costs=costs, forward_share=shares)
    if ex.completed or not flush_on_deadlock:
        return ex, "1f1b"
    ex = simulate_plan(plan, pipeline_stages, costs=costs, forward_share=shares, schedule="flush")
    return ex, "flush"


__all__ = [
    "WIDTH_LADDER",
    "forward_shares",
    "micro_batch_costs",
    "micro_batch_sequences",
    "pipeline_execution",
    "pipeline_lower_bound",
    "plan_pp_balanced",
    "with_pipeline_predictions",
]
