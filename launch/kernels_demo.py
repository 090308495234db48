"""A worked example of SAO's math on a synthetic multi-turn batch.

    python launch/kernels_demo.py

Until the trainer lands (`launch/train.py`), `make train` runs this: it builds
a batch of agent-like rows (prompt, action turns, tool observations, padding),
computes skip-observation GAE against the naive token-level arm, and takes DIS
and value-loss gradients, printing what a researcher would watch.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl import app

from sao_jax import advantages, losses


def synthetic_batch(rng, batch=8, length=96):
  action_mask = np.zeros((batch, length), bool)
  rewards = np.zeros((batch, length), np.float32)
  for b in range(batch):
    pos = int(rng.integers(4, 12))  # prompt
    while pos < length - 8:
      turn = int(rng.integers(3, 12))
      action_mask[b, pos:pos + turn] = True
      pos += turn + int(rng.integers(2, 10))  # tool observation
    last = np.flatnonzero(action_mask[b])[-1]
    rewards[b, last] = float(rng.random() < 0.5)  # terminal reward
  values = rng.normal(0.5, 0.2, (batch, length)).astype(np.float32)
  rollout_logp = np.where(action_mask, rng.normal(-1.0, 0.3, (batch, length)), 0.0)
  logp = rollout_logp + np.where(action_mask, rng.normal(0.0, 0.2, (batch, length)), 0.0)
  return (jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(action_mask),
          jnp.asarray(logp, jnp.float32), jnp.asarray(rollout_logp, jnp.float32))


def main(_):
  rewards, values, action_mask, logp, rollout_logp = synthetic_batch(np.random.default_rng(0))
  adv, ret = jax.jit(advantages.skip_observation_gae, static_argnums=(3, 4))(
      rewards, values, action_mask, 1.0, 0.95)
  naive, _ = advantages.token_gae(rewards, values, action_mask, 1.0, 0.95)
  print(f"action tokens: {int(action_mask.sum())} of {action_mask.size}")
  print(f"skip-observation GAE: mean |A| {float(jnp.abs(adv).sum() / action_mask.sum()):.4f}; "
        f"naive token GAE differs by {float(jnp.abs(adv - naive).max()):.4f} at most")
  (loss, metrics), grad = jax.value_and_grad(
      lambda lp: losses.dis_policy_loss(lp, rollout_logp, adv, action_mask, 0.2, 0.28),
      has_aux=True)(logp)
  print(f"DIS loss {float(loss):+.4f}; masked below {float(metrics['masked_low_frac']):.3f}, "
        f"above {float(metrics['masked_high_frac']):.3f}; ratio in "
        f"[{float(metrics['ratio_min']):.3f}, {float(metrics['ratio_max']):.3f}]; "
        f"tokens with zero gradient: {int(((grad == 0) & action_mask).sum())}")
  vloss, vmetrics = losses.value_loss(values, ret, action_mask)
  print(f"value loss {float(vloss):.4f}, explained variance "
        f"{float(vmetrics['explained_variance']):+.3f}")


if __name__ == "__main__":
  app.run(main)
