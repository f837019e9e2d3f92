"""Verify the GPU path on one GPU, and write the figures as JSON.

    python scripts/gpu/verify.py                 # on a CUDA machine: every section
    python scripts/gpu/verify.py --quick         # smaller sizes, fewer repeats
    python scripts/gpu/verify.py --cpu           # the small CPU run CI keeps alive
    python scripts/gpu/verify.py --quick --out "$OUT/verify.json" 2>&1 | tee "$OUT/verify.log"

Sections (`--sections`) and what each needs besides this checkout (which the script puts
on `sys.path`; the C++ planner, hypothesis and Ray are never used):
  env      torch. The device, torch, CUDA, which kernels run and why the others do not
  kernels  torch. Every available kernel against float64 (bf16, fp16): GQA over packed
           documents, zigzag half blocks, one query row per document, many tiny documents
  ring     torch. Ring attention with 2..8 virtual ranks in one process against one call
  variants torch (numpy for its window case, else skipped). Sliding window, attention
           sink and MLA's 192/128 head dims (padded) on the kernel "auto" resolves for each,
           as a pack and a ring of virtual ranks, against float64 on the CPU
  speed    torch. A ring member's step calls and the pack path against one direct call
  offload  torch; numpy for its memory figure only (without numpy that figure is
           reported as skipped). Activation offloading on a torch layer stack: loss and
           gradients bitwise at ratios 0/0.5/1, D2H/H2D GB/s, copy time hidden under
           compute, peak memory vs Eq. 3, pinned bytes
  train    torch, numpy and megatron-core (without them: reported as skipped). HDP
           attention in Megatron's GPT against Megatron's own attention on the same
           weights over 20 steps on one batch (the check), and a ~1B bf16 GPT trained by
           HDP at 16K-64K tokens per micro-batch (tokens/s, MFU); an MoE router
           recomputed in the backward on autograd's device thread (`moe_checks.py`)

How a run goes:
- Each section runs in a process of its own (`isolation.py`) with a time limit (three
  times its estimate, at least 60 s; 600 s on CPU; `--section-limit-s` sets one for all):
  one that raises, dies or hangs is recorded with its error and the tail of its output,
  and the next section runs.
- Before anything heavy runs, the plan (`plan.py`) is printed: each section's sizes, its
  estimated seconds (FLOP and byte counts at an H100's rates, assumed) and peak memory.
  What does not fit the GPU's free memory is skipped, never tried; `--budget-s` (default
  300 s, 150 s with --quick; none on CPU) drops the lowest-priority parts to fit.
- The JSON (`--out`, default `results/gpu/verify-<device>.json`) is rewritten atomically
  after every section: config, versions, GPU name, git revision, the plan, and per section
  its status, figures, estimated and actual seconds. Every section prints a one-line summary
  as it ends ("section  kernels ok ...").

Exit status: 0 every check passed; 1 a correctness check failed (every section ran);
2 bad arguments (or no CUDA without --cpu); 3 a section crashed or timed out (its
figures are missing; takes precedence over 1). The JSON is written in each case but 2.

`HDP_VERIFY_FAULT=SECTION:KIND[,...]` (KIND: raise, hang, abort) makes a section fail that
way as it starts: a test hook for the isolation, read by this script only.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
#: Each section but "env" is a module here with `run(mode, say, kernel) -> dict` ("ok": False
#: marks a failed correctness check); `kernel` is the one "auto" picks on this device.
SECTION_MODULES = {
    "kernels": "kernel_checks",
    "ring": "ring_checks",
    "variants": "variant_checks",
    "speed": "speed_checks",
    "offload": "offload_checks",
    "train": "train_checks",
}
SECTIONS = ("env", *SECTION_MODULES)
EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_ARGUMENTS, EXIT_INCOMPLETE = 0, 1, 2, 3
#: Default `--budget-s` on a GPU: full run, --quick (the targets for one H100).
BUDGET_S = {"gpu": 300.0, "gpu-quick": 150.0}
#: A section's time limit on CPU, where there is no estimate.
CPU_SECTION_LIMIT_S = 600.0
FAULT_ENV = "HDP_VERIFY_FAULT"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verify.py",
        description="Verify megatron_hdp's GPU path on one GPU; JSON to results/gpu/ or --out.",
        epilog="Exit status: 0 passed, 1 a check failed, 2 bad arguments, "
        "3 a section crashed or timed out.",
    )
    parser.add_argument("--cpu", action="store_true", help="small sizes on the CPU kernels (CI)")
    parser.add_argument("--quick", action="store_true", help="smaller GPU sizes, fewer repeats")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all; env always runs)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help='JSON file (default results/gpu/verify-<device>.json), e.g. "$OUT/verify.json"',
    )
    parser.add_argument(
        "--budget-s",
        type=_positive,
        default=None,
        help="estimated seconds the run may take: lowest-priority parts are dropped to fit "
        "(default 300 on GPU, 150 with --quick; none on CPU)",
    )
    parser.add_argument(
        "--section-limit-s",
        type=_limits,
        default=(None, {}),
        metavar="S|NAME=S[,NAME=S]",
        help="time limit of each section's process: S for all, or per section "
        "(default: 3x its estimate, >= 60 s; 600 s on CPU)",
    )
    parser.add_argument(
        "--_start-method", dest="start_method", choices=("fork", "spawn"), help=argparse.SUPPRESS
    )
    return parser


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _limits(text: str) -> tuple[float | None, dict[str, float]]:
    """`--section-limit-s`: one limit for all sections, or `name=seconds` pairs."""
    if "=" not in text:
        return _positive(text), {}
    limits = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name.strip() not in SECTIONS:
            raise argparse.ArgumentTypeError(f"unknown section {name.strip()!r}")
        limits[name.strip()] = _positive(value)
    return None, limits


def _sections(parser, text: str) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or not chosen:
        parser.error(f"--sections: unknown {unknown or text!r}; choose from {', '.join(SECTIONS)}")
    return chosen


def say(line: str) -> None:
    """A progress line (stdout, flushed: the log may be all that comes back)."""
    print(line, flush=True)


def run_section(name: str, mode, kernel: str | None) -> dict:
    """In a section's own process: the section's result (the fault hook first)."""
    for path in (str(REPO), str(HERE)):
        if path not in sys.path:
            sys.path.insert(0, path)
    _inject_fault(name)
    if name == "env":
        return env_section(mode)
    module = importlib.import_module(SECTION_MODULES[name])
    return module.run(mode, say, kernel)


def _inject_fault(name: str) -> None:
    """Fail as `HDP_VERIFY_FAULT` asks for this section (tests only)."""
    for item in os.environ.get(FAULT_ENV, "").split(","):
        section, _, kind = item.strip().partition(":")
        if section != name:
            continue
        say(f"{name:8s} injected fault: {kind} ({FAULT_ENV})")
        if kind == "raise":
            raise RuntimeError(f"injected fault in {name} ({FAULT_ENV})")
        if kind == "hang":
            while True:
                time.sleep(1)
        if kind == "abort":
            os.abort()


def env_section(mode) -> dict:
    """The environment, the kernel "auto" picks, and the device as the plan sees it."""
    import dataclasses

    import plan

    env = environment(mode)
    for kernel, verdict in env["kernels_bf16"].items():
        say(f"env      {kernel:16s} {verdict}")
    device = plan.describe_device(mode)
    runs = sum(1 for verdict in env["kernels_bf16"].values() if verdict == "runs")
    device = dataclasses.replace(device, kernels_per_dtype=max(1, runs))
    return {
        "environment": env,
        "first_kernel": _first_kernel(mode),
        "device": dataclasses.asdict(device),
    }


def environment(mode) -> dict:
    """Versions, the device, and each kernel's verdict for bf16 at the mode's head dim."""
    import platform

    import torch

    from megatron_hdp.attention.kernels import flash_attn, registry, torch_flash
    from megatron_hdp.attention.kernels.device import DeviceFacts
    from megatron_hdp.provenance import _version, git_revision

    facts = DeviceFacts.of(mode.device)
    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "megatron_core": _version("megatron-core"),
        "flash_attn": _version("flash-attn"),
        "flash_attn_4": _version("flash-attn-4"),
        "platform": platform.platform(),
        "git_revision": git_revision(REPO),
        "device": facts.describe(),
        "compute_capability": list(facts.capability) if facts.capability else None,
        "torch_flash_built": facts.flash_built,
        "aten_flash_schema_problem": torch_flash.schema_problem(),
        "flash_attn_signature_problem": flash_attn.signature_problem(),
        "flash_impl_switch": hasattr(torch.nn.attention, "activate_flash_attention_impl"),
        "kernels_bf16": {
            name: why or "runs"
            for name, why in registry.kernel_reasons(
                facts, dtype=torch.bfloat16, head_dim=mode.head_dim
            ).items()
        },
    }
    if mode.device.type == "cuda":
        props = torch.cuda.get_device_properties(mode.device)
        env["gpu_memory_bytes"] = props.total_memory
        env["driver"] = _driver_version()
    return env


def _driver_version() -> str | None:
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections, each in its own process; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    sections = _sections(parser, args.sections)
    sys.path[:0] = [str(REPO), str(HERE)]
    import torch

    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU machine, or give --cpu for the CPU run")
    import common
    import isolation
    import plan as planning

    mode = common.cpu_mode() if args.cpu else common.gpu_mode(args.quick)
    mode_name = "cpu" if args.cpu else ("gpu-quick" if args.quick else "gpu")
    start_method = args.start_method or ("fork" if args.cpu else "spawn")
    if start_method == "fork":
        _preload()
    budget = args.budget_s if args.budget_s is not None else BUDGET_S.get(mode_name)
    report = {
        "tool": "scripts/gpu/verify.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": mode_name,
        "config": _config(mode),
        "environment": None,
        "plan": None,
        "sections": {},
    }
    out = args.out
    say(f"verify.py ({mode_name}), torch {torch.__version__}, sections in their own processes")

    every, per_section = args.section_limit_s

    def isolated(name, kernel, estimate):
        limit = per_section.get(name) or every
        limit = limit or planning.section_limit(estimate, CPU_SECTION_LIMIT_S)
        return isolation.run_isolated(
            run_section,
            (name, mode, kernel),
            limit_s=limit,
            start_method=start_method,
            echo=say,
        )

    outcome = isolated("env", None, planning.SECTION_START_S + 2.0 if not args.cpu else None)
    report["sections"]["env"] = _entry(outcome, None)
    if outcome.status == "done":
        report["environment"] = report["sections"]["env"].pop("environment")
        first_kernel = outcome.result["first_kernel"]
        device = planning.Device(**outcome.result["device"])
    out = out or REPO / "results" / "gpu" / f"verify-{_slug(report['environment'])}.json"
    _summary("env", report["sections"]["env"])
    if outcome.status != "done":
        for name in sections:
            if name != "env":
                report["sections"][name] = {"ok": None, "status": "not run: env did not finish"}
        return _finish(report, out)
    if args.budget_s is not None and args.cpu:
        say("plan     --budget-s is ignored on CPU (no estimates there)")
    the_plan = planning.make_plan(mode, sections, device, budget_s=None if args.cpu else budget)
    for line in the_plan.lines():
        say(line)
    mode = the_plan.apply(mode)
    report["plan"], report["config"] = the_plan.to_json(), _config(mode)
    report["sections"]["env"]["estimated_s"] = the_plan.section_seconds("env")
    _write(report, out)
    for name in sections:
        if name == "env":
            continue
        estimate = the_plan.section_seconds(name)
        why_not = the_plan.why_not(name)
        if why_not:
            entry = {"ok": None, "status": "skipped", "skipped": why_not, "estimated_s": 0.0}
        elif first_kernel is None:
            entry = {"ok": False, "status": "done", "error": "no attention kernel runs here"}
        else:
            entry = _entry(isolated(name, first_kernel, estimate), estimate)
        report["sections"][name] = entry
        _summary(name, entry)
        _write(report, out)
    return _finish(report, out)


def _preload() -> None:
    """Import the section modules once before forking (each child then starts at once)."""
    for module in SECTION_MODULES.values():
        try:
            importlib.import_module(module)
        except Exception:  # noqa: S110 - the section's own process reports it
            pass


def _config(mode) -> dict:
    return {
        "heads": mode.heads,
        "kv_heads": mode.groups,
        "head_dim": mode.head_dim,
        "dtypes": [str(d).removeprefix("torch.") for d in mode.dtypes],
        "speed_tokens": list(mode.speed_tokens),
        "repeats": mode.repeats,
        "offload_tokens": mode.offload_tokens,
        "train_packed_tokens": list(mode.train_packed),
        "train_compare_lengths": list(mode.train_compare),
    }


def _entry(outcome, estimate: float | None) -> dict:
    """A section's report entry from how its process ended."""
    if outcome.status == "done":
        entry = dict(outcome.result) if outcome.result else {}
        entry.setdefault("ok", None)
        entry.update(status="done", seconds=outcome.seconds, estimated_s=estimate)
        return entry
    return {
        "ok": None,
        "status": outcome.status,
        "error": outcome.error,
        "output_tail": outcome.output_tail,
        "seconds": outcome.seconds,
        "estimated_s": estimate,
    }


