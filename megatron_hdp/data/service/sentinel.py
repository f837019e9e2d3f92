"""A rank's last line when Ray ends it: a small watching process (host layer, no Ray import).

When the Ray head stops mid-run (or the node's raylet dies), Ray's core worker inside each
rank ends the process at once (`_Exit(1)` in C++): no Python exception, handler or `atexit`
runs, so the job would stop with no word of its own. Each rank that joins a Ray cluster
therefore starts a sentinel: a plain Python process that reads a pipe from the rank until
it closes or the rank is gone (a process the rank forked, such as a checkpoint writer's
helper, holds the pipe open after it). A rank that leaves normally writes `done` first;
otherwise, if the cluster's address no longer answers, the sentinel writes one line to
the rank's stderr naming the address and the latest checkpoint. It stays silent when the
rank ended for another reason (the cluster still answers): that rank says why itself.
"""

from __future__ import annotations

import os
import subprocess
import sys

#: What a rank writes into the pipe when it leaves the cluster normally.
DONE = b"done"

_SCRIPT = r"""
import os, select, socket, sys, time
address, save, prog, rank_pid = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
data = b""
while os.getppid() == rank_pid:  # a forked helper of the rank may keep the pipe open
    if select.select([sys.stdin], [], [], 0.5)[0]:
        chunk = os.read(sys.stdin.fileno(), 64)
        if not chunk:
            break
        data += chunk
if data.endswith(b"done"):
    sys.exit(0)
host, _, port = address.rpartition(":")
deadline = time.monotonic() + 3.0
while True:
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except OSError:
        break  # the cluster is gone: Ray ended the rank
    if time.monotonic() > deadline:
        sys.exit(0)  # the cluster answers: the rank ended for another reason and says so
    time.sleep(0.2)
note = "No checkpoint was written."
tracker = os.path.join(save, "latest_checkpointed_iteration.txt") if save else ""
if tracker and os.path.exists(tracker):
    note = f"The latest checkpoint is iteration {open(tracker).read().strip()} in {save}."
sys.stderr.write(
    f"{prog}: error: the Ray cluster at {address} went away (its head or this node's raylet "
    f"stopped) and Ray ended the job's ranks. {note}\n"
)
"""


class Sentinel:
    """The watching process of one rank (see the module); `close()` when leaving normally."""

    def __init__(self, address: str, *, save: str | None, prog: str = "pretrain_hdp.py"):
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SCRIPT, address, save or "", prog, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,  # a Ctrl-C to the job's process group does not reach it
        )

    def close(self) -> None:
        """Tell the sentinel the rank leaves normally, and let it end."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self._proc.stdin.write(DONE)
                self._proc.stdin.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()


def speaks_for_this_node() -> bool:
    """True on torchrun's local rank 0 (or without torchrun): one line per node."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0
