"""The ablation arms measure their estimators, not handicaps (issue: evidence)."""

import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax import advantages as adv
from sao_jax import configuration
from sao_jax.train_step import StepConfig, compute_advantages

# One packed row: [prompt | turn 1 | observation | turn 2 | pad], then a
# second sequence [prompt | turn]. The token-GAE recursion reads values on
# every position from a sequence's first to its last action token.
ACTION = np.array([[0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 0]], bool)
SEGMENT = np.array([[1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 0]], np.int32)
SPAN = np.array([[0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0]], bool)


def _batch():
  rewards = np.zeros(ACTION.shape, np.float32)
  rewards[0, 8], rewards[0, 12] = 1.0, 0.5  # terminal rewards of the two sequences
  return {"rewards": jnp.asarray(rewards), "action_mask": jnp.asarray(ACTION),
          "segment_ids": jnp.asarray(SEGMENT)}


def test_action_span_is_where_token_gae_reads_values():
  np.testing.assert_array_equal(adv.action_span(jnp.asarray(ACTION), jnp.asarray(SEGMENT)),
                                SPAN)


def test_token_gae_critic_is_regressed_on_the_observations_it_bootstraps_through():
  values = jnp.asarray(np.random.default_rng(0).normal(size=ACTION.shape), jnp.float32)
  a, ret, value_mask = compute_advantages(StepConfig(advantage="token_gae"), values, _batch())
  np.testing.assert_array_equal(value_mask, SPAN)
  observation = SPAN & ~ACTION
  assert observation.any()
  # Targets exist (A + V) exactly where the critic is trained, nowhere else.
  assert np.all(np.asarray(ret)[~SPAN] == 0)
  assert np.all(np.asarray(a)[~ACTION] == 0)
  # The skip-observation arm trains on action tokens only.
  _, _, skip_mask = compute_advantages(StepConfig(advantage="value"), values, _batch())
  np.testing.assert_array_equal(skip_mask, ACTION)


@pytest.mark.parametrize("arm", ["value", "token_gae", "step_gae_mean", "step_gae_last"])
def test_critic_lambda_one_gives_monte_carlo_targets_and_keeps_the_actor(arm):
  values = jnp.asarray(np.random.default_rng(1).normal(size=ACTION.shape), jnp.float32)
  base = compute_advantages(StepConfig(advantage=arm, lam=0.9), values, _batch())
  mc = compute_advantages(StepConfig(advantage=arm, lam=0.9, critic_lam=1.0), values, _batch())
  np.testing.assert_allclose(mc[0], base[0])  # the actor's advantages do not change
  if arm == "value":  # gamma 1, lambda 1: the return is the sum of later rewards
    expect = np.where(ACTION, [[1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, .5, .5, 0]], 0)
    np.testing.assert_allclose(mc[1], expect, atol=1e-6)
  assert not np.allclose(mc[1], base[1])


def test_critic_lam_is_validated():
  import importlib.util, os  # pylint: disable=import-outside-toplevel,multiple-imports
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "configs", "sao_critic_lam1.py")
  spec = importlib.util.spec_from_file_location("c", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  assert c.rl.critic_lam == 1.0
  configuration.validate(c, num_devices=8)
  c.rl.critic_lam = 1.5
  with pytest.raises(configuration.ConfigError, match="rl.critic_lam"):
    configuration.validate(c, num_devices=8)


def test_online_style_schedule_moves_with_training_episodes_only():
  from sao_jax.envs.online_style import OnlineStyle, OnlineStyleConfig  # pylint: disable=import-outside-toplevel
  env = OnlineStyle(OnlineStyleConfig(switch_every=2))
  frozen = env.frozen()
  task = env.task(0)
  line = env.demonstration(task, "academic")[0][0]
  # Evaluation / value-pretraining episodes: the preference of the moment, no advance.
  assert [frozen.episode(task).step(line).reward for _ in range(5)] == [1.0] * 5
  assert [env.episode(task).step(line).reward for _ in range(2)] == [1.0, 1.0]
  assert frozen.episode(task).step(line).reward == 0.0  # two training episodes: switched
  assert env.episode(task).step(env.demonstration(task, "cute")[0][0]).reward == 1.0
