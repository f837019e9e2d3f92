r"""`python -m megatron_hdp.advise`: will HDP pay on my job? (docs/advise.md; `--help`).

    python -m megatron_hdp.advise --gpus 1024 --profile H100 --out advice \
        <the job's pretrain_hdp.py flags: model, layout, --seq-length, --data-path ...>

The advisor's own flags are below; every other flag goes to `pretrain_hdp.py`'s parser
and validation for a world of `--gpus` ranks. Bad input (an unknown profile, a bad
profile field, a bad lengths file, zero GPUs, a layout that does not divide the GPUs, an
output folder in use) stops with one line naming the value and exit status 2, before any
data is read or step simulated. Writes `advise.json`, `advise.md` and Gantt PNGs of one
step into `--out`, which must be new or empty unless `--overwrite` (then the advisor's
own earlier outputs there, advise.* and gantt_*.png, are replaced; other files are kept).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

from megatron_hdp.advise.budget import work_estimate
from megatron_hdp.advise.job import Job, data_source, parse_job
from megatron_hdp.advise.lengths import (
    batches_from_job_data,
    batches_from_lengths,
    batches_from_mix,
    read_lengths_file,
)
from megatron_hdp.advise.pictures import draw
from megatron_hdp.advise.profiles import PROFILES, resolve_profile
from megatron_hdp.advise.report import build_report, markdown
from megatron_hdp.advise.run import cost_model, simulate_job
from megatron_hdp.sim.distributions import GENERATORS
from megatron_hdp.sim.simulate import MEGATRON_MAX_RANKS, SYSTEMS

LOG = logging.getLogger("megatron_hdp.advise")
PROG = "python -m megatron_hdp.advise"
OUTPUTS = ("advise.json", "advise.md")


class UsageError(ValueError):
    """Bad input: reported in one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    """The advisor's own flags (the job's flags are `pretrain_hdp.py`'s)."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Predict, with the cluster simulator and the planner's cost model, the "
        "step time of the static DP x CP mesh, Megatron's power-of-two dynamic CP and HDP on "
        "your data, model and cluster. Flags not listed here are your job's pretrain_hdp.py "
        "flags (model, layout, --seq-length, --data-path or --hdp-data-spec, batch size).",
        allow_abbrev=False,
    )
    p.print_usage = lambda file=None: None  # errors are one line naming the flag
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the job (the world size)")
    p.add_argument(
        "--profile",
        default="H100",
        help=f"GPU profile: {', '.join(PROFILES)}, or a JSON file (docs/advise.md lists the "
        "fields)",
    )
    p.add_argument(
        "--lengths-file",
        default=None,
        help="sequence lengths, one per line, instead of the job's --data-path",
    )
    p.add_argument(
        "--mix",
        choices=tuple(GENERATORS),
        default=None,
        help="a built-in length mix of the simulator instead of the job's data",
    )
    p.add_argument("--steps", type=int, default=3, help="global batches simulated and averaged")
    p.add_argument(
        "--capacity",
        choices=("job", "memory"),
        default="job",
        help="tokens per rank: the job's (--hdp-capacity, else seq-length / CP) or the "
        "most the GPU's memory holds by the estimate",
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of systems to simulate")
    p.add_argument(
        "--megatron",
        choices=("auto", "core", "reimpl"),
        default="auto",
        help="Megatron dynamic CP: Megatron-Core's own scheduler (auto: for pools up to "
        f"{MEGATRON_MAX_RANKS} replicas, where it takes seconds) or the re-implementation",
    )
    p.add_argument("--out", default="advise", help="output folder (new or empty)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    p.add_argument("--gantt-ranks", type=int, default=64, help="ranks shown in a Gantt chart")
    p.add_argument("--no-charts", action="store_true", help="no PNG pictures")
    return p


def _check_out(out: Path, overwrite: bool) -> None:
    """--out is a new or empty folder (or --overwrite), and this process can write there."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UsageError(f"--out {out}: the folder is not empty; give another --out or --overwrite")
    for name in OUTPUTS:
        if (out / name).is_dir():
            raise UsageError(
                f"--out {out}: {name} there is a folder; the advisor cannot replace it"
            )
        if (out / name).exists() and not os.access(out / name, os.W_OK):
            raise UsageError(
                f"--out {out}: {name} there is not writable; --overwrite cannot replace it"
            )
    _check_writable(out)


