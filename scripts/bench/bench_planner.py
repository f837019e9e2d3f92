"""Planner benchmark: plan time (C++ vs Python core) and plan quality vs a lower bound.

For each length mix (`megatron_hdp.sim.distributions.BENCH_MIXES`: the paper's GitHub-like
and Byted-like mixes, the embedded corpus' stdlib-like lengths and our Pareto-tailed mix),
HDP pool size N and batch size, one global batch with lengths clipped at the context
`min(N * C, 2M)` (C = 8192 tokens per rank per micro-batch) is planned and scored under the
cost model of a LLaMA-7B-like GQA model (32 layers, h 4096, 32 heads, 8 query groups, ffn
11008, vocab 32000) on the H100 profile. Batch sizes: `large`, `8 * N * C` tokens (about 8
micro-batches of capacity per rank); `small`, `1.5 N` sequences (fewer than 2 per rank, as
long-context fine-tuning and RL batches are).

- plan time, median of `--repeats` runs on one core (`time.perf_counter`), of the balance
  core alone (C++ `megatron_hdp._planner.balance_core` and the Python reference
  `balance.balance_core`, inputs prepared beforehand) and of the whole balanced
  `plan_step` (cost arrays + packing + placement + plan building + validation);
- plan quality: predicted step time over the lower bound `ring_sizing.step_lower_bound`
  (no plan that runs each sequence on its own ring or packs it on one rank can be
  shorter: the widths a step time forces, their work, and the longest sequence at its
  best ring) or, where sequences x ranks <= `--relaxation-size` and it is higher, the
  rank-load relaxation's bound (`rank_load_relaxation.py`: the same plans with ring
  members free to run at different moments, solved by HiGHS within `--relaxation-limit`
  seconds; needs scipy) and, where sequences x ranks <= `--search-size`, the same
  relaxation's bound by branch and bound (`rank_load_search.py`: the largest step time it
  rules out within `--search-nodes` nodes per decision), for `balanced` (ring sizes
  decided), `balanced_min_rings` (the balance scheduler with every ring at its minimal
  size, as before ring sizing), `greedy`,
  the `static` DP x CP mesh (smallest CP that holds the longest sequence and divides N) and
  Megatron-Core 0.16.1's `BalancedCPScheduler` (barrier-separated groups; scored under our
  cost model with its actual CP per sequence and under its own s^2/cp measure).

Writes JSON and a PNG, and prints a markdown table. Run from the repository root:

    python scripts/bench/bench_planner.py                    # full run, a few minutes
    python scripts/bench/bench_planner.py --pools 64 512 --mixes byted_like --repeats 3
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one core: set before numpy/torch load their pools

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import asdict  # noqa: E402
from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from megatron_hdp.provenance import environment, git_revision  # noqa: E402
from megatron_hdp.scheduler import plan_step  # noqa: E402
from megatron_hdp.scheduler.balance import balance_core as python_core  # noqa: E402
from megatron_hdp.scheduler.cost import H100, CostModel  # noqa: E402
from megatron_hdp.scheduler.placement import plan_balanced  # noqa: E402
from megatron_hdp.scheduler.ring_sizing import RingCosts, step_lower_bound  # noqa: E402
from megatron_hdp.sim.distributions import (  # noqa: E402
    BENCH_MIXES,
    M,
    describe,
    first_sequences,
)
from megatron_hdp.sim.models import MODELS  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rank_load_relaxation import rank_load_bound  # noqa: E402
from rank_load_search import NODE_BUDGET, rank_load_search_bound  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CAPACITY = 8192
MICRO_BATCHES_PER_RANK = 8
MAX_CONTEXT = 2 * M
MODEL = MODELS["llama-7b"].shape  # the paper's LLaMA-7B (Table 1)
SMALL_SEQUENCES_PER_RANK = 1.5
SIZES = ("large", "small")
SYSTEMS = ("balanced", "balanced_min_rings", "greedy", "static", "mcore_0_16_1")
#: Seconds per (sequence x rank) of the 0.16.1 scheduler, measured on this machine
#: (GitHub-like mix, 2,048 ranks, 15K sequences: 13 s); used to skip runs over the limit.
MCORE_SECONDS_PER_SEQ_RANK = 5e-7


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--pools",
        type=int,
        nargs="+",
        default=[8, 16, 64, 509, 1024, 2048, 16384],
        help="HDP pool sizes N",
    )
    p.add_argument(
        "--mixes",
        nargs="+",
        default=list(BENCH_MIXES),
        choices=list(BENCH_MIXES),
        help="length mixes (megatron_hdp.sim.distributions.BENCH_MIXES)",
    )
    p.add_argument(
        "--sizes",
        nargs="+",
        default=list(SIZES),
        choices=list(SIZES),
        help="batch sizes: large (8 micro-batches of tokens per rank), small (1.5 N sequences)",
    )
    p.add_argument(
        "--repeats", type=int, default=5, help="timed runs per plan-time figure (median reported)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=REPO / "results" / "planner_bench.json",
        help="JSON path; the PNG goes next to it with the suffix .png",
    )
    p.add_argument("--seed", type=int, default=2025, help="base seed of the batches")
    p.add_argument(
        "--python-limit",
        type=float,
        default=60.0,
        help="stop repeating a Python-core timing once one run exceeds this many seconds",
    )
    p.add_argument(
        "--relaxation-limit",
        type=float,
        default=30.0,
        help="seconds the rank-load relaxation's solver may run per batch (0: not run)",
    )
    p.add_argument(
        "--relaxation-size",
        type=int,
        default=400,
        help="run the rank-load relaxation where sequences x ranks is at most this",
    )
    p.add_argument(
        "--search-nodes",
        type=int,
        default=NODE_BUDGET,
        help="nodes the rank-load search may visit per decision (0: not run)",
    )
    p.add_argument(
        "--search-size",
        type=int,
        default=10_000,
        help="run the rank-load search where sequences x ranks is at most this",
    )
    p.add_argument(
        "--mcore-limit",
        type=float,
        default=60.0,
        help="skip Megatron-Core's scheduler where its estimated run time exceeds this (s)",
    )
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if any(n < 1 for n in args.pools):
        p.error(f"pool sizes must be >= 1, got {args.pools}")
    if args.relaxation_limit < 0:
        p.error(f"--relaxation-limit must be >= 0, got {args.relaxation_limit}")
    if args.search_nodes < 0:
        p.error(f"--search-nodes must be >= 0, got {args.search_nodes}")
    return args


# ------------------------------------------------------------------------- timing


def timed(fn, repeats: int, limit: float = math.inf) -> dict:
    """Median of `repeats` runs of `fn()` (stops early once one run exceeds `limit`)."""
    runs = []
    result = None
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        runs.append(time.perf_counter() - t0)
        if runs[-1] > limit:
            break
    out = {"median_s": statistics.median(runs), "runs_s": runs}
    if runs[-1] > limit:
        out["note"] = f"one run exceeded {limit:g} s; not repeated"
    return out, result


def load_cpp_core():
    """The C++ core, or (None, reason) if it is not importable."""
    try:
        from megatron_hdp.scheduler.planner import default_core

        return default_core(), None
    except ImportError as err:
        return None, f"{err}"


def load_mcore():
    """Megatron-Core 0.16.1's BalancedCPScheduler class, or (None, reason)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
        return BalancedCPScheduler, None
    except Exception as err:  # noqa: BLE001 (any import failure is reported, not fatal)
        return None, f"{type(err).__name__}: {err}"


