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
  the blend weights and the tokens consumed so far (the dataset furthest below its token
  share goes next, as Megatron's blending does with its fixed-length samples), so blend
  weights are token shares and the stream depends on the seed and the consumed counts only.

The sampler never reads tokens: lengths come from the index.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_hdp.data.batch_ramp import BatchRamp


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


def _normalised(weights: Sequence[float]) -> np.ndarray:
    """Weights as shares; ValueError unless all are finite, >= 0, and some positive."""
    w = np.asarray(weights, dtype=np.float64)
    if not np.isfinite(w).all() or (w < 0).any() or not (w > 0).any():
        raise ValueError(
            f"blend weights must be positive (finite, >= 0, not all 0), got {list(weights)}"
        )
    with np.errstate(over="ignore"):
        total = w.sum()
    if not np.isfinite(total):  # huge weights: scale first, or every share would be 0
        w = w / w.max()
        total = w.sum()
    return w / total


#: The numbers of a `--split` value, found as Megatron-Core finds them
#: (`blended_megatron_dataset_config.parse_and_normalize_split`: `re.findall(r"[.0-9]+", split)`).
_SPLIT_NUMBER = re.compile(r"[.0-9]+")


def parse_split(text: str) -> list[float]:
    """Parse Megatron's `--split` as Megatron-Core does: every run of digits and dots is a weight.

    So "969,30,1", "98/2/0" and NVIDIA's recipes' `'99,1,0'` (quote characters inside the
    value) all parse; as in Megatron-Core, anything else between the numbers is ignored.
    Raises ValueError (naming the value) where Megatron-Core would fail or divide by zero:
    no number, a run that is no number ("1.2.3"), more than 3 weights, or a zero sum.
    """
    found = _SPLIT_NUMBER.findall(text)
    try:
        values = [float(x) for x in found]
    except ValueError:
        values = []
    if not values or len(values) != len(found):
        raise ValueError(f"--split {text!r} is not a list of numbers like 969,30,1") from None
    try:
        split_ranges(1, values)  # validates
    except ValueError as err:
        raise ValueError(f"--split {text!r}: {err}") from None
    return values


@dataclass
class SamplerState:
    """Where the stream stands: units and tokens consumed from each stream, and steps.

    With a schedule, `phase` is the schedule phase of the last batch and `phase_start` the
    tokens each stream had consumed when that phase began (weights are shares of the
    tokens drawn within a phase).
    """

    consumed: list[int]
    tokens: list[int]
    steps: int = 0
    phase: int = 0
    phase_start: list[int] | None = None

    def to_dict(self) -> dict:
        """A JSON-serialisable copy."""
        data = {"consumed": list(self.consumed), "tokens": list(self.tokens), "steps": self.steps}
        if self.phase_start is not None:
            data.update(phase=self.phase, phase_start=list(self.phase_start))
        return data

    @classmethod
    def from_dict(cls, data: dict) -> SamplerState:
        """Inverse of `to_dict`."""
        start = data.get("phase_start")
        return cls(
            consumed=[int(c) for c in data["consumed"]],
            tokens=[int(t) for t in data["tokens"]],
            steps=int(data["steps"]),
            phase=int(data.get("phase", 0)),
            phase_start=None if start is None else [int(t) for t in start],
        )


class TokenBudgetSampler:
    """Deterministic global batches of whole units, by token budget or by unit count.

    Args:
        datasets: Units of every stream of the blend (a dataset, or one length bucket of
            a data spec's source).
        weights: Blend weights (normalised here); one per stream, >= 0 with a positive sum.
        seed: Seeds every epoch permutation.
        tokens_per_batch: Token budget of a global batch (inputs); units are added while
            they fit, so a batch holds at most this many tokens and at least one unit.
        units_per_batch: Alternatively, a fixed number of units per batch.
        sources: The dataset each stream's units read from (`Unit.dataset`); default: the
            stream's own index.
        schedule: Phases `(until_step, weights)` replacing `weights` for the steps up to
            `until_step` (1-based, inclusive); the last phase's weights hold after it.
        ramp: Megatron-LM's batch size per step (`batch_ramp.BatchRamp`): the budget of
            step i is then `ramp.tokens_of_step(i)` (`tokens_per_batch` is the last one).
    """

    def __init__(
        self,
        datasets: Sequence[DatasetUnits],
        weights: Sequence[float],
        *,
        seed: int,
        tokens_per_batch: int | None = None,
        units_per_batch: int | None = None,
        sources: Sequence[int] | None = None,
        schedule: Sequence[tuple[int, Sequence[float]]] | None = None,
        ramp: BatchRamp | None = None,
    ) -> None:
        phases = [(int(until), list(w)) for until, w in schedule] if schedule else []
        for _, phase_weights in [(None, weights), *phases]:
            if len(datasets) == 0 or len(phase_weights) != len(datasets):
                raise ValueError(
                    f"need one weight per dataset: {len(phase_weights)} for {len(datasets)}"
                )
        w = _normalised(weights)
        self._phases = [(until, _normalised(pw)) for until, pw in phases]
        for pw in [pw for _, pw in self._phases] or [w]:
            empty = [k for k in range(len(datasets)) if pw[k] > 0 and len(datasets[k]) == 0]
            if empty:
                raise ValueError(f"dataset {empty[0]} of the blend has no usable document")
        if ramp is not None and tokens_per_batch is None and units_per_batch is None:
            tokens_per_batch = ramp.global_batch_size * ramp.seq_length
        if ramp is not None and tokens_per_batch != ramp.global_batch_size * ramp.seq_length:
            raise ValueError("a ramp's sampler takes its token budget from the ramp")
        if (tokens_per_batch is None) == (units_per_batch is None):
            raise ValueError("give exactly one of tokens_per_batch and units_per_batch")
        longest = max(int(units.length.max()) for units in datasets if len(units))
        if tokens_per_batch is not None and tokens_per_batch < longest:
            raise ValueError(
                f"a global batch of {tokens_per_batch} tokens is smaller than one sequence "
                f"({longest} tokens)"
            )
        if units_per_batch is not None and units_per_batch < 1:
            raise ValueError(f"units_per_batch must be >= 1, got {units_per_batch}")
        self.datasets = list(datasets)
        self.weights = w
        self.sources = list(sources) if sources is not None else list(range(len(datasets)))
        self.seed = seed
        self.tokens_per_batch = tokens_per_batch
        self.units_per_batch = units_per_batch
        self.ramp = ramp
        self.state = SamplerState(consumed=[0] * len(datasets), tokens=[0] * len(datasets))
        if self._phases:
            self.state.phase_start = [0] * len(datasets)
        self._perm_cache: dict[tuple[int, int], np.ndarray] = {}

    def _permutation(self, dataset: int, epoch: int) -> np.ndarray:
        key = (dataset, epoch)
        if key not in self._perm_cache:
            if len(self._perm_cache) > 2 * len(self.datasets):
                self._perm_cache.clear()
            rng = np.random.default_rng([self.seed, dataset, epoch])
            self._perm_cache[key] = rng.permutation(len(self.datasets[dataset]))
        return self._perm_cache[key]

    def _phase_of(self, step: int) -> int:
        """The schedule phase of the 0-based batch `step` (the last phase holds after it)."""
        for k, (until, _) in enumerate(self._phases):
            if step < until:
                return k
        return len(self._phases) - 1

    def current_weights(self) -> np.ndarray:
        """The normalised stream weights of the next batch."""
        if not self._phases:
            return self.weights
        return self._phases[self._phase_of(self.state.steps)][1]

    def _next_dataset(self, weights: np.ndarray) -> int:
        tokens = np.asarray(self.state.tokens, dtype=np.float64)
        if self.state.phase_start is not None:
            tokens = tokens - np.asarray(self.state.phase_start, dtype=np.float64)
        deficit = weights * tokens.sum() - tokens
        return int(np.argmax(np.where(weights > 0, deficit, -np.inf)))

    def _unit(self, dataset: int, index: int) -> Unit:
        units = self.datasets[dataset]
        epoch, offset = divmod(index, len(units))
        i = int(self._permutation(dataset, epoch)[offset])
        return Unit(
            self.sources[dataset], int(units.doc[i]), int(units.start[i]), int(units.length[i])
        )

    def next_batch(self) -> list[Unit]:
        """The next global batch; advances the state."""
        if self._phases:
            phase = self._phase_of(self.state.steps)
            if phase != self.state.phase:
                self.state.phase, self.state.phase_start = phase, list(self.state.tokens)
        weights = self.current_weights()
        budget = self.budget_of_step(self.state.steps)
        batch: list[Unit] = []
        tokens = 0
        while True:
            k = self._next_dataset(weights)
            unit = self._unit(k, self.state.consumed[k])
            if self.units_per_batch is not None:
                if len(batch) == self.units_per_batch:
                    break
            elif batch and tokens + unit.length > budget:
                break
            batch.append(unit)
            tokens += unit.length
            self.state.consumed[k] += 1
            self.state.tokens[k] += unit.length
        self.state.steps += 1
        return batch

    def budget_of_step(self, step: int) -> int | None:
        """The token budget of the 0-based batch `step` (None: batches of `units_per_batch`)."""
        if self.ramp is not None:
            return self.ramp.tokens_of_step(step)
        return self.tokens_per_batch

    def setup(self) -> dict:
        """What the stream depends on besides the state: seed, weights, budgets, units."""
        setup = {
            "seed": self.seed,
            "weights": [float(w) for w in self.weights],
            "tokens_per_batch": self.tokens_per_batch,
            "units_per_batch": self.units_per_batch,
            "units": [len(u) for u in self.datasets],
            "unit_tokens": [u.num_tokens for u in self.datasets],
        }
        if self._phases:  # absent otherwise, so that older checkpoints' set-ups still match
            setup["schedule"] = [[until, [float(x) for x in w]] for until, w in self._phases]
        if self.ramp is not None and self.ramp.rampup is not None:
            setup["rampup"] = list(self.ramp.rampup)  # absent without one, as before ramps
        if self.ramp is not None and self.ramp.schedule is not None:
            setup["step_schedule"] = [list(e) for e in self.ramp.schedule]
        if self.sources != list(range(len(self.datasets))):
            setup["sources"] = list(self.sources)
        return setup

    def state_dict(self) -> dict:
        """The resumable state, with the set-up it belongs to."""
        return {"setup": self.setup(), **self.state.to_dict()}

    def load_state_dict(self, data: dict) -> None:
        """Continue from a saved state; ValueError naming what differs if the set-up changed.

        A different seed, blend, batch size or sequence length (which changes the units)
        would break "every document once per epoch", so it is refused.
        """
        saved, mine = data["setup"], self.setup()
        for key in sorted(set(mine) | set(saved)):
            if saved.get(key) != mine.get(key):
                raise ValueError(
                    f"the data state was saved with {key}={saved.get(key)!r}, but this run has "
                    f"{key}={mine.get(key)!r} (changed --seed, --data-path, --hdp-data-spec, "
                    "--split, --seq-length or global batch size?)"
                )
        self.state = SamplerState.from_dict(data)

    def skip_tokens(self, tokens: int, *, steps: int) -> list[int]:
        """Start the stream after its first `tokens` input tokens; `steps` batches counted.

        For a job that trained `tokens` tokens elsewhere (a stock Megatron-LM checkpoint
        switched to HDP): each stream `k` of the blend skips the shortest prefix of its own
        order (its seeded permutation, epoch after epoch) that holds at least
        `round(share_k * tokens)` input tokens, `share_k` being the stream's weight for the
        batch `steps`; with one stream, exactly the first units reaching `tokens`. The next
        batch is the batch `steps` (0-based) of the schedule, whose phase counts its shares
        from here. Returns the units skipped per stream. No communication; vectorised
        (one cumulative sum over one epoch's permutation per stream).
        """
        if tokens < 0 or steps < 0:
            raise ValueError(f"tokens and steps must be >= 0, got {tokens} and {steps}")
        shares = self._phases[self._phase_of(steps)][1] if self._phases else self.weights
        consumed, used = [], []
        for k, units in enumerate(self.datasets):
            target = int(round(float(shares[k]) * tokens))
            epoch_tokens = units.num_tokens
            if target == 0 or epoch_tokens == 0:
                consumed.append(0)
                used.append(0)
                continue
            epochs, rest = divmod(target, epoch_tokens)
            count, taken = epochs * len(units), epochs * epoch_tokens
            if rest:
                running = np.cumsum(units.length[self._permutation(k, epochs)])
                last = int(np.searchsorted(running, rest))  # first prefix holding >= rest
                count, taken = count + last + 1, taken + int(running[last])
            consumed.append(count)
            used.append(taken)
        self.state = SamplerState(consumed=consumed, tokens=used, steps=steps)
        if self._phases:
            self.state.phase, self.state.phase_start = self._phase_of(steps), list(used)
        return consumed
