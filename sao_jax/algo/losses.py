"""Policy and value losses (docs/DESIGN.md section 2).

Every loss is a token-level sum divided by an explicit normaliser
N = number of action tokens in the batch (at least 1), returned as
`(loss, metrics)`. Metrics are scalars a researcher plots; `metrics["tokens"]`
is the number of action tokens (N, but 0 when there are none: the loss is
then 0), so sums across micro-batches or hosts can be re-normalised exactly.

Inputs are `[B, T]`. `advantages` and `returns` are treated as constants
(stop-gradient): they come from the critic pass before the update.
"""

from __future__ import annotations

import inspect

import chex
import jax
import jax.numpy as jnp

Array = jax.Array

# |log ratio| above this is far outside any trust region; clamping it keeps
# exp() finite so masked tokens get an exact zero gradient instead of 0 * inf.
_MAX_LOG_RATIO = 20.0


def _check(logp, rollout_logp, advantages, action_mask):
  chex.assert_rank([logp, rollout_logp, advantages, action_mask], 2)
  chex.assert_equal_shape([logp, rollout_logp, advantages, action_mask])
  chex.assert_type([logp, rollout_logp, advantages], float)
  chex.assert_type(action_mask, bool)


def _masked_stats(x: Array, action_mask: Array, n: Array, prefix: str) -> dict:
  big = jnp.finfo(x.dtype).max
  return {
    f"{prefix}_mean": jnp.where(action_mask, x, 0.0).sum() / n,
    f"{prefix}_max": jnp.where(action_mask, x, -big).max(),
    f"{prefix}_min": jnp.where(action_mask, x, big).min(),
  }


def log_importance_ratio(logp: Array, rollout_logp: Array, action_mask: Array) -> Array:
  """log r_t clamped to +-_MAX_LOG_RATIO on action tokens, 0 elsewhere."""
  log_ratio = jnp.where(action_mask, logp - rollout_logp, 0.0)
  return jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def importance_ratio(logp: Array, rollout_logp: Array, action_mask: Array) -> Array:
  """r_t = exp(logp_t - rollout_logp_t) on action tokens, 1 elsewhere."""
  return jnp.exp(log_importance_ratio(logp, rollout_logp, action_mask))


def _normaliser(action_mask: Array, dtype) -> Array:
  return jnp.maximum(action_mask.sum(), 1).astype(dtype)


def _token_count(action_mask: Array, dtype) -> Array:
  """The `tokens` metric: the action tokens counted, 0 for none (the
  normaliser's floor of 1 keeps the division finite, not the count)."""
  return action_mask.sum().astype(dtype)


def _ratio_metrics(ratio, logp, rollout_logp, action_mask, n) -> dict:
  log_ratio = jnp.where(action_mask, logp - rollout_logp, 0.0)
  metrics = _masked_stats(ratio, action_mask, n, "ratio")
  # k3 estimator of KL(rollout || current), non-negative per token.
  metrics["approx_kl"] = jnp.where(action_mask, ratio - 1.0 - log_ratio, 0.0).sum() / n
  metrics["tokens"] = _token_count(action_mask, n.dtype)
  return metrics


def dis_regions(
  ratio: Array, advantages: Array, action_mask: Array, eps_low: float, eps_high: float
) -> tuple[Array, Array, Array, Array]:
  """DIS's partition of the action tokens, each a bool `[B, T]`.

      below_t      = mask_t and r_t <= 1 - eps_low
      above_t      = mask_t and r_t >= 1 + eps_high
      inside_t     = mask_t and 1 - eps_low < r_t < 1 + eps_high
      corrective_t = (above_t and A_t < 0) or (below_t and A_t > 0)

  Corrective tokens are the out-of-window tokens whose policy gradient
  pulls the ratio back towards 1: PPO's clip keeps them, DIS drops them.

  Returns:
    (below, above, inside, corrective); non-action tokens are in none.
  """
  below = action_mask & (ratio <= 1.0 - eps_low)
  above = action_mask & (ratio >= 1.0 + eps_high)
  inside = action_mask & ~below & ~above
  corrective = (above & (advantages < 0)) | (below & (advantages > 0))
  return below, above, inside, corrective


def _dis_surrogate(ratio, advantages, keep_mask, n):
  return -jnp.where(keep_mask, ratio * advantages, 0.0).sum() / n


