"""Every system on the same global batches, with the figures the report needs (pure).

`simulate_job` calls the simulator's `simulate_step` for each (batch, system) exactly as
`python -m megatron_hdp.sim` does (`sim.__main__.run_cell`): same cost model
(`Cluster.rank_profile(TP)`), same pool, capacity, context, parameters and pipeline
stages. Per system it then adds, from the simulated plans:

- ranks per sequence: the ring size of the micro-batch each sequence is in (mean over
  sequences, token-weighted mean, largest);
- exposed communication: per rank, the seconds its micro-batches spend on ring transfers
  not hidden by attention (cost model, `duration - compute`; per pipeline stage with PP),
  plus the gradient sync;
- memory headroom: the GPU's HBM minus state and the activations of the rank's heaviest
  micro-batches (`job.py`): a ring member holds `ceil(tokens / k)` tokens, offloading
  keeps `(2 + (1 - r)(l - 2)) / l` of them resident (`scheduler.offload_rule`), and with
  PP the first stage holds up to PP micro-batches in flight (1F1B).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_hdp.advise.job import Job, activation_bytes_per_token, state_bytes_per_gpu
from megatron_hdp.scheduler.cost import CostModel
from megatron_hdp.sim.clusters import Cluster
from megatron_hdp.sim.simulate import SYSTEMS, StepResult, simulate_step

#: Figures whose worst step is reported (largest, or smallest headroom); others: the mean.
_WORST = {
    "ranks_per_seq_max": np.max,
    "exposed_ring_max": np.max,
    "peak_activation_tokens": np.max,
    "peak_activation_bytes": np.max,
    "memory_headroom_bytes": np.min,
}


@dataclass
class SystemOutcome:
    """One system over all simulated steps."""

    system: str
    results: list[StepResult]
    figures: list[dict]

    def row(self) -> dict:
        """Step-averaged numbers, tokens/s over all steps (as `sim.__main__.run_cell`)."""
        sums = [r.summary() for r in self.results]
        row = {
            k: float(np.mean([s[k] for s in sums]))
            for k in sums[0]
            if isinstance(sums[0][k], (int, float)) and not isinstance(sums[0][k], bool)
        }
        for key in self.figures[0]:
            values = [f[key] for f in self.figures]
            pick = _WORST.get(key, np.mean)
            row[key] = float(pick(values))
        tokens = sum(r.tokens for r in self.results)
        row["tokens_per_s"] = tokens / sum(r.step_time for r in self.results)
        row["implementation"] = sums[0]["implementation"]
        row["pipeline_schedule"] = "+".join(
            sorted({x for s in sums for x in s["pipeline_schedule"].split("+")})
        )
        row["step_times"] = [r.step_time for r in self.results]
        row["system"] = self.system
        return row


def cost_model(job: Job, cluster: Cluster) -> CostModel:
    """The cost model the simulator prices this job with (one stage's TP group)."""
    return CostModel(job.model.shape, cluster.rank_profile(job.model.tp))


def figures(result: StepResult, job: Job, cluster: Cluster) -> dict:
    """Ranks per sequence, exposed communication and memory of one simulated step."""
    pp = job.model.pp
    pool = len(result.busy)
    n = len(result.segments[0].plan.seqlens)
    seqlens = np.asarray(result.segments[0].plan.seqlens, dtype=np.float64)
    ranks = np.zeros(n)
    exposed = np.zeros(pool)
    per_rank_mbs: list[list[float]] = [[] for _ in range(pool)]
    layers = job.model.shape.num_layers
    for seg in result.segments:
        for mb, dur, comp in zip(seg.plan.micro_batches, seg.durations, seg.compute):
            k = mb.cp_size
            ranks[list(mb.seq_indices)] = k
            tokens = float(seqlens[list(mb.seq_indices)].sum())
            per_member = -(-tokens // k)
            if mb.offload_ratio > 0 and layers > 2:
                per_member *= (2 + (1 - mb.offload_ratio) * (layers - 2)) / layers
            for r in mb.ring:
                exposed[r] += max(0.0, dur - comp) / pp
                per_rank_mbs[r].append(per_member)
    in_flight = [sum(sorted(m, reverse=True)[:pp]) for m in per_rank_mbs]
    peak_tokens = max(in_flight, default=0.0)
    peak_bytes = peak_tokens * activation_bytes_per_token(job)
    headroom = cluster.gpu_memory - state_bytes_per_gpu(job) - peak_bytes
    return {
        "ranks_per_seq_mean": float(ranks.mean()),
        "ranks_per_seq_token_weighted": float((ranks * seqlens).sum() / seqlens.sum()),
        "ranks_per_seq_max": float(ranks.max()),
        "exposed_ring_mean": float(exposed.mean()),
        "exposed_ring_max": float(exposed.max()),
        "exposed_comm": float(exposed.mean()) + result.grad_sync,
        "peak_activation_tokens": float(peak_tokens),
        "peak_activation_bytes": float(peak_bytes),
        "memory_headroom_bytes": float(headroom),
    }


def simulate_job(
    batches: Sequence[Sequence[int]],
    job: Job,
    cluster: Cluster,
    *,
    systems: Sequence[str] = SYSTEMS,
    megatron: str = "auto",
    megatron_max_ranks: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, SystemOutcome]:
    """Simulate `systems` on every batch; `progress(system)` after each simulated step."""
    cm = cost_model(job, cluster)
    kw = {} if megatron_max_ranks is None else {"megatron_max_ranks": megatron_max_ranks}
    out = {s: SystemOutcome(s, [], []) for s in systems}
    for lens in batches:
        for system in systems:
            r = simulate_step(
                system,
                lens,
                pool_size=job.pool_size,
                capacity=job.capacity,
                context=job.context,
                cost_model=cm,
                params=job.model.total_params,
                megatron=megatron,
                pipeline_stages=job.model.pp,
                **kw,
            )
            out[system].results.append(r)
            out[system].figures.append(figures(r, job, cluster))
            if progress is not None:
                progress(system)
    return out
