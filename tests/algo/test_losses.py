"""Losses: values against numpy, gradients against r * A / N."""

import chex
import jax
import numpy as np
from absl.testing import absltest, parameterized

from sao_jax.algo import losses

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
    loss, metrics = self.variant(lambda *x: losses.dis_policy_loss(*x, EPS_LOW, EPS_HIGH))(
      logp, rollout, a, m
    )
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
    grad = jax.grad(lambda lp: losses.dis_policy_loss(lp, rollout, a, m, EPS_LOW, EPS_HIGH)[0])(
      logp
    )
    r = np.exp(logp - rollout)
    keep = m & (r > 1 - EPS_LOW) & (r < 1 + EPS_HIGH)
    np.testing.assert_array_equal(np.asarray(grad)[~keep], 0.0)
    np.testing.assert_allclose(np.asarray(grad)[keep], (-r * a / m.sum())[keep], rtol=1e-5)

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
    grad = jax.grad(lambda lp: losses.dis_policy_loss(lp, rollout, a, m, 0.2, 0.2)[0])(logp)
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


# --- DIS's variants: NumPy references -------------------------------------------

BETA, GEO_LOW, GEO_HIGH = 0.3, 0.1, 0.1


def np_regions(r, a, m, eps_low=EPS_LOW, eps_high=EPS_HIGH):
  below = m & (r <= 1 - eps_low)
  above = m & (r >= 1 + eps_high)
  return below, above, m & ~below & ~above


def np_dis_rollout_kl(logp, rollout, a, m, estimator="k2", reduction="sequence", seg=None):
  """(loss, dloss/dlogp, KL) of DIS + beta * KL, the sequence mean by loops."""
  r = np.exp(logp - rollout)
  lr = logp - rollout
  _, _, inside = np_regions(r, a, m)
  n = m.sum()
  k, g = (0.5 * lr**2, lr) if estimator == "k2" else (r - 1 - lr, r - 1)
  if reduction == "token":
    w = m / n
  else:
    seg = np.ones(m.shape, np.int32) if seg is None else seg
    w = np.zeros(m.shape)
    seqs = [
      (i, s) for i in range(m.shape[0]) for s in np.unique(seg[i]) if (m[i] & (seg[i] == s)).any()
    ]
    for i, s in seqs:
      sel = m[i] & (seg[i] == s)
      w[i][sel] = 1.0 / (sel.sum() * len(seqs))
  kl = (w * k).sum()
  loss = -(inside * r * a).sum() / n + BETA * kl
  grad = -(inside * r * a) / n + BETA * w * g
  return loss, grad, kl


def np_dis_corrective(logp, rollout, a, m, side):
  r = np.exp(logp - rollout)
  below, above, inside = np_regions(r, a, m)
  extra = below & (a > 0) if side == "low" else above & (a < 0)
  keep = inside | extra
  n = m.sum()
  return -(keep * r * a).sum() / n, -(keep * r * a) / n, keep


def np_dis_seq_geo(logp, rollout, a, m, seg):
  """Loops: each (row, segment)'s geometric mean ratio gates its tokens."""
  r = np.exp(logp - rollout)
  _, _, inside = np_regions(r, a, m)
  keep = np.zeros_like(m)
  dropped_seqs, seqs, dropped_tokens = 0, 0, 0
  for i in range(m.shape[0]):
    for s in np.unique(seg[i]):
      tokens = [t for t in range(m.shape[1]) if seg[i, t] == s and m[i, t]]
      if not tokens:
        continue
      seqs += 1
      g = np.exp(np.mean([logp[i, t] - rollout[i, t] for t in tokens]))
      if 1 - GEO_LOW < g < 1 + GEO_HIGH:
        for t in tokens:
          keep[i, t] = inside[i, t]
      else:
        dropped_seqs += 1
        dropped_tokens += len(tokens)
  n = m.sum()
  return (
    -(keep * r * a).sum() / n,
    -(keep * r * a) / n,
    keep,
    dropped_seqs / seqs,
    dropped_tokens / n,
  )


def np_cispo(logp, rollout, a, m, two_sided=False):
  r = np.exp(logp - rollout)
  w = np.clip(r, 1 - EPS_LOW, 1 + EPS_HIGH) if two_sided else np.minimum(r, 1 + EPS_HIGH)
  n = m.sum()
  return -(m * w * a * logp).sum() / n, -(m * w * a) / n