def _dis_metrics(
  ratio, logp, rollout_logp, advantages, action_mask, n, below, above, keep_mask
) -> dict:
  """DIS's metrics for a loss that trains on `keep_mask`; masked = action and not kept."""
  masked = action_mask & ~keep_mask
  metrics = _ratio_metrics(ratio, logp, rollout_logp, action_mask, n)
  metrics.update(
    masked_low_frac=(below & masked).sum() / n,
    masked_high_frac=(above & masked).sum() / n,
    kept_frac=keep_mask.sum() / n,
    masked_corrective_frac=(
      masked & ((above & (advantages < 0)) | (below & (advantages > 0)))
    ).sum()
    / n,
  )
  return metrics


def dis_policy_loss(
  logp: Array,
  rollout_logp: Array,
  advantages: Array,
  action_mask: Array,
  eps_low: float,
  eps_high: float,
) -> tuple[Array, dict]:
  """Direct double-sided importance sampling (DIS).

      r_t    = exp(logp_t - rollout_logp_t)
      keep_t = action_mask_t and (1 - eps_low < r_t < 1 + eps_high)
      L_pi   = - sum_t keep_t * r_t * A_t / N,    N = sum_t action_mask_t

  The ratio is taken against the log-prob saved at rollout time. A token
  whose ratio leaves the open interval contributes neither value nor
  gradient, on either side and for either sign of A_t (unlike PPO's clip,
  which keeps training on the side the advantage sign does not select). The
  gradient with respect to logp_t is -keep_t * r_t * A_t / N.

  Args:
    logp: float `[B, T]`, log-prob of x_t under the policy being trained.
    rollout_logp: float `[B, T]`, log-prob recorded at generation.
    advantages: float `[B, T]`, zero off action tokens (stop-gradient).
    action_mask: bool `[B, T]`.
    eps_low, eps_high: the trust region (1 - eps_low, 1 + eps_high).

  Returns:
    (loss, metrics) with masked_low_frac / masked_high_frac (fractions of
    action tokens masked below and above the region), kept_frac,
    masked_corrective_frac (the masked tokens PPO's clip would still train
    on: A_t < 0 above the region, A_t > 0 below it, where its gradient
    pulls the policy back towards the rollout's), ratio mean / max / min
    over action tokens, approx_kl and tokens (= N).
  """
  _check(logp, rollout_logp, advantages, action_mask)
  advantages = jax.lax.stop_gradient(advantages)
  n = _normaliser(action_mask, logp.dtype)
  ratio = importance_ratio(logp, rollout_logp, action_mask)
  below, above, inside, _ = dis_regions(ratio, advantages, action_mask, eps_low, eps_high)
  loss = _dis_surrogate(ratio, advantages, inside, n)
  return loss, _dis_metrics(
    ratio, logp, rollout_logp, advantages, action_mask, n, below, above, inside
  )


def ppo_clip_policy_loss(
  logp: Array,
  rollout_logp: Array,
  advantages: Array,
  action_mask: Array,
  eps_low: float,
  eps_high: float,
) -> tuple[Array, dict]:
  """PPO's clipped surrogate against the rollout log-prob.

      L = - sum_t mask_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) / N

  The vanilla (async) GRPO arm. `clip_frac` counts the action tokens whose
  gradient the clip removed.
  """
  _check(logp, rollout_logp, advantages, action_mask)
  advantages = jax.lax.stop_gradient(advantages)
  n = _normaliser(action_mask, logp.dtype)
  ratio = importance_ratio(logp, rollout_logp, action_mask)
  unclipped = ratio * advantages
  clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
  surrogate = jnp.minimum(unclipped, clipped)
  loss = -jnp.where(action_mask, surrogate, 0.0).sum() / n
  metrics = _ratio_metrics(ratio, logp, rollout_logp, action_mask, n)
  metrics["clip_frac"] = (action_mask & (clipped < unclipped)).sum() / n
  return loss, metrics


ROLLOUT_KL_ESTIMATORS = ("k2", "k3")
ROLLOUT_KL_REDUCTIONS = ("sequence", "token")