class _StubGroup:
    """What BalancedCPScheduler reads of its process group: `size()`."""

    def __init__(self, n: int) -> None:
        self._n = n

    def size(self) -> int:
        return self._n


# ------------------------------------------------------------------------- plans


def whole_plan(seqlens, pool, cost_model, core, size_rings=True):
    """The balanced `plan_step` path with a given core (cost arrays, packing, placement, plan)."""
    return plan_balanced(
        seqlens,
        pool_size=pool,
        capacity=CAPACITY,
        cost_model=cost_model,
        core=core,
        size_rings=size_rings,
    )


def score_plan(plan, lb: float, lb_s2: float) -> dict:
    """Quality of one of our plans.

    Step time: every rank runs its micro-batches in order; a ring starts when all its
    members are free (the execution rule of `StepPlan`), so waits count. s^2/cp measure:
    per rank, the sum over its micro-batches of sum(s^2) / cp; the step is the max rank.
    """
    seqlens = plan.seqlens
    free = [0.0] * plan.pool_size
    s2 = [0.0] * plan.pool_size
    planned_end = 0.0
    ring_of = [0] * len(seqlens)
    for mb in plan.micro_batches:
        ring = mb.ring
        start = max(free[r] for r in ring)
        end = start + mb.predicted_cost
        w = sum(seqlens[i] * seqlens[i] for i in mb.seq_indices) / len(ring)
        for r in ring:
            free[r] = end
            s2[r] += w
        planned_end = max(planned_end, mb.predicted_start + mb.predicted_cost)
        for i in mb.seq_indices:
            ring_of[i] = len(ring)
    counts = plan.num_micro_batches_per_rank()
    tokens = sum(seqlens)
    step = max(free)
    out = {
        "step_time_s": step,
        "ratio_to_lower_bound": step / lb,
        "s2_step": max(s2),
        "s2_ratio_to_lower_bound": max(s2) / lb_s2,
        "micro_batches_per_rank_mean": sum(counts) / len(counts),
        "micro_batches_per_rank_max": max(counts),
        "token_weighted_ring_size": sum(s * k for s, k in zip(seqlens, ring_of)) / tokens,
        "max_ring_size": max(ring_of),
        "num_micro_batches": len(plan.micro_batches),
    }
    if plan.policy == "balanced":
        out["planner_predicted_step_time_s"] = planned_end
        out["sequences_above_minimal_ring"] = int(
            sum(
                1
                for i, k in enumerate(ring_of)
                if k > max(1, math.ceil(seqlens[i] / plan.capacity))
            )
        )
    return out


