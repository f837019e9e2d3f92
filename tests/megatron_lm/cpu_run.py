"""Test-only: run Megatron-LM's training loop on a CPU (gloo), with no edit to its files.

Stock Megatron-LM (core_v0.16.1 and core_v0.19.0) assumes CUDA in seven places beyond the
ones Megatron-Core's own layers hit (`megatron_hdp.megatron.cpu_shim`, P1-P7; core_v0.19.0
has no S4). `megatron_lm_cpu_shims()` patches them process-locally for the duration of the
block
(`../shared/design/megatron-lm-dropin-trial-2026-11-24.md`, part 1):

- S1: `initialize_megatron` asserts CUDA unless `allow_no_cuda`, which `pretrain()` cannot
  pass: it is passed here;
- S2: `_initialize_distributed` builds Megatron's parallel groups only if
  `torch.cuda.device_count() > 0`: during that call alone the count is 1 and `set_device`
  does nothing (elsewhere a count > 0 would turn on CUDA RNG seeding);
- S3: `compile_helpers()` runs `make` in the wheel's folder (the wheel ships the helpers
  prebuilt): skipped;
- S4: `megatron.legacy.fused_kernels.load` runs nvcc: skipped;
- S5: `torch.cuda.get_rng_state` / `set_rng_state` (read by every checkpoint save) become
  placeholders;
- S6: `get_device_arch_version()` (asked with TP or CP > 1) answers 9;
- S7: Megatron-Core's activation checkpointing (`--recompute-*`) saves and restores the CUDA
  RNG state (`tensor_parallel.random._get_cuda_rng_state` / `_set_cuda_rng_state`): a
  placeholder and a no-op (nothing on CPU draws from it).

Needs `megatron.training` importable (a Megatron-LM tree first on `sys.path`). Run a
script with `python tests/megatron_lm/cpu_run.py SCRIPT ARGS` (or `-m MODULE ARGS`).
"""

from __future__ import annotations

import contextlib
import runpy
import sys

import torch


@contextlib.contextmanager
def megatron_lm_cpu_shims():
    """P1-P7 (`cpu_shims`) plus S1-S7 for the duration of the block."""
    import importlib

    from megatron.core.datasets import utils as dataset_utils
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.training import arguments, initialize, training

    from megatron_hdp.megatron.cpu_shim import cpu_shims

    try:  # core_v0.16.1; core_v0.19.0 has no megatron.legacy (and loads no fused kernels)
        fused_kernels = importlib.import_module("megatron.legacy.fused_kernels")
    except ImportError:
        fused_kernels = None
    stock_init, stock_dist = initialize.initialize_megatron, initialize._initialize_distributed

    def initialize_megatron(*args, **kwargs):
        return stock_init(*args, **dict(kwargs, allow_no_cuda=True))

    def initialize_distributed(*args, **kwargs):
        count, set_device = torch.cuda.device_count, torch.cuda.set_device
        torch.cuda.device_count, torch.cuda.set_device = (lambda: 1), (lambda device: None)
        try:
            return stock_dist(*args, **kwargs)
        finally:
            torch.cuda.device_count, torch.cuda.set_device = count, set_device

    patches = [
        (training, "initialize_megatron", initialize_megatron),
        (initialize, "initialize_megatron", initialize_megatron),
        (initialize, "_initialize_distributed", initialize_distributed),
        (dataset_utils, "compile_helpers", lambda: None),
        (fused_kernels, "load", lambda args: None),
        (torch.cuda, "get_rng_state", lambda device="cuda": torch.zeros(1, dtype=torch.uint8)),
        (torch.cuda, "set_rng_state", lambda new_state, device="cuda": None),
        (arguments, "get_device_arch_version", lambda: 9),
        (tp_random, "_get_cuda_rng_state", lambda *a, **k: torch.zeros(1, dtype=torch.uint8)),
        (tp_random, "_set_cuda_rng_state", lambda *a, **k: None),
    ]
    # Patch what this tree has (core_v0.19.0 lacks some of these names).
    patches = [p for p in patches if p[0] is not None and hasattr(p[0], p[1])]
    saved = {(module, name): getattr(module, name) for module, name, _ in patches}
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        with cpu_shims():
            yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


def main() -> None:
    """`cpu_run.py SCRIPT ARGS` or `cpu_run.py -m MODULE ARGS`, under the shims."""
    import os

    args = sys.argv[1:]
    if args[0] == "-m":
        module, argv = args[1], args[2:]
        script_dir = os.path.dirname(os.path.abspath(argv[0]))
    else:
        module, argv = None, args
        script_dir = os.path.dirname(os.path.abspath(argv[0]))
    sys.path.insert(0, script_dir)
    torch.set_num_threads(1)
    with megatron_lm_cpu_shims():
        if module is None:
            sys.argv = argv
            runpy.run_path(argv[0], run_name="__main__")
        else:
            sys.argv = [module, *argv]
            runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
