"""A failed checkpoint write names a full disk or a file-size limit that its error hides.

torch's zip writer reports ENOSPC and EFBIG as `enforce fail at inline_container.cc ...
unexpected pos` (the reliability sweep's D1 and D2). The limit case is reproduced for real:
a child process under `ulimit -f` saves a tensor with torch's own writer.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import namedtuple

from megatron_hdp import checkpoint_files
from tests.unit.scripts_loader import REPO

Usage = namedtuple("Usage", "total used free")


def test_a_real_file_size_limit_hides_behind_the_zip_writer_and_is_named(tmp_path):
    code = (
        "import resource, torch\n"
        "from megatron_hdp.checkpoint_files import hidden_write_causes\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
        "try:\n"
        f"    torch.save(torch.zeros(100000), {str(tmp_path / 'x.pt')!r})\n"
        "except Exception as err:\n"
        "    print(type(err).__name__, str(err).splitlines()[0])\n"
        f"    print(hidden_write_causes({str(tmp_path)!r}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout + done.stderr
    assert "File too large" not in lines[0]  # the writer does hide the cause...
    assert lines[1] == "; probably this process may write files of at most 4096 bytes (ulimit -f)"


def test_a_full_disk_is_named_with_its_free_space(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(100 * 2**30, 0, 5 * 2**20))
    note = checkpoint_files.hidden_write_causes(tmp_path)
    assert note.startswith("; probably no space left on the device: 5 MiB free of 100.0 GiB")


def test_nothing_is_blamed_on_a_disk_with_room_and_no_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(100 * 2**30, 0, 50 * 2**30))
    assert checkpoint_files.hidden_write_causes(tmp_path) == ""