def score_mcore(seqlens, sample_id_groups, pool, cost_model, lb, lb_s2, capacity) -> dict:
    """Quality of a 0.16.1 schedule: groups are separated by barriers.

    A sequence's CP is the number of ranks that hold it in its group. Step time = sum over
    groups of the max over ranks of that rank's summed costs in the group, under our cost
    model (`CostModel.time(s, cp)`) and under 0.16.1's own `s^2 / cp`.
    """
    s = np.asarray(seqlens, dtype=np.float64)
    n = len(seqlens)
    step = step_s2 = 0.0
    mb_count = np.zeros(pool, dtype=np.int64)
    cp_of = np.zeros(n, dtype=np.int64)
    placed = np.zeros(n, dtype=np.int64)
    for grp in sample_id_groups:
        ranks, ids = [], []
        for r, lst in enumerate(grp):
            ranks.extend([r] * len(lst))
            ids.extend(lst)
        if not ids:
            continue
        ranks_a = np.asarray(ranks)
        ids_a = np.asarray(ids)
        cp = np.bincount(ids_a, minlength=n)
        c = np.asarray(cost_model.time(s[ids_a], cp[ids_a]), dtype=np.float64)
        step += float(np.bincount(ranks_a, weights=c, minlength=pool).max())
        w = s[ids_a] ** 2 / cp[ids_a]
        step_s2 += float(np.bincount(ranks_a, weights=w, minlength=pool).max())
        mb_count += np.bincount(ranks_a, minlength=pool)
        cp_of[ids_a] = cp[ids_a]
        placed += cp > 0
    if not np.all(placed == 1):
        raise AssertionError("Megatron-Core's schedule does not place every sequence once")
    needed = np.maximum(1, 2 ** np.ceil(np.log2(s / capacity))).astype(np.int64)
    return {
        "step_time_s": step,
        "ratio_to_lower_bound": step / lb,
        "s2_step": step_s2,
        "s2_ratio_to_lower_bound": step_s2 / lb_s2,
        "micro_batches_per_rank_mean": float(mb_count.mean()),
        "micro_batches_per_rank_max": int(mb_count.max()),
        "token_weighted_ring_size": float((s * cp_of).sum() / s.sum()),
        "max_ring_size": int(cp_of.max()),
        "num_groups": len(sample_id_groups),
        "sequences_above_needed_cp": int((cp_of > needed).sum()),
    }


