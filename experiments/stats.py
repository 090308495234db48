"""The statistics of experiments/: intervals and tests over a few paired seeds.

Every finding compares arms seed by seed over 3-8 seeds. At that size a
percentile bootstrap of the mean is too narrow (it resamples the seeds it
has, so its interval never reaches past their range: simulated coverage of a
nominal 95% interval is roughly 76 / 81 / 84 / 88% at 3 / 4 / 5 / 8 seeds).
What a claim is worded by here:

  * `t_interval`: the Student-t interval of the mean (of paired differences
    when seeds are paired): mean +- t_{(1 + level) / 2, n - 1} * sd / sqrt(n).
  * `sign_flip_p`: the exact two-sided randomisation (sign-flip) p-value of
    the paired differences: under "no difference" each seed's difference is
    as likely to have either sign, so p is the share of the 2^n sign
    assignments whose |mean| is at least the observed one. It assumes no
    normality; its smallest value is 2 / 2^n (`min_sign_flip_p`): 0.25 at 3
    seeds, 0.125 at 4, 0.0078 at 8, whatever the effect size.

For two groups of seeds that are not paired (two separate grids), the
same two views: `welch_interval` (Student t with Welch-Satterthwaite
degrees of freedom) and `permutation_p` (exact: every relabelling of the
pooled values into groups of the two sizes), together in `unpaired_stats`.

`bootstrap_ci` stays beside them (earlier results.json files carry it).
`clopper_pearson` is the exact interval of a rate (collapses in n runs),
`collapsed` the one collapse rule every finding applies.
Everything here is a pure function of its arguments.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np
from scipy import stats as _scipy_stats

# A run collapsed when its final pass@1 is below this fraction of its seed's
# SFT pass@1 (why this line: experiments/dis_stability.py's docstring).
COLLAPSE_FRACTION = 0.25

# Exact two-sample permutations beyond this many pooled values (C(20, 10) ~
# 1.8e5 relabellings) are refused rather than approximated.
MAX_PERMUTATION_VALUES = 20

# Exhaustive sign flips beyond this many seeds (2^20 ~ 1e6 assignments) are
# refused rather than approximated: no grid here has that many.
MAX_SIGN_FLIP_SEEDS = 20


def _values(x: Sequence[float]) -> np.ndarray:
  d = np.asarray(x, np.float64).ravel()
  if not np.all(np.isfinite(d)):
    raise ValueError(f"non-finite values: {d.tolist()}")
  return d


def t_quantile(q: float, df: float) -> float:
  """The q-quantile of Student's t with `df` degrees of freedom (not always a
  whole number: Welch's)."""
  if df < 1:
    raise ValueError(f"t quantile needs df >= 1, got {df}")
  return float(_scipy_stats.t.ppf(q, df))


def t_interval(x: Sequence[float], level: float = 0.95) -> tuple[float, float]:
  """Student-t interval of the mean of `x`; (nan, nan) for fewer than 2 values."""
  d = _values(x)
  if d.size < 2:
    return (float("nan"), float("nan"))
  half = t_quantile((1 + level) / 2, d.size - 1) * d.std(ddof=1) / np.sqrt(d.size)
  return float(d.mean() - half), float(d.mean() + half)


def _share_at_least(stats_: np.ndarray, observed: float) -> float:
  """The share of `stats_` >= `observed`, counting ties within a relative 1e-12 as ties."""
  return float(np.mean(stats_ >= observed - 1e-12 * max(observed, 1e-300)))


def sign_flip_p(x: Sequence[float]) -> float:
  """Exact two-sided sign-flip p-value of the mean of paired differences `x`.

      p = #{s in {-1, +1}^n : |mean(s * x)| >= |mean(x)|} / 2^n

  (a relative tolerance of 1e-12 counts ties as ties). nan for no values;
  ValueError past MAX_SIGN_FLIP_SEEDS values.
  """
  d = _values(x)
  n = d.size
  if n == 0:
    return float("nan")
  if n > MAX_SIGN_FLIP_SEEDS:
    raise ValueError(f"exact sign flips of {n} values (> {MAX_SIGN_FLIP_SEEDS}) refused")
  signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))
  means = np.abs(signs @ d) / n
  observed = abs(d.mean())
  return _share_at_least(means, observed)


