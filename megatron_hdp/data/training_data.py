"""Open the job's datasets and build its samplers (host layer; no communication).

Every rank runs this before any process group exists: opening an indexed dataset only
maps its index, and the sampler needs lengths alone, so every rank derives the same global
batches without reading tokens or talking to other ranks. Bad data (missing or corrupt
`.idx`/`.bin`, tokens outside the vocabulary's range by dtype) fails here.

Documents: each sequence of an indexed dataset is one document (what Megatron's
`preprocess_data.py` writes without `--split-sentences`, and what our preprocessing writes).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megatron_hdp.data.batch_ramp import BatchRamp
from megatron_hdp.data.fingerprint import dataset_fingerprint
from megatron_hdp.data.indexed import ensure_stdlib_corpus, open_indexed_dataset
from megatron_hdp.data.lengths_only import LengthsOnly, open_lengths
from megatron_hdp.data.sampler import DatasetUnits, TokenBudgetSampler, split_ranges
from megatron_hdp.data.sources import open_source, source_location
from megatron_hdp.data.spec import DataSpec
from megatron_hdp.data.tokenizers import build_tokenizer
from megatron_hdp.megatron.indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)

DEFAULT_CACHE = Path(os.path.expanduser("~")) / ".cache" / "megatron_hdp"


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What the data set-up needs (Megatron flag names in parentheses)."""

    blend: list[tuple[float | None, str]]
    """(weight, prefix) pairs (--data-path); weight None = by the dataset's training tokens
    (as Megatron weights an unweighted list by size); empty = the embedded stdlib corpus."""
    split: list[float]
    """Train/valid/test weights over each dataset's documents (--split)."""
    seq_length: int
    """Longest training sequence; longer documents are cut (--seq-length)."""
    seed: int
    """Data order (--seed)."""
    tokens_per_batch: int | None = None
    """Global batch token budget (--hdp-global-batch-tokens)."""
    units_per_batch: int | None = None
    """Global batch in sequences (the advisor's and library callers' alternative; the flags
    give tokens: --global-batch-size B is B x --seq-length tokens)."""
    ramp: BatchRamp | None = None
    """Megatron-LM's batch size per step in samples of `seq_length` tokens
    (--global-batch-size with --rampup-batch-size); the training sampler's budget of step i
    is then `ramp.tokens_of_step(i)`, and `tokens_per_batch` the budget after the ramp."""
    batch_flag: str | None = None
    """How the user gave the global batch, as messages about it name it (default:
    `--hdp-global-batch-tokens N`)."""
    tokenizer_type: str = "ByteLevel"
    """(--tokenizer-type)."""
    tokenizer_model: str | None = None
    """(--tokenizer-model)."""
    vocab_size: int | None = None
    """For NullTokenizer (--vocab-size)."""
    cache_dir: str | None = None
    """Where the embedded corpus is built (--data-cache-path)."""
    spec: DataSpec | None = None
    """A declarative data spec (--hdp-data-spec), instead of `blend`."""
    lengths_only: bool = False
    """Hold each source's document lengths only, never its tokens (`data.lengths_only`):
    with --hdp-data-service ray the source loaders read every token, training and
    evaluation alike. The datasets are then `LengthsOnly`, whose reads raise."""
    build_lengths: Any = field(default=None, compare=False, repr=False)
    """With `lengths_only`: `build(source)`, the lengths of a JSONL source that has no
    cached lengths index yet (the Ray service's `service.indexer.cluster_lengths`, which
    builds it once in the cluster); None: it is built in this process."""
    tokenizer: Any = field(default=None, compare=False, repr=False)
    """A tokenizer object already built (`vocab_size`, `eod`, `encode`), used instead of
    building one from `tokenizer_type` / `tokenizer_model`: the drop-in passes the one
    Megatron-LM built (`megatron_lm.data.MegatronLMTokenizer`)."""


