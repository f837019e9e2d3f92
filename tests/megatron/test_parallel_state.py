"""Megatron's groups are forgotten entirely: a process forked after a layout's destroy starts
again (in-process tools such as calibrate set up and destroy a layout in a long-lived process)."""

import subprocess
import sys

from tests.e2e.harness import REPO

# Sets up and destroys a layout on a one-rank gloo world, twice: in this process, then in a
# forked child. Megatron's own destroy leaves groups set that the child would free (it then
# crashes with SIGSEGV or hangs).
SCRIPT = """
import os, signal, tempfile, time
from datetime import timedelta
import torch.distributed as dist
from megatron_hdp.distributed.layout import ParallelDims
from megatron_hdp.megatron.cpu_shim import cpu_shims

def start_and_destroy(folder):
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        layout.destroy()
    dist.destroy_process_group()

start_and_destroy(tempfile.mkdtemp())
pid = os.fork()
if pid == 0:
    start_and_destroy(tempfile.mkdtemp())
    os._exit(0)
deadline = time.monotonic() + 60
while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
    time.sleep(0.1)
if done[0] == 0:
    os.kill(pid, signal.SIGKILL)
    print("CHILD hung")
else:
    print("CHILD", os.waitstatus_to_exitcode(done[1]))
"""


def test_a_child_forked_after_destroy_sets_up_megatron_again():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=REPO, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "CHILD 0", done.stderr[-3000:]
