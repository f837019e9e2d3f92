"""run_ranks: fork gloo ranks from the already-imported parent and turn hangs into failures.

Each rank writes its result (or its traceback) to a file in a private temporary folder;
the parent waits with a deadline, kills every rank on the first failure or on timeout,
and re-raises the failing rank's traceback.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 60


def _child(rank, world_size, folder, fn, args):
    # Nothing inherited is ever collected here: an object whose destructor joins threads
    # (a process group the parent dropped in a reference cycle joins gloo's workers) would
    # wait forever in this copy, which has no threads but its main one.
    gc.freeze()
    code = 0
    try:
        _fork_checkpoint_writer_queue()
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{folder}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        try:
            payload = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        payload, code = ("error", traceback.format_exc()), 1
    with open(f"{folder}/rank{rank}.tmp", "wb") as f:
        pickle.dump(payload, f)
    os.replace(f"{folder}/rank{rank}.tmp", f"{folder}/rank{rank}.pkl")
    _stop_children()
    os._exit(code)


def _fork_checkpoint_writer_queue() -> None:
    """Start the helper server of Megatron's checkpoint writer by fork (test only).

    `dist_checkpointing`'s file writer keeps the queue through which its write workers
    report in a `multiprocessing` manager server started with the spawn method at this
    rank's first save (ours, `helper_processes.start_manager`, or Megatron's own getter):
    a fresh interpreter that imports torch, 4-6 s of the 2 cores per rank and test. These
    ranks were forked from a parent without CUDA, so a forked server does the same job at
    once; it ignores SIGTERM and ends with the rank, as in production. The writer itself,
    its workers and its files are Megatron's.
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    from megatron_hdp.distributed import helper_processes

    helper_processes.START_METHOD = "fork"

    def results_queue(mp_mode: str = "spawn"):  # the signature of 0.19 (0.16: none)
        if filesystem_async._results_queue is None:
            filesystem_async._results_queue = helper_processes.start_manager().Queue()
        return filesystem_async._results_queue

    for name in ("_get_write_results_queue", "get_write_results_queue"):  # 0.16, 0.19
        if hasattr(filesystem_async, name):
            setattr(filesystem_async, name, results_queue)


def _stop_children() -> None:
    """Stop the processes this rank started (os._exit below would leave them running).

    Megatron's distributed checkpoint writer, for one, keeps a `multiprocessing` Manager
    server (about 0.5 GB), which ignores SIGTERM: it is shut down first, as a normal exit
    would, and anything still alive after SIGTERM is killed.
    """
    writer = sys.modules.get("megatron_hdp.megatron.dist_checkpoint")
    if writer is not None:
        writer.close_writer_processes()
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=2)
        if child.is_alive():
            child.kill()
            child.join(timeout=10)


def _read(folder, rank):
    path = f"{folder}/rank{rank}.pkl"
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _describe_failures(folder, procs, timed_out, timeout_s):
    """All failing ranks' reports, ranks killed by a signal first; None if all succeeded."""
    reports = []
    for rank, p in sorted(enumerate(procs), key=lambda rp: (rp[1].exitcode or 0) >= 0):
        report = _read(folder, rank)
        if report is not None and report[0] == "error":
            reports.append(f"rank {rank} failed:\n{report[1]}")
        elif report is None and p.exitcode not in (0, None, -9):
            reports.append(f"rank {rank} died with exit code {p.exitcode} and no report")
    if timed_out:
        reports.insert(0, f"timed out after {timeout_s} s")
    return "\n".join(reports) if reports else None


def run_ranks(fn, world_size: int, *args, timeout_s: float = 120.0) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` forked gloo ranks; return results."""
    ctx = multiprocessing.get_context("fork")
    gc.collect()  # the parent's garbage dies here, where its threads still run
    with tempfile.TemporaryDirectory() as folder:
        procs = [
            ctx.Process(target=_child, args=(r, world_size, folder, fn, args))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        timed_out = False
        while any(p.exitcode is None for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(0.5)  # let the other ranks report what they saw
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.01)
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join(timeout=10)
        failure = _describe_failures(folder, procs, timed_out, timeout_s)
        if failure is not None:
            raise AssertionError(failure)
        return [_read(folder, r)[1] for r in range(world_size)]
