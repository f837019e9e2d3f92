"""A lower bound on the step time of small batches: the rank-load relaxation, solved as a MILP.

`ring_sizing.step_lower_bound` is fluid: it lets work spread over the ranks in any
fraction. With about one sequence per rank that is loose: a rank that holds a 0.30 s ring
member cannot also hold a 0.10 s sequence in a 0.38 s step, however the rest is arranged.
This module drops only the timing of rings (members of one ring need not run at the same
moment) and keeps everything else a plan must satisfy:

- every sequence runs on one ring of `k` ranks, `k_min <= k <= min(N, s)` (one token per
  member at least), each member busy `t(s, k)` (`CostModel.time`; `k = 1`: on one rank,
  where a pack's time is the sum of its sequences' times);
- the `k` members are distinct ranks;
- every rank's busy time is at most the step time `T`.

Any plan that prices each sequence on its own ring (ours, greedy, Megatron-Core's as the
benchmark scores it) satisfies these, so the least `T` they allow is a lower bound on its
step time. The static mesh's packs of several documents on one ring make one ring pass
per layer for the whole pack and fall outside: its ratio can drop below 1 (as it can
below the fluid bound). The least `T` is found with HiGHS (`scipy.optimize.milp`), whose
dual bound is a lower bound even when it stops at its time limit. A plan of step `U` is
known (our own), so widths with `t(s, k) > U` are left out: a plan shorter than `U`
cannot use them, and the bound returned is at most `U`.

Variables: `y[o]` (sequence i runs at width k, for each option `o = (i, k)`), `x[o, r]`
(rank r is a member of that ring) and `T`:

    sum_k y[i, k] = 1                      every sequence has one width
    sum_r x[o, r] = k y[o]                 its ring has k members
    x[o, r] <= y[o]
    sum_o t[o] x[o, r] <= T                every rank within the step
    T >= the fluid bound                   (a bound already; it prunes the search)

Needs scipy (the `dev` extra); sized for small batches (the benchmark runs it where
sequences x ranks is at most a few hundred).
"""

from __future__ import annotations

import time

import numpy as np

#: The dual bound is shaded by this share for the solver's tolerances. HiGHS's are
#: absolute (rows within 1e-7), so times are solved in units of `upper` (T near 1).
SAFETY = 1e-5


def rank_load_bound(
    seqlens,
    pool: int,
    cost_model,
    capacity: int,
    *,
    lower: float,
    upper: float,
    time_limit: float,
) -> dict:
    """The rank-load relaxation's lower bound on the step time (seconds), and how it ended.

    `lower`: a bound already known (the fluid one; the result is at least this);
    `upper`: the step time of a known plan (widths slower than it are left out);
    `time_limit`: seconds the solver may run (its dual bound at the limit is still a bound).
    Returns `value` (the bound: the dual bound shaded by `SAFETY`, at least `lower`, at
    most `upper`), `dual` (the solver's dual bound as it is), `optimal` (the solver closed
    the gap), `incumbent` (its best rank-load assignment's `T`, not necessarily a plan),
    `options`, `seconds`.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    s = np.asarray(seqlens, dtype=np.float64)
    k_min, _, _ = cost_model.cost_arrays(np.asarray(seqlens, dtype=np.int64), capacity)
    k_max = np.maximum(k_min, np.minimum(pool, s.astype(np.int64)))
    opt_seq, opt_k, opt_t = [], [], []
    for i, (x, lo, hi) in enumerate(zip(s, k_min, k_max)):
        ks = np.arange(int(lo), int(hi) + 1)
        ts = np.asarray(cost_model.time(np.full(len(ks), x), ks), dtype=np.float64)
        keep = ts <= upper * (1 + 1e-9)
        if not keep.any():  # no width within `upper`: `upper` is this sequence's best
            keep = ts == ts.min()
        opt_seq += [i] * int(keep.sum())
        opt_k += ks[keep].tolist()
        opt_t += ts[keep].tolist()
    n_opt, n_seq = len(opt_k), len(s)
    scale = float(upper)  # solved in units of `upper`: the solver's tolerances are absolute
    opt_seq, opt_k, opt_t = np.array(opt_seq), np.array(opt_k), np.array(opt_t) / scale
    n_var = n_opt + n_opt * pool + 1  # y, x (option-major), T
    x_of = n_opt + np.arange(n_opt * pool).reshape(n_opt, pool)
    t_var = n_var - 1

    rows, cols, vals, lo_b, hi_b = [], [], [], [], []

    def add(row_cols, row_vals, lo, hi):
        row = len(lo_b)
        rows.extend([row] * len(row_cols))
        cols.extend(row_cols)
        vals.extend(row_vals)
        lo_b.append(lo)
        hi_b.append(hi)

    for i in range(n_seq):
        mine = np.nonzero(opt_seq == i)[0]
        add(mine.tolist(), [1.0] * len(mine), 1.0, 1.0)
    for o in range(n_opt):
        add(x_of[o].tolist() + [o], [1.0] * pool + [-float(opt_k[o])], 0.0, 0.0)
        for r in range(pool):
            add([int(x_of[o, r]), o], [1.0, -1.0], -np.inf, 0.0)
    for r in range(pool):
        add(x_of[:, r].tolist() + [t_var], opt_t.tolist() + [-1.0], -np.inf, 0.0)

    matrix = coo_matrix((vals, (rows, cols)), shape=(len(lo_b), n_var)).tocsr()
    cost = np.zeros(n_var)
    cost[t_var] = 1.0
    integrality = np.ones(n_var)
    integrality[t_var] = 0
    upper_b = np.ones(n_var)
    upper_b[t_var] = np.inf
    t0 = time.perf_counter()
    res = milp(
        cost,
        constraints=LinearConstraint(matrix, lo_b, hi_b),
        integrality=integrality,
        bounds=Bounds(np.where(np.arange(n_var) == t_var, lower / scale, 0.0), upper_b),
        options={"time_limit": float(time_limit), "mip_rel_gap": 1e-6, "disp": False},
    )
    seconds = time.perf_counter() - t0
    dual = getattr(res, "mip_dual_bound", None)
    dual = float(dual) * scale if dual is not None and np.isfinite(dual) else 0.0
    return {
        "value": min(float(upper), max(float(lower), dual * (1 - SAFETY))),
        "dual": dual,
        "optimal": bool(res.status == 0),
        "incumbent": float(res.fun) * scale if res.fun is not None else None,
        "options": int(n_opt),
        "seconds": seconds,
    }
