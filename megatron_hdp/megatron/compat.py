"""Differences between the Megatron-Core releases we support, 0.16.x to 0.19.x (host layer).

Everything in the library that depends on which megatron-core is installed asks this module;
nothing else branches on versions. Each name says which releases differ and how.

Imports only the standard library at module level: the start-up filters below must be set
before anything imports torch or Megatron.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Iterator
from typing import Any

#: Megatron-Core warnings with nothing to act on in an HDP job, as regular expressions
#: matched at the start of the message. Only UserWarnings raised from `megatron.*` modules
#: match; any other warning, Megatron's or ours, is shown as usual. Each fires once or twice
#: per process, at import or model set-up.
KNOWN_MEGATRON_WARNINGS: tuple[str, ...] = (
    # All releases: optional GPU packages missing (Megatron falls back to its own code, as on
    # every CPU machine).
    r"Transformer Engine and Apex are not installed\. Falling back to ",
    r"Apex is not installed\. Falling back to Torch Norm",
    # Raised by `TransformerConfig`'s own default; the option is cuda_graph_scope in 0.16,
    # cuda_graph_modules from 0.17 on.
    r"full scope is deprecated\. Use empty cuda_graph_(scope|modules) to capture the whole layer",
    # 0.17+: importing Megatron-Core imports its experimental multimodal (MIMO) config.
    r"MimoModelConfig is experimental and still under active development",
)

#: Log records with nothing to act on in an HDP job: (logger name, start of the message).
KNOWN_LOG_RECORDS: tuple[tuple[str, str], ...] = (
    # 0.17+: every GPTModel warns that it is deprecated in favour of HybridModel; HDP builds a
    # GPTModel for the user, who cannot act on it.
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED."),
    # 0.17+ imports torch.utils.cpp_extension with Megatron-Core (tensor_parallel/random.py),
    # which logs this on a machine with a CUDA toolkit but no GPU (any CPU job there).
    ("torch.utils.cpp_extension", "No CUDA runtime is found, using CUDA_HOME="),
)


class _DropKnownRecords(logging.Filter):
    """Drops the records of one logger whose message starts with one of `starts`."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def _known_record_filters() -> list[tuple[logging.Logger, _DropKnownRecords]]:
    by_logger: dict[str, list[str]] = {}
    for name, start in KNOWN_LOG_RECORDS:
        by_logger.setdefault(name, []).append(start)
    return [
        (logging.getLogger(name), _DropKnownRecords(tuple(starts)))
        for name, starts in by_logger.items()
    ]


def _ignore_known_warnings() -> None:
    for message in KNOWN_MEGATRON_WARNINGS:
        warnings.filterwarnings(
            "ignore", message=message, category=UserWarning, module=r"megatron\."
        )


def hide_known_messages() -> None:
    """Hide exactly `KNOWN_MEGATRON_WARNINGS` and `KNOWN_LOG_RECORDS` in this process.

    Call it before Megatron-Core is imported (several fire at import). Warning filters are
    per process and go in front of any `PYTHONWARNINGS` / `-W` setting; calling it again
    adds nothing twice.
    """
    _ignore_known_warnings()
    for logger, new in _known_record_filters():
        if not any(isinstance(old, _DropKnownRecords) for old in logger.filters):
            logger.addFilter(new)


@contextlib.contextmanager
def quiet_megatron_import() -> Iterator[None]:
    """Within the block (an import of Megatron-Core), hide the known messages; then not."""
    filters = [
        (logger, new)
        for logger, new in _known_record_filters()
        if not any(isinstance(old, _DropKnownRecords) for old in logger.filters)
    ]
    with warnings.catch_warnings():
        _ignore_known_warnings()
        for logger, new in filters:
            logger.addFilter(new)
        try:
            yield
        finally:
            for logger, new in filters:
                logger.removeFilter(new)


def module_of(builder: Any) -> Any:
    """The class a spec entry builds: a `ModuleSpec`, a `functools.partial` (0.17+) or a class.

    From 0.17 on, Megatron's layer specs hold some submodules (the MoE MLP, its experts) as
    `functools.partial(cls, submodules=...)` instead of `ModuleSpec(module=cls, ...)`.
    """
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(builder, ModuleSpec):
        return builder.module
    if isinstance(builder, functools.partial):
        return builder.func
    return builder


