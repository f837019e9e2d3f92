"""Process start-up shared by the entry points (torchrun, SLURM): distributed init and logging.

Imports torch only inside `init_distributed`, so that logging (and the warning filters) can
be set up and flags validated before the heavy imports.
"""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta

from megatron_hdp.megatron import compat

#: Megatron-Core's warnings with nothing to act on in these jobs (regular expressions, per
#: release: `megatron/compat.py`); `quiet_known_warnings` hides exactly these.
KNOWN_MEGATRON_WARNINGS: tuple[str, ...] = compat.KNOWN_MEGATRON_WARNINGS


def quiet_known_warnings() -> None:
    """Hide exactly the `KNOWN_MEGATRON_WARNINGS` and `compat.KNOWN_LOG_RECORDS` here.

    Python's warning filters are per process and shared by all its threads, so calling this
    once before Megatron is imported covers the import-time warnings and those of threads
    started later; each process (torchrun starts every rank with a fresh interpreter) calls
    it itself. The filters go in front of any `PYTHONWARNINGS` / `-W` setting.
    """
    compat.hide_known_messages()


def setup_logging(rank: int, *, level: int = logging.INFO) -> None:
    """Log to stderr (ranks other than 0 only warnings and errors); hide known warnings.

    Also calls `quiet_known_warnings`, so an entry point that sets up logging before
    importing Megatron-Core starts without Megatron's missing-package warnings.
    """
    logging.basicConfig(
        level=level if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(name)s %(levelname)s: %(message)s",
    )
    logging.getLogger("megatron").setLevel(logging.WARNING)
    quiet_known_warnings()


def init_distributed(*, timeout_s: float = 600.0):
    """Initialise torch.distributed from torchrun's environment; return this rank's device.

    NCCL on CUDA machines (one GPU per local rank), gloo on CPU. Each CPU rank uses one
    intra-op thread unless OMP_NUM_THREADS says otherwise, since ranks share the cores.
    `timeout_s` bounds every collective (--distributed-timeout-minutes).
    """
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, **process_group_options(device, timeout_s=timeout_s))
    return device


def process_group_options(device, *, timeout_s: float) -> dict:
    """`init_process_group` keywords for a rank on `device`.

    On CUDA, `device_id` binds the rank to its GPU: NCCL forms the world communicator at
    once (not lazily at the first collective, so a failing NCCL set-up shows at start-up)
    and Megatron's sub-groups (the pool, TP, PP) are split from it with `ncclCommSplit`.
    Eager init does not cover the lazily formed P2P state of a group: a first
    `batch_isend_irecv` that involves only some of a group's ranks is undefined in torch,
    so each entry point issues a collective over the pool before the first ring exchange
    (`step.read_and_count` in `pretrain_hdp.py`, `schedule.warm_up_pool` in the drop-in).
    """
    options: dict = {"timeout": timedelta(seconds=timeout_s)}
    if device.type == "cuda":
        options["device_id"] = device
    return options


def megatron_device_context() -> contextlib.AbstractContextManager:
    """The CPU shims around Megatron-Core on a machine without CUDA; nothing otherwise."""
    from megatron_hdp.megatron.cpu_shim import maybe_cpu_shims

    return maybe_cpu_shims()
