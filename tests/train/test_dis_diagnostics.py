"""DIS under lag: the step's diagnostics against NumPy, the warning
lines, and DIS's variants as records usable in config validation and the
jitted train step.
"""

import json
import math
import os

import chex
import jax
import numpy as np
import pytest
from absl.testing import absltest, parameterized
from test_configs import load_config_module
from test_trainer import demo_trajs, make_state

from sao_jax.algo import losses
from sao_jax.data import packing
from sao_jax.train import configuration
from sao_jax.train import train_step as ts
from sao_jax.train.metrics import MetricsWriter

EPS_LOW, EPS_HIGH = 0.2, 0.28
VARIANTS = ("dis_rollout_kl", "dis_corrective", "dis_seq_geo", "cispo")
BUCKETS = ("lag0", "lag1", "lag2", "lag3_4", "lag5_8", "lag9up")


def lagged_batch(seed=0, b=6, t=40, lags=(0, 1, 3, 4, 5, 8, 9, 30)):
  """Random tokens whose lags are drawn from `lags` (lag 2 never: an empty bucket)."""
  rng = np.random.default_rng(seed)
  m = rng.random((b, t)) < 0.75
  rollout = rng.normal(-1.0, 0.3, (b, t)).astype(np.float32)
  lag = rng.choice(lags, size=(b, t)).astype(np.int32)
  # Older tokens drift further from the policy being trained.
  logp = (rollout + rng.normal(0.0, 0.05 + 0.04 * lag)).astype(np.float32)
  a = np.where(m, rng.normal(size=(b, t)), 0.0).astype(np.float32)
  return logp, rollout, a, m, lag


def np_bucket(lag):
  """Independent of LAG_BUCKETS' arithmetic: the table, written out."""
  if lag <= 0:
    return "lag0"
  return {1: "lag1", 2: "lag2", 3: "lag3_4", 4: "lag3_4"}.get(
    int(lag), "lag5_8" if lag <= 8 else "lag9up"
  )


def np_diagnostics(logp, rollout, a, m, lag):
  r = np.exp(logp - rollout)
  below, above = m & (r <= 1 - EPS_LOW), m & (r >= 1 + EPS_HIGH)
  corrective = (above & (a < 0)) | (below & (a > 0))
  mass = np.abs(r * a) * m
  out = {
    "corrective_token_frac": corrective.sum() / m.sum(),
    "corrective_mass_frac": mass[corrective].sum() / mass.sum(),
    "outside_frac": (below | above).sum() / m.sum(),
  }
  names = np.vectorize(np_bucket)(lag)
  for name in BUCKETS:
    sel = m & (names == name)
    out[f"tokens_{name}"] = sel.sum()
    if not sel.any():
      for k in (
        "approx_kl",
        "outside_frac",
        "ratio_q01",
        "ratio_q10",
        "ratio_q50",
        "ratio_q90",
        "ratio_q99",
      ):
        out[f"{k}_{name}"] = np.nan
      continue
    lr = (logp - rollout)[sel]
    out[f"approx_kl_{name}"] = (np.exp(lr) - 1 - lr).mean()
    out[f"outside_frac_{name}"] = (below | above)[sel].mean()
    for q, label in ((0.01, "01"), (0.1, "10"), (0.5, "50"), (0.9, "90"), (0.99, "99")):
      out[f"ratio_q{label}_{name}"] = np.quantile(r[sel], q)
  return out


