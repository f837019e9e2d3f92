"""Zigzag sharding: a partition of every document, balanced, in the documented chunk order."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hdp.sharding import chunk_sizes, rank_token_counts, shard
from tests.property import examples

lengths_st = st.lists(st.integers(min_value=1, max_value=200), min_size=1, max_size=8)
cp_st = st.integers(min_value=1, max_value=9)


@pytest.mark.property
@given(lengths_st, cp_st)
@settings(max_examples=examples(300), deadline=None)
def test_shards_partition_every_document(lengths, cp_size):
    shards = shard(lengths, cp_size)
    for d, length in enumerate(lengths):
        got = []
        for s in shards:
            got.extend(
                pos for doc, start, n in s.ranges() if doc == d for pos in range(start, start + n)
            )
        assert sorted(got) == list(range(length))


@pytest.mark.property
@given(lengths_st, cp_st)
@settings(max_examples=examples(300), deadline=None)
def test_rank_p_holds_chunks_p_and_mirror(lengths, cp_size):
    sizes = chunk_sizes(lengths, cp_size)
    for d, doc_sizes in enumerate(sizes):
        assert len(doc_sizes) == 2 * cp_size and sum(doc_sizes) == lengths[d]
        assert max(doc_sizes) - min(doc_sizes) <= 1  # chunks are near-equal cuts
        starts = [sum(doc_sizes[:c]) for c in range(2 * cp_size)]
        for p, s in enumerate(shard(lengths, cp_size)):
            mirror = 2 * cp_size - 1 - p
            assert (s.first_start[d], s.first_len[d]) == (starts[p], doc_sizes[p])
            assert (s.second_start[d], s.second_len[d]) == (starts[mirror], doc_sizes[mirror])


@pytest.mark.property
@given(lengths_st, cp_st)
@settings(max_examples=examples(300), deadline=None)
def test_ranks_are_balanced_to_one_token(lengths, cp_size):
    counts = rank_token_counts(lengths, cp_size)
    assert sum(counts) == sum(lengths)
    assert max(counts) - min(counts) <= 1
    assert max(counts) <= math.ceil(sum(lengths) / cp_size)


def test_positions_follow_original_positions_in_local_order():
    (s0, s1) = shard([10], 2)  # chunks of 10 over 4: sizes 3,3,2,2
    assert s0.positions() == [0, 1, 2, 8, 9]
    assert s1.positions() == [3, 4, 5, 6, 7]


def test_local_shard_is_the_whole_document_in_order():
    (only,) = shard([5, 3], 1)
    assert only.positions() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert only.local_doc_lengths() == [5, 3]
