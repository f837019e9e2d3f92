"""Shared fixtures for end-to-end runs of pretrain_hdp.py."""

import pytest

from megatron_hdp.data.indexed import ensure_stdlib_corpus


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory):
    """A cache folder holding the embedded stdlib corpus, built once per session."""
    folder = tmp_path_factory.mktemp("hdp-cache")
    ensure_stdlib_corpus(folder)
    return folder
