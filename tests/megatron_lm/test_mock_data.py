"""`pretrain_gpt.py --hdp --mock-data`: Megatron-Core's synthetic documents, planned by HDP.

The corpus is checked against its definition (NumPy's `default_rng(0)` lengths in [1, 4095],
ids `(1, 2, ...) mod vocab` then end-of-document), for every world size; training on 2 ranks
with rings equals 1 rank, across a --save / --load, and a resume on other data is refused.
"""

from __future__ import annotations

import logging
import types

import numpy as np
import pytest

from tests.dist import run_ranks
from tests.megatron_lm.harness import MEGATRON_CPU, SHARED, run_megatron_lm

TOKENIZER = types.SimpleNamespace(vocab_size=257, eod=256)


def _config(seed=1234, seq_length=512, units=8):
    from megatron_hdp.data.training_data import DataConfig

    return DataConfig(
        blend=[],
        split=[90.0, 10.0, 0.0],
        seq_length=seq_length,
        seed=seed,
        units_per_batch=units,
        tokenizer=TOKENIZER,
    )


def _summary(rank, world_size, seed):
    """What a rank derives from --mock-data: corpus name, lengths, sampled tokens, batches."""
    from megatron_hdp.megatron_lm.mock_data import mock_training_data

    data = mock_training_data(_config(seed))
    docs = data.datasets[0]
    batches = [[(u.doc, u.start, u.length) for u in data.train.next_batch()] for _ in range(2)]
    tokens = [docs.get(d, 0).tolist() for d in (0, 1, 99_999)]
    return data.prefixes, np.asarray(docs.sequence_lengths).tolist(), tokens, batches


@pytest.mark.parametrize("world_size", [1, 3])
def test_the_corpus_is_megatron_cores_mock_documents_on_every_rank(world_size):
    """Every rank of 1 or 3 derives the corpus the definition gives, and the same batches."""
    per_rank = run_ranks(_summary, world_size, 1234, timeout_s=120)
    want_lengths = np.random.default_rng(0).integers(1, 4096, size=100_000).tolist()
    prefixes, lengths, tokens, batches = per_rank[0]
    assert lengths == want_lengths
    assert min(lengths) >= 1 and max(lengths) <= 4095 and len(set(lengths)) > 4000
    for doc, got in zip((0, 1, 99_999), tokens, strict=True):
        n = want_lengths[doc]
        assert got == [i % 257 for i in range(1, n)] + [256]
    assert "vocab_size=257" in prefixes[0] and "eod=256" in prefixes[0]
    assert prefixes[0].startswith("mock:")
    for other in per_rank[1:]:
        assert other == per_rank[0]
    single = _summary(0, 1, 1234)  # in this process, without any process group
    assert single == per_rank[0]


def test_seed_fixes_the_order_not_the_corpus():
    """The same --seed gives the same batches; another seed another order of the same data."""
    a, b, c = _summary(0, 1, 1234), _summary(0, 1, 1234), _summary(0, 1, 7)
    assert a == b
    assert c[:3] == a[:3] and c[3] != a[3]


def test_mock_fingerprint_names_the_definition():
    from megatron_hdp.data.fingerprint import dataset_fingerprint
    from megatron_hdp.megatron_lm.mock_data import mock_documents, mock_prefix

    one = mock_prefix(mock_documents(TOKENIZER))
    other = mock_prefix(mock_documents(types.SimpleNamespace(vocab_size=300, eod=299)))
    assert dataset_fingerprint(one) == dataset_fingerprint(one) != dataset_fingerprint(other)


#: The flags of both runs: rings of 2 for the (mostly > 256 token) units of --seq-length 512.
FLAGS = [*SHARED, *MEGATRON_CPU, "--mock-data", "--global-batch-size", "8", "--hdp"]
FLAGS += ["--eval-iters", "0", "--eval-interval", "1000", "--train-iters", "4"]


def _close(got, want, rel=1e-5):
    assert len(got) == len(want) > 0, (got, want)
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=rel), (got, want)


def test_mock_data_two_ranks_with_rings_equal_one_rank_across_a_resume(trees, data, tmp_path):
    """2 ranks (capacity 256: rings of 2) for 4 steps equal 1 rank for 2 steps, --save, then
    --load and 2 more; a --load with --data-path instead of --mock-data is refused. Rank 0
    logs once what --mock-data means."""
    _, patched = trees
    first_batch = _summary(0, 1, 1234)[3][0]  # the same seed, split, batch and --seq-length
    assert max(length for _, _, length in first_batch) > 256  # so the 2-rank run rings
    script = patched / "pretrain_gpt.py"
    save = str(tmp_path / "ckpt")
    log = tmp_path / "hdp.log"  # the forked ranks inherit this handler
    handler, hdp_logger = logging.FileHandler(log), logging.getLogger("megatron_hdp")
    level = hdp_logger.level
    hdp_logger.addHandler(handler)
    hdp_logger.setLevel(logging.INFO)
    try:
        ring = run_megatron_lm(script, 2, [*FLAGS, "--hdp-capacity", "256"], timeout_s=300)
    finally:
        hdp_logger.removeHandler(handler)
        hdp_logger.setLevel(level)
        handler.close()
    meaning = [line for line in log.read_text().splitlines() if "--mock-data under --hdp" in line]
    assert len(meaning) == 1 and "MockGPTLowLevelDataset" in meaning[0], meaning  # rank 0 only
    alone = [*FLAGS, "--hdp-capacity", "512"]  # one rank holds a whole --seq-length unit
    stop = ["--exit-interval", "2", "--save", save, "--save-interval", "2"]
    first = run_megatron_lm(script, 1, [*alone, *stop], timeout_s=300)
    resume = [*alone, "--load", save, "--no-load-rng"]
    resumed = run_megatron_lm(script, 1, resume, timeout_s=300)
    assert [i for i, _, _ in ring["train"]] == [1, 2, 3, 4]
    assert [i for i, _, _ in first["train"] + resumed["train"]] == [1, 2, 3, 4]
    one = first["train"] + resumed["train"]
    _close([r[1] for r in ring["train"]], [r[1] for r in one])
    _close([r[2] for r in ring["train"]], [r[2] for r in one])
    other = [a for a in resume if a != "--mock-data"] + ["--data-path", data]
    with pytest.raises(AssertionError, match="mock:"):
        run_megatron_lm(script, 1, other, timeout_s=300)
