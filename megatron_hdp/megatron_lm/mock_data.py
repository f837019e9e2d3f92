"""`--mock-data` under `--hdp`: Megatron-Core's synthetic documents, planned like real data.

Stock Megatron-LM's `--mock-data` builds `MockGPTDataset` over Megatron-Core's
`MockGPTLowLevelDataset`: 100,000 synthetic documents whose lengths are drawn uniformly
from [1, 4095] tokens by NumPy's `default_rng` with the class's fixed seed 0, document `d`
of length L being the ids `(1, 2, ..., L-1) mod vocab_size` followed by the tokenizer's
end-of-document id (the same in megatron-core 0.16 and 0.19). `MockGPTDataset` then packs
them into `--seq-length` samples, split by `--split` and shuffled with `--seed`.

HDP plans documents, so under `--hdp` the same low-level dataset is the corpus: its
documents are split by `--split` over the document index (as Megatron's builder splits
it), cut at `--seq-length` like every other dataset, and sampled in the order `--seed`
gives, as any `--data-path` would be. No file is read or written; the corpus depends only
on the tokenizer's vocabulary size and end-of-document id, so every rank of any world size
derives the same documents. A checkpoint names it `mock:<definition>` (`mock_prefix`), so
a resume with another vocabulary or end-of-document id is refused like other data.
"""

from __future__ import annotations

import logging

from megatron_hdp.data.fingerprint import MOCK
from megatron_hdp.data.training_data import DataConfig, TrainingData, training_data_from

logger = logging.getLogger(__name__)


def mock_documents(tokenizer):
    """Megatron-Core's `MockGPTLowLevelDataset` for `tokenizer` (needs `vocab_size`, `eod`).

    Has `sequence_lengths` and `get(doc, offset, length)`, the interface HDP's sampler and
    batching read. Deterministic; no communication, no files.
    """
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

    return MockGPTLowLevelDataset(tokenizer)


def mock_prefix(documents) -> str:
    """The name checkpoints record for a `mock_documents` corpus: every value that fixes it."""
    return (
        f"{MOCK}megatron.core.datasets.gpt_dataset.MockGPTLowLevelDataset("
        f"seed={documents.seed},size={documents.size},"
        f"max_sequence_length={documents.max_sequence_length},"
        f"vocab_size={documents.vocab_size},eod={documents.eod_token})"
    )


def describe(documents, seq_length: int) -> str:
    """What `--mock-data` means under `--hdp`, for the start-up log."""
    longest = int(documents.sequence_lengths.max())
    return (
        f"--mock-data under --hdp: the {documents.size} synthetic documents of Megatron-Core's "
        f"MockGPTLowLevelDataset (lengths uniform in [1, {documents.max_sequence_length - 1}] "
        f"tokens from its fixed seed {documents.seed}, longest {longest}; ids "
        f"(1, 2, ...) mod {documents.vocab_size}, then end-of-document id "
        f"{documents.eod_token}), split by --split over documents, cut at --seq-length "
        f"{seq_length} and sampled in --seed order; the same corpus on every rank, no files"
    )


def mock_training_data(cfg: DataConfig) -> TrainingData:
    """HDP's data set-up over `mock_documents(cfg.tokenizer)`: splits and samplers.

    `cfg.tokenizer` is the tokenizer Megatron-LM built (`data.MegatronLMTokenizer`). Raises
    ValueError as `training_data_from` does (e.g. a global batch larger than the data).
    """
    documents = mock_documents(cfg.tokenizer)
    return training_data_from(
        [mock_prefix(documents)], [documents], cfg, int(cfg.tokenizer.vocab_size)
    )
