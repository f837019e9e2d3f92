"""Megatron-LM's own `pretrain_gpt.py` (core_v0.16.1) with `--hdp`, on 2 CPU ranks.

The patched script (and the unmodified one through the launcher) trains with HDP through
Megatron-LM's `pretrain()`: its losses and gradient norms equal `pretrain_hdp.py`'s on the
same data, seed and layout; `--save` / `--load` resume exactly; without `--hdp` it is stock.
"""

from __future__ import annotations

import pytest

from tests.e2e.harness import run_pretrain
from tests.megatron_lm.harness import (
    MEGATRON_CPU,
    SHARED,
    import_megatron_lm,
    prepare_trees,
    run_megatron_lm,
    write_documents,
)

megatron_core = pytest.importorskip("megatron.core")
if not megatron_core.__version__.startswith("0.16."):
    pytest.skip("the core_v0.16.1 tree runs with megatron-core 0.16", allow_module_level=True)


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """(stock, patched) Megatron-LM core_v0.16.1 trees; the patched one is imported."""
    stock, patched = prepare_trees("core_v0.16.1", tmp_path_factory.mktemp("mlm"))
    import_megatron_lm(patched)
    return stock, patched


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The indexed documents both scripts read."""
    prefix = tmp_path_factory.mktemp("data") / "docs"
    write_documents(prefix)
    return str(prefix)


def _close(got, want, rel=2e-5):
    assert len(got) == len(want) > 0, (got, want)
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=rel), (got, want)


def test_hdp_losses_equal_pretrain_hdp(trees, data):
    """Two ranks, capacity 256 (rings of 2 for documents over 256 tokens), 3 steps."""
    _, patched = trees
    flags = [*SHARED, "--data-path", data, "--train-iters", "3", "--global-batch-size", "8"]
    flags += ["--hdp-capacity", "256", "--eval-interval", "3", "--eval-iters", "2"]
    ran = run_megatron_lm(patched / "pretrain_gpt.py", 2, [*flags, *MEGATRON_CPU, "--hdp"])
    reference = run_pretrain(2, [*flags, "--no-progress-bar"])
    assert max(r["max_ranks_per_sequence"] for r in reference) == 2  # rings ran
    assert [i for i, _, _ in ran["train"]] == [1, 2, 3]
    _close([loss for _, loss, _ in ran["train"]], [r["loss"] for r in reference])
    _close([norm for _, _, norm in ran["train"]], [r["grad_norm"] for r in reference])
