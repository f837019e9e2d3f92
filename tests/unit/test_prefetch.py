"""The prefetcher against the sampler used directly: same batches, same order, and a
saved state that is what was handed out, however far the thread has run ahead."""

import threading
import time

import numpy as np
import pytest

from megatron_hdp.data.prefetch import Prefetcher
from megatron_hdp.data.sampler import DatasetUnits, TokenBudgetSampler


def sampler(seed=5):
    rng = np.random.default_rng(seed)
    units = DatasetUnits.from_documents(
        np.arange(300), rng.integers(2, 900, size=300), max_seq_length=256
    )
    return TokenBudgetSampler([units], [1.0], seed=seed, tokens_per_batch=1024)


def as_tuples(units):
    return [(u.dataset, u.doc, u.start, u.length) for u in units]


def prepare(units):
    return sum(u.length for u in units)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_same_batches_in_the_same_order_and_the_state_of_what_was_handed_out(depth):
    direct = sampler()
    expected, states = [], []
    for _ in range(12):
        expected.append(as_tuples(direct.next_batch()))
        states.append(direct.state_dict())
    feed = Prefetcher(sampler(), prepare, depth)
    try:
        for i in range(12):
            item = feed.next()
            assert as_tuples(item.units) == expected[i]
            assert item.value == sum(u[3] for u in expected[i]) and item.error is None
            assert item.wait_s >= 0
            if depth:
                deadline = time.monotonic() + 5
                while feed.sampler.state.steps < min(12, i + 1 + depth):  # ran ahead
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            assert feed.state_dict() == states[i]
    finally:
        feed.close()
    resumed = sampler()
    resumed.load_state_dict(states[6])
    feed = Prefetcher(resumed, prepare, depth)
    try:
        assert [as_tuples(feed.next().units) for _ in range(5)] == expected[7:12]
    finally:
        feed.close()


def test_a_failing_batch_is_handed_out_in_its_place_and_the_stream_goes_on():
    def picky(units):
        if picky.calls == 2:
            picky.calls += 1
            raise ValueError("cannot read document 7")
        picky.calls += 1
        return len(units)

    picky.calls = 0
    feed = Prefetcher(sampler(), picky, 2)
    try:
        items = [feed.next() for _ in range(4)]
    finally:
        feed.close()
    assert [i.error is None for i in items] == [True, True, False, True]
    assert "document 7" in str(items[2].error)


def test_close_stops_the_thread_and_bad_depths_are_refused():
    before = set(threading.enumerate())
    feed = Prefetcher(sampler(), prepare, 2)
    feed.next()
    (thread,) = [t for t in threading.enumerate() if t.name == "hdp-prefetch" and t not in before]
    feed.close()
    assert not thread.is_alive()
    for bad in (-1, 1.5, True, "2"):
        message = f"prefetch depth must be an integer >= 0, got {bad!r}"
        with pytest.raises(ValueError, match=message):
            Prefetcher(sampler(), prepare, bad)
