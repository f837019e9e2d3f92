"""The windowed ring plan (`attention.window`) against brute force over positions."""

import pytest

from megatron_hdp.attention.window import binds, check_window, window_plan
from megatron_hdp.sharding import shard


def _brute(lengths, k, position, source, window):
    """Local query rows of `position` that see a key of `source`, and the keys they see."""
    shards = shard(lengths, k)

    def rows(p):
        return [(d, s + i) for d, s, m in shards[p].ranges() for i in range(m)]

    q, kv = rows(position), rows(source)
    pairs = [
        (a, b)
        for a, (dq, pq) in enumerate(q)
        for b, (dk, pk) in enumerate(kv)
        if dq == dk and 0 <= pq - pk <= window
    ]
    return sorted({a for a, _ in pairs}), sorted({b for _, b in pairs})


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("window", [0, 1, 3, 5, 8, 50])
def test_steps_hold_exactly_the_rows_that_meet(k, window):
    lengths = [33, 1, 9, 16, 2, 7]
    shards = shard(lengths, k)
    active = tuple(p for p in range(k) if shards[p].num_tokens)
    for position in active:
        plan = window_plan(shards, position, active, window, lengths)
        for hop, source in enumerate(active[(active.index(position) - h) % len(active)]
                                     for h in range(len(active))):  # fmt: skip
            q_rows, k_rows = _brute(lengths, k, position, source, window)
            step = plan.steps.get(source)
            if not q_rows:
                assert step is None, (position, source)  # skipped: no kernel call
                continue
            if len(active) == 1:
                assert step.q_rows is None and sum(step.lengths_q) == len(q_rows)
                continue
            assert step.q_rows.tolist() == q_rows
            held = plan.carried[source, hop].tolist()
            assert [held[i] for i in step.kv_rows.tolist()] == k_rows
            assert sum(step.lengths_q) == len(q_rows) and sum(step.lengths_k) == len(k_rows)


def test_small_window_skips_steps_and_traffic():
    """A window shorter than a chunk: each member meets at most its two ring neighbours, and
    after the first hop only the tail of each source's second chunk still travels."""
    lengths, k, window = [64], 4, 2  # chunks of 8
    shards = shard(lengths, k)
    active = tuple(range(k))
    for position in active:
        plan = window_plan(shards, position, active, window, lengths)
        assert set(plan.steps) <= {position, (position - 1) % k, (position + 1) % k}
        for source in active:
            for hop in range(2, k):
                assert plan.rows_after(source, hop) <= window


def test_check_window_follows_megatron_and_refuses_the_rest():
    assert check_window(None) is None
    assert check_window((4, 0)) == 4
    for bad in ((4, 2), (-1, 0), (1,), "x"):
        with pytest.raises(ValueError, match="window"):
            check_window(bad)
    assert binds(3, [5]) and not binds(4, [5]) and not binds(None, [9])


def test_a_windowed_checkpoint_resumes_and_a_changed_window_is_named():
    """meta.json holds the window as a list: the same window resumes, another is refused."""
    import dataclasses
    import json

    from megatron_hdp.megatron.model import GPTConfig
    from megatron_hdp.megatron.validation import check_resume_matches

    cfg = GPTConfig(window_size=(8, 0), window_attn_skip_freq=(1, 0))
    meta = json.loads(json.dumps({"model": dataclasses.asdict(cfg)}))
    same = dict(load="ckpt", data_setup={}, prefixes=[], finetune=True)
    check_resume_matches(meta, model=dataclasses.asdict(cfg), **same)
    other = dataclasses.replace(cfg, window_size=(16, 0))
    with pytest.raises(ValueError, match=r"\(8, 0\)|\[8, 0\]"):
        check_resume_matches(meta, model=dataclasses.asdict(other), **same)
    old = json.loads(json.dumps({"model": dataclasses.asdict(GPTConfig())}))
    for key in ("window_size", "window_attn_skip_freq"):
        del old["model"][key]  # a checkpoint written before the window existed
    check_resume_matches(old, model=dataclasses.asdict(GPTConfig()), **same)