def _check_writable(out: Path) -> None:
    """Create --out (and missing parents) and a probe file in it, then remove what was made.

    UsageError naming the folder and the system's reason (a read-only mount, /proc, a file
    on the way) before anything is simulated; nothing is left behind either way.
    """
    made: list[Path] = []
    try:
        missing = [p for p in (out, *out.parents) if not p.exists()]
        for folder in reversed(missing):
            folder.mkdir()
            made.append(folder)
        probe = out / f".advise-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise UsageError(f"--out {out}: cannot write there ({reason})") from None
    finally:
        for folder in reversed(made):
            try:
                folder.rmdir()
            except OSError:
                pass


def _check_own(adv: argparse.Namespace) -> list[str]:
    if adv.gpus < 1:
        raise UsageError(f"--gpus {adv.gpus}: need at least one GPU")
    if adv.steps < 1:
        raise UsageError(f"--steps {adv.steps}: simulate at least one global batch")
    if adv.gantt_ranks < 1:
        raise UsageError(f"--gantt-ranks {adv.gantt_ranks}: show at least one rank")
    systems = [s for s in adv.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            raise UsageError(f"--systems: unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    if not systems:
        raise UsageError("--systems: name at least one system")
    if adv.lengths_file and adv.mix:
        raise UsageError("give --lengths-file or --mix, not both")
    return systems


def prepare(argv: list[str]):
    """Parse and check everything cheap; UsageError (or a parser exit) on bad input."""
    adv, rest = build_parser().parse_known_args(argv)
    systems = _check_own(adv)
    profile = resolve_profile(adv.profile)
    job = parse_job(
        rest,
        gpus=adv.gpus,
        steps=adv.steps,
        capacity=adv.capacity,
        hbm_bytes=profile.hbm_bytes,
        own_data=not (adv.lengths_file or adv.mix),
    )
    cluster = profile.cluster()
    if job.model.tp > cluster.gpus_per_node:
        raise UsageError(
            f"--tensor-model-parallel-size {job.model.tp} exceeds the {cluster.gpus_per_node} "
            f"GPUs of one NVLink node of profile {profile.name} (gpus_per_node)"
        )
    a = job.args
    own_data = a.data_path is not None or a.hdp_data_spec is not None
    if (adv.lengths_file or adv.mix) and own_data:
        given = "--lengths-file" if adv.lengths_file else "--mix"
        raise UsageError(f"give {given} or the job's --data-path/--hdp-data-spec, not both")
    lengths = read_lengths_file(adv.lengths_file) if adv.lengths_file else None
    _check_out(Path(adv.out), adv.overwrite)
    return adv, systems, profile, cluster, job, lengths


def load_batches(adv, job: Job, lengths) -> tuple[list[list[int]], str]:
    """The global batches to simulate and a description of where they come from."""
    a = job.args
    tokens, units = job.tokens_per_batch, job.units_per_batch
    if lengths is not None:
        batches = batches_from_lengths(lengths, a, tokens=tokens, units=units, steps=adv.steps)
        return batches, f"--lengths-file {adv.lengths_file} ({len(lengths):,} lengths)"
    if adv.mix:
        batches = batches_from_mix(
            adv.mix, seed=a.seed, context=job.context, tokens=tokens, steps=adv.steps
        )
        return batches, f"--mix {adv.mix} (seed {a.seed})"
    batches = batches_from_job_data(a, job.gpus, adv.steps)
    what = {
        "data-spec": f"--hdp-data-spec {a.hdp_data_spec}",
        "data-path": f"--data-path {' '.join(a.data_path or [])}",
        "default corpus": "the job's default corpus (no --data-path)",
    }[data_source(a)]
    return batches, what


def data_summary(batches, source: str, capacity: int) -> dict:
    """Length statistics of the simulated batches."""
    allen = np.concatenate([np.asarray(b, dtype=np.int64) for b in batches])
    tokens = [int(np.sum(b)) for b in batches]
    return {
        "source": source,
        "steps": len(batches),
        "tokens_mean": float(np.mean(tokens)),
        "sequences_mean": float(np.mean([len(b) for b in batches])),
        "longest": int(allen.max()),
        "length_p50": float(np.percentile(allen, 50)),
        "length_p90": float(np.percentile(allen, 90)),
        "length_p99": float(np.percentile(allen, 99)),
        "token_share_above_capacity": float(allen[allen > capacity].sum() / allen.sum()),
    }


def _fail(err: ValueError) -> int:
    sys.stderr.write(f"{PROG}: error: {err}\n")
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run the advisor; 2 with one line on stderr for bad input (nothing written then)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        adv, systems, profile, cluster, job, lengths = prepare(argv)
        work = work_estimate(
            job,
            steps=adv.steps,
            systems=systems,
            lengths=lengths,
            lengths_file=adv.lengths_file,
            mix=adv.mix,
        )  # refuses what would not fit in memory
    except ValueError as err:  # UsageError, the job's validation, profiles, lengths, budget
        return _fail(err)
    LOG.info(
        "simulating %d batches x %d systems on %d GPUs (a pool of %d ranks, about %s sequences "
        "per batch%s): by the estimate %s",
        adv.steps,
        len(systems),
        job.gpus,
        job.pool_size,
        f"{work.sequences_per_batch:,.0f}",
        f", {work.pieces:,} pieces of the lengths file" if work.pieces else "",
        work.text(),
    )
    t0 = time.perf_counter()
    try:
        batches, source = load_batches(adv, job, lengths)
    except ValueError as err:  # unreadable data, as pretrain_hdp.py reports it
        return _fail(err)
    from tqdm import tqdm

    with tqdm(
        total=adv.steps * len(systems),
        desc="simulate",
        file=sys.stderr,
        disable=job.args.no_progress_bar,
    ) as bar:

        def step_done(system: str) -> None:
            bar.set_postfix_str(system)
            bar.update()

        outcomes = simulate_job(
            batches,
            job,
            cluster,
            systems=systems,
            megatron=adv.megatron,
            progress=step_done,
        )
    out = Path(adv.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*(out / f for f in OUTPUTS), *out.glob("gantt_*.png")]:  # --overwrite
        old.unlink(missing_ok=True)
    files, note = ([], "No Gantt picture (--no-charts).")
    if not adv.no_charts:
        files, note = draw(outcomes, job, cost_model(job, cluster), out, adv.gantt_ranks)
    report = build_report(
        job=job.summary(),
        profile=profile.as_dict(),
        data=data_summary(batches, source, job.capacity),
        rows=[o.row() for o in outcomes.values()],
        extra={
            "command": [PROG, *argv],
            "pictures": files,
            "pictures_note": note,
            "wall_seconds": time.perf_counter() - t0,
        },
    )
    (out / "advise.json").write_text(json.dumps(report, indent=1))
    (out / "advise.md").write_text(markdown(report))
    LOG.info("%s", report["verdict"])
    LOG.info("wrote %s", ", ".join(str(out / f) for f in (*OUTPUTS, *files)))
    return 0


if __name__ == "__main__":
    from megatron_hdp.launch import quiet_known_warnings

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    quiet_known_warnings()  # Megatron-Core's scheduler is imported for Megatron's dynamic CP
    sys.exit(main())
