"""`python -m megatron_hdp.sim`: the cluster simulator's command line (see `--help`).

Writes `<out>/sim.json` (configuration, models, every run averaged over the steps, the
scale check, the Fig. 5 case), `<out>/sim.md` (tables), PNG charts (throughput vs context,
speedup over the static mesh, ablation bars, per-rank Gantt charts of one step, the Fig. 5
per-stage Gantt chart `fig5.png`), and the claims table
computed from the JSON by `sim.claims`: `<out>/claims.json` and the markdown document
(`--claims-doc`; by default `docs/claims.md` when `--out` is the default `results/sim`,
else `<out>/claims.md`), so the committed document always matches the committed results.
Progress goes to the `megatron_hdp.sim` logger (INFO, stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from megatron_hdp.scheduler.cost import CostModel
from megatron_hdp.scheduler.windows import parse_skip_freq, parse_window_size
from megatron_hdp.sim import claims as claims_mod
from megatron_hdp.sim import pipelines as pipelines_mod
from megatron_hdp.sim.clusters import CLUSTERS
from megatron_hdp.sim.distributions import GENERATORS
from megatron_hdp.sim.models import (
    MLA_MODELS,
    MODELS,
    PAPER_CAPACITY,
    memory_capacity,
    with_window,
)
from megatron_hdp.sim.simulate import (
    ABLATION,
    LABELS,
    MEGATRON_MAX_RANKS,
    SYSTEMS,
    StepResult,
    simulate_step,
)

K = 1024
DEFAULT_CONTEXTS = (256 * K, 512 * K, 1024 * K, 2048 * K)


def _tokens(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": K, "M": K * K}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KM" else text) * mult)


LOG = logging.getLogger("megatron_hdp.sim")
DEFAULT_OUT = "results/sim"
DEFAULT_CLAIMS_DOC = "docs/claims.md"


def _say(*parts, error: bool = False) -> None:
    """Log a progress line (INFO; ERROR with `error`)."""
    LOG.log(logging.ERROR if error else logging.INFO, " ".join(str(p) for p in parts))


def claims_doc_path(out: Path, claims_doc: str) -> Path | None:
    """Where the claims markdown goes.

    'auto' = docs/claims.md for the default output folder, else `<out>/claims.md`;
    '' = nowhere; else the given path.
    """
    if claims_doc == "":
        return None
    if claims_doc != "auto":
        return Path(claims_doc)
    if out.resolve() == Path(DEFAULT_OUT).resolve():
        return Path(DEFAULT_CLAIMS_DOC)
    return out / "claims.md"


def write_claims(result: dict, out: Path, doc: Path | None) -> list:
    """Compute the claim rows from the simulation JSON; write claims.json and the doc."""
    rows = claims_mod.claim_rows(result)
    (out / "claims.json").write_text(json.dumps(claims_mod.as_json(rows, result), indent=1))
    if doc is not None:
        doc.parent.mkdir(parents=True, exist_ok=True)
        doc.write_text(claims_mod.markdown(rows, result))
    return rows


def _fmt_ctx(n: int) -> str:
    return f"{n // (K * K)}M" if n % (K * K) == 0 else f"{n // K}K"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (every flag documented)."""
    p = argparse.ArgumentParser(
        prog="python -m megatron_hdp.sim",
        description="Simulate training steps of the static mesh, Megatron dynamic CP and HDP "
        "(greedy, +offload, +offload+balance, +balance) on identical global batches, priced "
        "by the planner's cost model; write JSON, markdown and PNG charts.",
    )
    p.add_argument("--out", default=DEFAULT_OUT, help="output folder (created)")
    p.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma list of models (also the MLA variants {', '.join(MLA_MODELS)})",
    )
    p.add_argument(
        "--contexts",
        default=",".join(_fmt_ctx(c) for c in DEFAULT_CONTEXTS),
        help="comma list of context lengths (suffix K or M = 1024 or 1024^2 tokens)",
    )
    p.add_argument("--datasets", default=",".join(GENERATORS), help="comma list of datasets")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of systems")
    p.add_argument("--steps", type=int, default=3, help="simulated steps averaged per cell")
    p.add_argument("--seed", type=int, default=0, help="base seed of the global batches")
    p.add_argument("--tokens", default="32M", help="tokens per global batch (paper: 32M)")
    p.add_argument(
        "--capacity",
        default=str(PAPER_CAPACITY),
        help="tokens per HDP rank per micro-batch: a number, or 'memory' for each model's "
        "memory-derived estimate (models.memory_capacity); default the paper's 8K",
    )
    p.add_argument(
        "--gpus", type=int, default=0, help="GPUs for every model (0 = the paper's per model)"
    )
    p.add_argument("--cluster", default="h100", choices=sorted(CLUSTERS), help="cluster profile")
    p.add_argument(
        "--ib-scale", type=float, default=1.0, help="multiply the InfiniBand bandwidth (what-if)"
    )
    p.add_argument(
        "--megatron",
        default="auto",
        choices=("auto", "core", "reimpl"),
        help="megatron_dcp implementation: auto = Megatron-Core's BalancedCPScheduler when "
        "installed and the pool is small enough, else the power-of-two re-implementation",
    )
    p.add_argument(
        "--megatron-max-ranks",
        type=int,
        default=MEGATRON_MAX_RANKS,
        help="largest pool for which 'auto' calls Megatron-Core (it takes minutes above)",
    )
    p.add_argument(
        "--gantt",
        default="llama-7b,byted_like,2M",
        help="model,dataset,context of the Gantt charts (first step); '' for none",
    )
    p.add_argument("--gantt-ranks", type=int, default=64, help="ranks shown in a Gantt chart")
    p.add_argument(
        "--scale-gpus",
        type=int,
        default=16384,
        help="scale check: one step of llama-7b at 1M context (byted) on this many GPUs, "
        "timed (0 = skip)",
    )
    p.add_argument(
        "--fig5-model",
        default="mixtral-8x7b",
        help="model whose cost model prices the Fig. 5 case (two 4-stage pipelines, 8 "
        "micro-batches each); '' to skip",
    )
    p.add_argument(
        "--window-size",
        type=parse_window_size,
        default=None,
        help="price sliding-window attention 'left,0' in every model (Megatron-Core's meaning)",
    )
    p.add_argument(
        "--window-attn-skip-freq",
        type=parse_skip_freq,
        default=None,
        help="with --window-size: every N-th layer full, or a 1/0 list per layer",
    )
    p.add_argument("--no-charts", action="store_true", help="skip the PNG charts")
    p.add_argument(
        "--claims-doc",
        default="auto",
        help="claims markdown: 'auto' = docs/claims.md when --out is results/sim, else "
        "<out>/claims.md; '' = none (claims.json is always written to --out)",
    )
    return p


