"""Fixtures: Megatron-LM core_v0.16.1 trees (stock and patched) and the documents to read."""

from __future__ import annotations

import pytest

from tests.megatron_lm.harness import import_megatron_lm, prepare_trees, write_documents


def _megatron_core_016() -> bool:
    try:
        import megatron.core
    except ImportError:
        return False
    return megatron.core.__version__.startswith("0.16.")


@pytest.fixture(scope="session")
def trees(tmp_path_factory):
    """(stock, patched) Megatron-LM core_v0.16.1 trees; the patched one is imported here."""
    if not _megatron_core_016():
        pytest.skip("the core_v0.16.1 training tree runs with megatron-core 0.16")
    stock, patched = prepare_trees("core_v0.16.1", tmp_path_factory.mktemp("mlm"))
    import_megatron_lm(patched)
    return stock, patched


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """The indexed documents both scripts read."""
    prefix = tmp_path_factory.mktemp("data") / "docs"
    write_documents(prefix)
    return str(prefix)
