"""Fixtures: the Megatron-LM trees (stock and patched) for the installed megatron-core, and
the documents to read.

megatron-core 0.16.x runs the core_v0.16.1 tree (Python 3.11, CI's first lane), 0.19.x the
core_v0.19.0 tree (Python 3.12, CI's third lane); any other release skips these tests.
"""

from __future__ import annotations

import pytest

from tests.megatron_lm.harness import import_megatron_lm, prepare_trees, write_documents

#: The Megatron-LM tag whose training tree runs with each megatron-core release line.
TREES = {"0.16": "core_v0.16.1", "0.19": "core_v0.19.0"}


def megatron_lm_tag() -> str | None:
    """The tag of the tree for the installed megatron-core (None: none, or not installed)."""
    try:
        import megatron.core
    except ImportError:
        return None
    return TREES.get(".".join(megatron.core.__version__.split(".")[:2]))


@pytest.fixture(scope="session")
def tag() -> str:
    """The Megatron-LM tag these tests run (skips when megatron-core has no tree here)."""
    found = megatron_lm_tag()
    if found is None:
        pytest.skip(f"no Megatron-LM training tree for this megatron-core (have {TREES})")
    return found


@pytest.fixture(scope="session")
def trees(tag, tmp_path_factory):
    """(stock, patched) Megatron-LM trees for `tag`; the patched one is imported here."""
    stock, patched = prepare_trees(tag, tmp_path_factory.mktemp("mlm"))
    import_megatron_lm(patched)
    return stock, patched


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """The indexed documents both scripts read."""
    prefix = tmp_path_factory.mktemp("data") / "docs"
    write_documents(prefix)
    return str(prefix)
