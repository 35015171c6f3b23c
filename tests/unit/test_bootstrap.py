"""attngeom.stats.resampling: resample counts, sums, intervals and pairwise shares against slow references
and cases with known answers."""

import math

import numpy as np
import pytest

from attngeom.stats import resampling as bs
from attngeom.runs.run import merge_sums


def test_counts_are_resamples_with_replacement_and_seeded():
    c = bs.resample_counts(7, n_resamples=500, seed=3)
    assert c.shape == (500, 7) and c.dtype == np.int64
    assert (c.sum(1) == 7).all() and (c >= 0).all()
    assert np.array_equal(c, bs.resample_counts(7, n_resamples=500, seed=3))
    assert not np.array_equal(c, bs.resample_counts(7, n_resamples=500, seed=4))
    # each item is drawn n * 1/n = 1 time on average, with variance n * (1/n)(1 - 1/n)
    assert c.mean() == pytest.approx(1.0, abs=0.05)
    assert c.var(0).mean() == pytest.approx(1 - 1 / 7, abs=0.1)
    assert bs.resample_counts(0, n_resamples=3).shape == (3, 0)
    with pytest.raises(ValueError):
        bs.resample_counts(3, n_resamples=0)


def test_resample_sums_equal_a_loop_and_merge_sums():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 2, 3))
    c = bs.resample_counts(6, n_resamples=20, seed=1)
    fast = bs.resample_sums(c, x)
    slow = np.stack([sum(c[b, w] * x[w] for w in range(6)) for b in range(20)])
    np.testing.assert_allclose(fast, slow, rtol=1e-12)
    # the runner's merge_sums with weights=counts is the same resample, for records of any shape
    recs = [{"a": x[w], "n": float(w + 1)} for w in range(6)]
    for b in range(5):
        m = merge_sums(recs, weights=c[b])
        np.testing.assert_allclose(m["a"], fast[b], rtol=1e-12)
        assert m["n"] == pytest.approx(float(c[b] @ np.arange(1, 7)))


def test_ratio_of_sums_and_perplexity_against_reference():
    rng = np.random.default_rng(1)
    nll = rng.uniform(100, 200, size=(5, 3))
    tok = rng.integers(50, 60, size=5).astype(float)
    c = bs.resample_counts(5, n_resamples=50, seed=2)
    ppl = bs.resampled_perplexity(c, nll, tok)
    for b in range(50):
        for v in range(3):
            ref = math.exp(sum(c[b, w] * nll[w, v] for w in range(5)) / sum(c[b, w] * tok[w] for w in range(5)))
            assert ppl[b, v] == pytest.approx(ref, rel=1e-12)
    # all-ones counts are the full sample
    one = bs.resampled_perplexity(np.ones((1, 5)), nll, tok)[0]
    np.testing.assert_allclose(one, np.exp(nll.sum(0) / tok.sum()))
    # a zero denominator gives NaN, not an error
    r = bs.ratio_of_sums(np.array([[1, 0]]), np.array([1.0, 2.0]), np.array([0.0, 1.0]))
    assert np.isnan(r[0])


def test_percentile_interval_of_a_mean_matches_the_normal_theory():
    """Known answer: the bootstrap distribution of a mean of n iid N(0, 1) values has sd ~ 1/sqrt(n)."""
    rng = np.random.default_rng(5)
    n = 400
    x = rng.normal(size=n)
    samples = bs.bootstrap(n, lambda c: bs.resample_sums(c, x) / n, n_resamples=2000, seed=0)
    lo, hi = bs.percentile_interval(samples)
    half = 1.96 * x.std() / math.sqrt(n)
    assert float(lo) == pytest.approx(x.mean() - half, abs=0.25 * half)
    assert float(hi) == pytest.approx(x.mean() + half, abs=0.25 * half)
    # the percentile interval is the 2.5 / 97.5 % quantiles, NaN left out
    s = np.concatenate([np.arange(1, 1001, dtype=float), [np.nan]])
    lo, hi = bs.percentile_interval(s[:, None])
    assert lo[0] == pytest.approx(np.quantile(np.arange(1, 1001), 0.025))
    assert hi[0] == pytest.approx(np.quantile(np.arange(1, 1001), 0.975))
    with pytest.raises(ValueError):
        bs.percentile_interval(s, level=1.5)


