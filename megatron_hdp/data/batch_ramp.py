"""Megatron-LM's global batch size as a function of the step, in tokens (pure).

Megatron-LM counts training in *samples* of `--seq-length` tokens: `--global-batch-size B`
is B samples per step, `--train-samples` / `--lr-*-samples` are sample counts, and
`--rampup-batch-size start incr ramp_samples` grows the batch from `start` to B by `incr`
every `ramp_samples / ((B - start) / incr)` consumed samples
(`megatron.core.num_microbatches_calculator.RampupBatchsizeNumMicroBatchesCalculator`);
megatron-core 0.19 replaced the ramp by `--step-batch-size-schedule "THRESHOLD:B ..."`
(`StepBatchsizeNumMicroBatchesCalculator`: the batch is the B of the last threshold, in
tokens, that the consumed tokens reached).

HDP plans documents, not samples, so a sample is read as what it holds: `--seq-length`
tokens. Step i of a run then trains (up to whole documents) `samples_of_step(i) x
seq_length` tokens, and Megatron-LM's consumed-sample counter, its learning-rate schedule
and `--train-samples` agree with what HDP trained. `BatchRamp` is that arithmetic; it is
what the sampler asks for each step's token budget (deterministic from the step index, so
batches planned ahead by the prefetch thread get the same budget as the training loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BatchRamp:
    """Samples (and tokens) per step: `global_batch_size`, ramped up as Megatron-LM does.

    Args:
        global_batch_size: Samples per step after the ramp (`--global-batch-size`).
        seq_length: Tokens per sample (`--seq-length`).
        rampup: `(start, increment, ramp_samples)` of `--rampup-batch-size`, or None.
        schedule: `((threshold_samples, samples), ...)` of `--step-batch-size-schedule`
            (`parse_step_schedule`), or None; its last size is `global_batch_size`.
    """

    global_batch_size: int
    seq_length: int
    rampup: tuple[int, int, int] | None = None
    schedule: tuple[tuple[int, int], ...] | None = None
    _per_step: list[int] = field(default_factory=list, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        problems = ramp_problems(self.global_batch_size, self.rampup)
        if problems:
            raise ValueError(problems[0])
        if self.seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {self.seq_length}")
        if self.schedule is not None:
            if self.rampup is not None:
                raise ValueError("give --rampup-batch-size or --step-batch-size-schedule")
            if self.schedule[-1][1] != self.global_batch_size:
                raise ValueError(
                    f"global_batch_size {self.global_batch_size} is not the schedule's last "
                    f"size {self.schedule[-1][1]}"
                )

    @property
    def varies(self) -> bool:
        """Whether steps differ in size (a ramp or a step schedule)."""
        return self.rampup is not None or self.schedule is not None

    def samples_at(self, consumed_samples: int) -> int:
        """Megatron-LM's current global batch size after `consumed_samples` samples."""
        if self.schedule is not None:
            size = self.schedule[0][1]
            for threshold, samples in self.schedule:
                if consumed_samples < threshold:
                    break
                size = samples
            return size
        if self.rampup is None:
            return self.global_batch_size
        start, increment, ramp_samples = self.rampup
        if consumed_samples > ramp_samples:
            return self.global_batch_size
        per_increment = ramp_samples / ((self.global_batch_size - start) // increment)
        return start + int(consumed_samples / per_increment) * increment

    def samples_of_step(self, step: int) -> int:
        """Samples of the 0-based `step` (Megatron-LM's consumed count is their running sum)."""
        if not self.varies:
            return self.global_batch_size
        consumed = sum(self._per_step)
        while len(self._per_step) <= step:
            size = self.samples_at(consumed)
            self._per_step.append(size)
            consumed += size
        return self._per_step[step]

    def tokens_of_step(self, step: int) -> int:
        """The token budget of the 0-based `step`: its samples x `--seq-length`."""
        return self.samples_of_step(step) * self.seq_length

    def consumed_samples(self, steps: int) -> int:
        """Samples consumed by the first `steps` steps."""
        return sum(self.samples_of_step(i) for i in range(steps))

    def train_iters(self, train_samples: int) -> int:
        """Steps of a run of `--train-samples`, as Megatron-LM's `update_train_iters`.

        The ramp's steps while at most `ramp_samples` (and `train_samples`) are consumed,
        then whole steps of `global_batch_size` (a partial last batch is dropped). With a
        step schedule, steps until `train_samples` are consumed (the last may overshoot), as
        core_v0.19's `update_train_iters`.
        """
        if self.schedule is not None:
            iterations = consumed = 0
            while consumed < train_samples:
                consumed += self.samples_at(consumed)
                iterations += 1
            return iterations
        if self.rampup is None:
            return train_samples // self.global_batch_size
        iterations = consumed = 0
        while consumed <= self.rampup[2] and consumed <= train_samples:
            consumed += self.samples_at(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations

    def setup(self) -> dict:
        """What the batch sizes depend on (recorded in the sampler's checkpointed set-up)."""
        return {
            "global_batch_size": self.global_batch_size,
            "seq_length": self.seq_length,
            "rampup": None if self.rampup is None else list(self.rampup),
            **({} if self.schedule is None else {"schedule": [list(e) for e in self.schedule]}),
        }


def ramp_problems(global_batch_size: int | None, rampup: Sequence[int] | None) -> list[str]:
    """What Megatron-LM's calculator would assert about these values, as sentences."""
    if global_batch_size is None or global_batch_size < 1:
        return [f"--global-batch-size must be >= 1, got {global_batch_size}"]
    if rampup is None:
        return []
    if len(rampup) != 3:
        return [f"--rampup-batch-size takes start increment samples, got {list(rampup)}"]
    start, increment, samples = (int(x) for x in rampup)
    named = f"--rampup-batch-size {start} {increment} {samples}"
    if start < 1 or increment < 1 or samples < 1:
        # samples 0 passes Megatron-Core's assert, then divides by zero at the first step
        return [f"{named}: start, increment and samples must be >= 1"]
    diff = global_batch_size - start
    if diff <= 0 or diff % increment:
        return [
            f"{named}: --global-batch-size {global_batch_size} minus the start must be a "
            f"positive multiple of the increment (Megatron-LM's rule)"
        ]
    return []


_SUFFIXES = {"T": 10**12, "B": 10**9, "M": 10**6, "K": 10**3}


def _count(text: str) -> int:
    """`250B` -> 250e9, as Megatron-Core reads a schedule's numbers (K, M, B, T)."""
    text = text.strip().upper()
    multiplier = _SUFFIXES.get(text[-1:], 1)
    if multiplier != 1:
        text = text[:-1]
    return int(float(text) * multiplier)


def parse_step_schedule(text: str, seq_length: int) -> tuple[tuple[int, int], ...]:
    """`--step-batch-size-schedule "0:768 250B:1536"` as megatron-core 0.19 reads it.

    Thresholds are tokens (Megatron-LM passes `--seq-length`, so each becomes
    `threshold // seq_length` samples), sizes are samples per step; sorted by threshold; the
    first threshold must be 0, thresholds strictly increase, sizes are positive. Raises
    ValueError naming the bad entry.
    """
    entries = []
    for entry in text.strip().replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(
                f'--step-batch-size-schedule: entry "{entry}" is not THRESHOLD:BATCH_SIZE'
            )
        threshold, size = entry.split(":", 1)
        try:
            entries.append((_count(threshold) // seq_length, _count(size)))
        except ValueError:
            raise ValueError(
                f'--step-batch-size-schedule: entry "{entry}" is not a number'
            ) from None
    entries.sort(key=lambda e: e[0])
    if not entries or entries[0][0] != 0:
        raise ValueError(f'--step-batch-size-schedule "{text}": the first threshold must be 0')
    for before, after in zip(entries, entries[1:]):
        if after[0] <= before[0]:
            raise ValueError(
                f'--step-batch-size-schedule "{text}": thresholds must strictly increase '
                f"(in samples of --seq-length {seq_length} tokens)"
            )
    if any(size <= 0 for _, size in entries):
        raise ValueError(f'--step-batch-size-schedule "{text}": batch sizes must be positive')
    return tuple(entries)