def packed_batch(seed=0, b=4, t=24):
  """A batch of packed rows: 2-3 segments then padding; per segment its own drift.

  Each segment's log-ratios are centred on a drift drawn per segment, so some
  segments' geometric mean ratios stay in the window and others leave it.
  """
  rng = np.random.default_rng(seed)
  seg = np.zeros((b, t), np.int32)
  logp = np.zeros((b, t), np.float32)
  rollout = rng.normal(-1.0, 0.3, (b, t)).astype(np.float32)
  for i in range(b):
    cuts = np.sort(rng.choice(np.arange(4, t - 4), size=2, replace=False))
    end = t - rng.integers(0, 4)
    bounds = [0, cuts[0], cuts[1], end]
    for s in range(3):
      seg[i, bounds[s] : bounds[s + 1]] = s + 1
      drift = rng.choice([0.0, 0.3, -0.3])
      span = slice(bounds[s], bounds[s + 1])
      logp[i, span] = rollout[i, span] + drift + rng.normal(0, 0.1, bounds[s + 1] - bounds[s])
  m = (rng.random((b, t)) < 0.7) & (seg > 0)
  a = np.where(m, rng.normal(size=(b, t)), 0.0).astype(np.float32)
  return logp.astype(np.float32), rollout, a, m, seg


