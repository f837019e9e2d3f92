"""Token-budget sampler: units, epochs, budgets, blends, resume."""

import numpy as np
import pytest

from megatron_hdp.data.sampler import (
    DatasetUnits,
    TokenBudgetSampler,
    parse_split,
    split_ranges,
)


def brute_force_units(lengths, max_len):
    out = []
    for doc, n in enumerate(lengths):
        inputs = n - 1
        start = 0
        while start < inputs:
            out.append((doc, start, min(max_len, inputs - start)))
            start += max_len
    return out


def as_tuples(units: DatasetUnits):
    return list(zip(units.doc.tolist(), units.start.tolist(), units.length.tolist()))


def test_documents_are_cut_into_context_sized_units():
    lengths = [1, 2, 5, 9, 10, 11, 30]
    units = DatasetUnits.from_documents(np.arange(7), np.array(lengths), max_seq_length=4)
    assert as_tuples(units) == brute_force_units(lengths, 4)
    assert units.num_tokens == sum(n - 1 for n in lengths)


def test_every_unit_once_per_epoch_and_budget_respected():
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 200, size=57)
    units = DatasetUnits.from_documents(np.arange(57), lengths, max_seq_length=64)
    sampler = TokenBudgetSampler([units], [1.0], seed=3, tokens_per_batch=150)
    seen, batches = [], []
    while len(seen) < 2 * len(units):
        batch = sampler.next_batch()
        batches.append(batch)
        assert sum(u.length for u in batch) <= 150
        seen.extend((u.doc, u.start, u.length) for u in batch)
    epoch1, epoch2 = seen[: len(units)], seen[len(units) : 2 * len(units)]
    assert sorted(epoch1) == sorted(as_tuples(units))
    assert sorted(epoch2) == sorted(as_tuples(units))
    assert epoch1 != epoch2  # a new permutation every epoch
    for batch, following in zip(batches, batches[1:]):
        assert sum(u.length for u in batch) + following[0].length > 150  # batches are full


def test_resume_continues_the_same_stream():
    units = DatasetUnits.from_documents(np.arange(40), np.arange(2, 42), max_seq_length=16)
    a = TokenBudgetSampler([units], [1.0], seed=9, tokens_per_batch=50)
    for _ in range(5):
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch() for _ in range(20)]
    b = TokenBudgetSampler([units], [1.0], seed=9, tokens_per_batch=50)
    b.load_state_dict(state)
    assert [b.next_batch() for _ in range(20)] == expected
    with pytest.raises(ValueError, match="saved with seed=9, but this run has seed=10"):
        TokenBudgetSampler([units], [1.0], seed=10, tokens_per_batch=50).load_state_dict(state)
    other = DatasetUnits.from_documents(np.arange(40), np.arange(2, 42), max_seq_length=8)
    with pytest.raises(ValueError, match="saved with units="):
        TokenBudgetSampler([other], [1.0], seed=9, tokens_per_batch=50).load_state_dict(state)


def test_blend_weights_are_token_shares():
    rng = np.random.default_rng(5)
    a = DatasetUnits.from_documents(np.arange(300), rng.integers(2, 40, 300), max_seq_length=32)
    b = DatasetUnits.from_documents(np.arange(90), rng.integers(2, 200, 90), max_seq_length=32)
    sampler = TokenBudgetSampler([a, b], [1.0, 3.0], seed=0, units_per_batch=8)
    tokens = [0, 0]
    for _ in range(40):
        for unit in sampler.next_batch():
            tokens[unit.dataset] += unit.length
        assert abs(tokens[1] - 0.75 * sum(tokens)) <= 32  # within one sequence


@pytest.mark.parametrize("huge", [1e308, 1.7e308])
def test_blend_weights_whose_sum_overflows_keep_their_shares(huge):
    """Two weights of 1e308 sum to inf; the shares must still be 1/2 each, not 0 and 0."""
    rng = np.random.default_rng(6)
    a = DatasetUnits.from_documents(np.arange(200), rng.integers(2, 40, 200), max_seq_length=32)
    b = DatasetUnits.from_documents(np.arange(200), rng.integers(2, 40, 200), max_seq_length=32)
    sampler = TokenBudgetSampler([a, b], [huge, huge], seed=0, units_per_batch=8)
    assert sampler.weights.tolist() == [0.5, 0.5]
    tokens = [0, 0]
    for _ in range(20):
        for unit in sampler.next_batch():
            tokens[unit.dataset] += unit.length
    assert abs(tokens[0] - tokens[1]) <= 2 * 32
    # Ordinary weights normalise as before (a checkpoint's saved set-up still matches).
    plain = TokenBudgetSampler([a, b], [0.3, 0.7], seed=0, units_per_batch=8)
    assert plain.weights.tolist() == (np.array([0.3, 0.7]) / np.sum([0.3, 0.7])).tolist()