@dataclass
class TrainingData:
    """Open datasets, the training sampler and the vocabulary size (before padding).

    `valid_units` is None when some dataset has no validation document. With a data spec,
    `valid_weights` weights the validation blend (each source by its validation tokens).
    """

    datasets: list[IndexedDataset]
    prefixes: list[str]
    train: TokenBudgetSampler
    vocab_size: int
    train_units: list[DatasetUnits]
    valid_units: list[DatasetUnits] | None
    cfg: DataConfig
    valid_weights: list[float] | None = None

    @functools.cached_property
    def fingerprints(self) -> list[str]:
        """Each dataset's content fingerprint (`data.fingerprint`), in `prefixes` order."""
        return [dataset_fingerprint(prefix) for prefix in self.prefixes]

    @property
    def streams(self) -> list[str]:
        """Names of the training sampler's streams: the spec's `source/bucket`s or prefixes."""
        return list(self.cfg.spec.streams) if self.cfg.spec is not None else list(self.prefixes)

    def fresh_valid_sampler(self) -> TokenBudgetSampler | None:
        """A validation sampler at its start (every evaluation sees the same batches)."""
        if self.valid_units is None:
            return None
        if self.valid_weights is not None:
            return TokenBudgetSampler(
                self.valid_units,
                self.valid_weights,
                seed=self.cfg.seed + 1,
                tokens_per_batch=self.cfg.tokens_per_batch,
                units_per_batch=self.cfg.units_per_batch,
            )
        return _sampler(
            self.valid_units, self.cfg, seed=self.cfg.seed + 1, train_units=self.train_units
        )


def _sampler(
    units, cfg: DataConfig, *, seed: int, train_units=None, ramp: BatchRamp | None = None
) -> TokenBudgetSampler:
    sizes = train_units or units
    weights = [
        w if w is not None else float(u.num_tokens)
        for (w, _), u in zip(cfg.blend or [(1.0, "")], sizes, strict=True)
    ]
    return TokenBudgetSampler(
        units,
        weights,
        seed=seed,
        tokens_per_batch=cfg.tokens_per_batch,
        units_per_batch=cfg.units_per_batch,
        ramp=ramp,
    )


def _vocab_size(cfg: DataConfig) -> int:
    if cfg.tokenizer is not None:
        return int(cfg.tokenizer.vocab_size)
    if cfg.tokenizer_type == "NullTokenizer":
        return int(cfg.vocab_size) + 1  # Megatron's NullTokenizer puts EOD at vocab_size
    return build_tokenizer(cfg.tokenizer_type, tokenizer_model=cfg.tokenizer_model).vocab_size


def _split_units(prefixes, datasets, cfg: DataConfig):
    """Each dataset's training and validation units (by --split over its documents)."""
    train_units, valid_units = [], []
    for prefix, dataset in zip(prefixes, datasets, strict=True):
        lengths = np.asarray(dataset.sequence_lengths, dtype=np.int64)
        ranges = split_ranges(len(lengths), cfg.split)
        per_split = []
        for lo, hi in ranges[:2]:
            ids = np.arange(lo, hi, dtype=np.int64)
            per_split.append(
                DatasetUnits.from_documents(ids, lengths[lo:hi], max_seq_length=cfg.seq_length)
            )
        if len(per_split[0]) == 0:
            raise ValueError(f"{prefix}: the training split ({cfg.split}) holds no usable document")
        train_units.append(per_split[0])
        valid_units.append(per_split[1])
        logger.info(
            "data %s: %d documents, %d training sequences (%d tokens), %d validation sequences",
            prefix,
            len(lengths),
            len(per_split[0]),
            per_split[0].num_tokens,
            len(per_split[1]),
        )
    return train_units, valid_units


def _subset(units: DatasetUnits, keep: np.ndarray) -> DatasetUnits:
    return DatasetUnits(doc=units.doc[keep], start=units.start[keep], length=units.length[keep])


