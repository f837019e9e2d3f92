"""run_ranks: fork gloo ranks from the already-imported parent and turn hangs into failures.

Each rank writes its result (or its traceback) to a file in a private temporary folder;
the parent waits with a deadline, kills every rank on the first failure or on timeout,
and re-raises the failing rank's traceback.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 60


def _child(rank, world_size, folder, fn, args):
    code = 0
    try:
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
    os._exit(code)


def _read(folder, rank):
    path = f"{folder}/rank{rank}.pkl"
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def run_ranks(fn, world_size: int, *args, timeout_s: float = 120.0) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` forked gloo ranks; return results."""
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as folder:
        procs = [
            ctx.Process(target=_child, args=(r, world_size, folder, fn, args))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        failure = None
        while failure is None and any(p.exitcode is None for p in procs):
            bad = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if bad:
                report = _read(folder, bad[0])
                detail = report[1] if report else f"exit code {procs[bad[0]].exitcode}"
                failure = f"rank {bad[0]} failed:\n{detail}"
            elif time.monotonic() > deadline:
                failure = f"timed out after {timeout_s} s"
            else:
                time.sleep(0.01)
        if failure is None:
            bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
            if bad:
                report = _read(folder, bad[0])
                detail = report[1] if report else f"exit code {procs[bad[0]].exitcode}"
                failure = f"rank {bad[0]} failed:\n{detail}"
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join(timeout=10)
        if failure is not None:
            raise AssertionError(failure)
        return [_read(folder, r)[1] for r in range(world_size)]
