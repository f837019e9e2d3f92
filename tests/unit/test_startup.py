"""Start-up: `--help` is fast and light; only Megatron's known warnings are hidden."""

import logging
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from megatron_hdp.launch import KNOWN_MEGATRON_WARNINGS, quiet_known_warnings

REPO = Path(__file__).resolve().parents[2]
NO_APEX = "Apex is not installed. Falling back to Torch Norm"

# Runs `pretrain_hdp.py --help` as a script, then reports what the process imported.
HELP_PROBE = """
import runpy, sys
sys.argv = ["pretrain_hdp.py", "--help"]
try:
    runpy.run_path("pretrain_hdp.py", run_name="__main__")
except SystemExit as done:
    status = done.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron"))
print("STATUS", status, "HEAVY", ",".join(heavy) or "-", file=sys.stderr)
"""


def test_help_takes_under_two_seconds():
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "pretrain_hdp.py", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    elapsed = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    assert "--hdp-capacity" in done.stdout and "--seq-length" in done.stdout
    assert elapsed < 2.0, f"pretrain_hdp.py --help took {elapsed:.2f} s"


def test_help_imports_neither_torch_nor_megatron():
    done = subprocess.run(
        [sys.executable, "-c", HELP_PROBE], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert "usage: pretrain_hdp.py" in done.stdout
    assert done.stderr.strip().splitlines()[-1] == "STATUS 0 HEAVY -", done.stderr


# The messages as Megatron-Core 0.x raises them (megatron/core/...), with the module they come
# from: the filters must hide exactly these.
MEGATRON_MESSAGES = [
    (
        "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
        "megatron.core.optimizer",
    ),
    (
        "Transformer Engine and Apex are not installed. Falling back to local implementations "
        "of multi_tensor_applier, multi_tensor_l2norm, and multi_tensor_scale",
        "megatron.core.optimizer.clip_grads",
    ),
    (
        "Transformer Engine and Apex are not installed. Falling back to local implementations "
        "of multi_tensor_applier and multi_tensor_scale",
        "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision",
    ),
    (NO_APEX, "megatron.core.models.backends"),
    (NO_APEX, "megatron.core.models.gpt.gpt_layer_specs"),
    (
        "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
        "megatron.core.transformer.transformer_config",
    ),
    # Megatron-Core 0.17+ (as 0.19.2 raises them).
    (
        "full scope is deprecated. Use empty cuda_graph_modules to capture the whole layer.",
        "megatron.core.transformer.transformer_config",
    ),
    (
        "MimoModelConfig is experimental and still under active development. "
        "The API may change without notice in future releases.",
        "megatron.core.models.mimo.config.base_configs",
    ),
]

STILL_SHOWN = [
    # Another Megatron warning, even one mentioning Apex.
    ("Apex fused kernel produced a NaN", "megatron.core.fusions", UserWarning),
    ("tensor parallel size changed", "megatron.core.parallel_state", UserWarning),
    # A known message from somewhere else (ours, a user's module) or of another category.
    (NO_APEX, "megatron_hdp.megatron.model", UserWarning),
    (NO_APEX, "__main__", UserWarning),
    (
        "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
        "megatron.core.transformer.transformer_config",
        DeprecationWarning,
    ),
]


def _shown(message: str, module: str, category=UserWarning) -> list[str]:
    """Messages that get through the filters when `module` warns `message` (first time)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # what the filters leave out is all that is hidden
        quiet_known_warnings()
        warnings.warn_explicit(message, category, f"{module.replace('.', '/')}.py", 1, module, {})
    return [str(w.message) for w in caught]


@pytest.mark.parametrize(("message", "module"), MEGATRON_MESSAGES)
def test_known_megatron_warnings_are_hidden(message, module):
    assert _shown(message, module) == []


@pytest.mark.parametrize(("message", "module", "category"), STILL_SHOWN)
def test_other_warnings_are_still_shown(message, module, category):
    assert _shown(message, module, category) == [message]


def test_each_known_pattern_hides_a_real_message():
    """No pattern is dead: each one is there for a message Megatron really raises."""
    for pattern in KNOWN_MEGATRON_WARNINGS:
        assert any(re.match(pattern, message, re.I) for message, _ in MEGATRON_MESSAGES), pattern


def test_nccl_ranks_bind_their_gpu_at_init_and_cpu_ranks_do_not():
    """`device_id` (eager NCCL communicators, ncclCommSplit sub-groups) on CUDA only; the
    keywords are ones torch's `init_process_group` takes."""
    import inspect
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from megatron_hdp.launch import process_group_options

    gpu = process_group_options(torch.device("cuda", 3), timeout_s=90)
    assert gpu == {"timeout": timedelta(seconds=90), "device_id": torch.device("cuda", 3)}
    cpu = process_group_options(torch.device("cpu"), timeout_s=90)
    assert cpu == {"timeout": timedelta(seconds=90)}
    accepted = inspect.signature(dist.init_process_group).parameters
    assert set(gpu) <= set(accepted)


# Log records as Megatron-Core 0.19.2 and torch's cpp_extension write them (logger, format,
# arguments), and records of the same loggers that must still show.
KNOWN_RECORDS = [
    (
        "megatron.core.models.gpt.gpt_model",
        "GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes, no new "
        "features. Please reference the migration guide "
        "`docs/user-guide/hybrid-model-migration.md` for details on how to use `HybridModel`",
        (),
    ),
    (
        "torch.utils.cpp_extension",
        "No CUDA runtime is found, using CUDA_HOME='%s'",
        ("/usr/local/cuda",),
    ),
]
OTHER_RECORDS = [
    ("megatron.core.models.gpt.gpt_model", "GPTModel forward saw %d tokens", (3,)),
    ("torch.utils.cpp_extension", "Error building extension '%s'", ("planner",)),
]


def _logged(records) -> list[str]:
    """The messages of `records` that reach a handler after `quiet_known_warnings`."""
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    quiet_known_warnings()
    quiet_known_warnings()  # twice: no second filter, nothing else changes
    handler = Keep()
    for name, msg, args in records:
        logger = logging.getLogger(name)
        assert len(logger.filters) <= 1, logger.filters
        logger.addHandler(handler)  # a logger's filters apply before its own handlers
        try:
            logger.warning(msg, *args)
        finally:
            logger.removeHandler(handler)
    return seen


def test_known_log_records_are_hidden_and_others_of_those_loggers_shown():
    assert _logged(KNOWN_RECORDS) == []
    assert _logged(OTHER_RECORDS) == [
        "GPTModel forward saw 3 tokens",
        "Error building extension 'planner'",
    ]


def test_each_known_log_record_is_a_real_one():
    from megatron_hdp.megatron.compat import KNOWN_LOG_RECORDS

    for name, start in KNOWN_LOG_RECORDS:
        assert any(n == name and msg.startswith(start) for n, msg, _ in KNOWN_RECORDS), start
