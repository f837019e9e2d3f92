"""GlobalBatchLoader: read errors are handed to the step, close() rewinds the sampler."""

import numpy as np

from megatron_hdp.data.loader import GlobalBatchLoader
from megatron_hdp.data.sampler import DatasetUnits, TokenBudgetSampler
from megatron_hdp.data.service.client import PlannedBatch
from megatron_hdp.scheduler import plan_step


class _Doc:
    """An `IndexedReader` of documents whose token i is i % 200."""

    def get(self, idx, offset=0, length=None):
        return np.arange(offset, offset + length) % 200


def _sampler():
    lengths = np.array([30, 70, 12, 90, 55, 8, 64, 40] * 4)
    units = DatasetUnits.from_documents(np.arange(len(lengths)), lengths, max_seq_length=32)
    return TokenBudgetSampler([units], [1.0], seed=3, tokens_per_batch=64)


def _plan(lengths):
    return plan_step(lengths, pool_size=2, capacity=16, policy="greedy")


def test_close_rewinds_the_sampler_to_the_last_batch_handed_out():
    straight = _sampler()
    expected = [straight.next_batch() for _ in range(5)]
    sampler = _sampler()
    loader = GlobalBatchLoader(sampler, _plan, [_Doc()], rank=0, depth=3)
    first = [loader.next().units for _ in range(2)]
    loader.close()  # the thread had prepared up to 3 more
    assert first == expected[:2]
    assert sampler.state_dict()["steps"] == 2
    again = GlobalBatchLoader(sampler, _plan, [_Doc()], rank=1, depth=2)
    try:
        assert [again.next().units for _ in range(3)] == expected[2:]
    finally:
        again.close()


class _FailingService:
    def tokens(self, batch, rank, collect, **kwargs):
        raise RuntimeError("source loader 0 of source 0 failed 3 times")

    def note_wait(self, seconds):  # the data wait the loader reports to the planner
        self.waited = seconds


class _PlannedBatches:
    """A sampler-like feed of batches that come planned (as the Ray service's do)."""

    def __init__(self):
        self.inner = _sampler()

    def next_batch(self):
        units = self.inner.next_batch()
        return PlannedBatch(units, _plan([u.length for u in units]))

    def state_dict(self):
        return self.inner.state_dict()


def test_a_failed_fetch_is_handed_to_the_step_not_raised_on_one_rank():
    loader = GlobalBatchLoader(
        _PlannedBatches(), _plan, [], rank=0, depth=1, service=_FailingService()
    )
    try:
        item = loader.next()
    finally:
        loader.close()
    assert item.error is None  # the batch itself is fine: its plan and units are there
    plan, _, (local, error), _ = item.value
    assert plan.num_micro_batches > 0 and local == []
    assert isinstance(error, RuntimeError) and "failed 3 times" in str(error)
