"""The door to Megatron-Core's indexed dataset files (host layer).

The data layer reads and writes Megatron's `.bin`/`.idx` files through these names, so
that `megatron.core` is imported in the host layer only (architecture rule 6).
"""

from __future__ import annotations

from megatron_hdp.megatron import compat

with compat.quiet_megatron_import():
    # Importing megatron.core warns that Transformer Engine / Apex are missing (and more, by
    # release): irrelevant to data files, noise before the preprocessing tool's one-line errors.
    from megatron.core.datasets.indexed_dataset import (
        DType,
        IndexedDataset,
        IndexedDatasetBuilder,
    )

__all__ = ["DType", "IndexedDataset", "IndexedDatasetBuilder"]
