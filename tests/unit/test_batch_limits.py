"""A global batch larger than the training data is refused when the data is opened."""

import numpy as np
import pytest

from megatron_hdp.data.indexed import write_indexed_dataset
from megatron_hdp.data.training_data import DataConfig, build_training_data


@pytest.fixture
def tiny(tmp_path):
    """10 documents of 21-30 tokens: 10 sequences, 245 training tokens (one label fewer)."""
    docs = [np.arange(n, dtype=np.int32) % 50 for n in range(21, 31)]
    write_indexed_dataset(tmp_path / "tiny", docs, vocab_size=100)
    return str(tmp_path / "tiny")


def _config(prefix, **batch):
    return DataConfig(
        blend=[(None, prefix)], split=[100.0], seq_length=64, seed=0,
        tokenizer_type="NullTokenizer", vocab_size=100, **batch,
    )  # fmt: skip


def test_a_batch_of_more_sequences_or_tokens_than_the_data_is_refused(tiny):
    assert len(build_training_data(_config(tiny, units_per_batch=10)).train.next_batch()) == 10
    with pytest.raises(ValueError) as info:
        build_training_data(_config(tiny, units_per_batch=11))
    assert str(info.value) == (
        "a global batch of 11 sequences: more than the 10 training sequences of the data"
    )
    build_training_data(_config(tiny, tokens_per_batch=245))
    with pytest.raises(ValueError) as info:
        build_training_data(_config(tiny, tokens_per_batch=490))
    assert str(info.value) == (
        "--hdp-global-batch-tokens 490: a global batch of more than the 245 training tokens of "
        "the data (every step would read every document 2.0 times)"
    )
