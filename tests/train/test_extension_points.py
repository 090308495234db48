"""Advantage estimators, policy losses and trajectory sources are records in one table each.

Adding one is one entry: config validation, the train step and the trainer
all read the table, so a new record is usable everywhere and an unknown
name fails validation with one line listing the known ones.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_configs import load_config_module
from test_trainer import demo_trajs, make_state

from sao_jax.algo import advantages as adv
from sao_jax.algo import losses
from sao_jax.config import sections
from sao_jax.data import packing, store
from sao_jax.train import configuration, rl_loop, sources
from sao_jax.train import run as run_lib
from sao_jax.train.train_step import StepConfig


def _config(**fields):
  c = load_config_module("sao_tiny.py").get_config()
  for field, value in fields.items():
    configuration.set_field(c, field, value)
  return c


@pytest.mark.parametrize(
  "field,value", [("rl.advantage", "gae_v2"), ("rl.policy_loss", "clip_dis")]
)
def test_unknown_names_fail_validation_with_the_known_ones(field, value):
  with pytest.raises(configuration.ConfigError) as e:
    configuration.validate(_config(**{field: value}), num_devices=8)
  message = str(e.value)
  assert "\n" not in message and field in message and repr(value) in message
  table = adv.ESTIMATORS if field == "rl.advantage" else losses.POLICY_LOSSES
  assert all(name in message for name in table)


def test_estimator_record_needs_exactly_one_of_gae_and_baseline():
  with pytest.raises(ValueError, match="exactly one"):
    adv.Estimator("neither")
  with pytest.raises(ValueError, match="exactly one"):
    adv.Estimator("both", gae=adv.skip_observation_gae, baseline=lambda *a: a)
  for e in adv.ESTIMATORS.values():
    assert e.uses_critic == (e.gae is not None)


def _constant_gae(rewards, values, action_mask, gamma, lam, segment_ids=None):
  del rewards, gamma, lam, segment_ids
  a = jnp.where(action_mask, 0.25, 0.0).astype(values.dtype)
  return a, a + values * action_mask


def test_a_new_estimator_is_one_record(monkeypatch):
  monkeypatch.setitem(
    adv.ESTIMATORS, "constant", adv.Estimator("constant", gae=_constant_gae, critic_span=False)
  )
  configuration.validate(_config(**{"rl.advantage": "constant"}), num_devices=8)
  state, step = make_state(StepConfig.of(advantage="constant", critic_updates=1))
  batch = packing.pack(demo_trajs(4), 4, (256,))
  _, metrics = jax.jit(step)(state, batch)
  # The train step used the record's kernel: every action token's advantage is 0.25.
  np.testing.assert_allclose(metrics["advantage_mean"], 0.25, rtol=1e-6)


def test_a_new_policy_loss_is_one_record(monkeypatch):
  calls = []

  def zero_loss(logp, rollout_logp, advantages, action_mask, eps_low, eps_high):
    calls.append(logp.shape)
    return 0.0 * jnp.sum(logp), {"zero": jnp.zeros(())}

  monkeypatch.setitem(losses.POLICY_LOSSES, "zero", zero_loss)
  configuration.validate(_config(**{"rl.policy_loss": "zero"}), num_devices=8)
  state, step = make_state(StepConfig.of(policy_loss="zero", critic_updates=1))
  batch = packing.pack(demo_trajs(4), 4, (256,))
  _, metrics = jax.jit(step)(state, batch)
  assert calls and "policy/zero" in metrics and float(metrics["policy/loss"]) == 0.0


def test_a_policy_loss_option_the_config_lacks_is_an_error(monkeypatch):
  """A loss whose keyword option the train step does not offer would run at
  its own default whatever the config says: refused at validation and when
  the step is made, naming the option."""

  def needs_beta(logp, rollout_logp, advantages, action_mask, eps_low, eps_high, beta=0.3):
    return beta * jnp.sum(logp), {}

  monkeypatch.setitem(losses.POLICY_LOSSES, "needs_beta", needs_beta)
  with pytest.raises(
    configuration.ConfigError,
    match=r"^rl.policy_loss = 'needs_beta': .*"
    r"\['beta'\].*does not offer",
  ):
    configuration.validate(_config(**{"rl.policy_loss": "needs_beta"}), num_devices=8)
  with pytest.raises(ValueError, match=r"\['beta'\]"):
    make_state(StepConfig.of(policy_loss="needs_beta", critic_updates=1))


def test_critic_free_estimator_minimum_group_is_validated():
  with pytest.raises(configuration.ConfigError, match="samples_per_prompt = 1: must be >= 2"):
    configuration.validate(
      _config(**{"rl.advantage": "group", "rl.critic_updates": 0}), num_devices=8
    )


def test_running_mean_baseline_state_round_trips_through_lists():
  e = adv.ESTIMATORS["running_mean"]
  rl = _config().rl
  state = e.init_state(rl)
  state, a = e.baseline(state, np.array([1.0, 0.0], np.float32), np.array([0, 1]), rl)
  np.testing.assert_allclose(a, [1.0, 0.0])  # no rewards seen before: baseline 0
  restored = [np.asarray(x).tolist() for x in state]  # what the checkpoint's meta holds
  _, a = e.baseline(restored, np.array([1.0], np.float32), np.array([0]), rl)
  np.testing.assert_allclose(a, [0.5])  # baseline: mean of the two rewards seen


class ReplaySource:
  """Stored trajectories, round and round (docs/DESIGN.md section 11's example)."""

  def __init__(self, trajs, position=0):
    self.trajs, self.position = trajs, position

  def take(self, n):
    out = [self.trajs[(self.position + i) % len(self.trajs)] for i in range(n)]
    self.position += n
    return out

  def publish(self, params, version):
    del params, version
    return {}

  def report(self):
    return sources.SourceReport(sources.RolloutCounts(), 0, 0, {})

  def state(self):
    return {"position": self.position}

  def close(self, finished):
    del finished


def _replay(run, saved):
  shard = os.path.join(run.workdir, "replay.array_record")
  trajs, _ = store.read_valid_trajectories([shard], run.tok.vocab_size, run.config.rollout.max_len)
  return ReplaySource(trajs, (saved or {}).get("position", 0))


def test_a_new_trajectory_source_is_one_record(monkeypatch, tmp_path):
  monkeypatch.setitem(sources.SOURCES, "replay", sources.SourceSpec(_replay))
  config = _config(
    **{
      "rl.mode": "replay",
      "rl.steps": 3,
      "rl.batch_size": 8,
      "log_every": 1,
      "checkpoint.every": 2,
      "tensorboard": False,
    }
  )
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  with store.TrajectoryWriter(os.path.join(workdir, "replay.array_record")) as writer:
    for t in demo_trajs(6):
      writer.write(t)
  run = run_lib.load(config, workdir)
  try:
    assert isinstance(run.config, sections.Sections)  # no ConfigDict below run.build
    run.meta["stage"] = "rl"  # straight to RL: the source is what is under test
    rl_loop.rl(run)
    assert run.meta["stage"] == "done" and int(run.state.step) == 3
    assert run.meta["source"] == {"position": 24}  # checkpointed with the run
  finally:
    run.close()
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    rl_records = [r for r in map(json.loads, f) if r.get("stage") == "rl"]
  assert [r["step"] for r in rl_records] == [1, 2, 3]
  assert all(np.isfinite(r["policy/loss"]) for r in rl_records)