class DisVariantsTest(parameterized.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(estimator=("k2", "k3"), reduction=("sequence", "token"))
  def test_rollout_kl_value_and_gradient(self, estimator, reduction):
    logp, rollout, a, m, seg = packed_batch(4)
    fn = lambda lp: losses.dis_rollout_kl_policy_loss(
      lp,
      rollout,
      a,
      m,
      EPS_LOW,
      EPS_HIGH,
      rollout_kl_coef=BETA,
      rollout_kl_estimator=estimator,
      rollout_kl_reduction=reduction,
      segment_ids=seg,
    )
    (loss, metrics), grad = self.variant(jax.value_and_grad(fn, has_aux=True))(logp)
    want_loss, want_grad, kl = np_dis_rollout_kl(logp, rollout, a, m, estimator, reduction, seg)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(grad)[~m], 0.0)
    r = np.exp(logp - rollout)
    np.testing.assert_allclose(metrics["rollout_kl"], kl, rtol=1e-5)
    np.testing.assert_allclose(metrics["kl_penalty"], BETA * kl, rtol=1e-5)
    if (estimator, reduction) == ("k3", "token"):  # the reported approx_kl
      np.testing.assert_allclose(metrics["approx_kl"], kl, rtol=1e-5)
    dis, _ = losses.dis_policy_loss(logp, rollout, a, m, EPS_LOW, EPS_HIGH)
    np.testing.assert_allclose(metrics["dis_loss"], dis, rtol=1e-6)
    # The penalty reaches tokens DIS masks: the window's outside has gradient.
    below, above, _ = np_regions(r, a, m)
    self.assertTrue((np.asarray(grad)[below | above] != 0).all())

  def test_rollout_kl_by_hand(self):
    # One row, two sequences: log r = (0.2, -0.2 | 0.4); A = 0 leaves the penalty.
    lr = np.array([[0.2, -0.2, 0.4]], np.float32)
    m, a = np.ones((1, 3), bool), np.zeros((1, 3), np.float32)
    zero, seg = np.zeros((1, 3), np.float32), np.array([[1, 1, 2]], np.int32)

    def loss(lp, **kw):
      return losses.dis_rollout_kl_policy_loss(
        lp, zero, a, m, EPS_LOW, EPS_HIGH, rollout_kl_coef=1.0, segment_ids=seg, **kw
      )[0]

    # k2, sequence mean (the default): (0.5 * (0.04 + 0.04) / 2 + 0.5 * 0.16) / 2 = 0.05;
    # gradient log r / (|s| S): (0.2 / 4, -0.2 / 4, 0.4 / 2).
    np.testing.assert_allclose(loss(lr), 0.05, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(loss)(lr), [[0.05, -0.05, 0.2]], rtol=1e-6)
    # k2, token mean: 0.5 * 0.24 / 3 = 0.04; gradient log r / 3.
    np.testing.assert_allclose(loss(lr, rollout_kl_reduction="token"), 0.04, rtol=1e-6)
    np.testing.assert_allclose(
      jax.grad(lambda x: loss(x, rollout_kl_reduction="token"))(lr), lr / 3, rtol=1e-6
    )
    # k3, token mean: sum(e^x - 1 - x) / 3.
    k3 = (np.exp(lr) - 1 - lr).sum() / 3
    np.testing.assert_allclose(
      loss(lr, rollout_kl_estimator="k3", rollout_kl_reduction="token"), k3, rtol=1e-5
    )
    for kw in ({"rollout_kl_estimator": "k1"}, {"rollout_kl_reduction": "row"}):
      with self.assertRaisesRegex(ValueError, "must be one of"):
        loss(lr, **kw)

  def test_rollout_kl_with_zero_coefficient_is_dis(self):
    logp, rollout, a, m = batch(5)
    got = jax.grad(
      lambda lp: losses.dis_rollout_kl_policy_loss(
        lp, rollout, a, m, EPS_LOW, EPS_HIGH, rollout_kl_coef=0.0
      )[0]
    )(logp)
    want = jax.grad(lambda lp: losses.dis_policy_loss(lp, rollout, a, m, EPS_LOW, EPS_HIGH)[0])(
      logp
    )
    np.testing.assert_array_equal(got, want)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("low", "high")
  def test_corrective_value_and_gradient(self, side):
    logp, rollout, a, m = batch(6, b=4, t=16)
    fn = lambda lp: losses.dis_corrective_policy_loss(
      lp, rollout, a, m, EPS_LOW, EPS_HIGH, corrective_side=side
    )
    (loss, metrics), grad = self.variant(jax.value_and_grad(fn, has_aux=True))(logp)
    want_loss, want_grad, keep = np_dis_corrective(logp, rollout, a, m, side)
    r = np.exp(logp - rollout)
    below, above, inside = np_regions(r, a, m)
    kept_side = below if side == "low" else above
    other_side = above if side == "low" else below
    # The case exercises both: corrective tokens kept on one side, masked on the other.
    self.assertTrue((keep & kept_side).any() and (~keep & kept_side).any())
    self.assertTrue(other_side.any() and not (keep & other_side).any())
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(grad)[~keep], 0.0)
    n = m.sum()
    np.testing.assert_allclose(metrics["kept_corrective_frac"], (keep & ~inside).sum() / n)
    np.testing.assert_allclose(metrics["kept_frac"], keep.sum() / n)
    np.testing.assert_allclose(metrics["masked_low_frac"], (below & ~keep).sum() / n)
    np.testing.assert_allclose(metrics["masked_high_frac"], (above & ~keep).sum() / n)

  def test_corrective_side_is_checked(self):
    logp, rollout, a, m = batch()
    with self.assertRaisesRegex(ValueError, "corrective_side"):
      losses.dis_corrective_policy_loss(
        logp, rollout, a, m, EPS_LOW, EPS_HIGH, corrective_side="both"
      )

  @chex.variants(with_jit=True, without_jit=True)
  def test_seq_geo_value_and_gradient(self):
    logp, rollout, a, m, seg = packed_batch()
    fn = lambda lp, s: losses.dis_seq_geo_policy_loss(
      lp,
      rollout,
      a,
      m,
      EPS_LOW,
      EPS_HIGH,
      segment_ids=s,
      geo_eps_low=GEO_LOW,
      geo_eps_high=GEO_HIGH,
    )
    (loss, metrics), grad = self.variant(jax.value_and_grad(fn, has_aux=True))(logp, seg)
    want_loss, want_grad, keep, dropped, dropped_tokens = np_dis_seq_geo(logp, rollout, a, m, seg)
    r = np.exp(logp - rollout)
    _, _, inside = np_regions(r, a, m)
    # Whole sequences dropped although some of their tokens are inside DIS's window.
    self.assertTrue(0 < dropped < 1 and (inside & ~keep).any() and keep.any())
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(grad)[~keep], 0.0)
    np.testing.assert_allclose(metrics["seq_masked_frac"], dropped, rtol=1e-6)
    np.testing.assert_allclose(metrics["kept_frac"], keep.sum() / m.sum(), rtol=1e-6)
    np.testing.assert_allclose(metrics["seq_masked_token_frac"], dropped_tokens, rtol=1e-6)

  def test_seq_geo_by_hand(self):
    # Row 0, segment 1: log r = 0, 0.02, G = e^0.01 = 1.01, kept. Segment 2:
    # log r = 0.2, 0.1, G = e^0.15 = 1.16, dropped, though its r = 1.22 and
    # 1.11 are inside DIS's (0.8, 1.28). Row 1 is one segment of all four:
    # G = e^0.08 = 1.083, out of (0.95, 1.05): dropped.
    rollout = np.zeros((2, 5), np.float32)
    logp = np.array([[0.0, 0.02, 0.2, 0.1, 0.0]] * 2, np.float32)
    seg = np.array([[1, 1, 2, 2, 0], [1, 1, 1, 1, 0]], np.int32)
    m = np.array([[True, True, True, True, False]] * 2)
    a = np.where(m, 1.0, 0.0).astype(np.float32)
    r = np.exp(logp)

    def grad(segment_ids, geo_eps_high):
      return np.asarray(
        jax.grad(
          lambda lp: losses.dis_seq_geo_policy_loss(
            lp,
            rollout,
            a,
            m,
            0.2,
            0.28,
            segment_ids=segment_ids,
            geo_eps_low=0.05,
            geo_eps_high=geo_eps_high,
          )[0]
        )(logp)
      )

    g = grad(seg, 0.05)
    np.testing.assert_allclose(g[0], [-r[0, 0] / 8, -r[0, 1] / 8, 0, 0, 0], rtol=1e-6)
    np.testing.assert_array_equal(g[1], 0.0)
    # Without segment ids each row is one sequence (G = 1.083 in both rows):
    # dropped at (0.95, 1.05), kept at (0.95, 1.1).
    np.testing.assert_array_equal(grad(None, 0.05), 0.0)
    np.testing.assert_allclose(grad(None, 0.1), -(m * r) / 8, rtol=1e-6)

  def test_sequence_mean_log_ratio(self):
    logp, rollout, a, m, seg = packed_batch(1)
    del a
    lr = logp - rollout
    got = np.asarray(losses.sequence_mean_log_ratio(lr, m, seg))
    for i in range(m.shape[0]):
      for s in np.unique(seg[i]):
        sel = seg[i] == s
        want = lr[i][sel & m[i]].mean() if (sel & m[i]).any() else 0.0
        np.testing.assert_allclose(got[i][sel], want, rtol=1e-5, atol=1e-6)
    rows = np.asarray(losses.sequence_mean_log_ratio(lr, m))
    np.testing.assert_allclose(
      rows,
      np.broadcast_to((lr * m).sum(1, keepdims=True) / m.sum(1, keepdims=True), m.shape),
      rtol=1e-5,
    )

  def test_cispo_clips_the_weight_from_above_only(self):
    # r = 0.5 (below 1 - eps_low), 1.0, 2.0 (above 1 + eps_high); A = 1, N = 3.
    rollout = np.zeros((1, 3), np.float32)
    logp = np.log(np.array([[0.5, 1.0, 2.0]], np.float32))
    a, m = np.ones((1, 3), np.float32), np.ones((1, 3), bool)
    grad = lambda fn: jax.grad(lambda lp: fn(lp, rollout, a, m, EPS_LOW, EPS_HIGH)[0])(logp)
    np.testing.assert_allclose(
      grad(losses.cispo_policy_loss), [[-0.5 / 3, -1 / 3, -(1 + EPS_HIGH) / 3]], rtol=1e-6
    )
    np.testing.assert_allclose(
      grad(losses.cispo_two_sided_policy_loss),
      [[-(1 - EPS_LOW) / 3, -1 / 3, -(1 + EPS_HIGH) / 3]],
      rtol=1e-6,
    )

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(False, True)
  def test_cispo_value_and_gradient(self, two_sided):
    logp, rollout, a, m = batch(7)
    loss_fn = losses.cispo_two_sided_policy_loss if two_sided else losses.cispo_policy_loss
    fn = lambda lp: loss_fn(lp, rollout, a, m, EPS_LOW, EPS_HIGH)
    (loss, metrics), grad = self.variant(jax.value_and_grad(fn, has_aux=True))(logp)
    want_loss, want_grad = np_cispo(logp, rollout, a, m, two_sided)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    grad = np.asarray(grad)
    # No action token's gradient is removed, the out-of-window ones included.
    r = np.exp(logp - rollout)
    below, above, _ = np_regions(r, a, m)
    self.assertTrue(below.any() and above.any())
    self.assertTrue((grad[m & (a != 0)] != 0).all())
    np.testing.assert_array_equal(grad[~m], 0.0)
    n = m.sum()
    if two_sided:
      np.testing.assert_allclose(metrics["clip_low_frac"], (m & (r < 1 - EPS_LOW)).sum() / n)
    else:
      self.assertNotIn("clip_low_frac", metrics)
    np.testing.assert_allclose(metrics["clip_high_frac"], (m & (r > 1 + EPS_HIGH)).sum() / n)


