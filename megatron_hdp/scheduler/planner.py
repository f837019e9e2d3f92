"""Which balance core runs: the C++ one (built with the package), or the Python reference.

The C++ extension `megatron_hdp._planner` is built by `pip install` (one build path, no
compilation at run time). `default_core()` returns it; if it is missing, that is an
installation error and is reported as such, never silently replaced by the slower
reference. `reference_core` is `balance.balance_core`, the specification.
"""

from __future__ import annotations

from megatron_hdp.scheduler.balance import balance_core as reference_core


def default_core():
    """The C++ balance core; ImportError with instructions if the extension is not built."""
    try:
        from megatron_hdp._planner import balance_core
    except ImportError as err:
        raise ImportError(
            "the C++ planner extension megatron_hdp._planner is not built; reinstall the "
            "package (pip install -e .) so its build step compiles csrc/"
        ) from err
    return balance_core


__all__ = ["default_core", "reference_core"]
