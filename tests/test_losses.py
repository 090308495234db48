"""Losses: values against numpy, gradients against r * A / N."""

import chex
import jax
import numpy as np
from absl.testing import absltest, parameterized

from sao_jax import losses

EPS_LOW, EPS_HIGH = 0.2, 0.28


def batch(seed=0, b=3, t=11):
  rng = np.random.default_rng(seed)
  m = rng.random((b, t)) < 0.7
  rollout = rng.normal(-1.0, 0.3, (b, t)).astype(np.float32)
  # Ratios spread well beyond both sides of the trust region.
  logp = (rollout + rng.normal(0.0, 0.3, (b, t))).astype(np.float32)
  a = np.where(m, rng.normal(size=(b, t)), 0.0).astype(np.float32)
  return logp, rollout, a, m


class DisTest(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_value_matches_numpy(self):
    logp, rollout, a, m = batch()
    loss, metrics = self.variant(
        lambda *x: losses.dis_policy_loss(*x, EPS_LOW, EPS_HIGH))(logp, rollout, a, m)
    r = np.exp(logp - rollout)
    below = m & (r <= 1 - EPS_LOW)
    above = m & (r >= 1 + EPS_HIGH)
    keep = m & ~below & ~above
    n = m.sum()
    self.assertTrue(below.any() and above.any() and keep.any())
    np.testing.assert_allclose(loss, -(keep * r * a).sum() / n, rtol=1e-5)
    np.testing.assert_allclose(metrics["masked_low_frac"], below.sum() / n)
    np.testing.assert_allclose(metrics["masked_high_frac"], above.sum() / n)
    corrective = (above & (a < 0)) | (below & (a > 0))
    self.assertTrue(corrective.any() and (corrective != (above | below)).any())
    np.testing.assert_allclose(metrics["masked_corrective_frac"], corrective.sum() / n)
    np.testing.assert_allclose(metrics["ratio_max"], r[m].max(), rtol=1e-5)
    np.testing.assert_allclose(metrics["ratio_min"], r[m].min(), rtol=1e-5)
    np.testing.assert_allclose(metrics["ratio_mean"], r[m].mean(), rtol=1e-5)
    self.assertEqual(float(metrics["tokens"]), n)

  def test_gradient_is_zero_when_masked_and_rA_over_n_when_kept(self):
    logp, rollout, a, m = batch(1)
    grad = jax.grad(lambda lp: losses.dis_policy_loss(
        lp, rollout, a, m, EPS_LOW, EPS_HIGH)[0])(logp)
    r = np.exp(logp - rollout)
    keep = m & (r > 1 - EPS_LOW) & (r < 1 + EPS_HIGH)
    np.testing.assert_array_equal(np.asarray(grad)[~keep], 0.0)
    np.testing.assert_allclose(np.asarray(grad)[keep],
                               (-r * a / m.sum())[keep], rtol=1e-5)

  def test_region_is_open(self):
    # Ratios exactly on the boundary are masked (strict inequalities).
    rollout = np.zeros((1, 3), np.float32)
    logp = np.log(np.array([[1 - 0.25, 1.0, 1 + 0.5]], np.float32))
    a = np.ones((1, 3), np.float32)
    m = np.ones((1, 3), bool)
    _, metrics = losses.dis_policy_loss(logp, rollout, a, m, 0.25, 0.5)
    self.assertAlmostEqual(float(metrics["kept_frac"]), 1 / 3, places=6)

  def test_extreme_ratios_give_finite_zero_gradient(self):
    logp = np.array([[0.0, -500.0, 0.0]], np.float32)
    rollout = np.array([[-300.0, 0.0, 0.0]], np.float32)
    a = np.ones((1, 3), np.float32)
    m = np.ones((1, 3), bool)
    grad = jax.grad(lambda lp: losses.dis_policy_loss(
        lp, rollout, a, m, 0.2, 0.2)[0])(logp)
    np.testing.assert_array_equal(np.asarray(grad)[0, :2], 0.0)
    self.assertTrue(np.isfinite(np.asarray(grad)).all())

  def test_bad_inputs_raise(self):
    logp, rollout, a, m = batch()
    with self.assertRaises(AssertionError):
      losses.dis_policy_loss(logp, rollout, a, m.astype(np.float32), 0.2, 0.2)
    with self.assertRaises(AssertionError):
      losses.dis_policy_loss(logp[:, 1:], rollout, a, m, 0.2, 0.2)


class PpoClipTest(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_value_and_gradient(self):
    logp, rollout, a, m = batch(2)
    fn = lambda lp: losses.ppo_clip_policy_loss(lp, rollout, a, m, EPS_LOW, EPS_HIGH)
    loss, metrics = self.variant(fn)(logp)
    r = np.exp(logp - rollout)
    surr = np.minimum(r * a, np.clip(r, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
    n = m.sum()
    np.testing.assert_allclose(loss, -(m * surr).sum() / n, rtol=1e-5)
    grad = np.asarray(jax.grad(lambda lp: fn(lp)[0])(logp))
    # PPO keeps the gradient of tokens out of the region on the "wrong" side
    # (e.g. r < 1 - eps with A > 0), which DIS masks.
    trained = m & ~(((r > 1 + EPS_HIGH) & (a > 0)) | ((r < 1 - EPS_LOW) & (a < 0)))
    np.testing.assert_allclose(grad[trained], (-r * a / n)[trained], rtol=1e-5)
    np.testing.assert_array_equal(grad[~trained], 0.0)
    outside = m & ((r <= 1 - EPS_LOW) | (r >= 1 + EPS_HIGH))
    self.assertTrue((trained & outside).any())
    np.testing.assert_allclose(metrics["clip_frac"], (m & ~trained).sum() / n)


class ValueLossTest(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_value_gradient_and_explained_variance(self):
    rng = np.random.default_rng(3)
    m = rng.random((4, 9)) < 0.5
    v = rng.normal(size=(4, 9)).astype(np.float32)
    ret = rng.normal(size=(4, 9)).astype(np.float32)
    fn = self.variant(losses.value_loss)
    loss, metrics = fn(v, ret, m)
    n = m.sum()
    np.testing.assert_allclose(loss, 0.5 * (m * (v - ret) ** 2).sum() / n, rtol=1e-5)
    ev = 1 - np.var((ret - v)[m]) / np.var(ret[m])
    np.testing.assert_allclose(metrics["explained_variance"], ev, rtol=1e-4)
    grad = jax.grad(lambda x: losses.value_loss(x, ret, m)[0])(v)
    np.testing.assert_allclose(grad, m * (v - ret) / n, rtol=1e-5, atol=1e-7)
    _, perfect = losses.value_loss(ret, ret, m)
    self.assertAlmostEqual(float(perfect["explained_variance"]), 1.0, places=5)

  def test_clipped(self):
    v = np.array([[2.0, 0.0]], np.float32)
    old = np.array([[0.0, 0.0]], np.float32)
    ret = np.array([[3.0, 0.0]], np.float32)
    m = np.array([[True, False]])
    loss, _ = losses.value_loss(v, ret, m, old_values=old, clip=0.5)
    # max((2-3)^2, (0.5-3)^2) = 6.25
    self.assertAlmostEqual(float(loss), 0.5 * 6.25, places=5)
    with self.assertRaisesRegex(ValueError, "both"):
      losses.value_loss(v, ret, m, old_values=old)


if __name__ == "__main__":
  absltest.main()