# ------------------------------------------------------------------------- one case


def batch(mix, pool, size, seed):
    """The lengths of one benchmark batch and its context."""
    max_len = min(pool * CAPACITY, MAX_CONTEXT)
    rng = np.random.default_rng([seed, pool, list(BENCH_MIXES).index(mix), SIZES.index(size)])
    if size == "large":
        total = MICRO_BATCHES_PER_RANK * pool * CAPACITY
        return BENCH_MIXES[mix](rng, total, max_len), max_len
    count = max(2, round(SMALL_SEQUENCES_PER_RANK * pool))
    return first_sequences(BENCH_MIXES[mix], rng, count, max_len), max_len


def run_case(mix, pool, size, args, cost_model, cpp_core, mcore_cls) -> dict:
    seqlens, max_len = batch(mix, pool, size, args.seed)
    k, local, ring = cost_model.cost_arrays(seqlens, CAPACITY)
    bound = step_lower_bound(RingCosts(seqlens, cost_model, pool, k, np.where(k > 1, ring, local)))
    lb = bound.value
    lb_s2 = float(sum(x * x for x in seqlens)) / pool
    core_inputs = (np.asarray(seqlens, dtype=np.int64), k, local, ring)
    case = {
        "mix": mix,
        "pool": pool,
        "size": size,
        "max_len": max_len,
        "total_tokens": int(sum(seqlens)),
        "num_sequences": len(seqlens),
        "seed": args.seed,
        "batch": describe(seqlens),
        "lower_bound_s": lb,
        "lower_bound_fluid_s": lb,
        "lower_bound_work_at_min_rings_s": bound.work_at_min_rings,
        "lower_bound_longest_at_best_ring_s": bound.longest_at_best_ring,
        "lower_bound_s2": lb_s2,
        "plan_time": {},
        "quality": {},
    }
    t = case["plan_time"]

    def core_call(core):
        return lambda: core(*core_inputs, pool_size=pool, capacity=CAPACITY)

    # Python reference: core alone (minimal rings), then the whole plan_step path.
    py_core, py_placements = timed(core_call(python_core), args.repeats, args.python_limit)
    py_whole, balanced = timed(
        lambda: whole_plan(seqlens, pool, cost_model, python_core), args.repeats, args.python_limit
    )
    t["python"] = {"core": py_core, "plan_step": py_whole}
    if cpp_core is not None:
        cpp_c, cpp_placements = timed(core_call(cpp_core), args.repeats)
        from megatron_hdp._planner import balance_core_arrays

        cpp_arrays, _ = timed(core_call(balance_core_arrays), args.repeats)
        cpp_whole, cpp_plan = timed(
            lambda: plan_step(
                seqlens, pool_size=pool, capacity=CAPACITY, policy="balanced", cost_model=cost_model
            ),
            args.repeats,
        )
        cpp_min, min_rings = timed(
            lambda: whole_plan(seqlens, pool, cost_model, cpp_core, size_rings=False),
            args.repeats,
        )
        t["cpp"] = {
            "core": cpp_c,
            "core_arrays": cpp_arrays,
            "plan_step": cpp_whole,
            "plan_step_min_rings": cpp_min,
        }
        t["ring_sizing_time_growth"] = cpp_whole["median_s"] / cpp_min["median_s"]
        case["cpp_plan_identical_to_python"] = bool(
            cpp_placements == py_placements and cpp_plan == balanced
        )
    else:
        t["cpp"] = None
        min_rings = whole_plan(seqlens, pool, cost_model, python_core, size_rings=False)

    upper = max(mb.predicted_start + mb.predicted_cost for mb in balanced.micro_batches)
    if args.relaxation_limit > 0 and len(seqlens) * pool <= args.relaxation_size:
        try:
            relaxation = rank_load_bound(
                seqlens,
                pool,
                cost_model,
                CAPACITY,
                lower=lb,
                upper=upper,
                time_limit=args.relaxation_limit,
            )
        except ImportError as err:
            relaxation = {"skipped": f"{err}"}
        else:
            lb = relaxation["value"]
        case["lower_bound_s"] = lb
        case["lower_bound_relaxation"] = relaxation
    if args.search_nodes > 0 and len(seqlens) * pool <= args.search_size:
        search = rank_load_search_bound(
            seqlens,
            pool,
            cost_model,
            CAPACITY,
            lower=min(lb, upper),
            upper=upper,
            node_budget=args.search_nodes,
        )
        lb = max(lb, search["value"])
        case["lower_bound_s"] = lb
        case["lower_bound_search"] = search

    q = case["quality"]
    greedy, static = (
        plan_step(seqlens, pool_size=pool, capacity=CAPACITY, policy=name, cost_model=cost_model)
        for name in ("greedy", "static")
    )
    for plan in (balanced, min_rings, greedy, static):
        plan.validate(pool_size=pool)  # every invariant, untimed
    q["balanced"] = score_plan(balanced, lb, lb_s2)
    q["balanced_min_rings"] = score_plan(min_rings, lb, lb_s2)
    q["greedy"] = score_plan(greedy, lb, lb_s2)
    q["static"] = score_plan(static, lb, lb_s2)
    q["static"]["cp"] = static.micro_batches[0].cp_size

    estimate = MCORE_SECONDS_PER_SEQ_RANK * len(seqlens) * pool
    if mcore_cls is None:
        q["mcore_0_16_1"] = {"skipped": "megatron-core scheduler not importable"}
    elif estimate > args.mcore_limit:
        q["mcore_0_16_1"] = {
            "skipped": f"estimated {estimate:.0f} s > {args.mcore_limit:g} s limit "
            f"({len(seqlens)} sequences x {pool} ranks)"
        }
    else:
        sched = mcore_cls(CAPACITY, _StubGroup(pool))
        t0 = time.perf_counter()
        try:
            _, groups = sched.get_groups_and_subsamples(list(enumerate(seqlens)), None)
        except Exception as err:  # noqa: BLE001 (its failure on a batch is a result)
            q["mcore_0_16_1"] = {"failed": f"{type(err).__name__}: {err}"}
        else:
            elapsed = time.perf_counter() - t0
            q["mcore_0_16_1"] = score_mcore(seqlens, groups, pool, cost_model, lb, lb_s2, CAPACITY)
            t["mcore_0_16_1"] = {"one_run_s": elapsed}
    return case


