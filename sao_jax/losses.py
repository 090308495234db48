"""Policy and value losses (DESIGN.md section 2).

Every loss is a token-level sum divided by an explicit normaliser
N = number of action tokens in the batch (at least 1), returned as
`(loss, metrics)`. Metrics are scalars a researcher plots; `metrics["tokens"]`
is N, so sums across micro-batches or hosts can be re-normalised exactly.

Inputs are `[B, T]`. `advantages` and `returns` are treated as constants
(stop-gradient): they come from the critic pass before the update.
"""

from __future__ import annotations

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


def importance_ratio(logp: Array, rollout_logp: Array, action_mask: Array) -> Array:
  """r_t = exp(logp_t - rollout_logp_t) on action tokens, 1 elsewhere."""
  log_ratio = jnp.where(action_mask, logp - rollout_logp, 0.0)
  return jnp.exp(jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))


def _normaliser(action_mask: Array, dtype) -> Array:
  return jnp.maximum(action_mask.sum(), 1).astype(dtype)


def _ratio_metrics(ratio, logp, rollout_logp, action_mask, n) -> dict:
  log_ratio = jnp.where(action_mask, logp - rollout_logp, 0.0)
  metrics = _masked_stats(ratio, action_mask, n, "ratio")
  # k3 estimator of KL(rollout || current), non-negative per token.
  metrics["approx_kl"] = jnp.where(
      action_mask, ratio - 1.0 - log_ratio, 0.0).sum() / n
  metrics["tokens"] = n
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
  below = action_mask & (ratio <= 1.0 - eps_low)
  above = action_mask & (ratio >= 1.0 + eps_high)
  keep_mask = action_mask & ~below & ~above
  loss = -jnp.where(keep_mask, ratio * advantages, 0.0).sum() / n
  metrics = _ratio_metrics(ratio, logp, rollout_logp, action_mask, n)
  metrics.update(
      masked_low_frac=below.sum() / n,
      masked_high_frac=above.sum() / n,
      kept_frac=keep_mask.sum() / n,
      masked_corrective_frac=((above & (advantages < 0)) | (below & (advantages > 0))).sum() / n,
  )
  return loss, metrics


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


def explained_variance(predictions: Array, targets: Array, action_mask: Array) -> Array:
  """1 - Var[R - V] / Var[R] over action tokens (1 is perfect, <= 0 useless)."""
  w = action_mask.astype(targets.dtype)
  n = jnp.maximum(w.sum(), 1.0)

  def var(x):
    mean = (w * x).sum() / n
    return (w * (x - mean) ** 2).sum() / n

  return 1.0 - var(targets - predictions) / jnp.maximum(var(targets), 1e-8)


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
      tokens=n,
  )
  return loss, metrics


# The policy losses by name (`rl.policy_loss`). Each is
# fn(logp, rollout_logp, advantages, action_mask, eps_low, eps_high) -> (loss, metrics);
# adding one is a function here and its entry.
POLICY_LOSSES = {
    "dis": dis_policy_loss,
    "ppo_clip": ppo_clip_policy_loss,
}


def policy_loss(name: str):
  """The policy loss called `name`; ValueError listing the known ones."""
  if name not in POLICY_LOSSES:
    raise ValueError(f"policy_loss {name!r} is unknown; known: {sorted(POLICY_LOSSES)}")
  return POLICY_LOSSES[name]
