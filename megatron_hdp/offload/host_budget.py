"""How much host memory each process's offload pool takes, and whether the machine has it.

Pure layer (stdlib only): `pretrain_hdp.py` calls it before torch is imported, to refuse a
budget the machine cannot hold, and again at start-up to size the pool.

The rule:
- `--hdp-host-memory-gb G` given: each process takes `G` GB. All the processes of this
  machine together (torchrun's `LOCAL_WORLD_SIZE`) must leave `HEADROOM_SHARE` of the
  *available* memory free (`MemAvailable`: what can be had without swapping), or the job is
  refused before start-up with the figures.
- not given: each process takes `DEFAULT_SHARE` of the available memory divided by the
  processes of this machine. That fits by construction and leaves the rest to the data
  loaders, the checkpoint writers and the page cache.

The pool is allocated once, at start-up, pinned on GPU (page-locked: it cannot be swapped
out, and a pinned slab larger than the memory left takes the machine down), so its size is
decided here, not by the device profile the simulator uses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: Without `--hdp-host-memory-gb`: this share of the available memory, split among this
#: machine's processes, goes to the offload pools.
DEFAULT_SHARE = 0.5
#: The pools of all this machine's processes together leave at least this share of the
#: available memory free.
HEADROOM_SHARE = 0.2
#: A process never pins so much that less than this is left available when it pins (the
#: guard at allocation time, when the other processes may have pinned already).
MIN_FREE_AT_PIN_BYTES = 2 * 2**30

GIB = 2**30


def size_text(nbytes: float) -> str:
    """`nbytes` for a person: `1.5 GiB`, `12.0 MiB`."""
    if nbytes >= GIB:
        return f"{nbytes / GIB:.1f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


def available_memory_bytes() -> int | None:
    """Memory this machine can hand out now without swapping (`MemAvailable`), or None.

    Falls back to the free physical pages where `/proc/meminfo` does not exist.
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def local_processes() -> int:
    """Processes of this job on this machine (torchrun's `LOCAL_WORLD_SIZE`; 1 without it)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


@dataclass(frozen=True)
class HostBudget:
    """One process's offload pool size and where it came from.

    Attributes:
        nbytes: Bytes of host memory the process's pool takes.
        why: One phrase for the log: the flag, or the default's arithmetic.
    """

    nbytes: int
    why: str


def host_budget(
    flag_gb: float | None, *, local: int | None = None, available: int | None = None
) -> HostBudget:
    """The pool size of one process: `flag_gb` GB, or the default share of `available`.

    Args:
        flag_gb: `--hdp-host-memory-gb` (None: not given).
        local: Processes on this machine (default: `local_processes()`).
        available: Available bytes (default: `available_memory_bytes()`).

    Raises:
        ValueError: Without `flag_gb`, when the OS does not say how much memory is available.
    """
    local = local_processes() if local is None else local
    if flag_gb is not None:
        return HostBudget(int(flag_gb * 1e9), f"--hdp-host-memory-gb {flag_gb:g}")
    available = available_memory_bytes() if available is None else available
    if available is None:
        raise ValueError(
            "--hdp-offload: this OS does not say how much memory is available, so the offload "
            "pool cannot be sized: give --hdp-host-memory-gb"
        )
    nbytes = int(DEFAULT_SHARE * available / local)
    return HostBudget(
        nbytes,
        f"default: {DEFAULT_SHARE:.0%} of the {available / GIB:.1f} GiB available on this "
        f"machine, shared by {local} local process{'es' if local > 1 else ''}; "
        "--hdp-host-memory-gb sets it",
    )


def budget_problem(flag_gb: float, *, local: int, available: int | None) -> str | None:
    """Why `local` pools of `flag_gb` GB do not fit this machine's available memory, or None.

    The pools together must leave `HEADROOM_SHARE` of `available` free.
    """
    if available is None:
        return None
    total = flag_gb * 1e9 * local
    allowed = (1 - HEADROOM_SHARE) * available
    if total <= allowed:
        return None
    each = allowed / local / 1e9
    return (
        f"--hdp-host-memory-gb {flag_gb:g}: {local} process{'es' if local > 1 else ''} on "
        f"this machine would take {total / GIB:.1f} GiB of host memory for offloaded "
        f"activations, more than {1 - HEADROOM_SHARE:.0%} of the {available / GIB:.1f} GiB "
        f"available now; give at most {each:.3g} (or leave the flag out: "
        f"{DEFAULT_SHARE:.0%} of the available memory is shared out)"
    )


def pin_problem(nbytes: int, available: int | None) -> str | None:
    """Why pinning `nbytes` now would leave too little memory available, or None.

    Checked by each process as it pins its pool, after the others may have pinned theirs.
    """
    if available is None or nbytes + MIN_FREE_AT_PIN_BYTES <= available:
        return None
    return (
        f"pinning an offload host pool of {size_text(nbytes)} would leave less than "
        f"{size_text(MIN_FREE_AT_PIN_BYTES)} of this machine's {size_text(available)} of "
        "available memory; lower --hdp-host-memory-gb"
    )
