"""Differences between the Megatron-Core releases we support, 0.16.x to 0.19.x (host layer).

Everything in the library that depends on which megatron-core is installed asks this module;
nothing else branches on versions. Each function says which releases differ and how.
"""

from __future__ import annotations

import functools
from typing import Any

from megatron.core import package_info
from megatron.core.transformer.spec_utils import ModuleSpec

MEGATRON_CORE_VERSION: tuple[int, int] = (int(package_info.MAJOR), int(package_info.MINOR))
"""(major, minor) of the installed megatron-core."""

SUPPORTED_MEGATRON_CORE = ((0, 16), (0, 19))
"""The oldest and newest (major, minor) CI runs; `pyproject.toml` declares the same range."""


def module_of(builder: Any) -> Any:
    """The class a spec entry builds: a `ModuleSpec`, a `functools.partial` (0.17+) or a class.

    From 0.17 on, Megatron's layer specs hold some submodules (the MoE MLP, its experts) as
    `functools.partial(cls, submodules=...)` instead of `ModuleSpec(module=cls, ...)`.
    """
    if isinstance(builder, ModuleSpec):
        return builder.module
    if isinstance(builder, functools.partial):
        return builder.func
    return builder


def submodules_of(builder: Any) -> Any:
    """The `submodules` a spec entry passes to its class (None if it passes none)."""
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