def test_constant_data_give_a_zero_width_interval():
    x = np.full(10, 3.0)
    s = bs.bootstrap(10, lambda c: bs.resample_sums(c, x) / 10, n_resamples=1000)
    lo, hi = bs.percentile_interval(s)
    assert float(lo) == pytest.approx(3.0) and float(hi) == pytest.approx(3.0)


def test_bootstrap_batches_and_loop_use_the_same_resamples():
    x = np.random.default_rng(2).normal(size=(9, 4))
    stat = lambda c: bs.resample_sums(c, x)  # noqa: E731
    a = bs.bootstrap(9, stat, n_resamples=1000, seed=7)
    b = bs.bootstrap(9, stat, n_resamples=1000, seed=7, batch=64)
    c = np.stack(bs.bootstrap_loop(9, lambda cnt: cnt @ x, n_resamples=1000, seed=7))
    np.testing.assert_allclose(a, b)
    np.testing.assert_allclose(a, c)


def test_beats_share_against_a_loop_and_known_cases():
    rng = np.random.default_rng(3)
    s = rng.normal(size=(300, 4)) + np.array([0.0, 0.1, 6.0, 0.0])
    share = bs.beats_share(s)
    for i in range(4):
        for j in range(4):
            ref = np.mean([(1.0 if s[b, i] > s[b, j] else 0.5 if s[b, i] == s[b, j] else 0.0) for b in range(300)])
            assert share[i, j] == pytest.approx(ref)
    assert share[2, 0] > 0.99 and share[0, 2] < 0.01
    np.testing.assert_allclose(share + share.T, 1.0)
    np.testing.assert_allclose(np.diag(share), 0.5)
    low = bs.beats_share(s, larger_is_better=False)
    np.testing.assert_allclose(low, share.T)
    # a resample with a NaN is left out
    s2 = np.array([[1.0, 0.0], [np.nan, 5.0], [2.0, 1.0]])
    assert bs.beats_share(s2)[0, 1] == 1.0


def test_side_of_and_interval_dict():
    assert bs.side_of(0.1, 0.5) == 1 and bs.side_of(-0.5, -0.1) == -1 and bs.side_of(-0.1, 0.1) == 0
    assert bs.side_of(2.0, 3.0, threshold=1.0) == 1 and bs.side_of(None, 1.0) == 0
    assert bs.side_of(float("nan"), 1.0) == 0
    d = bs.interval_dict(1.5, np.array([1.0, 2.0, 3.0]))
    assert d["value"] == 1.5 and d["low"] < d["high"]
    assert bs.interval_dict(float("nan"), np.array([np.nan, np.nan]))["value"] is None


def test_nan_reductions_over_rows():
    x = np.array([[1.0, np.nan, 3.0], [np.nan, np.nan, np.nan]])
    m = bs.nanmedian_rows(x)
    assert m[0] == 2.0 and np.isnan(m[1])
    assert bs.nanmean_rows(x)[0] == 2.0


def test_fewer_units_than_the_minimum_give_no_interval():
    samples = np.random.default_rng(0).normal(size=(200, 3))
    lo, hi = bs.percentile_interval(samples, units=2)
    assert np.isnan(lo).all() and np.isnan(hi).all() and lo.shape == (3,)
    lo, hi = bs.percentile_interval(samples, units=bs.MIN_UNITS)
    assert np.isfinite(lo).all() and (lo < hi).all()
    assert bs.interval_dict(1.0, samples[:, 0], units=2) == {"value": 1.0, "low": None, "high": None}
    assert not bs.enough_units(bs.MIN_UNITS - 1) and bs.enough_units(bs.MIN_UNITS)


def test_numbers_are_written_one_way():
    f = bs.format_number
    assert [f(72390.3), f(114286), f(4.949), f(0.03671), f(-1.537, signed=True), f(2.5, signed=True)] == \
        ["72,390", "114,286", "4.949", "0.03671", "-1.537", "+2.5"]
    assert f(None) == f(float("nan")) == "—" and f(1.2e-5) == "1.20e-05"