def batch(dataset: str, seed: int, ds_index: int, context: int, step: int, tokens: int):
    """The global batch of one cell and step: identical for every system and model."""
    rng = np.random.default_rng([seed, ds_index, context, step])
    return GENERATORS[dataset](rng, tokens, context)


def run_cell(model, cluster, dataset, ds_index, context, args, capacity, gpus, keep=False):
    """All systems on `args.steps` batches of one (model, dataset, context)."""
    cm = CostModel(model.shape, cluster.rank_profile(model.tp))
    pool = model.pool_size(gpus or None)
    per_system: dict[str, list[StepResult]] = {s: [] for s in args.systems}
    for step in range(args.steps):
        lens = batch(dataset, args.seed, ds_index, context, step, args.tokens)
        for system in args.systems:
            r = simulate_step(
                system,
                lens,
                pool_size=pool,
                capacity=capacity,
                context=context,
                cost_model=cm,
                params=model.total_params,
                megatron=args.megatron,
                megatron_max_ranks=args.megatron_max_ranks,
                pipeline_stages=model.pp,
            )
            per_system[system].append(r)
    rows = []
    for system, results in per_system.items():
        sums = [r.summary() for r in results]
        row = {
            k: float(np.mean([s[k] for s in sums]))
            for k in sums[0]
            if isinstance(sums[0][k], (int, float))
        }
        row["tokens_per_s"] = args.tokens * len(results) / sum(r.step_time for r in results)
        row.update(
            model=model.name,
            dataset=dataset,
            context=context,
            system=system,
            implementation=sums[0]["implementation"],
            pipeline_schedule="+".join(
                sorted({x for s in sums for x in s["pipeline_schedule"].split("+")})
            ),
            pool_size=pool,
            gpus=pool * model.gpus_per_rank,
            capacity=capacity,
            step_times=[r.step_time for r in results],
        )
        rows.append(row)
    return rows, (per_system if keep else None)


