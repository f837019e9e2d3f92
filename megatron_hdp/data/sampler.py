"""Global batches by token budget, from document lengths alone (pure layer, numpy).

Vocabulary:
- *document*: one entry of an indexed dataset (its tokens end with the EOD token).
- *unit*: what the planner places, one training sequence. A document of `L` tokens gives
  `L - 1` input positions (the last token is only a label); they are cut into units of at
  most `max_seq_length` inputs, so a long document becomes several context-sized pieces.
  A unit `(doc, start, length)` reads tokens `[start, start + length + 1)` of its document.
- *stream*: the order in which units are consumed. Each dataset of a blend walks its units
  in a seeded permutation, a new one every epoch, so within an epoch every unit (and so
  every document) is used exactly once. Which dataset feeds the next unit is decided by
  the blend weights alone (largest deficit first, as Megatron's blending does), so the
  stream depends on the seed and the consumed counts only.

The sampler never reads tokens: lengths come from the index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Unit:
    """One training sequence: `length` inputs from token `start` of document `doc`."""

    dataset: int
    doc: int
    start: int
    length: int


@dataclass(frozen=True)
class DatasetUnits:
    """The units of one dataset split, as parallel arrays."""

    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray

    @classmethod
    def from_documents(
        cls, doc_ids: np.ndarray, doc_lengths: np.ndarray, *, max_seq_length: int
    ) -> DatasetUnits:
        """Cut documents (token counts `doc_lengths`) into units of <= `max_seq_length` inputs."""
        if max_seq_length < 1:
            raise ValueError(f"max_seq_length must be >= 1, got {max_seq_length}")
        doc_ids = np.asarray(doc_ids, dtype=np.int64)
        inputs = np.asarray(doc_lengths, dtype=np.int64) - 1
        keep = inputs >= 1
        doc_ids, inputs = doc_ids[keep], inputs[keep]
        pieces = (inputs + max_seq_length - 1) // max_seq_length
        doc = np.repeat(doc_ids, pieces)
        first = np.repeat(np.cumsum(pieces) - pieces, pieces)
        piece_index = np.arange(len(doc), dtype=np.int64) - first
        start = piece_index * max_seq_length
        length = np.minimum(max_seq_length, np.repeat(inputs, pieces) - start)
        return cls(doc=doc, start=start, length=length)

    def __len__(self) -> int:
        return len(self.doc)

    @property
    def num_tokens(self) -> int:
        """Input tokens of all units."""
        return int(self.length.sum())


def split_ranges(num_docs: int, split: Sequence[float]) -> list[tuple[int, int]]:
    """Document index ranges of the train/valid/test splits ("969,30,1" style weights)."""
    weights = np.asarray(list(split) + [0.0] * (3 - len(split)), dtype=np.float64)[:3]
    if len(split) == 0 or len(split) > 3 or (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(f"split needs 1 to 3 non-negative weights with a positive sum: {split}")
    bounds = np.round(np.concatenate([[0.0], np.cumsum(weights / weights.sum())]) * num_docs)
    bounds = bounds.astype(np.int64)
    bounds[-1] = num_docs
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(3)]


def parse_split(text: str) -> list[float]:
    """Parse Megatron's `--split` ("969,30,1" or "98/2/0")."""
    try:
        values = [float(x) for x in text.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--split {text!r} is not a list of numbers like 969,30,1") from None
    split_ranges(1, values)  # validates
    return values


@dataclass
class SamplerState:
    """Where the stream stands: units consumed from each dataset and in total."""

    consumed: list[int]
    steps: int = 0

    def to_dict(self) -> dict:
        """A JSON-serialisable copy."""
        return {"consumed": list(self.consumed), "steps": self.steps}

    @classmethod
    def from_dict(cls, data: dict) -> SamplerState:
        """Inverse of `to_dict`."""
        return cls(consumed=[int(c) for c in data["consumed"]], steps=int(data["steps"]))


class TokenBudgetSampler:
    """Deterministic global batches of whole units, by token budget or by unit count.

    Args:
        datasets: Units of every dataset of the blend.
        weights: Blend weights (normalised here); one per dataset.
        seed: Seeds every epoch permutation.
        tokens_per_batch: Token budget of a global batch (inputs); units are added while
            they fit, so a batch holds at most this many tokens and at least one unit.
        units_per_batch: Alternatively, a fixed number of units per batch.
    """

    def __init__(
        self,
        datasets: Sequence[DatasetUnits],
        weights: Sequence[float],
        *,
        seed: int,
        tokens_per_batch: int | None = None,
        units_per_batch: int | None = None,
    ) -> None:
        if len(datasets) == 0 or len(weights) != len(datasets):
            raise ValueError(f"need one weight per dataset: {len(weights)} for {len(datasets)}")
        for k, units in enumerate(datasets):
            if len(units) == 0:
                raise ValueError(f"dataset {k} of the blend has no usable document")
        w = np.asarray(weights, dtype=np.float64)
        if (w <= 0).any():
            raise ValueError(f"blend weights must be positive, got {list(weights)}")
        if (tokens_per_batch is None) == (units_per_batch is None):
            raise ValueError("give exactly one of tokens_per_batch and units_per_batch")
        longest = max(int(units.length.max()) for units in datasets)
        if tokens_per_batch is not None and tokens_per_batch < longest:
            raise ValueError(
                f"a global batch of {tokens_per_batch} tokens is smaller than one sequence "
                f"({longest} tokens)"
            )
        if units_per_batch is not None and units_per_batch < 1:
            raise ValueError(f"units_per_batch must be >= 1, got {units_per_batch}")
        self.datasets = list(datasets)
        self.weights = w / w.sum()
        self.seed = seed
        self.tokens_per_batch = tokens_per_batch
        self.units_per_batch = units_per_batch
        self.state = SamplerState(consumed=[0] * len(datasets))
        self._perm_cache: dict[tuple[int, int], np.ndarray] = {}

    def _permutation(self, dataset: int, epoch: int) -> np.ndarray:
        key = (dataset, epoch)
        if key not in self._perm_cache:
            if len(self._perm_cache) > 2 * len(self.datasets):
                self._perm_cache.clear()
            rng = np.random.default_rng([self.seed, dataset, epoch])
            self._perm_cache[key] = rng.permutation(len(self.datasets[dataset]))
        return self._perm_cache[key]

    def _next_dataset(self) -> int:
        consumed = np.asarray(self.state.consumed, dtype=np.float64)
        total = consumed.sum()
        return int(np.argmax(self.weights * (total + 1) - consumed))

    def _unit(self, dataset: int, index: int) -> Unit:
        units = self.datasets[dataset]
        epoch, offset = divmod(index, len(units))
        i = int(self._permutation(dataset, epoch)[offset])
        return Unit(dataset, int(units.doc[i]), int(units.start[i]), int(units.length[i]))

    def epoch_of(self, dataset: int) -> int:
        """The epoch the next unit of `dataset` belongs to."""
        return self.state.consumed[dataset] // len(self.datasets[dataset])

    def next_batch(self) -> list[Unit]:
        """The next global batch; advances the state."""
        batch: list[Unit] = []
        tokens = 0
        while True:
            k = self._next_dataset()
            unit = self._unit(k, self.state.consumed[k])
            if self.units_per_batch is not None:
                if len(batch) == self.units_per_batch:
                    break
            elif batch and tokens + unit.length > self.tokens_per_batch:
                break
            batch.append(unit)
            tokens += unit.length
            self.state.consumed[k] += 1
        self.state.steps += 1
        return batch

    def state_dict(self) -> dict:
        """The resumable state (with the seed, to catch a resume under another seed)."""
        return {"seed": self.seed, **self.state.to_dict()}

    def load_state_dict(self, data: dict) -> None:
        """Continue from a saved state; ValueError if it belongs to another set-up."""
        if int(data["seed"]) != self.seed:
            raise ValueError(f"data state was saved with seed {data['seed']}, not {self.seed}")
        state = SamplerState.from_dict(data)
        if len(state.consumed) != len(self.datasets):
            raise ValueError(
                f"data state has {len(state.consumed)} datasets, this blend has "
                f"{len(self.datasets)}"
            )
        self.state = state
