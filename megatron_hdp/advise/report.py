"""The advisor's report: JSON, a markdown table and a plain-language verdict (pure).

Speedups are tokens/s over the static DP x CP mesh's on the same batches. The verdict
names the HDP system to use (`recommended`: among those the job can run, `runnable`, the
default balanced placement unless another is at least `LITTLE` faster), compares it with
the static mesh and with Megatron's power-of-two dynamic CP, says what offloading adds,
and warns where a system's activations do not fit the GPU's memory. Thresholds: a gain of at least
`PAYS` (10%) "pays", at least `LITTLE` (2%) "pays a little", less "does not pay".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from megatron_hdp.sim.simulate import LABELS

PAYS = 1.10
LITTLE = 1.02
GB = 1e9

#: The job flags that run each HDP system (the static mesh: --no-hdp).
FLAGS = {
    "static": "--no-hdp",
    "hdp_greedy": "--hdp-placement greedy",
    "hdp_balance": "--hdp-placement balanced (the default)",
    "hdp_offload_balance": "--hdp-offload",
}


def runnable(system: str, pipeline_stages: int) -> bool:
    """True when `pretrain_hdp.py` can run `system` (the others are simulator compositions).

    `hdp_offload` (greedy placement with offloading) has no job flag; with PP the job runs
    only the static mesh and PP-Balance (`megatron.validation`).
    """
    if system == "static" or system == "hdp_balance":
        return True
    if system in ("hdp_greedy", "hdp_offload_balance"):
        return pipeline_stages == 1
    return False


#: HDP systems by preference: the default first; another is recommended only when it is
#: at least `LITTLE` faster than the one preferred so far.
PREFERENCE = ("hdp_balance", "hdp_offload_balance", "hdp_greedy", "hdp_offload")


def recommended(rows: Sequence[dict]) -> dict:
    """The HDP row to recommend among `rows` (`PREFERENCE`, then `LITTLE` gains)."""
    ordered = sorted(rows, key=lambda r: PREFERENCE.index(r["system"]))
    best = ordered[0]
    for r in ordered[1:]:
        if r["tokens_per_s"] >= LITTLE * best["tokens_per_s"]:
            best = r
    return best


def with_speedups(rows: Sequence[dict]) -> list[dict]:
    """Rows with `speedup` (tokens/s over the static mesh's; None without a static row)."""
    base = next((r["tokens_per_s"] for r in rows if r["system"] == "static"), None)
    return [{**r, "speedup": r["tokens_per_s"] / base if base else None} for r in rows]


def _num(seconds: float) -> str:
    """Seconds: two decimals, three significant figures below 0.1."""
    return f"{seconds:.2f}" if abs(seconds) >= 0.1 else f"{seconds:.3g}"


def _s(seconds: float) -> str:
    return f"{_num(seconds)} s"


def _pct(x: float) -> str:
    return f"{100 * (x - 1):+.0f}%"


def verdict(rows: Sequence[dict], job: Mapping) -> str:
    """A few plain sentences: does HDP pay on this job, with which flags, and why."""
    by = {r["system"]: r for r in rows}
    pp = job["pp"]
    hdp = [r for r in rows if r["system"].startswith("hdp") and runnable(r["system"], pp)]
    out = []
    static = by.get("static")
    if not hdp or static is None:
        return "Simulate the static mesh and at least one HDP system for a verdict."
    best = recommended(hdp)
    gain = best["tokens_per_s"] / static["tokens_per_s"]
    name = LABELS[best["system"]]
    cp = job["static_cp"]
    if gain >= PAYS:
        out.append(
            f"HDP pays on this job: {name} is predicted at {gain:.2f}x the static DP x CP "
            f"mesh's tokens/s (CP {cp})."
        )
    elif gain >= LITTLE:
        out.append(
            f"HDP pays a little on this job: {name} is predicted at {gain:.2f}x the static "
            f"mesh's tokens/s (CP {cp})."
        )
    else:
        out.append(
            f"HDP does not pay on this job: its best, {name}, is predicted at {gain:.2f}x the "
            f"static mesh's tokens/s (CP {cp}); stay with the static mesh."
        )
    dcp = by.get("megatron_dcp")
    if dcp is not None:
        out.append(
            f"Against Megatron's power-of-two dynamic CP it is "
            f"{best['tokens_per_s'] / dcp['tokens_per_s']:.2f}x."
        )
    out.append(
        f"Sequences get {best['ranks_per_seq_token_weighted']:.1f} ranks on average by tokens "
        f"(static mesh: {static['ranks_per_seq_token_weighted']:.1f}); exposed communication "
        f"per step is {_s(best['exposed_comm'])} (static mesh: {_s(static['exposed_comm'])}) and "
        f"a rank waits {_s(best['wait_mean'])} for the others (static mesh: "
        f"{_s(static['wait_mean'])})."
    )
    if gain >= LITTLE and best["system"] in FLAGS:
        out.append(f"Run it with {FLAGS[best['system']]}.")
    off, bal = by.get("hdp_offload_balance"), by.get("hdp_balance")
    if off is not None and bal is not None and pp == 1:
        ratio = off["tokens_per_s"] / bal["tokens_per_s"]
        if ratio >= LITTLE:
            out.append(f"Offloading adds {_pct(ratio)} (--hdp-offload).")
        else:
            out.append("Offloading adds nothing here (its rings are not the bottleneck).")
    tight = [LABELS[r["system"]] for r in rows if r["memory_headroom_bytes"] < 0]
    if tight:
        which = "every system" if len(tight) == len(rows) else ", ".join(tight)
        out.append(
            f"Out of memory by the estimate: {which} at a capacity of {job['capacity']:,} "
            "tokens per rank; lower --hdp-capacity, or see --capacity memory."
        )
    out.append("All figures are the cost model's predictions, not measurements.")
    return " ".join(out)


def build_report(
    *, job: dict, profile: dict, data: dict, rows: Sequence[dict], extra: Mapping | None = None
) -> dict:
    """The JSON report (every number the markdown shows, and more)."""
    rows = with_speedups(rows)
    for r in rows:
        r["label"] = LABELS[r["system"]]
        r["runnable_by_job"] = runnable(r["system"], job["pp"])
        r["yours"] = r["system"] == job["your_system"]
    return {
        "job": job,
        "profile": profile,
        "data": data,
        "systems": rows,
        "verdict": verdict(rows, job),
        **(extra or {}),
    }


def _fmt_tokens(n: float) -> str:
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    return f"{n / 1e3:.1f}K" if n >= 1e3 else f"{n:.0f}"


def markdown(report: Mapping) -> str:
    """The report as markdown: job, table, verdict, notes."""
    job, data, prof = report["job"], report["data"], report["profile"]
    lines = [
        "# Will HDP pay on this job?",
        "",
        f"**Verdict.** {report['verdict']}",
        "",
        f"Cluster: {job['gpus']:,} x {prof['name']} GPUs; model {job['num_layers']} layers, "
        f"hidden {job['hidden_size']}, {job['total_params'] / 1e9:.2f}B parameters "
        f"({job['active_params'] / 1e9:.2f}B active per token); TP {job['tp']} x PP {job['pp']}"
        f" = {job['gpus_per_replica']} GPUs per replica, a pool of {job['pool_size']:,} HDP "
        f"ranks; capacity {job['capacity']:,} tokens per rank ({job['capacity_source']}); "
        f"context {job['context']:,} tokens, static mesh CP {job['static_cp']}.",
        "",
        f"Data: {data['source']}; {data['steps']} global batches of "
        f"{_fmt_tokens(data['tokens_mean'])} tokens on average, "
        f"{data['sequences_mean']:,.0f} sequences, the longest {data['longest']:,} tokens.",
        "",
        "| system | step (s) | tokens/s | speedup | ranks/seq (mean, by tokens, max) "
        "| exposed comm (s): ring + grad sync | memory headroom (GB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["systems"]:
        mark = " (your flags)" if r["yours"] else ""
        mark += "" if r["runnable_by_job"] or r["system"] == "megatron_dcp" else " [sim only]"
        sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        lines.append(
            f"| {r['label']}{mark} | {_num(r['step_time'])} | {_fmt_tokens(r['tokens_per_s'])} | "
            f"{sp} | {r['ranks_per_seq_mean']:.2f}, {r['ranks_per_seq_token_weighted']:.2f}, "
            f"{r['ranks_per_seq_max']:.0f} | {_num(r['exposed_ring_mean'])} + "
            f"{_num(r['grad_sync'])} | {r['memory_headroom_bytes'] / GB:.1f} |"
        )
    lines += [
        "",
        "Step times, tokens/s and exposed ring time are means over the global batches; "
        "ranks/seq max and memory headroom are the worst batch's (headroom on the fullest "
        "GPU; negative: out of memory by the estimate). [sim only]: a simulator "
        "composition `pretrain_hdp.py` has no flags for"
        + (" with pipeline parallelism." if job["pp"] > 1 else "."),
    ]
    dcp = next((r for r in report["systems"] if r["system"] == "megatron_dcp"), None)
    if dcp is not None:
        lines += ["", f"Megatron dynamic CP was planned by: {dcp['implementation']}."]
    if job.get("num_experts"):
        lines += [
            "",
            "MoE: compute is priced on the active parameters (the router and the top-k "
            "experts each token runs); the token dispatch between expert-parallel ranks is "
            "not priced, the gradient sync moves every expert's weights.",
        ]
    if job.get("ignored_flags"):
        lines += [
            "",
            "Set aside (they change nothing in a prediction): "
            + ", ".join(job["ignored_flags"])
            + ".",
        ]
    pictures = report.get("pictures") or []
    if pictures:
        lines += ["", "## One step (the first global batch)", ""]
        lines += [f"![{p}]({p})" for p in pictures]
    elif report.get("pictures_note"):
        lines += ["", report["pictures_note"]]
    return "\n".join(lines) + "\n"