def markdown(rows, systems) -> str:
    """Tables: tokens/s per system and speedup over the static mesh."""
    out = [
        "# Simulated throughput (tokens/s) and speedup over the static mesh",
        "",
        "Generated by `python -m megatron_hdp.sim`; see `sim.json` for every number.",
        "",
    ]
    head = "| model | dataset | context | " + " | ".join(LABELS[s] for s in systems) + " |"
    out += [head, "|" + "---|" * (3 + len(systems))]
    cells = {}
    for r in rows:
        cells.setdefault((r["model"], r["dataset"], r["context"]), {})[r["system"]] = r
    for (model, ds, ctx), by in cells.items():
        base = by.get("static", {}).get("tokens_per_s")
        vals = []
        for s in systems:
            tps = by[s]["tokens_per_s"]
            sp = f" ({tps / base:.2f}x)" if base else ""
            vals.append(f"{tps / 1e3:,.0f}K{sp}")
        out.append(f"| {model} | {ds} | {_fmt_ctx(ctx)} | " + " | ".join(vals) + " |")
    return "\n".join(out) + "\n"


def charts(rows, systems, out: Path, gantt_results, gantt_ranks: int, gantt_cell) -> list[str]:
    """Throughput, speedup, ablation and Gantt PNGs; returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    models = list(dict.fromkeys(r["model"] for r in rows))
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    get = {(r["model"], r["dataset"], r["context"], r["system"]): r for r in rows}
    contexts = sorted({r["context"] for r in rows})
    for kind in ("throughput", "speedup"):
        fig, axes = plt.subplots(
            len(models),
            len(datasets),
            figsize=(4 * len(datasets), 2.8 * len(models)),
            squeeze=False,
        )
        for i, m in enumerate(models):
            for j, d in enumerate(datasets):
                ax = axes[i][j]
                for s in systems:
                    ys = []
                    for c in contexts:
                        r = get.get((m, d, c, s))
                        base = get.get((m, d, c, "static"))
                        if r is None:
                            ys.append(np.nan)
                        elif kind == "throughput":
                            ys.append(r["tokens_per_s"])
                        else:
                            ys.append(r["tokens_per_s"] / base["tokens_per_s"] if base else np.nan)
                    ax.plot(range(len(contexts)), ys, marker="o", label=LABELS[s])
                ax.set_xticks(range(len(contexts)), [_fmt_ctx(c) for c in contexts])
                gpus = next(r["gpus"] for r in rows if r["model"] == m)
                ax.set_title(f"{m} @{gpus} GPUs, {d}", fontsize=9)
                if kind == "throughput":
                    ax.set_yscale("log")
                    ax.set_ylabel("tokens/s")
                else:
                    ax.axhline(1.0, color="grey", lw=0.5)
                    ax.set_ylabel("speedup vs static")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        name = f"{kind}.png"
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        files.append(name)
    if gantt_cell is not None:
        m, d, c = gantt_cell
        order = [s for s in (*ABLATION, "megatron_dcp", "hdp_balance") if (m, d, c, s) in get]
        if order and (m, d, c, "static") in get:
            base = get[(m, d, c, "static")]["tokens_per_s"]
            fig, ax = plt.subplots(figsize=(8, 3.5))
            vals = [get[(m, d, c, s)]["tokens_per_s"] / base for s in order]
            ax.bar(range(len(order)), vals, color="tab:blue")
            for x, v in enumerate(vals):
                ax.text(x, v, f"{v:.2f}x", ha="center", va="bottom", fontsize=8)
            ax.set_xticks(range(len(order)), [LABELS[s] for s in order], rotation=20, fontsize=7)
            ax.set_ylabel("speedup vs static")
            ax.set_title(f"Ablation: {m}, {d}, {_fmt_ctx(c)} (paper: 1.59 / 2.01 / 3.69x)")
            fig.tight_layout()
            fig.savefig(out / "ablation.png", dpi=90)
            plt.close(fig)
            files.append("ablation.png")
    for res in (gantt_results or {}).values():
        if res.pipeline_stages == 1:  # per-rank bars; pipelines have fig5.png's stage view
            files.append(gantt(res, out, gantt_ranks, plt))
    return files


def gantt(res: StepResult, out: Path, n_ranks: int, plt) -> str:
    """Per-rank timeline of one step: compute, exposed ring, waiting, gradient sync."""
    pool = len(res.busy)
    ranks = list(range(min(n_ranks, pool)))
    shown = set(ranks)
    fig, ax = plt.subplots(figsize=(10, max(3, 0.12 * len(ranks) + 1.5)))
    bars = {r: {"local": [], "ring": [], "comm": []} for r in ranks}
    for seg, starts, off in zip(res.segments, res.starts, res.offsets):
        for mb, st, dur, comp in zip(seg.plan.micro_batches, starts, seg.durations, seg.compute):
            for r in mb.ring:
                if r in shown:
                    kind = "local" if mb.is_local else "ring"
                    bars[r][kind].append((off + st, comp))
                    if dur > comp:
                        bars[r]["comm"].append((off + st + comp, dur - comp))
    colors = {"local": "tab:green", "ring": "tab:blue", "comm": "tab:red"}
    end = res.step_time - res.grad_sync
    for r in ranks:
        for kind, spans in bars[r].items():
            if spans:
                ax.broken_barh(spans, (r - 0.4, 0.8), facecolors=colors[kind], edgecolor="none")
        ax.broken_barh([(end, res.grad_sync)], (r - 0.4, 0.8), facecolors="tab:purple")
    for kind, c in (*colors.items(), ("grad sync", "tab:purple")):
        ax.plot([], [], color=c, lw=6, label={"comm": "exposed ring comm"}.get(kind, kind))
    ax.legend(fontsize=7, loc="lower right")
    ax.set_xlabel("seconds")
    ax.set_ylabel("HDP rank")
    ax.invert_yaxis()
    ax.set_title(
        f"{LABELS[res.system]}: step {res.step_time:.1f} s, ranks 0-{ranks[-1]} of {pool} "
        "(white = waiting)",
        fontsize=9,
    )
    fig.tight_layout()
    name = f"gantt_{res.system}.png"
    fig.savefig(out / name, dpi=90)
    plt.close(fig)
    return name


def scale_check(args, cluster) -> dict:
    """One step of llama-7b, 1M context, Byted-like, on `args.scale_gpus` GPUs, timed."""
    model = MODELS["llama-7b"]
    pool = model.pool_size(args.scale_gpus)
    cm = CostModel(model.shape, cluster.rank_profile(model.tp))
    t0 = time.perf_counter()
    lens = batch("byted_like", args.seed, 1, 1024 * K, 0, args.tokens)
    gen = time.perf_counter() - t0
    out = {"gpus": args.scale_gpus, "pool_size": pool, "context": 1024 * K, "batch_seconds": gen}
    for system in args.systems:
        t0 = time.perf_counter()
        r = simulate_step(
            system,
            lens,
            pool_size=pool,
            capacity=PAPER_CAPACITY,
            context=1024 * K,
            cost_model=cm,
            params=model.total_params,
            megatron=args.megatron,
            megatron_max_ranks=args.megatron_max_ranks,
        )
        out[system] = {
            "wall_seconds": time.perf_counter() - t0,
            "step_time": r.step_time,
            "tokens_per_s": r.tokens_per_s,
            "implementation": r.implementation,
        }
    return out


def fig5_case(args, cluster, out: Path) -> dict | None:
    """ByteScale's Fig. 5 on the 1F1B simulator (`sim.pipelines`), with its Gantt chart."""
    if not args.fig5_model:
        return None
    model = MODELS[args.fig5_model]
    cm = CostModel(model.shape, cluster.rank_profile(model.tp))
    plan, ex, constructed = pipelines_mod.constructed_case(cm)
    result = {
        "model": model.name,
        "constructed": constructed,
        "random": pipelines_mod.random_case(cm),
    }
    if not args.no_charts:
        pipelines_mod.gantt(
            plan,
            ex,
            cm,
            out / "fig5.png",
            f"Fig. 5 on the 1F1B simulator ({model.name}, 4 stages, 8 micro-batches each): "
            f"DP bubble {100 * constructed['dp_bubble_share']:.1f}% of the step (grey)",
        )
    _say(f"fig5: DP bubble {100 * constructed['dp_bubble_share']:.1f}%")
    return result