def test_bad_inputs_name_the_value():
    units = DatasetUnits.from_documents(np.arange(3), np.array([100, 5, 5]), max_seq_length=64)
    with pytest.raises(ValueError, match="global batch of 40 tokens is smaller than one sequence"):
        TokenBudgetSampler([units], [1.0], seed=0, tokens_per_batch=40)
    with pytest.raises(ValueError, match="blend weights must be positive"):
        TokenBudgetSampler([units], [0.0], seed=0, units_per_batch=1)
    empty = DatasetUnits.from_documents(np.arange(2), np.array([1, 1]), max_seq_length=4)
    with pytest.raises(ValueError, match="dataset 0 of the blend has no usable document"):
        TokenBudgetSampler([empty], [1.0], seed=0, units_per_batch=1)


def test_split_ranges_match_megatron_style_weights():
    assert split_ranges(1000, parse_split("969,30,1")) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(10, parse_split("98/2/0")) == [(0, 10), (10, 10), (10, 10)]
    with pytest.raises(ValueError, match="not a list of numbers"):
        parse_split("a,b")


@pytest.mark.parametrize(
    "text, want",
    [
        ("'99,1,0'", [99.0, 1.0, 0.0]),  # NVIDIA's Llama-3 recipes: the quotes reach the value
        ('"949,50,1"', [949.0, 50.0, 1.0]),
        ("98/2/0", [98.0, 2.0, 0.0]),
        (" 90, 10 ", [90.0, 10.0]),
        ("0.9,0.1", [0.9, 0.1]),
        ("100", [100.0]),
    ],
)
def test_split_is_read_as_megatron_core_reads_it(text, want):
    """Every run of digits and dots is a weight (Megatron-Core's parse_and_normalize_split),
    so both entry points (pretrain_hdp.py and pretrain_gpt.py --hdp) take what stock takes."""
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    from megatron_hdp.megatron.arguments import build_parser
    from megatron_hdp.megatron.config import batch_data_config

    assert parse_split(text) == want
    stock = parse_and_normalize_split(text)
    ours = np.asarray(want + [0.0] * (3 - len(want)))
    assert np.allclose(ours / ours.sum(), stock)
    required = "--num-layers 1 --hidden-size 8 --num-attention-heads 1 --seq-length 8 "
    required += "--train-iters 1 --lr 1"
    argv = [*required.split(), "--split", text, "--data-path", "x"]
    args = build_parser().parse_args(argv)  # pretrain_hdp.py's parser
    assert batch_data_config(args, tokens_per_batch=8, units_per_batch=None).split == want


@pytest.mark.parametrize("text", ["", "a,b", "1.2.3,1", "1,1,1,1", "0,0,0"])
def test_a_split_megatron_core_cannot_use_is_refused_by_value(text):
    with pytest.raises(ValueError, match="--split"):
        parse_split(text)


@pytest.mark.parametrize("tokens", [0, 1, 777, 5_000, 60_000])
def test_skip_tokens_skips_each_streams_share_of_its_own_order(tokens):
    """A stock job's trained tokens, skipped: stream k drops the shortest prefix of its
    order (epoch after epoch) holding >= round(share_k x tokens) tokens. The reference
    walks each stream's order one unit at a time (across epochs for the larger counts)."""
    rng = np.random.default_rng(1)
    blend = [
        DatasetUnits.from_documents(np.arange(n), rng.integers(2, 300, size=n), max_seq_length=64)
        for n in (40, 90)
    ]
    sampler = TokenBudgetSampler(blend, [1.0, 3.0], seed=5, units_per_batch=4)
    walker = TokenBudgetSampler(blend, [1.0, 3.0], seed=5, units_per_batch=4)
    skipped = sampler.skip_tokens(tokens, steps=7)
    for k, share in enumerate([0.25, 0.75]):
        target, count, drawn = round(share * tokens), 0, 0
        while drawn < target:
            drawn += walker._unit(k, count).length
            count += 1
        assert skipped[k] == sampler.state.consumed[k] == count
        assert sampler.state.tokens[k] == drawn
    assert sampler.state.steps == 7
    if tokens == 60_000:  # both streams are past their first epoch
        assert all(skipped[k] > len(blend[k]) for k in range(2))
    nxt = list(skipped)
    for unit in sampler.next_batch():  # the stream continues after the skipped units
        assert unit == walker._unit(unit.dataset, nxt[unit.dataset])
        nxt[unit.dataset] += 1
