"""Verify the GPU path on one GPU with torch alone, and write the figures as JSON.

    python scripts/gpu/verify.py                 # on a CUDA machine: every section
    python scripts/gpu/verify.py --quick         # smaller sizes, fewer repeats
    python scripts/gpu/verify.py --cpu           # the small CPU run CI keeps alive

Needs torch and this checkout only (it puts the checkout on `sys.path`): no megatron-core
(the train section uses it where installed), hypothesis or Ray; the C++ planner is not
used. Sections (`--sections`):
  env      the device, torch, CUDA, which kernels run and why the others do not
  kernels  every available kernel against float64 (bf16, fp16): GQA over packed documents,
           zigzag half blocks, one query row per document, many tiny documents
  ring     ring attention with 2..8 virtual ranks in one process against one call
  speed    a ring member's step calls and the pack path against one direct call
  offload  activation offloading on a torch layer stack: loss and gradients bitwise at ratios
           0/0.5/1, D2H/H2D GB/s, copy time hidden under compute, peak memory vs Eq. 3,
           pinned bytes
  train    with megatron-core (else skipped): a ~1B bf16 GPT trained by HDP at 16K-64K tokens
           per micro-batch (tokens/s, MFU), and HDP core attention against Megatron's own
           attention module on the same weights and sequences
Writes `results/gpu/verify-<device>.json` (or `--out`): config, versions, GPU name, git
revision, figures. Exit status 1 if a correctness check failed (the JSON is written first),
2 for bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: Each section but "env" is a module here with `run(mode, say, kernel) -> dict` ("ok": False
#: marks a failed correctness check); `kernel` is the one "auto" picks on this device.
SECTION_MODULES = {
    "kernels": "kernel_checks",
    "ring": "ring_checks",
    "speed": "speed_checks",
    "offload": "offload_checks",
    "train": "train_checks",
}
SECTIONS = ("env", *SECTION_MODULES)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verify.py",
        description="Verify megatron_hdp's GPU path on one GPU (torch only); JSON to results/gpu/.",
    )
    parser.add_argument("--cpu", action="store_true", help="small sizes on the CPU kernels (CI)")
    parser.add_argument("--quick", action="store_true", help="smaller GPU sizes, fewer repeats")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON file (default results/gpu/verify-<device>.json)",
    )
    return parser


def _sections(parser, text: str) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or not chosen:
        parser.error(f"--sections: unknown {unknown or text!r}; choose from {', '.join(SECTIONS)}")
    return chosen


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
    """Run the chosen sections; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    sections = _sections(parser, args.sections)
    sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]
    import torch

    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU machine, or give --cpu for the CPU run")
    import common

    mode = common.cpu_mode() if args.cpu else common.gpu_mode(args.quick)

    def say(line: str) -> None:
        print(line, flush=True)

    report = {
        "tool": "scripts/gpu/verify.py",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": "cpu" if args.cpu else ("gpu-quick" if args.quick else "gpu"),
        "config": {
            "heads": mode.heads,
            "kv_heads": mode.groups,
            "head_dim": mode.head_dim,
            "dtypes": [str(d).removeprefix("torch.") for d in mode.dtypes],
            "speed_tokens": list(mode.speed_tokens),
            "repeats": mode.repeats,
        },
        "environment": environment(mode),
        "sections": {},
    }
    say(f"verify.py on {report['environment']['device']}, torch {torch.__version__}")
    first_kernel = _first_kernel(mode)
    for name in sections:
        started = time.perf_counter()
        if name == "env":
            for kernel, verdict in report["environment"]["kernels_bf16"].items():
                say(f"env      {kernel:16s} {verdict}")
            continue
        if first_kernel is None:
            report["sections"][name] = {"ok": False, "error": "no attention kernel runs here"}
            say(f"{name:8s} no attention kernel runs here (see env)")
            continue
        module = importlib.import_module(SECTION_MODULES[name])
        result = module.run(mode, say, first_kernel)
        result["seconds"] = time.perf_counter() - started
        report["sections"][name] = result
    failed = [n for n, r in report["sections"].items() if r.get("ok") is False]
    report["ok"] = not failed
    out = args.out or REPO / "results" / "gpu" / f"verify-{_slug(report['environment'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(out)
    say(f"wrote {out}" + (f"; FAILED: {', '.join(failed)}" if failed else "; every check passed"))
    return 1 if failed else 0


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


def _slug(env: dict) -> str:
    return re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-") or "device"


if __name__ == "__main__":
    sys.exit(main())