def submodules_of(builder: Any) -> Any:
    """The `submodules` a spec entry passes to its class (None if it passes none)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(builder, ModuleSpec):
        return builder.submodules
    if isinstance(builder, functools.partial):
        return builder.keywords.get("submodules")
    return None


def with_module(builder: Any, cls: type) -> Any:
    """`builder` building `cls` instead, with the same arguments, in the same form.

    A `ModuleSpec` is changed in place (and returned); a `functools.partial` cannot be, so a
    new one is returned: assign the result back where `builder` came from.
    """
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(builder, ModuleSpec):
        builder.module = cls
        return builder
    if isinstance(builder, functools.partial):
        return functools.partial(cls, *builder.args, **builder.keywords)
    return cls


def name_kwargs(name: str | None) -> dict[str, str]:
    """The `name=` keyword to hand a Megatron module, given the name its parent received.

    From 0.17 on, Megatron passes every module its dotted name (`name=`); 0.16's modules
    take no such argument, and their parents pass none (`name` is then None).
    """
    return {} if name is None else {"name": name}


def core_version() -> tuple[int, int]:
    """The installed megatron-core's (major, minor)."""
    from megatron.core import package_info

    major, minor = package_info.__version__.split(".")[:2]
    return int(major), int(minor)


def megatron_rng_sharded_object(
    states: list,
    *,
    pp: tuple[int, int],
    tp: tuple[int, int],
    dp: tuple[int, int],
    expert_parallel: bool,
) -> Any:
    """Megatron-LM's `rng_state` ShardedObject (its `get_rng_state` for torch_dist).

    `pp`, `tp`, `dp`: (size, rank). Megatron-LM with core 0.16 shards the RNG states of a
    job with expert parallelism over DP too (key shape (PP, TP, DP), one copy per rank);
    from 0.17 on it always shards them over (PP, TP), replicated over DP. Each release's
    Megatron-LM reads only its own form, so we write the installed release's.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if expert_parallel and core_version() < (0, 17):
        return ShardedObject(
            "rng_state", states, (pp[0], tp[0], dp[0]), (pp[1], tp[1], dp[1]), replica_id=0
        )
    return ShardedObject("rng_state", states, (pp[0], tp[0]), (pp[1], tp[1]), replica_id=dp[1])


def fully_reshardable_formats() -> set[str]:
    """The distributed optimizer's sharding types that reshard over TP and PP (0.16-0.19)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return set(DistributedOptimizer.checkpoint_fully_reshardable_formats)


def async_save_kwargs(async_save: bool) -> dict:
    """`dist_checkpointing.save`'s extra keywords for an asynchronous save.

    From 0.17 on, `save` defaults to NVIDIA Resiliency Extension's asynchronous writer
    (`async_strategy="nvrx"`); Megatron-Core's own (`"mcore"`, the only one in 0.16) needs
    no extra package.
    """
    if async_save and core_version() >= (0, 17):
        return {"async_strategy": "mcore"}
    return {}


@contextlib.contextmanager
def deferred_common_save_errors() -> Iterator[list]:
    """Within the block, a failed write of `common.pt` is kept in the yielded list, not raised.

    Megatron-Core 0.16's `dist_checkpointing.save` has rank 0 write `common.pt` (torch.save)
    before the collective sharded write: raised there, the failure would stop rank 0 alone
    while the other ranks wait in the collective. Kept, the save goes on and the caller
    reports it on every rank afterwards. From 0.17 on the common part is one of the sharded
    objects, whose failures the collective write already reports on every rank.
    """
    from megatron.core.dist_checkpointing.strategies import common

    errors: list = []
    strategy = getattr(common, "TorchCommonSaveStrategy", None)
    if strategy is None:
        yield errors
        return
    original = strategy.save_common

    def save_common(self, common_state_dict, checkpoint_dir):
        try:
            original(self, common_state_dict, checkpoint_dir)
        except (OSError, RuntimeError) as err:  # torch.save reports a full disk as RuntimeError
            errors.append(err)

    strategy.save_common = save_common
    try:
        yield errors
    finally:
        strategy.save_common = original
