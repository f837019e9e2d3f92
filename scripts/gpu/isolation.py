"""Run one `verify.py` section in a process of its own, with a time limit, keeping its output.

A section that raises, dies (a CUDA error that aborts the process, a segfault) or hangs
must not take the other sections' figures with it. `run_isolated` starts the section in a
child process (`fork` on CPU: cheap, torch is already imported; `spawn` on CUDA, since a
forked child cannot use CUDA), sends the child's stdout and stderr (C-level output
included) to a file that it echoes line by line as they come and keeps the tail of, and
kills the child's process group when the limit passes. The child hands its result back
as a JSON file.

With `fork`, the parent must not have run a torch op before: a child forked from a
process whose OpenMP threads have run hangs at its first parallel op (seen here with
torch 2.13's CPU build). `verify.py` only imports modules and plans before forking.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

#: Lines of a section's output kept for the report when it crashes or times out.
TAIL_LINES = 30
#: How often the parent looks at the child and its output.
POLL_S = 0.1


@dataclass
class Outcome:
    """How a section's process ended."""

    status: str
    """"done" (it returned a result), "crashed" (it raised or died) or "timed_out"."""
    result: dict | None
    seconds: float
    error: str | None = None
    output_tail: list[str] = field(default_factory=list)


def _child(target, args, log_path: str, result_path: str) -> None:
    """In the child: output to the log, run `target(*args)`, write its result or error."""
    os.setpgrp()  # so that the parent can end whatever this process starts
    _die_with_parent()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (lives with the process)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    try:
        payload = {"result": target(*args)}
    except BaseException as err:  # reported, whatever it is
        traceback.print_exc()
        payload = {"error": f"{type(err).__name__}: {err}"}
    sys.stdout.flush()
    sys.stderr.flush()
    tmp = result_path + ".tmp"
    with open(tmp, "w") as out:
        json.dump(payload, out, default=str)
    os.replace(tmp, result_path)


class _Echo:
    """Echoes new complete lines of a growing file and keeps the last `TAIL_LINES`."""

    def __init__(self, path: Path, echo) -> None:
        self.path, self.echo, self.offset, self.partial = path, echo, 0, b""
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)

    def poll(self, final: bool = False) -> None:
        """Read what was written since the last call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        if final and self.partial:
            lines, self.partial = [*lines, self.partial], b""
        for raw in lines:
            line = raw.decode(errors="replace")
            self.tail.append(line)
            self.echo(line)


def run_isolated(target, args: tuple, *, limit_s: float, start_method: str, echo) -> Outcome:
    """`target(*args)` (a picklable function returning a JSON-able dict) in a child process.

    Its output lines go to `echo` as they come. Ends the child (SIGKILL to its process
    group) after `limit_s` seconds.
    """
    context = multiprocessing.get_context(start_method)
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryDirectory(prefix="verify-section-") as folder:
        log, result = Path(folder) / "output.log", Path(folder) / "result.json"
        log.touch()
        started = time.monotonic()
        process = context.Process(target=_child, args=(target, args, str(log), str(result)))
        process.start()
        reader = _Echo(log, echo)
        timed_out = False
        while process.exitcode is None:
            process.join(POLL_S)
            reader.poll()
            if process.exitcode is None and time.monotonic() - started > limit_s:
                timed_out = True
                _kill(process)
        reader.poll(final=True)
        seconds = time.monotonic() - started
        tail = list(reader.tail)
        if timed_out:
            return Outcome("timed_out", None, seconds, f"no result in {limit_s:.0f} s", tail)
        payload = json.loads(result.read_text()) if result.exists() else None
        if payload is None:
            code = process.exitcode
            why = f"signal {-code} ({_signal_name(-code)})" if code < 0 else f"exit status {code}"
            return Outcome("crashed", None, seconds, f"the process ended by {why}", tail)
        if "error" in payload:
            return Outcome("crashed", None, seconds, payload["error"], tail)
        return Outcome("done", payload["result"], seconds, None, tail)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a killed verify.py leaves no child)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's limit still applies
        pass


def _kill(process) -> None:
    """SIGKILL the child's process group (the child itself if it has none yet)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()
    process.join(10)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"
