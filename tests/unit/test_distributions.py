"""Simulated length mixes: published shares, exact budgets, clipping, determinism."""

import numpy as np
import pytest

from megatron_hdp.sim import distributions as d
from megatron_hdp.sim.distributions import (
    BYTED,
    GENERATORS,
    GITHUB,
    K,
    M,
    Piece,
    byted_like,
    describe,
    github_like,
    solve_mixture,
    stdlib_lengths,
    stdlib_like,
)

BIG = 2**33  # 8.6G tokens: ~1M sequences, ~500 at 2M; share noise well under 1 point
PP = 0.02  # +-2 percentage points


@pytest.fixture(scope="module")
def byted():
    return describe(byted_like(np.random.default_rng(11), BIG, 2 * M))


@pytest.fixture(scope="module")
def github():
    return describe(github_like(np.random.default_rng(12), BIG, 2 * M))


# ---------------------------------------------------------------- the solved mixtures


def test_solved_mixtures_hit_the_published_shares_exactly():
    shares = BYTED.token_shares()
    assert shares[-5:] == pytest.approx([0.073, 0.076, 0.076, 0.097, 0.121], abs=1e-12)
    assert BYTED.probs[0] == pytest.approx(0.80) and BYTED.probs[-1] == pytest.approx(0.0005)
    assert sum(BYTED.probs) == pytest.approx(1.0)
    g = GITHUB.token_shares()
    assert g[3] + g[4] == pytest.approx(0.162) and g[4] == pytest.approx(0.098)
    assert sum(GITHUB.probs) == pytest.approx(1.0)
    # the share of samples >= 128K is an output of the Byted construction (published "1%")
    assert 0.008 <= sum(BYTED.probs[3:]) <= 0.012


def test_solve_mixture_rejects_bad_systems():
    pieces = [Piece(1, 10), Piece(11, 100)]
    with pytest.raises(ValueError, match="square"):
        solve_mixture("x", pieces)
    with pytest.raises(ValueError, match="negative"):
        solve_mixture("x", pieces, sample_shares=[([0], 1.5)])
    with pytest.raises(ValueError, match="low <= high"):
        Piece(5, 4)


def test_piece_mean_matches_its_draws():
    rng = np.random.default_rng(0)
    for piece in (Piece(32, 4096), Piece(128 * K, int(128 * K * 2**0.25)), Piece(7, 7)):
        x = piece.draw(rng, 200_000)
        assert x.min() >= piece.low and x.max() <= piece.high
        assert x.mean() == pytest.approx(piece.mean, rel=5e-3)


# ---------------------------------------------------------------- published statistics


def test_byted_like_reproduces_published_shares(byted):
    assert byted["token_share_ge_2m"] == pytest.approx(0.121, abs=PP)
    assert byted["token_share_ge_128k"] == pytest.approx(0.443, abs=PP)
    assert byted["token_share_ge_256k"] == pytest.approx(0.370, abs=PP)
    expected = {"2m": 0.121, "1m": 0.097, "512k": 0.076, "256k": 0.076, "128k": 0.073}
    for bucket, share in expected.items():
        assert byted["token_share_bucket"][bucket] == pytest.approx(share, abs=PP), bucket
    assert byted["sample_share_le_4k"] == pytest.approx(0.80, abs=PP)
    assert byted["sample_share_ge_2m"] == pytest.approx(0.0005, abs=0.0001)
    assert byted["sample_share_ge_128k"] == pytest.approx(0.01, abs=0.002)  # "1%"
    assert byted["max"] == 2 * M


def test_github_like_reproduces_published_shares(github):
    assert github["token_share_ge_128k"] == pytest.approx(0.162, abs=PP)
    assert github["token_share_ge_256k"] == pytest.approx(0.098, abs=PP)
    assert github["p50"] == pytest.approx(2 * K, rel=0.1)  # body: median ~2K (our choice)
    assert github["max"] <= 2 * M


# ---------------------------------------------------------------- budget, clipping, seeds


@pytest.mark.parametrize("name", sorted(GENERATORS))
@pytest.mark.parametrize(
    ("total", "max_len"), [(1, 1), (1000, 8192), (8 * 64 * 8192, 512 * K), (10**8, 2 * M)]
)
def test_budget_is_met_exactly_and_lengths_are_clipped(name, total, max_len):
    x = GENERATORS[name](np.random.default_rng(3), total, max_len)
    assert isinstance(x, list) and all(isinstance(v, int) for v in x[:100])
    assert sum(x) == total
    assert min(x) >= 1 and max(x) <= max_len


def test_clipping_piles_the_tail_at_the_context():
    stats = describe(byted_like(np.random.default_rng(5), 2**31, 512 * K))
    assert stats["max"] == 512 * K
    # every sample of the 512K, 1M and 2M pieces now holds exactly 512K tokens
    above = sum(BYTED.probs[5:])
    expected = above * 512 * K / BYTED.clipped_mean(512 * K)
    assert stats["token_share_bucket"]["512k"] == pytest.approx(expected, abs=PP)
    assert stats["sample_share_ge_128k"] == pytest.approx(sum(BYTED.probs[3:]), abs=0.002)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_deterministic_by_seed(name):
    gen = GENERATORS[name]
    a = gen(np.random.default_rng(7), 10**7, 2 * M)
    assert a == gen(np.random.default_rng(7), 10**7, 2 * M)
    assert a == gen(7, 10**7, 2 * M)  # an int seed works the same
    assert a != gen(np.random.default_rng(8), 10**7, 2 * M)


@pytest.mark.parametrize("name", sorted(GENERATORS))
@pytest.mark.parametrize(("total", "max_len"), [(0, 10), (10, 0)])
def test_bad_budget_or_context_is_rejected(name, total, max_len):
    with pytest.raises(ValueError):
        GENERATORS[name](0, total, max_len)


def test_stdlib_like_draws_real_document_lengths():
    real = set(stdlib_lengths())
    assert len(real) > 100 and stdlib_lengths() is stdlib_lengths()  # read once, cached
    x = stdlib_like(np.random.default_rng(1), 10**8, 2 * M)
    body = x[:-1]  # the last one is trimmed to the budget
    assert all(v in real or v == 2 * M for v in body)
    assert any(v == 2 * M for v in body)  # the multi-megabyte `test` package is clipped


# ---------------------------------------------------------------- describe


def test_describe_on_a_hand_made_batch():
    x = [4 * K, 4 * K + 1, 128 * K, 256 * K, 2 * M]
    s = describe(x)
    total = sum(x)
    assert s["num_sequences"] == 5 and s["total_tokens"] == total and s["max"] == 2 * M
    assert s["sample_share_le_4k"] == pytest.approx(0.2)
    assert s["sample_share_ge_128k"] == pytest.approx(0.6)
    assert s["sample_share_ge_2m"] == pytest.approx(0.2)
    assert s["token_share_ge_128k"] == pytest.approx((128 * K + 256 * K + 2 * M) / total)
    assert s["token_share_ge_256k"] == pytest.approx((256 * K + 2 * M) / total)
    assert s["token_share_bucket"]["128k"] == pytest.approx(128 * K / total)
    assert s["token_share_bucket"]["512k"] == 0.0
    assert s["token_share_bucket"]["2m"] == pytest.approx(2 * M / total)
    with pytest.raises(ValueError):
        describe([])


def test_module_is_pure():
    src = open(d.__file__).read()
    for banned in ("import torch", "import megatron."):
        assert banned not in src