def _summary(name: str, entry: dict) -> None:
    """The one line every section prints as it ends."""
    status = entry.get("status")
    if status == "done":
        verdict = {True: "ok", False: "FAILED", None: "done (no pass/fail check)"}[entry.get("ok")]
        if entry.get("skipped"):
            verdict = f"skipped: {entry['skipped']}"
        if entry.get("error"):
            verdict += f": {entry['error']}"
    elif status in ("crashed", "timed_out"):
        verdict = f"{status.upper().replace('_', ' ')}: {entry.get('error')}"
    else:
        verdict = entry.get("skipped") and f"skipped: {entry['skipped']}" or str(status)
    took = f" in {entry['seconds']:.1f} s" if entry.get("seconds") is not None else ""
    est = entry.get("estimated_s")
    est = f" (estimated {est:.0f} s)" if est else ""
    say(f"section  {name:8s} {verdict}{took}{est}")


def _finish(report: dict, out: Path) -> int:
    """Status, exit code and the last write of the JSON."""
    entries = report["sections"]
    failed = [n for n, r in entries.items() if r.get("ok") is False]
    incomplete = [n for n, r in entries.items() if r.get("status") in ("crashed", "timed_out")] + [
        n for n, r in entries.items() if str(r.get("status", "")).startswith("not run")
    ]
    code = EXIT_INCOMPLETE if incomplete else (EXIT_CHECK_FAILED if failed else EXIT_OK)
    report.update(ok=code == EXIT_OK, failed=failed, incomplete=incomplete, exit_status=code)
    _write(report, out)
    verdict = f"FAILED: {', '.join(failed)}" if failed else "no check failed"
    if incomplete:
        verdict += f"; CRASHED, TIMED OUT or NOT RUN: {', '.join(incomplete)}"
    elif not failed:
        verdict = "every check passed"
    say(f"wrote {out}; {verdict}; exit status {code}")
    return code


def _write(report: dict, out: Path) -> None:
    """Rewrite the JSON atomically (a temporary file, then a rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(out)


def _first_kernel(mode) -> str | None:
    """The kernel the job's "auto" picks here for the mode's first dtype (None: none runs)."""
    from megatron_hdp.attention.kernels import registry
    from megatron_hdp.attention.kernels.device import DeviceFacts

    try:
        return registry.resolve_kernel(
            "auto", DeviceFacts.of(mode.device), dtype=mode.dtypes[0], head_dim=mode.head_dim
        )
    except ValueError:
        return None


def _slug(env: dict | None) -> str:
    if env is None:
        return "unknown-device"
    return re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-") or "device"


if __name__ == "__main__":
    sys.exit(main())
