"""The patches and `scripts/apply_megatron_patch.py`, against the real Megatron-LM trees.

Applying a patch needs no Megatron; running the patched trees is test_pretrain_gpt.py's (the
tree for the installed megatron-core).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.megatron_lm.harness import REPO, THIRD_PARTY

TAGS = ["core_v0.16.1", "core_v0.19.0"]


def _apply(*args):
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "apply_megatron_patch.py"), *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
    )


def _copy(tag, tmp_path):
    source = THIRD_PARTY / f"megatron-lm-{tag}"
    if not source.is_dir():
        pytest.skip(f"{source} is not here")
    checkout = tmp_path / tag
    shutil.copytree(source, checkout)
    return checkout


@pytest.mark.parametrize("tag", TAGS)
def test_each_patch_applies_to_its_stock_tree_once(tag, tmp_path):
    checkout = _copy(tag, tmp_path)
    stock = (checkout / "pretrain_gpt.py").read_text()
    checked = _apply(checkout, "--tag", tag, "--check")
    assert checked.returncode == 0 and "applies" in checked.stdout, checked.stderr
    assert (checkout / "pretrain_gpt.py").read_text() == stock  # --check writes nothing
    applied = _apply(checkout, "--tag", tag)
    assert applied.returncode == 0, applied.stderr
    patched = (checkout / "pretrain_gpt.py").read_text()
    assert "hdp_pretrain(pretrain, loss_func=loss_func)" in patched
    compile(patched, "pretrain_gpt.py", "exec")
    again = _apply(checkout, "--tag", tag)  # idempotent
    assert again.returncode == 0 and "already applied" in again.stdout
    assert (checkout / "pretrain_gpt.py").read_text() == patched


def test_an_unknown_tag_is_refused_by_name(tmp_path):
    checkout = _copy("core_v0.16.1", tmp_path)
    result = _apply(checkout, "--tag", "core_v0.15.0")
    assert result.returncode == 2
    assert "core_v0.15.0" in result.stderr and "core_v0.16.1" in result.stderr
    undetectable = _apply(checkout)  # no git, no package_info.py: the tag cannot be read
    assert undetectable.returncode == 2 and "--tag" in undetectable.stderr


def test_the_tag_is_read_from_package_info(tmp_path):
    checkout = _copy("core_v0.16.1", tmp_path)
    info = checkout / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True, exist_ok=True)
    info.write_text("MAJOR = 0\nMINOR = 16\nPATCH = 1\n")
    result = _apply(checkout)
    assert result.returncode == 0 and result.stdout.startswith("core_v0.16.1"), result.stderr


def test_a_patch_that_does_not_apply_is_refused(tmp_path):
    checkout = _copy("core_v0.16.1", tmp_path)
    script = checkout / "pretrain_gpt.py"
    script.write_text(script.read_text().replace("maybe_wrap_for_inprocess_restart", "edited"))
    result = _apply(checkout, "--tag", "core_v0.16.1")
    assert result.returncode == 2 and "does not apply" in result.stderr
