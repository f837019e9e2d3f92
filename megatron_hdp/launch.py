"""Process start-up shared by the entry points (torchrun, SLURM): distributed init and logging.

Imports torch only inside `init_distributed`, so that logging can be set up and flags
validated before the heavy imports.
"""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta


def setup_logging(rank: int, *, level: int = logging.INFO) -> None:
    """Log to stderr; ranks other than 0 only log warnings and errors."""
    logging.basicConfig(
        level=level if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(name)s %(levelname)s: %(message)s",
    )
    logging.getLogger("megatron").setLevel(logging.WARNING)


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
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return device


def megatron_device_context() -> contextlib.AbstractContextManager:
    """The CPU shims around Megatron-Core on a machine without CUDA; nothing otherwise."""
    from megatron_hdp.megatron.cpu_shim import maybe_cpu_shims

    return maybe_cpu_shims()
