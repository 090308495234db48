"""The RL step against a plain re-statement of docs/DESIGN.md section 2's step.

The step computes GAE from the first critic update's own forward pass (no
separate no-grad critic forward) and hands the actor's global gradient norm
from its metrics to the finiteness guard. Both are speed changes only: the
reference below runs the textbook order (critic forward -> GAE -> K critic
updates on fixed targets -> one actor update) and every output must match.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_trainer import CFG, demo_trajs, make_state

from sao_jax.algo import losses, optim
from sao_jax.data import packing
from sao_jax.models import policy
from sao_jax.train.train_step import StepConfig, apply_if_finite, compute_advantages


def reference_step(step_cfg, ptx, ctx, state, batch):
  """docs/DESIGN.md's step, written plainly: (new state, advantages, first value loss)."""
  inputs = (batch["tokens"], batch["positions"], batch["segment_ids"])
  values, _ = policy.token_values(CFG, state.critic, *inputs)
  advantages, returns, value_mask = compute_advantages(step_cfg, values, batch)

  def critic_loss(p):
    v, aux = policy.token_values(CFG, p, *inputs)
    loss, _ = losses.value_loss(v, returns, value_mask)
    return loss + step_cfg.load_balance_coef * aux["load_balance_loss"], loss

  critic, copt, first = state.critic, state.critic_opt, None
  for _ in range(step_cfg.critic_updates):
    (_, loss), g = jax.value_and_grad(critic_loss, has_aux=True)(critic)
    first = loss if first is None else first
    critic, copt, _ = apply_if_finite(ctx, g, copt, critic, loss)

  def actor_loss(p):
    logp, aux = policy.token_logprobs(CFG, p, *inputs, step_cfg.temperature)
    loss, _ = losses.dis_policy_loss(
      logp,
      batch["rollout_logprobs"],
      advantages,
      batch["action_mask"],
      step_cfg.eps_low,
      step_cfg.eps_high,
    )
    return loss + step_cfg.load_balance_coef * aux["load_balance_loss"], loss

  (_, loss), g = jax.value_and_grad(actor_loss, has_aux=True)(state.policy)
  pol, popt, ok = apply_if_finite(ptx, g, state.policy_opt, state.policy, loss)
  new = state.replace(
    step=state.step + ok.astype(state.step.dtype),
    policy=pol,
    critic=critic,
    policy_opt=popt,
    critic_opt=copt,
  )
  return new, advantages, first


@pytest.mark.parametrize("advantage", ["value", "token_gae"])
def test_rl_step_matches_the_textbook_order(advantage):
  step_cfg = StepConfig.of(advantage=advantage, critic_updates=2)
  state, step = make_state(step_cfg)
  # The optimizers make_state builds (stateless definitions, rebuilt alike).
  ptx = optim.make_optimizer(state.policy, 1e-3)
  ctx = optim.make_optimizer(state.critic, 1e-3, rules=optim.CRITIC_FREEZE_RULES)
  batch = packing.pack(demo_trajs(4), 4, (256,))
  want, advantages, first_loss = jax.jit(lambda s, b: reference_step(step_cfg, ptx, ctx, s, b))(
    state, batch
  )
  got, metrics = jax.jit(step)(state, batch)
  m = batch["action_mask"]
  n = max(int(m.sum()), 1)
  np.testing.assert_allclose(
    metrics["advantage_mean"], float(jnp.where(m, advantages, 0).sum()) / n, rtol=1e-5, atol=1e-7
  )
  np.testing.assert_allclose(metrics["critic/value_loss"], first_loss, rtol=1e-5)
  assert int(got.step) == int(want.step) == 1
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_nonfinite_policy_gradient_skips_the_update():
  state, step = make_state(StepConfig.of(advantage="group", critic_updates=0))
  batch = packing.pack(demo_trajs(4), 4, (256,), np.array([1.0, -1.0, 0.5, -0.5], np.float32))
  batch = dict(batch)
  # A NaN advantage on one action token: finite loss terms elsewhere, NaN gradient.
  batch["baseline_advantages"] = np.where(
    np.cumsum(batch["action_mask"].ravel()).reshape(batch["action_mask"].shape) == 1,
    np.nan,
    batch["baseline_advantages"],
  ).astype(np.float32)
  new, metrics = jax.jit(step)(state, batch)
  assert int(metrics["policy/update_skipped"]) == 1 and int(new.step) == 0
  assert not np.isfinite(float(metrics["policy/grad_norm_all"]))
  for a, b in zip(jax.tree.leaves(new.policy), jax.tree.leaves(state.policy)):
    np.testing.assert_array_equal(a, b)
