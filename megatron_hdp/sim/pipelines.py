"""ByteScale's Fig. 5 on the 1F1B simulator: a heavier pipeline stalls the gradient sync (pure).

The paper's Fig. 5 (bytescale-paper.md, section 1, claim 6): data parallelism over two
pipelines of `d_pp = 4` stages, 8 micro-batches each, statically assigned; one pipeline
holds heavier micro-batches, so the other waits for it at the gradient sync, and that
"DP bubble" exceeds 30% of the step. The figure is a sketch without numbers, so two
instances are run here, both through `scheduler.pipeline_timeline` with the simulator's
cost model:

- `constructed`: packing equalises tokens, not FLOPs (the paper's Observation 1). Both
  pipelines run micro-batches of `tokens` tokens; the light one's hold `tokens / short`
  documents of `short` tokens each, the heavy one's one document of `tokens` tokens.
- `random`: Fig. 6b's setting: a GitHub-like batch in random order, packed next-fit into
  micro-batches of at most `tokens` tokens, dealt round robin to the two pipelines (static
  assignment in data order), 8 each; repeated over seeds.

The DP bubble share is `(T_slow - T_fast) / T_slow` (the share of the step the faster
pipeline waits); the pipeline bubble share is all idle stage time over all stage time.
"""

from __future__ import annotations

import numpy as np

from megatron_hdp.scheduler.cost import CostModel
from megatron_hdp.scheduler.pipeline_timeline import Execution, simulate_plan, stage_times
from megatron_hdp.scheduler.plan import MicroBatch, StepPlan, plan_from_rank_lists
from megatron_hdp.scheduler.pp_balance import forward_shares, micro_batch_costs
from megatron_hdp.sim.distributions import github_like

K = 1024


def _two_pipelines(packs: list[list[int]], lengths: list[int], tokens: int) -> StepPlan:
    """Packs dealt round robin to pipelines 0 and 1, in order (the static assignment)."""
    mbs = [MicroBatch(order=n, ring=(n % 2,), seq_indices=tuple(p)) for n, p in enumerate(packs)]
    return plan_from_rank_lists(lengths, 2, tokens, "static", mbs)


def _run(plan: StepPlan, cost_model: CostModel, stages: int) -> tuple[Execution, dict]:
    costs = micro_batch_costs(plan, cost_model)
    ex = simulate_plan(plan, stages, costs=costs, forward_share=forward_shares(plan, cost_model))
    slow, fast = float(np.max(ex.finish)), float(np.min(ex.finish))
    per = [
        [float(costs[i]) for i, mb in enumerate(plan.micro_batches) if mb.ring == (r,)]
        for r in (0, 1)
    ]
    return ex, {
        "finish_s": [float(x) for x in ex.finish],
        "dp_bubble_share": (slow - fast) / slow,
        "pipeline_bubble_share": ex.bubble_share,
        "micro_batch_cost_s": [float(np.mean(p)) for p in per],
    }


def constructed_case(
    cost_model: CostModel,
    *,
    stages: int = 4,
    micro_batches: int = 8,
    tokens: int = 32 * K,
    short: int = 4 * K,
) -> tuple[StepPlan, Execution, dict]:
    """The constructed instance: equal tokens, one pipeline of long documents."""
    lengths, packs = [], []
    for n in range(2 * micro_batches):
        if n % 2 == 0:  # pipeline 0: documents of `short` tokens
            packs.append(list(range(len(lengths), len(lengths) + tokens // short)))
            lengths += [short] * (tokens // short)
        else:  # pipeline 1: one document of `tokens` tokens
            packs.append([len(lengths)])
            lengths.append(tokens)
    plan = _two_pipelines(packs, lengths, tokens)
    ex, out = _run(plan, cost_model, stages)
    out.update(stages=stages, micro_batches=micro_batches, tokens=tokens, short=short)
    return plan, ex, out


def random_case(
    cost_model: CostModel,
    *,
    seeds: int = 50,
    stages: int = 4,
    micro_batches: int = 8,
    tokens: int = 32 * K,
) -> dict:
    """The random instance over `seeds` batches: median, p90 and max DP bubble share."""
    shares = []
    for seed in range(seeds):
        rng = np.random.default_rng([5, seed])
        lengths = github_like(rng, 4 * 2 * micro_batches * tokens, tokens)
        rng.shuffle(lengths)
        packs, load = [[]], 0
        for i, s in enumerate(lengths):
            if load + s > tokens:
                packs.append([])
                load = 0
            packs[-1].append(i)
            load += s
        packs = packs[: 2 * micro_batches]
        used = sorted(i for p in packs for i in p)
        index = {old: new for new, old in enumerate(used)}
        sub = [lengths[i] for i in used]
        plan = _two_pipelines([[index[i] for i in p] for p in packs], sub, tokens)
        shares.append(_run(plan, cost_model, stages)[1]["dp_bubble_share"])
    a = np.asarray(shares)
    return {
        "seeds": seeds,
        "stages": stages,
        "micro_batches": micro_batches,
        "tokens": tokens,
        "mix": "github_like",
        "dp_bubble_share_median": float(np.median(a)),
        "dp_bubble_share_p90": float(np.percentile(a, 90)),
        "dp_bubble_share_max": float(a.max()),
    }


def gantt(plan: StepPlan, ex: Execution, cost_model: CostModel, path, title: str) -> None:
    """Per-stage Gantt chart of the two pipelines (forward light, backward dark, grey wait)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = ex.starts.shape[1]
    fwd, bwd = stage_times(
        micro_batch_costs(plan, cost_model), stages, forward_shares(plan, cost_model)
    )
    colors = {0: ("#9ecae1", "#3182bd"), 1: ("#fdae6b", "#e6550d")}
    end = float(np.max(ex.finish))
    fig, ax = plt.subplots(figsize=(10, 3.6))
    for u, mb in enumerate(plan.micro_batches):
        p = mb.ring[0]
        for s in range(stages):
            row = p * (stages + 1) + s
            for k, dur in ((0, fwd[u, s]), (1, bwd[u, s])):
                ax.broken_barh(
                    [(ex.starts[u, s, k], dur)], (row - 0.4, 0.8), facecolors=colors[p][k]
                )
    for p in (0, 1):
        if ex.finish[p] < end:
            for s in range(stages):
                row = p * (stages + 1) + s
                ax.broken_barh(
                    [(ex.finish[p], end - ex.finish[p])], (row - 0.4, 0.8), facecolors="#dddddd"
                )
    ticks = [p * (stages + 1) + s for p in (0, 1) for s in range(stages)]
    ax.set_yticks(ticks, [f"P{p} stage {s}" for p in (0, 1) for s in range(stages)], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