def min_sign_flip_p(n: int) -> float:
  """The smallest two-sided sign-flip p that n paired seeds can give: 2 / 2^n."""
  if n < 1:
    raise ValueError(f"need n >= 1, got {n}")
  return min(1.0, 2.0 / 2.0**n)


def bootstrap_ci(
  x: Sequence[float], level: float = 0.95, samples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
  """Percentile bootstrap CI of the mean of `x` (resampling seeds); too narrow at few seeds."""
  d = _values(x)
  if d.size < 2:
    return (float("nan"), float("nan"))
  idx = np.random.default_rng(seed).integers(0, d.size, (samples, d.size))
  means = d[idx].mean(1)
  lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
  return float(lo), float(hi)


def paired_stats(diffs: Sequence[float], level: float = 0.95) -> dict:
  """Mean of paired differences with every interval and test of this module.

  Keys: n, mean_diff, sd, t_ci95 (Student t), sign_flip_p (exact),
  min_sign_flip_p (the best p n seeds allow), ci95 (percentile bootstrap,
  kept for earlier results), wins (seeds with a positive difference),
  excludes_zero (the t-interval's, the one claims are worded by) and
  bootstrap_excludes_zero.
  """
  d = _values(diffs)
  if d.size == 0:
    raise ValueError("paired_stats of no differences")
  t_lo, t_hi = t_interval(d, level)
  b_lo, b_hi = bootstrap_ci(d, level)
  return {
    "n": int(d.size),
    "mean_diff": float(d.mean()),
    "sd": float(d.std(ddof=1)) if d.size > 1 else 0.0,
    "t_ci95": [t_lo, t_hi],
    "sign_flip_p": sign_flip_p(d),
    "min_sign_flip_p": min_sign_flip_p(d.size),
    "ci95": [b_lo, b_hi],
    "wins": int((d > 0).sum()),
    "excludes_zero": bool(t_lo > 0 or t_hi < 0),
    "bootstrap_excludes_zero": bool(b_lo > 0 or b_hi < 0),
  }


def welch_interval(
  a: Sequence[float], b: Sequence[float], level: float = 0.95
) -> tuple[float, float]:
  """Student-t interval of mean(a) - mean(b) for unpaired groups (Welch):

      mean(a) - mean(b) +- t_{(1 + level) / 2, df} * se,
      se^2 = va / na + vb / nb,   df = se^4 / ((va / na)^2 / (na - 1) + (vb / nb)^2 / (nb - 1))

  (nan, nan) when a group has fewer than 2 values or both have no spread.
  """
  x, y = _values(a), _values(b)
  if x.size < 2 or y.size < 2:
    return (float("nan"), float("nan"))
  va, vb = x.var(ddof=1) / x.size, y.var(ddof=1) / y.size
  se2 = va + vb
  if se2 == 0:
    return (float("nan"), float("nan"))
  df = se2**2 / (va**2 / (x.size - 1) + vb**2 / (y.size - 1))
  half = t_quantile((1 + level) / 2, df) * np.sqrt(se2)
  diff = x.mean() - y.mean()
  return float(diff - half), float(diff + half)


def permutation_p(a: Sequence[float], b: Sequence[float]) -> float:
  """Exact two-sided permutation p of mean(a) - mean(b) for unpaired groups:
  the share of the C(na + nb, na) ways to split the pooled values into
  groups of those sizes whose |difference of means| is at least the
  observed one (ties by a relative tolerance of 1e-12). nan when a group is
  empty; ValueError past MAX_PERMUTATION_VALUES pooled values.
  """
  x, y = _values(a), _values(b)
  if x.size == 0 or y.size == 0:
    return float("nan")
  pooled = np.concatenate([x, y])
  if pooled.size > MAX_PERMUTATION_VALUES:
    raise ValueError(
      f"exact permutations of {pooled.size} values (> {MAX_PERMUTATION_VALUES}) refused"
    )
  groups = np.array(list(itertools.combinations(range(pooled.size), x.size)))
  sums_a = pooled[groups].sum(1)
  diffs = np.abs(sums_a / x.size - (pooled.sum() - sums_a) / y.size)
  return _share_at_least(diffs, abs(x.mean() - y.mean()))


def unpaired_stats(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> dict:
  """mean(a) - mean(b) for two unpaired groups: n_a, n_b, diff, welch_ci95, permutation_p,
  excludes_zero (the Welch interval's)."""
  x, y = _values(a), _values(b)
  lo, hi = welch_interval(x, y, level)
  return {
    "n_a": int(x.size),
    "n_b": int(y.size),
    "diff": float(x.mean() - y.mean()) if x.size and y.size else float("nan"),
    "welch_ci95": [lo, hi],
    "permutation_p": permutation_p(x, y),
    "excludes_zero": bool(lo > 0 or hi < 0),
  }


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
  """The exact (Clopper-Pearson) binomial interval of k successes in n trials.

      lower = Beta^-1(a / 2; k, n - k + 1)       (0 when k = 0)
      upper = Beta^-1(1 - a / 2; k + 1, n - k)   (1 when k = n),   a = 1 - level

  n = 0: the whole of [0, 1].
  """
  if not 0 <= k <= n:
    raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
  if n == 0:
    return 0.0, 1.0
  a = 1.0 - level
  lo = 0.0 if k == 0 else float(_scipy_stats.beta.ppf(a / 2, k, n - k + 1))
  hi = 1.0 if k == n else float(_scipy_stats.beta.ppf(1 - a / 2, k + 1, n - k))
  return lo, hi


def collapsed(rec: dict) -> bool | None:
  """Whether a run record collapsed: final pass@1 < COLLAPSE_FRACTION x its SFT pass@1.

  None (not judged, not counted) for a record without its SFT pass@1; a
  seed whose SFT pass@1 is 0 cannot collapse.
  """
  sft = rec.get("sft_pass@1")
  if sft is None:
    return None
  return bool(rec["final_pass@1"] < COLLAPSE_FRACTION * sft)


def fisher_exact_p(k_a: int, n_a: int, k_b: int, n_b: int) -> float:
  """Two-sided Fisher exact p of k_a events in n_a runs against k_b in n_b."""
  return float(_scipy_stats.fisher_exact([[k_a, n_a - k_a], [k_b, n_b - k_b]])[1])


def fmt_paired(vs: dict | None) -> str:
  """'+0.034 [t: -0.008, +0.077; boot: +0.002, +0.068] p=0.16 (n=8)' of a
  `paired_stats` record (t-interval, bootstrap CI, sign-flip p); '-' for None.

  A record of an earlier results.json without the t-interval shows its
  bootstrap interval, marked as such.
  """
  if vs is None:
    return "-"
  if "t_ci95" not in vs:
    lo, hi = vs["ci95"]
    return f"{vs['mean_diff']:+.3f} [bootstrap: {lo:+.3f}, {hi:+.3f}]"

  def ci(lo, hi):
    return "n/a" if not (np.isfinite(lo) and np.isfinite(hi)) else f"{lo:+.3f}, {hi:+.3f}"

  return (
    f"{vs['mean_diff']:+.3f} [t: {ci(*vs['t_ci95'])}; boot: {ci(*vs['ci95'])}] "
    f"p={vs['sign_flip_p']:.2g} (n={vs['n']})"
  )