def rollout_kl_terms(log_ratio: Array, estimator: str) -> Array:
  """Per token, an estimator of the KL divergence between rollout and current policy.

      k2_t = 0.5 * (log r_t)^2          (d / d logp_t = log r_t)
      k3_t = r_t - 1 - log r_t          (d / d logp_t = r_t - 1)

  Both are >= 0 and 0 at r_t = 1; `log_ratio` is log r (0 off action tokens).
  """
  if estimator == "k2":
    return 0.5 * jnp.square(log_ratio)
  if estimator == "k3":
    return jnp.exp(log_ratio) - 1.0 - log_ratio
  raise ValueError(f"rollout_kl_estimator {estimator!r}: must be one of {ROLLOUT_KL_ESTIMATORS}")


def sequence_mean_weights(
  action_mask: Array, segment_ids: Array | None = None, dtype=jnp.float32
) -> Array:
  """Per-token weights w_t with sum_t w_t x_t = the mean over sequences of each
  sequence's mean of x over its action tokens:

      w_t = mask_t / (|s(t)| * S),   |s| = action tokens of sequence s,
                                     S   = sequences with an action token

  Sequences as in `sequence_mean_log_ratio`. All zero without action tokens.
  """
  count = _sequence_action_counts(action_mask, segment_ids, dtype)
  per_token = jnp.where(action_mask, 1.0 / jnp.maximum(count, 1.0), 0.0).astype(dtype)
  return per_token / jnp.maximum(per_token.sum(), 1.0)


def dis_rollout_kl_policy_loss(
  logp: Array,
  rollout_logp: Array,
  advantages: Array,
  action_mask: Array,
  eps_low: float,
  eps_high: float,
  *,
  rollout_kl_coef: float = 0.1,
  rollout_kl_estimator: str = "k2",
  rollout_kl_reduction: str = "sequence",
  segment_ids: Array | None = None,
) -> tuple[Array, dict]:
  """DIS plus a penalty on the divergence from the rollout policy.

      L = L_dis + beta * KL,   beta = rollout_kl_coef
      KL (reduction "sequence") = (1 / S) sum_s (1 / |s|) sum_{t in s} k_t
      KL (reduction "token")    = sum_t mask_t k_t / N

  L_dis is `dis_policy_loss`'s; k_t is `rollout_kl_terms`' k2 (default) or
  k3; the sequence mean is `sequence_mean_weights`' (sequences are
  `segment_ids`' segments, whole rows when None). The defaults, k2 with a
  per-sequence mean, are the rollout-KL penalty as SkyRL proposes it; k3
  with a token mean (the `approx_kl` every loss reports) is the variant
  experiments/dis_stability.py's dis_kl arms run (they set it
  explicitly). With token mean the gradient with respect to logp_t is

      -keep_t r_t A_t / N + beta * mask_t * g_t / N,   g = log r (k2), r - 1 (k3)

  and with sequence mean the penalty's term is beta * g_t / (|s(t)| S) in
  place of beta * g_t / N. Either way an out-of-window token still gets the
  penalty's pull back towards r = 1.

  Which estimator: under samples from the rollout policy mu, k3's value and
  gradient are unbiased for KL(mu || pi) and its gradient; k2's gradient
  E_mu[log r grad log pi] is that of KL(pi || mu) only where pi ~ mu
  (tokens near r = 1). k2's pull back is weaker than k3's above r = 1
  (log r < r - 1) and stronger below it.

  Returns:
    (loss, metrics): DIS's metrics, plus rollout_kl (the penalty's KL before
    beta), kl_penalty (beta times it) and dis_loss (L_dis).
  """
  if rollout_kl_reduction not in ROLLOUT_KL_REDUCTIONS:
    raise ValueError(
      f"rollout_kl_reduction {rollout_kl_reduction!r}: must be one of {ROLLOUT_KL_REDUCTIONS}"
    )
  _check(logp, rollout_logp, advantages, action_mask)
  advantages = jax.lax.stop_gradient(advantages)
  n = _normaliser(action_mask, logp.dtype)
  log_ratio = log_importance_ratio(logp, rollout_logp, action_mask)
  ratio = jnp.exp(log_ratio)
  below, above, inside, _ = dis_regions(ratio, advantages, action_mask, eps_low, eps_high)
  dis_loss = _dis_surrogate(ratio, advantages, inside, n)
  terms = jnp.where(action_mask, rollout_kl_terms(log_ratio, rollout_kl_estimator), 0.0)
  if rollout_kl_reduction == "token":
    kl = terms.sum() / n
  else:
    kl = (sequence_mean_weights(action_mask, segment_ids, logp.dtype) * terms).sum()
  metrics = _dis_metrics(
    ratio, logp, rollout_logp, advantages, action_mask, n, below, above, inside
  )
  metrics.update(rollout_kl=kl, kl_penalty=rollout_kl_coef * kl, dis_loss=dis_loss)
  return dis_loss + rollout_kl_coef * kl, metrics