# ------------------------------------------------------------------------- output


def plot(results, mixes, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    colors = {
        "balanced": "tab:blue",
        "balanced_min_rings": "tab:cyan",
        "greedy": "tab:green",
        "static": "tab:gray",
        "mcore_0_16_1": "tab:red",
    }
    styles = {"large": "-", "small": "--"}
    fig, axes = plt.subplots(3, len(mixes), figsize=(5 * len(mixes), 12), squeeze=False)
    for col, mix in enumerate(mixes):
        for size, style in styles.items():
            cases = sorted(
                (c for c in results if c["mix"] == mix and c["size"] == size),
                key=lambda c: c["pool"],
            )
            if not cases:
                continue
            ax = axes[0][col]
            for impl, key, marker in (
                ("cpp", "plan_step", "o"),
                ("cpp", "plan_step_min_rings", "x"),
                ("python", "plan_step", "s"),
            ):
                pts = [
                    (c["pool"], c["plan_time"][impl][key]["median_s"])
                    for c in cases
                    if c["plan_time"].get(impl) and key in c["plan_time"][impl]
                ]
                if pts:
                    ax.plot(*zip(*pts), style, marker=marker, label=f"{impl} {key} ({size})")
            for row, key in ((1, "ratio_to_lower_bound"), (2, "s2_ratio_to_lower_bound")):
                ax = axes[row][col]
                for system in SYSTEMS:
                    pts = [
                        (c["pool"], c["quality"][system][key])
                        for c in cases
                        if key in c["quality"][system]
                    ]
                    if pts:
                        ax.plot(
                            *zip(*pts),
                            style,
                            marker="o",
                            markersize=3,
                            color=colors[system],
                            label=f"{system} ({size})",
                        )
        axes[0][col].set(
            xscale="log",
            yscale="log",
            title=f"{mix}: plan time",
            xlabel="pool size N",
            ylabel="seconds (median)",
        )
        axes[0][col].legend(fontsize=6)
        for row, label in (
            (1, "step / lower bound (our cost model)"),
            (2, "step / lower bound (s^2/cp measure)"),
        ):
            ax = axes[row][col]
            ax.axhline(1.0, color="black", linewidth=0.5)
            if row == 1:
                ax.axhline(1.03, color="black", linewidth=0.5, linestyle=":")
            ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set(
                xscale="log",
                yscale="log",
                title=f"{mix}: {label}",
                xlabel="pool size N (solid: large batch, dashed: small)",
                ylabel="ratio (1 = lower bound)",
            )
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ms(entry, what):
    if not entry or what not in entry:
        return "-"
    return f"{entry[what]['median_s'] * 1e3:.1f}"


def _mcore(q, key):
    mc = q["mcore_0_16_1"]
    if key in mc:
        return f"{mc[key]:.3f}"
    return "skipped" if "skipped" in mc else "failed"


def markdown(results) -> str:
    lines = [
        "| mix | size | N | seqs | C++ core ms | C++ plan_step ms (min rings) | Py plan_step ms "
        "| bound / fluid | balanced | min rings | greedy | static (cp) | MCore ours "
        "| balanced s2 | MCore s2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in results:
        t, q = c["plan_time"], c["quality"]
        lines.append(
            f"| {c['mix']} | {c['size']} | {c['pool']} | {c['num_sequences']} "
            f"| {_ms(t['cpp'], 'core')} "
            f"| {_ms(t['cpp'], 'plan_step')} ({_ms(t['cpp'], 'plan_step_min_rings')}) "
            f"| {_ms(t['python'], 'plan_step')} "
            f"| {c['lower_bound_s'] / c['lower_bound_fluid_s']:.4f} "
            f"| {q['balanced']['ratio_to_lower_bound']:.3f} "
            f"| {q['balanced_min_rings']['ratio_to_lower_bound']:.3f} "
            f"| {q['greedy']['ratio_to_lower_bound']:.3f} "
            f"| {q['static']['ratio_to_lower_bound']:.2f} ({q['static']['cp']}) "
            f"| {_mcore(q, 'ratio_to_lower_bound')} "
            f"| {q['balanced']['s2_ratio_to_lower_bound']:.3f} "
            f"| {_mcore(q, 's2_ratio_to_lower_bound')} |"
        )
    lines.append(
        "\nQuality = predicted step time / lower bound (1.0 is optimal); bound / fluid > 1: "
        "the rank-load relaxation (HiGHS or the search) raised the bound; "
        "s2 = Megatron-Core's own s^2/cp measure over sum(s^2)/N."
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    cost_model = CostModel(MODEL, H100)
    cpp_core, cpp_error = load_cpp_core()
    mcore_cls, mcore_error = load_mcore()
    results = []
    t_start = time.perf_counter()
    for mix in args.mixes:
        for size in args.sizes:
            for pool in args.pools:
                t0 = time.perf_counter()
                results.append(run_case(mix, pool, size, args, cost_model, cpp_core, mcore_cls))
                print(
                    f"[{time.perf_counter() - t0:6.1f} s] {mix} {size} N={pool}",
                    file=sys.stderr,
                    flush=True,
                )
    versions = environment()
    for pkg in ("numpy", "matplotlib", "scipy"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    report = {
        "benchmark": "planner_bench",
        "config": {
            "capacity": CAPACITY,
            "micro_batches_per_rank": MICRO_BATCHES_PER_RANK,
            "total_tokens": "large: micro_batches_per_rank * pool * capacity; small: "
            f"{SMALL_SEQUENCES_PER_RANK} * pool sequences (distributions.first_sequences)",
            "sizes": args.sizes,
            "max_len": f"min(pool * capacity, {MAX_CONTEXT}) (the context; lengths clipped)",
            "model": asdict(MODEL),
            "device": asdict(H100),
            "pools": args.pools,
            "mixes": args.mixes,
            "repeats": args.repeats,
            "seed": args.seed,
            "python_limit_s": args.python_limit,
            "mcore_limit_s": args.mcore_limit,
            "relaxation_limit_s": args.relaxation_limit,
            "relaxation_size": args.relaxation_size,
            "search_nodes": args.search_nodes,
            "search_size": args.search_size,
            "mcore_seconds_per_seq_rank_estimate": MCORE_SECONDS_PER_SEQ_RANK,
            "definitions": {
                "plan_time.core": "balance core call alone (numpy inputs prepared), returning "
                "Placement objects, median of runs",
                "plan_time.core_arrays": "C++ balance_core_arrays: the same placements as "
                "numpy arrays (no Python object per micro-batch)",
                "plan_time.plan_step": "balanced plan_step path: cost arrays, packing, "
                "placement, StepPlan (C++: plan_step itself; Python: "
                "plan_balanced(core=balance.balance_core)); plans are validated once, untimed",
                "plan_time.mcore_0_16_1": "get_groups_and_subsamples, one run",
                "lower_bound_s": "ring_sizing.step_lower_bound: least T with every sequence "
                "fitting some ring within T and the work of the widths T forces fitting in "
                "N T; at least max(longest item at its best ring, total work at minimal "
                "rings / N); where sequences x ranks <= relaxation_size, the higher of that "
                "(lower_bound_fluid_s) and the rank-load relaxation's "
                "(lower_bound_relaxation: rank_load_relaxation.py, HiGHS dual bound within "
                "relaxation_limit_s) and, where sequences x ranks <= search_size, the "
                "same relaxation's by branch and bound (lower_bound_search: "
                "rank_load_search.py, the largest step time ruled out within search_nodes "
                "nodes per decision); same bound for every system (both price each "
                "sequence on its own ring: static's packs on one ring can score below 1)",
                "balanced_min_rings": "the balanced policy with every ring at ceil(s / C) "
                "(plan_balanced(size_rings=False)), the planner before ring sizing",
                "plan_time.ring_sizing_time_growth": "C++ plan_step / plan_step with "
                "minimal rings, same run",
                "step_time_s (ours)": "ranks run micro-batches in plan order, a ring starts "
                "when all members are free; max finish over ranks",
                "step_time_s (mcore)": "sum over barrier-separated groups of max over ranks "
                "of summed CostModel.time(s, cp) with its actual cp per sequence",
                "s2 measure": "ours: max over ranks of sum over micro-batches of sum(s^2)/cp; "
                "mcore: sum over groups of that max; bound sum(s^2)/N",
                "greedy/static": "plan_step(policy=greedy|static) with the same cost model; "
                "a packed ring micro-batch makes one ring pass per layer for the whole pack",
            },
        },
        "versions": versions,
        "git_revision": git_revision(REPO),
        "cpp_available": cpp_core is not None,
        "cpp_import_error": cpp_error,
        "mcore_import_error": mcore_error,
        "wall_time_s": time.perf_counter() - t_start,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    png = args.out.with_suffix(".png")
    plot(results, args.mixes, png)
    print(markdown(results))
    print(f"\nwrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