class DiagnosticsTest(parameterized.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_masked_quantiles_match_numpy(self):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 13)).astype(np.float32)
    # Groups of sizes 0 (group 2), 1 (group 3) and many; -1 and 9: left out.
    groups = rng.choice([0, 1, 4, -1, 9], size=x.shape).astype(np.int32)
    groups[0, 0] = 3
    qs = (0.0, 0.01, 0.1, 0.5, 0.9, 0.99, 1.0)
    got = np.asarray(self.variant(lambda x, g: ts.masked_quantiles(x, g, 5, qs))(x, groups))
    self.assertEqual(got.shape, (5, len(qs)))
    for g in range(5):
      if g == 2:
        self.assertTrue(np.isnan(got[g]).all())
      else:
        np.testing.assert_allclose(got[g], np.quantile(x[groups == g], qs), rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_lag_diagnostics_match_numpy(self):
    logp, rollout, a, m, lag = lagged_batch()
    got = self.variant(lambda *x: ts.lag_diagnostics(*x, EPS_LOW, EPS_HIGH))(
      logp, rollout, a, m, lag
    )
    want = np_diagnostics(logp, rollout, a, m, lag)
    self.assertEqual(sorted(got), sorted(want))
    # The case is not degenerate: corrective tokens exist, lag 2 is empty, the rest are not.
    self.assertTrue(0 < want["corrective_mass_frac"] < 1 and want["tokens_lag2"] == 0)
    self.assertTrue(all(want[f"tokens_{b}"] > 0 for b in BUCKETS if b != "lag2"))
    for k, v in want.items():
      np.testing.assert_allclose(got[k], v, rtol=2e-5, atol=1e-7, err_msg=k)
    # Older buckets are further from 1, as the batch was built.
    self.assertLess(got["approx_kl_lag0"], got["approx_kl_lag9up"])

  def test_a_share_of_no_advantage_mass_is_undefined(self):
    logp, rollout, _, m, lag = lagged_batch(1)
    got = ts.lag_diagnostics(logp, rollout, np.zeros_like(logp), m, lag, EPS_LOW, EPS_HIGH)
    self.assertTrue(np.isnan(float(got["corrective_mass_frac"])))  # NaN: logged as no number
    none = ts.lag_diagnostics(
      logp, rollout, np.zeros_like(logp), np.zeros_like(m), lag, EPS_LOW, EPS_HIGH
    )
    for k in ("corrective_token_frac", "outside_frac"):  # over no action tokens
      self.assertTrue(np.isnan(float(none[k])), k)


def test_nan_of_an_empty_bucket_is_null_in_the_metrics_file(tmp_path):
  writer = MetricsWriter(str(tmp_path), tensorboard=False)
  rec = writer.write(1, {"dis/approx_kl_lag2": np.float32(np.nan), "dis/tokens_lag2": 0}, "rl")
  writer.close()
  assert math.isnan(rec["dis/approx_kl_lag2"])  # the caller's record keeps the float
  with open(os.path.join(tmp_path, "metrics.jsonl"), encoding="utf-8") as f:
    line = f.readline()
  assert "NaN" not in line  # strict JSON, for jq and JavaScript readers too
  record = json.loads(line)
  assert record["dis/approx_kl_lag2"] is None and record["dis/tokens_lag2"] == 0


class WarningsTest(parameterized.TestCase):
  def test_quiet_below_the_levels_and_on_nan(self):
    record = {
      "dis/outside_frac": 0.05,
      "dis/corrective_mass_frac": 0.08,
      "dis/corrective_token_frac": 0.017,
      "dis/approx_kl_lag1": 0.01,
      "dis/approx_kl_lag2": float("nan"),
      "policy/loss": 3.0,
    }
    self.assertEqual(ts.dis_warnings(record), [])
    self.assertEqual(ts.dis_warnings({}), [])

  def test_one_line_per_diagnostic_above_its_level(self):
    record = {
      "dis/outside_frac": 0.12,
      "dis/corrective_mass_frac": 0.175,
      "dis/corrective_token_frac": 0.017,
      "dis/approx_kl_lag0": 0.01,
      "dis/approx_kl_lag5_8": 0.06,
      "dis/approx_kl_lag9up": 0.2,
      "dis/approx_kl_lag2": float("nan"),
    }
    lines = ts.dis_warnings(record)
    self.assertLen(lines, 3)
    outside, mass, kl = lines
    self.assertIn("12.0% of action tokens outside", outside)
    self.assertIn("17.5% of |r A|", mass)
    self.assertIn("1.7% of the tokens", mass)
    self.assertIn("0.06 at lag5_8", kl)
    self.assertIn("0.2 at lag9up", kl)
    self.assertNotIn("lag0", kl)
    self.assertTrue(all("\n" not in line for line in lines))
    # Levels are overridable; exactly at the level is quiet.
    self.assertEqual(
      ts.dis_warnings(
        record, {"outside_frac": 0.12, "corrective_mass_frac": 0.2, "approx_kl": 1.0}
      ),
      [],
    )

  def test_levels_against_the_step_metrics(self):
    # The keys the warnings read are the ones the step writes.
    logp, rollout, a, m, lag = lagged_batch(2)
    record = {
      f"dis/{k}": float(v)
      for k, v in ts.lag_diagnostics(logp, rollout, a, m, lag, EPS_LOW, EPS_HIGH).items()
    }
    lines = ts.dis_warnings(
      record, {"outside_frac": 0.0, "corrective_mass_frac": 0.0, "approx_kl": 0.0}
    )
    self.assertLen(lines, 3)
    for b in BUCKETS:
      self.assertEqual(f" at {b}" in lines[2], b != "lag2", b)


# --- the variants as records: config validation and the jitted train step ----------


def _config(**fields):
  c = load_config_module("sao_tiny.py").get_config()
  for field, value in fields.items():
    configuration.set_field(c, field, value)
  return c


def _lagged_packed_batch():
  batch = dict(packing.pack(demo_trajs(4), 4, (256,)))
  # At step 0 a version of -k is a lag of k: spread the segments over the buckets.
  version = np.where(batch["segment_ids"] > 0, -3 * (batch["segment_ids"] - 1), -1)
  version = version - np.arange(4)[:, None] * 4 * (batch["segment_ids"] > 0)
  batch["policy_version"] = version.astype(np.int32)
  return batch


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_passes_validation_and_trains_in_the_jitted_step(name, monkeypatch):
  configuration.validate(_config(**{"rl.policy_loss": name}), num_devices=8)
  seen = {}
  record = losses.POLICY_LOSSES[name]

  def spy(*args, **options):
    seen.update(options)
    return losses.call_policy_loss(record, *args, **options)

  monkeypatch.setitem(losses.POLICY_LOSSES, name, spy)
  state, step = make_state(
    ts.StepConfig.of(
      policy_loss=name,
      critic_updates=1,
      corrective_side="high",
      geo_eps_low=0.5,
      geo_eps_high=1.0,
      rollout_kl_estimator="k3",
      rollout_kl_reduction="token",
    )
  )
  batch = _lagged_packed_batch()
  new, metrics = jax.jit(step)(state, batch)
  assert int(new.step) == 1 and np.isfinite(float(metrics["policy/loss"]))
  # Every option reaches the record; the batch's segment ids among them.
  assert seen["corrective_side"] == "high" and seen["geo_eps_high"] == 1.0
  assert (seen["rollout_kl_estimator"], seen["rollout_kl_reduction"]) == ("k3", "token")
  assert seen["segment_ids"].shape == batch["segment_ids"].shape
  # The diagnostics: every action token in one bucket, NaN only where a bucket is empty.
  m = batch["action_mask"]
  assert sum(int(metrics[f"dis/tokens_{b}"]) for b in BUCKETS) == int(m.sum())
  for b in BUCKETS:
    empty = int(metrics[f"dis/tokens_{b}"]) == 0
    for k in ("approx_kl", "outside_frac", "ratio_q01", "ratio_q50", "ratio_q99"):
      assert np.isnan(float(metrics[f"dis/{k}_{b}"])) == empty, (k, b)
    if not empty:
      q = [float(metrics[f"dis/ratio_q{x}_{b}"]) for x in ("01", "10", "50", "90", "99")]
      assert q == sorted(q) and q[0] > 0
  assert sum(int(metrics[f"dis/tokens_{b}"]) > 0 for b in BUCKETS) >= 4
  for k in ("corrective_token_frac", "corrective_mass_frac", "outside_frac"):
    assert 0.0 <= float(metrics[f"dis/{k}"]) <= 1.0


def test_step_diagnostics_are_the_kernels_on_the_steps_own_log_probs():
  # With a loss whose metrics expose nothing, the step's dis/ metrics must still
  # match lag_diagnostics on the log-probs of the params before the update.
  from test_trainer import CFG

  from sao_jax.models import policy

  cfg = ts.StepConfig.of(advantage="group", critic_updates=0)
  state, step = make_state(cfg)
  batch = _lagged_packed_batch()
  batch["baseline_advantages"] = np.where(
    batch["action_mask"],
    np.sign(np.sin(np.arange(batch["action_mask"].size))).reshape(batch["action_mask"].shape),
    0.0,
  ).astype(np.float32)
  _, metrics = jax.jit(step)(state, batch)
  logp, _ = policy.token_logprobs(
    CFG, state.policy, batch["tokens"], batch["positions"], batch["segment_ids"], cfg.temperature
  )
  m = batch["action_mask"]
  want = np_diagnostics(
    np.asarray(logp),
    batch["rollout_logprobs"],
    batch["baseline_advantages"],
    m,
    np.where(m, -batch["policy_version"], 0),
  )
  for k, v in want.items():
    np.testing.assert_allclose(metrics[f"dis/{k}"], v, rtol=1e-4, atol=1e-6, err_msg=k)


@pytest.mark.parametrize(
  "field,value",
  [
    ("rl.corrective_side", "both"),
    ("rl.rollout_kl_coef", -0.1),
    ("rl.rollout_kl_coef", float("inf")),
    ("rl.geo_eps_low", 1.0),
    ("rl.geo_eps_high", 0.0),
    ("rl.rollout_kl_estimator", "k1"),
    ("rl.rollout_kl_reduction", "row"),
  ],
)
def test_bad_variant_options_fail_validation(field, value):
  with pytest.raises(configuration.ConfigError) as e:
    configuration.validate(_config(**{field: value}), num_devices=8)
  assert field in str(e.value) and "\n" not in str(e.value)


def test_step_config_checks_the_corrective_side():
  with pytest.raises(ValueError, match="corrective_side"):
    ts.StepConfig.of(corrective_side="both")


if __name__ == "__main__":
  absltest.main()
