"""Megatron-LM's batch sizes in samples of --seq-length tokens (`data.batch_ramp`).

The reference is Megatron-Core's own calculator (`num_microbatches_calculator`), driven
as Megatron-LM's training loop drives it: `update(consumed_samples)` before each step, then
the step's samples added to the consumed count.
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hdp.data.batch_ramp import BatchRamp, ramp_problems
from megatron_hdp.data.sampler import DatasetUnits, TokenBudgetSampler

calculator = pytest.importorskip("megatron.core.num_microbatches_calculator")
RAMPS = [(2, 2, 20, 10), (4, 4, 1, 16), (1, 1, 7, 4), (3, 3, 100, 12)]


def _megatron_steps(start, increment, samples, gbs, steps):
    if not hasattr(calculator, "RampupBatchsizeNumMicroBatchesCalculator"):
        pytest.skip("this megatron-core has no --rampup-batch-size calculator (0.19 ignores it)")
    calc = calculator.RampupBatchsizeNumMicroBatchesCalculator(
        gbs, 1, 1, False, 1, start, increment, samples
    )
    sizes, consumed = [], 0
    for _ in range(steps):
        calc.update(consumed, consistency_check=True)
        sizes.append(calc.get_current_global_batch_size())
        consumed += sizes[-1]
    return sizes


@pytest.mark.parametrize("start,increment,samples,gbs", RAMPS)
def test_the_ramp_is_megatron_cores_calculator(start, increment, samples, gbs):
    ramp = BatchRamp(gbs, seq_length=64, rampup=(start, increment, samples))
    want = _megatron_steps(start, increment, samples, gbs, 30)
    assert [ramp.samples_of_step(i) for i in range(30)] == want
    assert [ramp.tokens_of_step(i) for i in range(30)] == [64 * s for s in want]
    # asked out of order (prefetched steps): the same sizes
    late = BatchRamp(gbs, seq_length=64, rampup=(start, increment, samples))
    assert [late.samples_of_step(i) for i in (29, 3, 0, 17)] == [want[i] for i in (29, 3, 0, 17)]


def _megatron_train_iters(start, increment, samples, gbs, train_samples):
    """Megatron-LM core_v0.16.1's `update_train_iters` loop, over Megatron-Core's calculator."""
    calculator.destroy_num_microbatches_calculator()
    calculator.init_num_microbatches_calculator(0, [start, increment, samples], gbs, 1, 1)
    try:
        iterations = consumed = 0
        while consumed <= samples and consumed <= train_samples:
            calculator.update_num_microbatches(consumed, consistency_check=False)
            consumed += calculator.get_current_global_batch_size()
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // gbs
        return iterations
    finally:
        calculator.destroy_num_microbatches_calculator()


@pytest.mark.parametrize("start,increment,samples,gbs", RAMPS)
@pytest.mark.parametrize("train_samples", [5, 40, 333])
def test_train_samples_give_megatron_lms_steps(start, increment, samples, gbs, train_samples):
    _megatron_steps(start, increment, samples, gbs, 1)  # skips where 0.19 has no ramp
    ramp = BatchRamp(gbs, seq_length=8, rampup=(start, increment, samples))
    assert ramp.train_iters(train_samples) == _megatron_train_iters(
        start, increment, samples, gbs, train_samples
    )


def test_without_a_ramp_every_step_is_the_batch():
    ramp = BatchRamp(6, seq_length=512)
    assert {ramp.tokens_of_step(i) for i in range(5)} == {6 * 512}
    assert ramp.train_iters(100) == 100 // 6


@pytest.mark.parametrize(
    "gbs,rampup,word",
    [
        (8, (3, 2, 10), "multiple of the increment"),
        (8, (8, 2, 10), "multiple"),
        (8, (0, 2, 1), ">= 1"),
        (8, (2, 2, 0), ">= 1"),  # Megatron-Core divides by zero
    ],
)
def test_a_ramp_megatron_lm_would_assert_on_is_refused(gbs, rampup, word):
    (problem,) = ramp_problems(gbs, rampup)
    assert "--rampup-batch-size" in problem and word in problem


def test_the_sampler_fills_each_step_to_its_ramped_budget():
    """Step i holds whole units up to (and just under) samples_of_step(i) x seq_length."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 40, size=4000)
    units = DatasetUnits.from_documents(np.arange(4000), lengths, max_seq_length=32)
    ramp = BatchRamp(8, seq_length=32, rampup=(2, 2, 30))
    sampler = TokenBudgetSampler([units], [1.0], seed=1, ramp=ramp)
    for step in range(12):
        budget = ramp.samples_of_step(step) * 32
        batch = sampler.next_batch()
        total = sum(u.length for u in batch)
        assert budget - 32 < total <= budget, (step, total, budget)
    assert sampler.setup()["rampup"] == [2, 2, 30]


SCHEDULES = ["0:4 2K:8 6K:12", "0:2,1K:6", "0:8", "4K:6 0:2 8.5K:10"]


def _step_calculator(schedule, seq_length):
    if not hasattr(calculator, "StepBatchsizeNumMicroBatchesCalculator"):
        pytest.skip("this megatron-core has no --step-batch-size-schedule (0.16)")
    return calculator.StepBatchsizeNumMicroBatchesCalculator(1, 1, False, 1, schedule, seq_length)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_step_schedule_is_megatron_cores_calculator(schedule):
    """megatron-core 0.19's `--step-batch-size-schedule` (thresholds in tokens): the same
    size every step as its calculator, asked in any order, and the same number of steps for
    `--train-samples` as core_v0.19.0's `update_train_iters` loop."""
    from megatron_hdp.data.batch_ramp import parse_step_schedule

    calc = _step_calculator(schedule, 128)
    steps = parse_step_schedule(schedule, 128)
    assert list(steps) == calc.schedule
    ramp = BatchRamp(steps[-1][1], seq_length=128, schedule=steps)
    want, consumed = [], 0
    for _ in range(40):
        calc.update(consumed, consistency_check=False)
        want.append(calc.get_current_global_batch_size())
        consumed += want[-1]
    assert [ramp.samples_of_step(i) for i in range(40)] == want
    late = BatchRamp(steps[-1][1], seq_length=128, schedule=steps)
    assert [late.tokens_of_step(i) for i in (39, 5, 0)] == [128 * want[i] for i in (39, 5, 0)]
    for train_samples in (1, 17, 64, 203):
        iterations = consumed = 0
        while consumed < train_samples:  # core_v0.19.0 training.py update_train_iters
            calc.update(consumed, consistency_check=False)
            consumed += calc.get_current_global_batch_size()
            iterations += 1
        assert ramp.train_iters(train_samples) == iterations, train_samples


@pytest.mark.parametrize(
    "schedule,word",
    [("1K:4 2K:8", "first threshold"), ("0:4 0:8", "strictly"), ("0:4 x", "THRESHOLD"),
     ("0:0", "positive"), ("0:a", "not a number")],
)  # fmt: skip
def test_a_bad_step_schedule_is_refused_naming_it(schedule, word):
    from megatron_hdp.data.batch_ramp import parse_step_schedule

    with pytest.raises(ValueError, match=word):
        parse_step_schedule(schedule, 128)