def _spec_data(cfg: DataConfig, vocab_size: int) -> TrainingData:
    """Open a data spec's sources; one sampler stream per (source, length bucket)."""
    spec = cfg.spec
    cache = cfg.cache_dir or DEFAULT_CACHE
    prefixes = [source_location(source, cache) for source in spec.sources]
    how = {
        "tokenizer_type": cfg.tokenizer_type,
        "tokenizer_model": cfg.tokenizer_model,
        "cache_dir": cache,
        "tokenizer": cfg.tokenizer,
    }
    if cfg.lengths_only:
        datasets = [open_lengths(s, **how, build=cfg.build_lengths) for s in spec.sources]
    else:
        datasets = [open_source(source, **how) for source in spec.sources]
    train_units, valid_units = _split_units(prefixes, datasets, cfg)
    streams, sources = [], []
    for k, units in enumerate(train_units):
        buckets = np.asarray(spec.bucket_of(units.length.tolist()), dtype=np.int64)
        for b in range(max(1, len(spec.buckets))):
            streams.append(_subset(units, buckets == b))
            sources.append(k)
    tokens = [u.num_tokens for u in streams]
    phases = [(until, spec.stream_weights(w, tokens)) for until, w in spec.phase_weights()]
    for (until, weights), (_, named) in zip(phases, spec.phase_weights(), strict=True):
        when = f" (the phase up to step {until})" if until else ""
        empty = [spec.streams[k] for k, w in enumerate(weights) if w > 0 and not len(streams[k])]
        if empty or sum(weights) <= 0:
            raise ValueError(
                f"data spec {spec.origin}: the weights {dict(named)}{when} select "
                f"{', '.join(empty) or 'streams'} with no training sequence "
                f"(--seq-length {cfg.seq_length}, --split {','.join(map(str, cfg.split))})"
            )
    train = TokenBudgetSampler(
        streams,
        phases[0][1],
        seed=cfg.seed,
        tokens_per_batch=cfg.tokens_per_batch,
        units_per_batch=cfg.units_per_batch,
        sources=sources,
        schedule=phases if spec.schedule else None,
        ramp=cfg.ramp,
    )
    has_valid = all(len(u) > 0 for u in valid_units)
    if not has_valid:
        logger.warning("no validation documents in some source: evaluation is skipped")
    return TrainingData(
        datasets=datasets,
        prefixes=prefixes,
        train=train,
        vocab_size=vocab_size,
        train_units=train_units,
        valid_units=valid_units if has_valid else None,
        cfg=cfg,
        valid_weights=[float(u.num_tokens) for u in valid_units] if has_valid else None,
    )


def _check_batch_fits(data: TrainingData) -> TrainingData:
    """ValueError if one global batch needs more tokens than the training data holds."""
    tokens = sum(u.num_tokens for u in data.train.datasets)
    wanted = data.cfg.tokens_per_batch
    if wanted is not None and wanted > tokens:
        raise ValueError(
            f"{data.cfg.batch_flag or f'--hdp-global-batch-tokens {wanted}'}: a global batch "
            f"of more than the {tokens} "
            f"training tokens of the data (every step would read every document "
            f"{wanted / tokens:.1f} times)"
        )
    units = sum(len(u) for u in data.train.datasets)
    if data.cfg.units_per_batch is not None and data.cfg.units_per_batch > units:
        raise ValueError(
            f"a global batch of {data.cfg.units_per_batch} sequences: more than the {units} "
            "training sequences of the data"
        )
    return data


def build_training_data(cfg: DataConfig) -> TrainingData:
    """Open (or build) the datasets, split them and make the train/valid samplers.

    Raises ValueError for unreadable data, a dataset split with no usable document, or a
    global batch larger than the training data.
    """
    vocab_size = _vocab_size(cfg)
    if cfg.spec is not None:
        return _check_batch_fits(_spec_data(cfg, vocab_size))
    if cfg.blend:
        prefixes = [prefix for _, prefix in cfg.blend]
    else:
        prefixes = [ensure_stdlib_corpus(cfg.cache_dir or DEFAULT_CACHE)]
        logger.debug("no --data-path: using the embedded stdlib corpus %s", prefixes[0])
    datasets = [open_indexed_dataset(prefix) for prefix in prefixes]
    if cfg.lengths_only:
        datasets = [
            LengthsOnly(p, d.sequence_lengths, owner=d)
            for p, d in zip(prefixes, datasets, strict=True)
        ]
    return training_data_from(prefixes, datasets, cfg, vocab_size)


def training_data_from(
    prefixes: list[str], datasets: list, cfg: DataConfig, vocab_size: int
) -> TrainingData:
    """Split datasets already open and make the samplers (no reading, no communication).

    One dataset per `cfg.blend` entry, or one without a blend; `prefixes` name them in
    checkpoints. Each dataset needs `sequence_lengths` and `get(doc, offset, length)`
    (Megatron's `IndexedDataset`).

    Raises ValueError for a dataset split with no usable document or a global batch larger
    than the training data.
    """
    train_units, valid_units = _split_units(prefixes, datasets, cfg)
    if not all(len(u) > 0 for u in valid_units):
        logger.warning("no validation documents in some dataset: evaluation is skipped")
        valid_units = None
    return _check_batch_fits(
        TrainingData(
            datasets=datasets,
            prefixes=prefixes,
            train=_sampler(train_units, cfg, seed=cfg.seed, ramp=cfg.ramp),
            vocab_size=vocab_size,
            train_units=train_units,
            valid_units=valid_units,
            cfg=cfg,
        )
    )
