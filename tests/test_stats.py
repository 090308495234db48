"""experiments/stats.py against table values and exhaustive enumeration."""

import itertools

import numpy as np
import pytest

from experiments import stats


@pytest.mark.parametrize(
  "df,want",
  [(1, 12.706205), (2, 4.302653), (3, 3.182446), (4, 2.776445), (7, 2.364624), (30, 2.042272)],
)
def test_t_quantile_matches_the_table(df, want):
  assert stats.t_quantile(0.975, df) == pytest.approx(want, abs=1e-6)


def test_t_interval_by_hand():
  # mean 2, sd 1, n 3: 2 +- 4.302653 / sqrt(3).
  lo, hi = stats.t_interval([1.0, 2.0, 3.0])
  assert (lo, hi) == pytest.approx((2 - 2.484138, 2 + 2.484138), abs=1e-6)
  assert np.isnan(stats.t_interval([0.3])[0])
  # At 3 seeds the t-interval is wider than the percentile bootstrap, which
  # never leaves the range of the values it resamples.
  b_lo, b_hi = stats.bootstrap_ci([1.0, 2.0, 3.0])
  assert lo < b_lo and hi > b_hi and b_lo >= 1.0 and b_hi <= 3.0


def _p_by_loop(x):
  x = list(x)
  obs = abs(sum(x))
  hits = sum(
    abs(sum(s * v for s, v in zip(signs, x))) >= obs - 1e-12
    for signs in itertools.product((1, -1), repeat=len(x))
  )
  return hits / 2 ** len(x)


@pytest.mark.parametrize(
  "x,want",
  [
    ([0.1, 0.2, 0.3, 0.05, 0.15, 0.25, 0.12, 0.08], 2 / 256),  # 8 of 8 ahead
    ([1.0, 2.0, 3.0, 4.0], 0.125),  # 4 seeds can do no better
    ([3.0, 1.0, 1.0], 0.25),
    ([1.0, 2.0, 3.0, -0.5], 0.25),  # flipping the -0.5 also reaches |sum| >= 5.5
    ([1.0, -1.0], 1.0),
  ],
)
def test_sign_flip_p_known_values(x, want):
  assert stats.sign_flip_p(x) == pytest.approx(want)
  assert stats.sign_flip_p(x) == pytest.approx(_p_by_loop(x))


def test_sign_flip_p_matches_enumeration_on_random_values():
  rng = np.random.default_rng(0)
  for n in (3, 5, 7):
    x = rng.normal(0.02, 0.05, n)
    assert stats.sign_flip_p(x) == pytest.approx(_p_by_loop(x))


def test_min_sign_flip_p_and_refusals():
  assert [stats.min_sign_flip_p(n) for n in (1, 3, 4, 8)] == [1.0, 0.25, 0.125, 2 / 256]
  assert np.isnan(stats.sign_flip_p([]))
  with pytest.raises(ValueError, match="refused"):
    stats.sign_flip_p(np.ones(stats.MAX_SIGN_FLIP_SEEDS + 1))
  with pytest.raises(ValueError, match="non-finite"):
    stats.t_interval([0.1, float("nan")])


def test_paired_stats_words_claims_by_the_t_interval():
  # 3 seeds, all ahead, a bootstrap interval excluding 0: the t-interval
  # does not, and p is 0.25 (the least 3 seeds allow).
  d = [0.02, 0.03, 0.10]
  rec = stats.paired_stats(d)
  assert rec["ci95"][0] > 0
  assert rec["t_ci95"][0] < 0 and not rec["excludes_zero"]
  assert rec["sign_flip_p"] == pytest.approx(0.25) == rec["min_sign_flip_p"]
  assert rec["n"] == 3 and rec["wins"] == 3 and rec["mean_diff"] == pytest.approx(0.05)
  assert "p=0.25 (n=3)" in stats.fmt_paired(rec)
  # A record of an earlier results.json (bootstrap only) is shown as such.
  assert "bootstrap" in stats.fmt_paired({"mean_diff": 0.1, "ci95": [0.0, 0.2]})


def test_welch_interval_matches_scipy():
  from scipy import stats as scipy_stats

  rng = np.random.default_rng(3)
  a, b = rng.normal(0.1, 0.06, 8), rng.normal(0.0, 0.02, 8)
  want = scipy_stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
  np.testing.assert_allclose(stats.welch_interval(a, b), (want.low, want.high), rtol=1e-10)
  assert np.isnan(stats.welch_interval([1.0], [1.0, 2.0])).all()
  assert np.isnan(stats.welch_interval([1.0, 1.0], [2.0, 2.0])).all()


def test_permutation_p_by_hand_and_against_scipy():
  # Splits of {1, 2, 3, 4} into two pairs: |difference| 2, 2, 1, 1, 0, 0 -> p = 2 / 6.
  assert stats.permutation_p([1.0, 2.0], [3.0, 4.0]) == pytest.approx(1 / 3)
  assert stats.permutation_p([1.0, 2.0], [1.0, 2.0]) == 1.0
  from scipy import stats as scipy_stats

  rng = np.random.default_rng(4)
  a, b = rng.normal(0.05, 0.05, 6), rng.normal(0.0, 0.05, 5)
  want = scipy_stats.permutation_test(
    (a, b),
    lambda x, y: abs(np.mean(x) - np.mean(y)),
    permutation_type="independent",
    n_resamples=10**6,
    alternative="greater",
  ).pvalue  # |difference|, as permutation_p
  assert stats.permutation_p(a, b) == pytest.approx(want, rel=1e-9)
  with pytest.raises(ValueError, match="refused"):
    stats.permutation_p(np.arange(11.0), np.arange(10.0))


def test_unpaired_stats_reports_both_views():
  out = stats.unpaired_stats([0.3, 0.4, 0.35, 0.45], [0.0, 0.05, -0.02, 0.01])
  assert (out["n_a"], out["n_b"]) == (4, 4)
  assert out["diff"] == pytest.approx(0.365)
  assert out["excludes_zero"] and out["welch_ci95"][0] > 0
  assert out["permutation_p"] == pytest.approx(2 / 70)  # the least C(8, 4) allows
