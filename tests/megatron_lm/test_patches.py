"""The patches and `scripts/apply_megatron_patch.py`, against the real Megatron-LM trees.

Running the core_v0.19.0 tree needs megatron-core 0.19 (Python 3.12, the second CI lane):
those tests skip elsewhere.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.megatron_lm.harness import (
    MEGATRON_CPU,
    REPO,
    SHARED,
    THIRD_PARTY,
    import_megatron_lm,
    prepare_trees,
    run_megatron_lm,
)

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


def _megatron_core_019() -> bool:
    try:
        import megatron.core
    except ImportError:
        return False
    return megatron.core.__version__.startswith("0.19.")


@pytest.mark.skipif(
    not _megatron_core_019(), reason="runs core_v0.19.0 with megatron-core 0.19 (Python 3.12)"
)
def test_core_v0_19_hdp_and_stock(tmp_path_factory):
    """core_v0.19.0: --hdp equals pretrain_hdp.py (patch and launcher); stock is untouched."""
    from tests.e2e.harness import run_pretrain
    from tests.megatron_lm.harness import write_documents

    stock, patched = prepare_trees("core_v0.19.0", tmp_path_factory.mktemp("mlm19"))
    import_megatron_lm(patched)
    prefix = tmp_path_factory.mktemp("data19") / "docs"
    write_documents(prefix)
    flags = [*SHARED, "--data-path", str(prefix), "--train-iters", "2"]
    flags += ["--global-batch-size", "6", "--hdp-capacity", "256"]
    flags += ["--eval-iters", "0", "--eval-interval", "1000"]
    reference = [r["loss"] for r in run_pretrain(2, [*flags, "--no-progress-bar"])]
    for script, launcher in ((patched, False), (stock, True)):
        ran = run_megatron_lm(
            script / "pretrain_gpt.py", 2, [*flags, *MEGATRON_CPU, "--hdp"], launcher=launcher
        )
        assert [loss for _, loss, _ in ran["train"]] == pytest.approx(reference, rel=1e-6)
    plain = [*flags, *MEGATRON_CPU]
    want = run_megatron_lm(stock / "pretrain_gpt.py", 2, plain)["train"]
    assert len(want) == 2
    assert run_megatron_lm(patched / "pretrain_gpt.py", 2, plain)["train"] == want