CORRECTIVE_SIDES = ("low", "high")


def dis_corrective_policy_loss(
  logp: Array,
  rollout_logp: Array,
  advantages: Array,
  action_mask: Array,
  eps_low: float,
  eps_high: float,
  *,
  corrective_side: str = "low",
) -> tuple[Array, dict]:
  """DIS that also trains on the corrective tokens of one side of the window.

      keep_t = inside_t or (side = "low"  and r_t <= 1 - eps_low  and A_t > 0)
                        or (side = "high" and r_t >= 1 + eps_high and A_t < 0)
      L      = - sum_t keep_t * r_t * A_t / N

  (inside_t as in `dis_regions`.) Every other out-of-window token is masked
  as in DIS: zero value, zero gradient. The gradient is -keep_t r_t A_t / N.

  "low" keeps the tokens the policy made less likely although their
  advantage is positive; their weight r_t is below 1 - eps_low, so each
  such token's gradient is smaller than an in-window one's. "high" keeps
  the tokens made more likely although their advantage is negative; r_t is
  unbounded there (it is PPO clip's unclipped side), so its gradient can be
  large.

  Returns:
    (loss, metrics): DIS's metrics (masked_* count only the tokens this
    loss masks) plus kept_corrective_frac.
  """
  if corrective_side not in CORRECTIVE_SIDES:
    raise ValueError(f"corrective_side {corrective_side!r}: must be one of {CORRECTIVE_SIDES}")
  _check(logp, rollout_logp, advantages, action_mask)
  advantages = jax.lax.stop_gradient(advantages)
  n = _normaliser(action_mask, logp.dtype)
  ratio = importance_ratio(logp, rollout_logp, action_mask)
  below, above, inside, _ = dis_regions(ratio, advantages, action_mask, eps_low, eps_high)
  if corrective_side == "low":
    corrective = below & (advantages > 0)
  else:
    corrective = above & (advantages < 0)
  keep_mask = inside | corrective
  loss = _dis_surrogate(ratio, advantages, keep_mask, n)
  metrics = _dis_metrics(
    ratio, logp, rollout_logp, advantages, action_mask, n, below, above, keep_mask
  )
  metrics["kept_corrective_frac"] = corrective.sum() / n
  return loss, metrics


def sequence_mean_log_ratio(
  log_ratio: Array, action_mask: Array, segment_ids: Array | None = None
) -> Array:
  """Per token, the mean of log r over the action tokens of its sequence.

      g_s = sum_{t in s} mask_t log r_t / max(1, sum_{t in s} mask_t)

  A sequence is a segment of a packed row (`segment_ids`, int `[B, T]`,
  ids in [0, T], 0 padding), or the whole row when `segment_ids` is None.
  Returns float `[B, T]`: g of each token's sequence (0 for a sequence
  without action tokens).
  """
  chex.assert_equal_shape([log_ratio, action_mask])
  ids, num = _sequence_ids(action_mask, segment_ids)
  total = jax.ops.segment_sum(jnp.where(action_mask, log_ratio, 0.0).ravel(), ids, num)
  count = jax.ops.segment_sum(action_mask.astype(log_ratio.dtype).ravel(), ids, num)
  mean = total / jnp.maximum(count, 1.0)
  return mean[ids].reshape(log_ratio.shape)


def _sequence_ids(action_mask: Array, segment_ids: Array | None) -> tuple[Array, int]:
  """One flat id per (row, segment) pair, so segments never mix across rows; and their count."""
  b, t = action_mask.shape
  if segment_ids is None:
    segment_ids = jnp.ones((b, t), jnp.int32)
  chex.assert_equal_shape([action_mask, segment_ids])
  return (jnp.arange(b, dtype=jnp.int32)[:, None] * (t + 1) + segment_ids).ravel(), b * (t + 1)


def _sequence_action_counts(action_mask: Array, segment_ids: Array | None, dtype) -> Array:
  """Per token, the number of action tokens of its sequence."""
  ids, num = _sequence_ids(action_mask, segment_ids)
  count = jax.ops.segment_sum(action_mask.astype(dtype).ravel(), ids, num)
  return count[ids].reshape(action_mask.shape)


