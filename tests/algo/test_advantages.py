"""Advantage estimators against independent oracles."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rlax
from absl.testing import parameterized

from sao_jax.algo import advantages as adv

GAMMA, LAM = 0.97, 0.9


def numpy_skip_obs_gae(r, v, m, gamma, lam):
  """Textbook GAE on the compressed action sequence, by explicit loops."""
  a_out, r_out = np.zeros_like(r), np.zeros_like(r)
  for b in range(r.shape[0]):
    idx = np.flatnonzero(m[b])
    next_v, next_a = 0.0, 0.0
    for i in idx[::-1]:
      delta = r[b, i] + gamma * next_v - v[b, i]
      a = delta + gamma * lam * next_a
      a_out[b, i], r_out[b, i] = a, a + v[b, i]
      next_v, next_a = v[b, i], a
  return a_out, r_out


def numpy_token_gae(r, v, m, gamma, lam):
  a_out, r_out = np.zeros_like(r), np.zeros_like(r)
  for b in range(r.shape[0]):
    idx = np.flatnonzero(m[b])
    if not len(idx):
      continue
    lo, hi = idx[0], idx[-1]
    next_a = 0.0
    for t in range(hi, lo - 1, -1):
      next_v = v[b, t + 1] if t < hi else 0.0
      a = r[b, t] + gamma * next_v - v[b, t] + gamma * lam * next_a
      next_a = a
      r_out[b, t] = a + v[b, t]  # the critic's target on the whole span
      if m[b, t]:
        a_out[b, t] = a
  return a_out, r_out


def numpy_step_gae(r, v, m, gamma, lam, step_value):
  a_out, r_out = np.zeros_like(r), np.zeros_like(r)
  for b in range(r.shape[0]):
    runs, t = [], 0
    while t < r.shape[1]:
      if m[b, t]:
        s = t
        while t < r.shape[1] and m[b, t]:
          t += 1
        runs.append((s, t))
      else:
        t += 1
    rew = [r[b, s:e].sum() for s, e in runs]
    val = [v[b, s:e].mean() if step_value == "mean" else v[b, e - 1] for s, e in runs]
    next_v, next_a = 0.0, 0.0
    for j in range(len(runs) - 1, -1, -1):
      a = rew[j] + gamma * next_v - val[j] + gamma * lam * next_a
      s, e = runs[j]
      a_out[b, s:e], r_out[b, s:e] = a, a + val[j]
      next_v, next_a = val[j], a
  return a_out, r_out


def random_batch(seed, b=5, t=67, p_action=0.6):
  rng = np.random.default_rng(seed)
  m = rng.random((b, t)) < p_action
  m[0] = False  # a row with no action at all
  m[1, -1] = True  # a row ending on an action
  r = np.where(m, rng.normal(size=(b, t)), 0.0).astype(np.float32)
  v = rng.normal(size=(b, t)).astype(np.float32)
  return r, v, m


class SkipObservationGaeTest(parameterized.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(0, 1)
  def test_matches_numpy_oracle(self, seed):
    r, v, m = random_batch(seed)
    fn = self.variant(lambda *x: adv.skip_observation_gae(*x, GAMMA, LAM))
    a, ret = fn(r, v, m)
    a_ref, ret_ref = numpy_skip_obs_gae(r, v, m, GAMMA, LAM)
    np.testing.assert_allclose(a, a_ref, atol=1e-5)
    np.testing.assert_allclose(ret, ret_ref, atol=1e-5)

  def test_hand_computed_multi_turn(self):
    # prompt | act act | obs obs | act   (gamma = 0.5, lam = 1)
    m = np.array([[0, 1, 1, 0, 0, 1]], bool)
    v = np.array([[9.0, 1.0, 2.0, 9.0, 9.0, 4.0]], np.float32)
    r = np.array([[0.0, 0.0, 1.0, 0.0, 0.0, 3.0]], np.float32)
    a, ret = adv.skip_observation_gae(r, v, m, 0.5, 1.0)
    # t=5: 3 - 4 = -1; t=2: 1 + .5*4 - 2 = 1, + .5*(-1) = .5;
    # t=1: 0 + .5*2 - 1 = 0, + .5*.5 = .25. Observations' 9s never enter.
    np.testing.assert_allclose(a, [[0, 0.25, 0.5, 0, 0, -1]], atol=1e-6)
    np.testing.assert_allclose(ret, [[0, 1.25, 2.5, 0, 0, 3]], atol=1e-6)

  def test_all_actions_equals_rlax(self):
    rng = np.random.default_rng(3)
    b, t = 3, 300
    r = rng.normal(size=(b, t)).astype(np.float32)
    v = rng.normal(size=(b, t)).astype(np.float32)
    m = np.ones((b, t), bool)
    a, _ = adv.skip_observation_gae(r, v, m, GAMMA, LAM)
    discount = np.full((t,), GAMMA, np.float32)
    discount[-1] = 0.0  # terminal after the last token
    ref = jax.vmap(rlax.truncated_generalized_advantage_estimation, in_axes=(0, None, None, 0))(
      r, discount, LAM, np.pad(v, ((0, 0), (0, 1)))
    )
    np.testing.assert_allclose(a, ref, atol=2e-5)

  def test_gathered_actions_equal_rlax(self):
    r, v, m = random_batch(4, b=2, t=90)
    a, _ = adv.skip_observation_gae(r, v, m, GAMMA, LAM)
    row = 1
    idx = np.flatnonzero(m[row])
    discount = np.full((len(idx),), GAMMA, np.float32)
    discount[-1] = 0.0
    ref = rlax.truncated_generalized_advantage_estimation(
      r[row, idx], discount, LAM, np.append(v[row, idx], 0.0)
    )
    np.testing.assert_allclose(np.asarray(a)[row, idx], ref, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(a)[row, ~m[row]], 0.0)

  def test_linear_recurrence_matches_loop(self):
    rng = np.random.default_rng(5)
    a = rng.uniform(0, 1, (3, 40)).astype(np.float32)
    b = rng.normal(size=(3, 40)).astype(np.float32)
    expect, y = np.zeros_like(b), np.zeros(3, np.float32)
    for t in range(39, -1, -1):
      y = a[:, t] * y + b[:, t]
      expect[:, t] = y
    np.testing.assert_allclose(adv.reverse_linear_recurrence(a, b), expect, rtol=1e-5, atol=1e-6)

  def test_observation_values_do_not_leak(self):
    r, v, m = random_batch(6)
    a1, _ = adv.skip_observation_gae(r, v, m, GAMMA, LAM)
    v2 = np.where(m, v, 1e3).astype(np.float32)
    a2, _ = adv.skip_observation_gae(r, v2, m, GAMMA, LAM)
    np.testing.assert_array_equal(a1, a2)

  def test_bad_inputs_raise(self):
    r, v, m = random_batch(0)
    with self.assertRaises(AssertionError):
      adv.skip_observation_gae(r, v, m.astype(np.float32), GAMMA, LAM)
    with self.assertRaises(AssertionError):
      adv.skip_observation_gae(r[0], v[0], m[0], GAMMA, LAM)
    with self.assertRaises(AssertionError):
      adv.skip_observation_gae(r[:, :-1], v, m, GAMMA, LAM)


class AblationArmsTest(parameterized.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_token_gae_matches_oracle(self):
    r, v, m = random_batch(7)
    a, ret = self.variant(lambda *x: adv.token_gae(*x, GAMMA, LAM))(r, v, m)
    a_ref, ret_ref = numpy_token_gae(r, v, m, GAMMA, LAM)
    np.testing.assert_allclose(a, a_ref, atol=1e-5)
    np.testing.assert_allclose(ret, ret_ref, atol=1e-5)

  def test_token_gae_differs_when_observations_present(self):
    r, v, m = random_batch(8)
    a_tok, _ = adv.token_gae(r, v, m, GAMMA, LAM)
    a_skip, _ = adv.skip_observation_gae(r, v, m, GAMMA, LAM)
    self.assertGreater(np.abs(np.asarray(a_tok) - np.asarray(a_skip)).max(), 1e-2)
    full = np.ones_like(m)
    np.testing.assert_allclose(
      adv.token_gae(r, v, full, GAMMA, LAM)[0],
      adv.skip_observation_gae(r, v, full, GAMMA, LAM)[0],
      atol=1e-5,
    )

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("mean", "last")
  def test_step_gae_matches_oracle(self, step_value):
    r, v, m = random_batch(9)
    fn = self.variant(lambda *x: adv.step_gae(*x, GAMMA, LAM, step_value=step_value))
    a, ret = fn(r, v, m)
    a_ref, ret_ref = numpy_step_gae(r, v, m, GAMMA, LAM, step_value)
    np.testing.assert_allclose(a, a_ref, atol=1e-5)
    np.testing.assert_allclose(ret, ret_ref, atol=1e-5)

  def test_step_gae_rejects_unknown_step_value(self):
    r, v, m = random_batch(0)
    with self.assertRaisesRegex(ValueError, "step_value"):
      adv.step_gae(r, v, m, GAMMA, LAM, step_value="first")


class PackedRowsTest(parameterized.TestCase):
  @parameterized.parameters(
    ("skip", lambda r, v, m, **kw: adv.skip_observation_gae(r, v, m, GAMMA, LAM, **kw)),
    ("token", lambda r, v, m, **kw: adv.token_gae(r, v, m, GAMMA, LAM, **kw)),
    ("step_mean", lambda r, v, m, **kw: adv.step_gae(r, v, m, GAMMA, LAM, "mean", **kw)),
    ("step_last", lambda r, v, m, **kw: adv.step_gae(r, v, m, GAMMA, LAM, "last", **kw)),
  )
  def test_packed_equals_separate(self, _, fn):
    r, v, m = random_batch(11, b=3, t=30)
    m[:, :2] = False  # every sequence starts with a prompt
    m[:, -1] = True  # ...and may end on an action
    packed = [np.concatenate([x[0], x[1], x[2], np.zeros(5, x.dtype)])[None] for x in (r, v, m)]
    seg = np.concatenate([np.full(30, 1), np.full(30, 2), np.full(30, 3), np.zeros(5)])
    a_p, ret_p = fn(*packed, segment_ids=seg[None].astype(np.int32))
    a_s, ret_s = fn(r, v, m)
    np.testing.assert_allclose(np.asarray(a_p)[0, :90], np.asarray(a_s).reshape(-1), atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret_p)[0, :90], np.asarray(ret_s).reshape(-1), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(a_p)[0, 90:], 0.0)


class BaselinesTest(parameterized.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_group_advantages(self):
    rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    ids = jnp.array([0, 0, 0, 7, 7, 3])
    with self.assertRaisesRegex(ValueError, r"groups \[3\]"):
      adv.group_advantages(rewards, ids)
    rewards, ids = rewards[:5], ids[:5]
    got = self.variant(adv.group_advantages)(rewards, ids)
    g0 = np.array([1.0, 0.0, 0.0])
    expect0 = (g0 - g0.mean()) / (g0.std() + 1e-6)
    np.testing.assert_allclose(got[:3], expect0, rtol=1e-5)
    np.testing.assert_allclose(got[3:], 0.0, atol=1e-6)  # equal rewards

  def test_running_mean(self):
    state = adv.running_mean_init(3)
    state, a = adv.running_mean_update(state, jnp.array([1.0, 2.0]))
    np.testing.assert_allclose(a, [1.0, 2.0])  # no baseline yet
    state, a = adv.running_mean_update(state, jnp.array([4.0]))
    np.testing.assert_allclose(a, [4.0 - 1.5])
    state, a = adv.running_mean_update(state, jnp.array([0.0, 0.0]))
    np.testing.assert_allclose(a, [-7.0 / 3, -7.0 / 3])
    # window now holds the last three rewards: 4, 0, 0
    _, a = jax.jit(adv.running_mean_update)(state, jnp.array([1.0]))
    np.testing.assert_allclose(a, [1.0 - 4.0 / 3], rtol=1e-6)
    with self.assertRaises(ValueError):
      adv.running_mean_init(0)


if __name__ == "__main__":
  pytest.main([__file__])