def main(argv=None) -> int:
    """Run the simulation grid and write the outputs."""
    args = build_parser().parse_args(argv)
    args.tokens = _tokens(args.tokens)
    args.systems = [s for s in args.systems.split(",") if s]
    for s in args.systems:
        if s not in SYSTEMS:
            _say(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}", error=True)
            return 2
    known = {**MODELS, **MLA_MODELS}  # MLA variants by name only
    unknown = [m for m in args.models.split(",") if m and m not in known]
    if unknown:
        _say(f"unknown model(s) {unknown}; choose from {', '.join(known)}", error=True)
        return 2
    models = [known[m] for m in args.models.split(",") if m]
    try:
        models = [with_window(m, args.window_size, args.window_attn_skip_freq) for m in models]
    except ValueError as err:
        _say(str(err), error=True)
        return 2
    datasets = [d for d in args.datasets.split(",") if d]
    contexts = [_tokens(c) for c in args.contexts.split(",") if c]
    cluster = CLUSTERS[args.cluster]
    if args.ib_scale != 1.0:
        cluster = cluster.scaled(ib_bandwidth=cluster.ib_bandwidth * args.ib_scale)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gantt_cell = None
    if args.gantt:
        gm, gd, gc = args.gantt.split(",")
        gantt_cell = (gm, gd, _tokens(gc))
    t_start = time.perf_counter()
    rows, gantt_results = [], None
    for model in models:
        cap = (
            memory_capacity(model, pool=model.pool_size(args.gpus or None))
            if args.capacity == "memory"
            else _tokens(args.capacity)
        )
        for di, ds in enumerate(GENERATORS):
            if ds not in datasets:
                continue
            for ctx in contexts:
                t0 = time.perf_counter()
                keep = gantt_cell == (model.name, ds, ctx)
                cell_rows, kept = run_cell(model, cluster, ds, di, ctx, args, cap, args.gpus, keep)
                rows += cell_rows
                if kept:
                    gantt_results = {
                        s: kept[s][0]
                        for s in ("static", "hdp_balance", "hdp_offload_balance")
                        if s in kept
                    }
                _say(
                    f"{model.name:14s} {ds:12s} {_fmt_ctx(ctx):5s} "
                    + " ".join(f"{r['system']}={r['tokens_per_s'] / 1e3:.0f}K" for r in cell_rows)
                    + f"  [{time.perf_counter() - t0:.1f}s]"
                )
    scale = scale_check(args, cluster) if args.scale_gpus else None
    fig5 = fig5_case(args, cluster, out)
    if scale:
        _say("scale check:", json.dumps(scale))
    total = time.perf_counter() - t_start
    result = {
        "config": {
            k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, list, bool))
        },
        "cluster": vars(cluster),
        "models": {
            m.name: {
                "active_params": m.active_params,
                "total_params": m.total_params,
                "tp": m.tp,
                "pp": m.pp,
                "gpus": args.gpus or m.gpus,
                "pool_size": m.pool_size(args.gpus or None),
                "layers_per_stage": m.layers_per_stage,
                "pipeline": "1F1B timeline per stage" if m.pp > 1 else "none",
                "memory_capacity_estimate": memory_capacity(m),
            }
            for m in models
        },
        "runs": rows,
        "scale_check": scale,
        "fig5": fig5,
        "wall_seconds": total,
    }
    (out / "sim.json").write_text(json.dumps(result, indent=1))
    md = markdown(rows, args.systems)
    if scale:
        md += (
            f"\nScale check: llama-7b, 1M context, {scale['gpus']} GPUs ({scale['pool_size']} "
            "HDP ranks), one step; wall seconds to plan and simulate: "
            + ", ".join(f"{s} {scale[s]['wall_seconds']:.2f}" for s in args.systems)
            + "\n"
        )
    if fig5:
        c, r = fig5["constructed"], fig5["random"]
        md += (
            f"\nFig. 5 ({fig5['model']}, static assignment, {c['stages']} stages, "
            f"{c['micro_batches']} micro-batches per pipeline, two pipelines): DP bubble "
            f"{100 * c['dp_bubble_share']:.1f}% of the step (constructed: "
            f"{c['tokens'] // K}K-token micro-batches, {c['short'] // K}K documents "
            "against whole ones; paper > 30%), "
            f"GitHub-like random packing over {r['seeds']} seeds median "
            f"{100 * r['dp_bubble_share_median']:.1f}%, "
            f"p90 {100 * r['dp_bubble_share_p90']:.1f}%.\n"
        )
    pp_rows = [r for r in rows if r.get("pipeline_schedule") not in (None, "-")]
    flushed = sorted(
        {(r["model"], r["system"]) for r in pp_rows if "flush" in r["pipeline_schedule"]}
    )
    if pp_rows:
        md += (
            "\nPP models run every plan through the 1F1B simulator; DP plans that are not "
            "lock-step and deadlock 1F1B ran with a flush around every ring in: "
            + (", ".join(f"{m} {s}" for m, s in flushed) or "none")
            + ".\n"
        )
    md += f"\nTotal run time: {total:.0f} s.\n"
    (out / "sim.md").write_text(md)
    if not args.no_charts:
        files = charts(rows, args.systems, out, gantt_results, args.gantt_ranks, gantt_cell)
        _say("charts:", ", ".join(files))
    doc = claims_doc_path(out, args.claims_doc)
    write_claims(result, out, doc)
    _say(
        f"wrote {out / 'sim.json'}, {out / 'sim.md'}, {out / 'claims.json'}",
        f"and {doc}" if doc else "",
    )
    _say(f"total {total:.0f} s")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main())
