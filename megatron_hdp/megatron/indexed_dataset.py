"""The door to Megatron-Core's indexed dataset files (host layer).

The data layer reads and writes Megatron's `.bin`/`.idx` files through these names, so
that `megatron.core` is imported in the host layer only (architecture rule 6).
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    # Importing megatron.core warns four times that Transformer Engine / Apex are missing;
    # irrelevant to data files, and noise in front of the preprocessing tool's one-line errors.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex", category=UserWarning)
    from megatron.core.datasets.indexed_dataset import (
        DType,
        IndexedDataset,
        IndexedDatasetBuilder,
    )

__all__ = ["DType", "IndexedDataset", "IndexedDatasetBuilder"]
