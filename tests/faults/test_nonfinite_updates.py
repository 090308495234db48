"""A non-finite loss or gradient skips the update: params and moments unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sao_jax.algo import optim
from sao_jax.data import packing
from sao_jax.envs.demonstrations import demonstration_trajectory
from sao_jax.envs.python_tool import PythonTool
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import config as mcfg
from sao_jax.models import policy
from sao_jax.train.train_step import (
  StepConfig,
  TrainState,
  apply_if_finite,
  make_sft_step,
  make_train_step,
)

TOK = CharTokenizer()
ENV = PythonTool()
CFG = mcfg.tiny(vocab_size=TOK.vocab_size)


def _batch(poison=None):
  trajs = []
  for i in range(4):
    t = demonstration_trajectory(ENV, ENV.task(i), TOK)
    t.rollout_logprobs = np.where(t.action_mask, -0.5, 0).astype(np.float32)
    trajs.append(t)
  batch = packing.pack(trajs, 4, (256,), np.array([1.0, -1.0, 0.5, -0.5], np.float32))
  if poison is not None:
    rows, cols = np.nonzero(batch["action_mask"])
    batch[poison] = np.array(batch[poison], copy=True)
    batch[poison][rows[-1], cols[-1]] = np.nan
  return batch


def _state():
  p = policy.init_params(CFG, jax.random.key(0))
  c = jax.tree.map(
    jnp.copy,
    policy.value_params_from_policy(p, policy.init_params(CFG, jax.random.key(1), "value")),
  )
  ptx = optim.make_optimizer(p, 1e-3)
  ctx = optim.make_optimizer(c, 1e-3, rules=optim.CRITIC_FREEZE_RULES)
  return TrainState(jnp.zeros((), jnp.int32), p, c, ptx.init(p), ctx.init(c)), ptx, ctx


def _assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
  "arm,poison",
  [
    (dict(advantage="value"), "rewards"),  # -> NaN advantages and returns
    (dict(advantage="group", critic_updates=0), "baseline_advantages"),
  ],
)
def test_nonfinite_step_leaves_state_bit_identical(arm, poison):
  state, ptx, ctx = _state()
  step = jax.jit(make_train_step(CFG, StepConfig.of(**arm), ptx, ctx))
  # A healthy step first, so the optimizer moments are non-trivial.
  state, m = step(state, _batch())
  assert int(m["policy/update_skipped"]) == 0 and int(state.step) == 1
  before = jax.tree.map(np.asarray, state)
  after, m = step(state, _batch(poison))
  assert int(m["policy/update_skipped"]) == 1
  assert int(after.step) == 1  # a skipped update is not a new policy version
  _assert_same(after.policy, before.policy)
  _assert_same(after.policy_opt, before.policy_opt)
  if StepConfig.of(**arm).uses_critic and poison == "rewards":
    assert int(m["critic/updates_skipped"]) == 2
    _assert_same(after.critic, before.critic)
    _assert_same(after.critic_opt, before.critic_opt)
  # And the next healthy batch trains again.
  again, m = step(after, _batch())
  assert int(m["policy/update_skipped"]) == 0 and int(again.step) == 2


def test_apply_if_finite_updates_when_finite_and_not_otherwise():
  params = {"w": jnp.ones(3)}
  tx = optax.adam(0.1)
  opt = tx.init(params)
  new, new_opt, ok = apply_if_finite(tx, {"w": jnp.ones(3)}, opt, params, jnp.float32(1.0))
  assert bool(ok) and not np.allclose(new["w"], 1.0)
  assert int(new_opt[0].count) == 1
  for bad_grad, bad_loss in (([1.0, np.inf, 1.0], 1.0), ([1.0, 1.0, 1.0], np.nan)):
    new, new_opt, ok = apply_if_finite(
      tx, {"w": jnp.asarray(bad_grad)}, opt, params, jnp.float32(bad_loss)
    )
    assert not bool(ok)
    np.testing.assert_array_equal(new["w"], params["w"])
    assert int(new_opt[0].count) == 0


def test_sft_step_skips_nonfinite():
  p = policy.init_params(CFG, jax.random.key(0))
  tx = optim.make_optimizer(p, 1e-3)
  opt = tx.init(p)
  step = jax.jit(make_sft_step(CFG, tx))
  batch = _batch()
  batch["tokens"] = np.array(batch["tokens"], copy=True)
  # NaN params make every loss non-finite: the update must not apply.
  bad = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan) if x.dtype.kind == "f" else x, p)
  new, new_opt, m = step(bad, opt, batch)
  assert int(m["sft/update_skipped"]) == 1
  _assert_same(new_opt, opt)