def dis_seq_geo_policy_loss(
  logp: Array,
  rollout_logp: Array,
  advantages: Array,
  action_mask: Array,
  eps_low: float,
  eps_high: float,
  *,
  segment_ids: Array | None = None,
  geo_eps_low: float = 0.05,
  geo_eps_high: float = 0.05,
) -> tuple[Array, dict]:
  """DIS inside a sequence-level mask on the geometric mean ratio.

      G_s     = exp(mean over the action tokens t of sequence s of log r_t)
      keep_t  = inside_t and (1 - geo_eps_low < G_{s(t)} < 1 + geo_eps_high)
      L       = - sum_t keep_t * r_t * A_t / N

  (inside_t: token-level DIS's window, as in `dis_regions`.) A sequence
  whose geometric mean ratio leaves its window is dropped whole: every one
  of its tokens gets zero value and zero gradient; the mask is a hard
  indicator, so the gradient of a kept token is -r_t A_t / N, as in DIS.
  Sequences are `segment_ids`' segments (int `[B, T]`, 0 padding), or
  whole rows when it is None (see `sequence_mean_log_ratio`).

  Returns:
    (loss, metrics): DIS's metrics (masked_low / high count the
    token-level window only), plus seq_masked_frac (the fraction of
    sequences with action tokens that the geometric mask drops) and
    seq_masked_token_frac (their action tokens, over N).
  """
  _check(logp, rollout_logp, advantages, action_mask)
  advantages = jax.lax.stop_gradient(advantages)
  n = _normaliser(action_mask, logp.dtype)
  log_ratio = log_importance_ratio(logp, rollout_logp, action_mask)
  ratio = jnp.exp(log_ratio)
  below, above, inside, _ = dis_regions(ratio, advantages, action_mask, eps_low, eps_high)
  geo = jnp.exp(sequence_mean_log_ratio(log_ratio, action_mask, segment_ids))
  seq_kept = (geo > 1.0 - geo_eps_low) & (geo < 1.0 + geo_eps_high)
  keep_mask = inside & seq_kept
  loss = _dis_surrogate(ratio, advantages, keep_mask, n)
  metrics = _dis_metrics(
    ratio, logp, rollout_logp, advantages, action_mask, n, below, above, inside
  )
  metrics["kept_frac"] = keep_mask.sum() / n
  dropped = action_mask & ~seq_kept
  # Each sequence counted once, at its first action token.
  seg = jnp.ones(action_mask.shape, jnp.int32) if segment_ids is None else segment_ids
  starts = seg != jnp.pad(seg[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  first = action_mask & (_segment_cumsum(action_mask, starts) == 1)
  num_seqs = jnp.maximum(first.sum(), 1)
  metrics.update(
    seq_masked_frac=(first & dropped).sum() / num_seqs, seq_masked_token_frac=dropped.sum() / n
  )
  return loss, metrics


def _segment_cumsum(x: Array, starts: Array) -> Array:
  """Inclusive running sum of bool `x` along axis 1, restarting where `starts`."""
  x = x.astype(jnp.int32)
  total = jnp.cumsum(x, axis=1)
  # The running total just before each start, carried forward to the next start.
  base = jnp.where(starts, total - x, 0)
  base = jax.lax.cummax(base, axis=1)
  return total - base


def cispo_policy_loss(
  logp: Array,
  rollout_logp: Array,
  advantages: Array,
  action_mask: Array,
  eps_low: float,
  eps_high: float,
) -> tuple[Array, dict]:
  """CISPO as MiniMax-M1 defines it: an upper-clipped, stop-gradient weight on the log-prob.

      w_t = sg(min(r_t, 1 + eps_high)),   r_t against rollout_logp
      L   = - sum_t mask_t * w_t * A_t * logp_t / N

  MiniMax-M1 clips the importance weight from above only (its lower bound
  is set so large that none applies); `eps_low` is not used. The clip
  bounds each token's weight but, unlike DIS or PPO's clip, removes no
  token's gradient: d L / d logp_t = -mask_t * w_t * A_t / N for every
  action token. The loss value is a REINFORCE-style sum over logp, not a
  surrogate of r * A; only its gradient is comparable with DIS's. The
  two-sided clip is `cispo_two_sided_policy_loss`.

  Returns:
    (loss, metrics): ratio mean / max / min, approx_kl, tokens, and
    clip_high_frac (action tokens whose weight was clipped down to 1 + eps_high).
  """
  return _weighted_logp_loss(logp, rollout_logp, advantages, action_mask, None, eps_high)


def cispo_two_sided_policy_loss(
  logp: Array,
  rollout_logp: Array,
  advantages: Array,
  action_mask: Array,
  eps_low: float,
  eps_high: float,
) -> tuple[Array, dict]:
  """CISPO's weight clipped on both sides: not MiniMax-M1's, a named option.

      w_t = sg(clip(r_t, 1 - eps_low, 1 + eps_high))
      L   = - sum_t mask_t * w_t * A_t * logp_t / N

  The "CISPO (0.2, 0.28)" of experiments/dis_stability.py's cispo arms.
  d L / d logp_t =
  -mask_t * w_t * A_t / N.

  Returns:
    (loss, metrics): `cispo_policy_loss`'s, plus clip_low_frac (action
    tokens whose weight was clipped up to 1 - eps_low).
  """
  return _weighted_logp_loss(logp, rollout_logp, advantages, action_mask, eps_low, eps_high)


def _weighted_logp_loss(logp, rollout_logp, advantages, action_mask, eps_low, eps_high):
  """CISPO's loss with the weight clipped to [1 - eps_low, 1 + eps_high]
  (no lower bound when eps_low is None), and its clip fractions."""
  _check(logp, rollout_logp, advantages, action_mask)
  advantages = jax.lax.stop_gradient(advantages)
  n = _normaliser(action_mask, logp.dtype)
  ratio = importance_ratio(logp, rollout_logp, action_mask)
  low = None if eps_low is None else 1.0 - eps_low
  weight = jax.lax.stop_gradient(jnp.clip(ratio, low, 1.0 + eps_high))
  loss = -jnp.where(action_mask, weight * advantages * logp, 0.0).sum() / n
  metrics = _ratio_metrics(ratio, logp, rollout_logp, action_mask, n)
  if low is not None:
    metrics["clip_low_frac"] = (action_mask & (ratio < low)).sum() / n
  metrics["clip_high_frac"] = (action_mask & (ratio > 1.0 + eps_high)).sum() / n
  return loss, metrics


def explained_variance(predictions: Array, targets: Array, action_mask: Array) -> Array:
  """1 - Var[R - V] / Var[R] over action tokens (1 is perfect, <= 0 useless).

  NaN where it is undefined: no action tokens, or targets without variance
  (Var[R] within float rounding of 0), where 1 - 0/0 would read as a perfect
  fit (sao_jax/train/metrics.py logs no number for NaN)."""
  w = action_mask.astype(targets.dtype)
  n = jnp.maximum(w.sum(), 1.0)

  def var(x):
    mean = (w * x).sum() / n
    return (w * (x - mean) ** 2).sum() / n

  var_t = var(targets)
  scale = (w * targets**2).sum() / n
  defined = (w.sum() > 0) & (var_t > jnp.finfo(targets.dtype).eps * scale)
  return jnp.where(
    defined, 1.0 - var(targets - predictions) / jnp.where(defined, var_t, 1.0), jnp.nan
  )


def undefined_if_empty(metrics: dict, action_mask: Array, keep=("tokens",)) -> dict:
  """`metrics` (means, fractions, extremes over the action tokens), each NaN
  when there are no action tokens, but those in `keep` (counts): a statistic
  over an empty set is undefined, not 0."""
  empty = ~action_mask.any()
  return {k: v if k in keep else jnp.where(empty, jnp.nan, v) for k, v in metrics.items()}


def value_loss(
  values: Array,
  returns: Array,
  action_mask: Array,
  old_values: Array | None = None,
  clip: float | None = None,
) -> tuple[Array, dict]:
  """Masked value regression: L_V = 0.5 * sum_t mask_t (V_t - R_t)^2 / N.

  With `old_values` and `clip`, the PPO-style clipped variant: the squared
  error is the larger of the unclipped one and that of
  old_V + clip(V - old_V, -clip, clip).

  Returns:
    (loss, metrics) with explained_variance, value mean, return mean, tokens.
  """
  chex.assert_rank([values, returns, action_mask], 2)
  chex.assert_equal_shape([values, returns, action_mask])
  chex.assert_type([values, returns], float)
  chex.assert_type(action_mask, bool)
  if (old_values is None) != (clip is None):
    raise ValueError("value clipping needs both old_values and clip.")
  returns = jax.lax.stop_gradient(returns)
  n = _normaliser(action_mask, values.dtype)
  sq_err = (values - returns) ** 2
  metrics = {}
  if clip is not None:
    chex.assert_equal_shape([values, old_values])
    old_values = jax.lax.stop_gradient(old_values)
    clipped_v = old_values + jnp.clip(values - old_values, -clip, clip)
    clipped_err = (clipped_v - returns) ** 2
    metrics["value_clip_frac"] = (action_mask & (clipped_err > sq_err)).sum() / n
    sq_err = jnp.maximum(sq_err, clipped_err)
  loss = 0.5 * jnp.where(action_mask, sq_err, 0.0).sum() / n
  metrics.update(
    explained_variance=explained_variance(values, returns, action_mask),
    value_mean=jnp.where(action_mask, values, 0.0).sum() / n,
    return_mean=jnp.where(action_mask, returns, 0.0).sum() / n,
    tokens=_token_count(action_mask, n.dtype),
  )
  return loss, undefined_if_empty(metrics, action_mask)


# The policy losses by name (`rl.policy_loss`). Each is
# fn(logp, rollout_logp, advantages, action_mask, eps_low, eps_high, **options)
# -> (loss, metrics); adding one is a function here and its entry. A loss
# receives those of POLICY_LOSS_OPTIONS it names as keyword parameters
# (`call_policy_loss`), so a record that needs none takes none.
POLICY_LOSSES = {
  "dis": dis_policy_loss,
  "ppo_clip": ppo_clip_policy_loss,
  "dis_rollout_kl": dis_rollout_kl_policy_loss,
  "dis_corrective": dis_corrective_policy_loss,
  "dis_seq_geo": dis_seq_geo_policy_loss,
  "cispo": cispo_policy_loss,
  "cispo_two_sided": cispo_two_sided_policy_loss,
}

# The keyword options the train step offers every policy loss: the packed
# batch's segment ids, and the rl section's fields of the same names.
BATCH_OPTIONS = ("segment_ids",)
CONFIG_OPTIONS = (
  "rollout_kl_coef",
  "rollout_kl_estimator",
  "rollout_kl_reduction",
  "corrective_side",
  "geo_eps_low",
  "geo_eps_high",
)
POLICY_LOSS_OPTIONS = BATCH_OPTIONS + CONFIG_OPTIONS

# The inputs every policy loss takes first, positionally.
_LOSS_INPUTS = 6


def policy_loss(name: str):
  """The policy loss called `name`; ValueError listing the known ones."""
  if name not in POLICY_LOSSES:
    raise ValueError(f"policy_loss {name!r} is unknown; known: {sorted(POLICY_LOSSES)}")
  return POLICY_LOSSES[name]


def check_policy_loss(name: str) -> None:
  """Raises ValueError (one line) when the policy loss `name` takes a keyword
  option that the train step does not offer (not in POLICY_LOSS_OPTIONS): it
  would run at the loss's own default whatever the config says."""
  params = list(inspect.signature(policy_loss(name)).parameters.values())[_LOSS_INPUTS:]
  unknown = [
    p.name
    for p in params
    if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    and p.name not in POLICY_LOSS_OPTIONS
  ]
  if unknown:
    raise ValueError(
      f"policy loss {name!r} takes {unknown}, which the train step does not "
      f"offer (losses.POLICY_LOSS_OPTIONS = {POLICY_LOSS_OPTIONS}): add each to "
      "CONFIG_OPTIONS and declare it in the rl section"
    )


def call_policy_loss(fn, logp, rollout_logp, advantages, action_mask, eps_low, eps_high, **options):
  """fn(logp, ..., eps_high, **those of `options` that fn names as parameters).

  A loss with a `**kwargs` parameter gets every option. Its metrics are NaN
  (undefined) when there are no action tokens (`undefined_if_empty`).
  """
  params = inspect.signature(fn).parameters.values()
  if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
    names = {
      p.name
      for p in params
      if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    }
    options = {k: v for k, v in options.items() if k in names}
  loss, metrics = fn(logp, rollout_logp, advantages, action_mask, eps_low, eps_high, **options)
  return loss, undefined_if_empty(metrics, action_mask)