class PolicyLossTableTest(parameterized.TestCase):
  def test_options_reach_only_the_losses_that_name_them(self):
    logp, rollout, a, m = batch()
    seen = {}

    def plain(logp, rollout_logp, advantages, action_mask, eps_low, eps_high):
      return logp.sum(), {}

    def wants_kl(
      logp, rollout_logp, advantages, action_mask, eps_low, eps_high, *, rollout_kl_coef=0.0
    ):
      seen["kl"] = rollout_kl_coef
      return logp.sum(), {}

    def wants_all(*args, **options):
      seen["all"] = sorted(options)
      return args[0].sum(), {}

    options = dict(segment_ids=None, rollout_kl_coef=0.5, corrective_side="low")
    for fn in (plain, wants_kl, wants_all):
      losses.call_policy_loss(fn, logp, rollout, a, m, EPS_LOW, EPS_HIGH, **options)
    self.assertEqual(seen, {"kl": 0.5, "all": sorted(options)})

  @parameterized.parameters(
    "dis_rollout_kl", "dis_corrective", "dis_seq_geo", "cispo", "cispo_two_sided"
  )
  def test_variants_are_records_with_the_shared_signature(self, name):
    logp, rollout, a, m = batch(8)
    fn = losses.policy_loss(name)
    loss, metrics = losses.call_policy_loss(
      fn, logp, rollout, a, m, EPS_LOW, EPS_HIGH, segment_ids=np.ones(m.shape, np.int32)
    )
    self.assertTrue(np.isfinite(float(loss)))
    self.assertEqual(float(metrics["tokens"]), m.sum())


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

  def test_undefined_statistics_are_nan_not_numbers(self):
    """Targets without variance (one reward for the whole batch) or no action
    tokens: explained variance is undefined (NaN, which the metrics writer
    logs as no number), not 1; so are a loss's means and fractions over no
    action tokens, while the loss itself stays 0."""
    rng = np.random.default_rng(4)
    m = rng.random((3, 8)) < 0.6
    v = rng.normal(size=(3, 8)).astype(np.float32)
    for ret in (np.full((3, 8), 0.7, np.float32), np.zeros((3, 8), np.float32)):
      self.assertTrue(np.isnan(float(losses.explained_variance(v, ret, m))))
      self.assertTrue(np.isnan(float(losses.explained_variance(ret, ret, m))))
    none = np.zeros_like(m)
    loss, metrics = losses.value_loss(v, rng.normal(size=(3, 8)).astype(np.float32), none)
    self.assertEqual(float(loss), 0.0)
    for k in ("explained_variance", "value_mean", "return_mean"):
      self.assertTrue(np.isnan(float(metrics[k])), k)
    self.assertEqual(float(metrics["tokens"]), 0.0)  # counted, not the normaliser's floor
    logp, rollout, a, _ = batch(8)
    none = np.zeros(logp.shape, bool)
    for name in ("ppo_clip", "dis", "cispo"):
      loss, metrics = losses.call_policy_loss(
        losses.policy_loss(name), logp, rollout, a, none, EPS_LOW, EPS_HIGH
      )
      self.assertEqual(float(loss), 0.0)
      self.assertTrue(
        all(np.isnan(float(x)) for k, x in metrics.items() if k != "tokens"), (name, metrics)
      )
      self.assertEqual(float(metrics["tokens"]), 0.0, name)

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
