"""The ablation arms measure their estimators, not handicaps (issue: evidence)."""

import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.algo import advantages as adv
from sao_jax.train import configuration
from sao_jax.train.train_step import StepConfig, compute_advantages

# One packed row: [prompt | turn 1 | observation | turn 2 | pad], then a
# second sequence [prompt | turn]. The token-GAE recursion reads values on
# every position from a sequence's first to its last action token.
ACTION = np.array([[0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 0]], bool)
SEGMENT = np.array([[1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 0]], np.int32)
SPAN = np.array([[0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0]], bool)


def _batch():
  rewards = np.zeros(ACTION.shape, np.float32)
  rewards[0, 8], rewards[0, 12] = 1.0, 0.5  # terminal rewards of the two sequences
  return {
    "rewards": jnp.asarray(rewards),
    "action_mask": jnp.asarray(ACTION),
    "segment_ids": jnp.asarray(SEGMENT),
  }


def test_action_span_is_where_token_gae_reads_values():
  np.testing.assert_array_equal(adv.action_span(jnp.asarray(ACTION), jnp.asarray(SEGMENT)), SPAN)


def test_token_gae_critic_is_regressed_on_the_observations_it_bootstraps_through():
  values = jnp.asarray(np.random.default_rng(0).normal(size=ACTION.shape), jnp.float32)
  a, ret, value_mask = compute_advantages(StepConfig.of(advantage="token_gae"), values, _batch())
  np.testing.assert_array_equal(value_mask, SPAN)
  observation = SPAN & ~ACTION
  assert observation.any()
  # Targets exist (A + V) exactly where the critic is trained, nowhere else.
  assert np.all(np.asarray(ret)[~SPAN] == 0)
  assert np.all(np.asarray(a)[~ACTION] == 0)
  # The skip-observation arm trains on action tokens only.
  _, _, skip_mask = compute_advantages(StepConfig.of(advantage="value"), values, _batch())
  np.testing.assert_array_equal(skip_mask, ACTION)


@pytest.mark.parametrize("arm", ["value", "token_gae", "step_gae_mean", "step_gae_last"])
def test_critic_lambda_one_gives_monte_carlo_targets_and_keeps_the_actor(arm):
  values = jnp.asarray(np.random.default_rng(1).normal(size=ACTION.shape), jnp.float32)
  base = compute_advantages(StepConfig.of(advantage=arm, lam=0.9), values, _batch())
  mc = compute_advantages(StepConfig.of(advantage=arm, lam=0.9, critic_lam=1.0), values, _batch())
  np.testing.assert_allclose(mc[0], base[0])  # the actor's advantages do not change
  if arm == "value":  # gamma 1, lambda 1: the return is the sum of later rewards
    expect = np.where(ACTION, [[1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0.5, 0.5, 0]], 0)
    np.testing.assert_allclose(mc[1], expect, atol=1e-6)
  assert not np.allclose(mc[1], base[1])


def test_critic_lam_is_validated():
  import importlib.util
  import os

  path = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "sao_critic_lam1.py"
  )
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
  from sao_jax.envs.online_style import OnlineStyle, OnlineStyleConfig

  env = OnlineStyle(OnlineStyleConfig(switch_every=2))
  frozen = env.frozen()
  task = env.task(0)
  line = env.demonstration(task, "academic")[0][0]
  # Evaluation / value-pretraining episodes: the preference of the moment, no advance.
  assert [frozen.episode(task).step(line).reward for _ in range(5)] == [1.0] * 5
  assert [env.episode(task).step(line).reward for _ in range(2)] == [1.0, 1.0]
  assert frozen.episode(task).step(line).reward == 0.0  # two training episodes: switched
  assert env.episode(task).step(env.demonstration(task, "cute")[0][0]).reward == 1.0


def test_online_style_quality_credit_rewards_form_but_is_not_a_pass():
  from sao_jax.envs.online_style import OnlineStyle, OnlineStyleConfig
  from sao_jax.train import evaluation

  env = OnlineStyle(OnlineStyleConfig(switch_every=10**9, quality_credit=0.2))
  task = env.task(0)
  preferred = env.demonstration(task, "academic")[0][0]
  other = env.demonstration(task, "cute")[0][0]
  assert env.episode(task).step(preferred).reward == 1.0
  assert env.episode(task).step(other).reward == pytest.approx(0.2)
  assert env.episode(task).step("no").reward == 0.0  # not a well-formed line
  with pytest.raises(ValueError, match="quality_credit"):
    OnlineStyleConfig(quality_credit=1.0)

  class T:  # the fields summarize reads
    def __init__(self, prompt_id, reward):
      self.prompt_id, self.total_reward, self.num_turns = prompt_id, reward, 1
      self.action_mask = np.array([1], bool)
      self.finish_reason = "done"

    def __len__(self):
      return 1

  # A partial credit is not a solved task.
  assert evaluation.summarize([T(0, 1.0), T(1, 0.2)])["pass@1"] == pytest.approx(0.5)


# --- GRPO's rescaling, evaluation noise, token budgets ------------------------


def test_group_advantages_without_std_are_group_centred_rewards():
  rewards = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0], np.float32)
  groups = np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32)
  centred = np.empty_like(rewards)
  scaled = np.empty_like(rewards)
  for g in (0, 1):
    r = rewards[groups == g]
    centred[groups == g] = r - r.mean()
    scaled[groups == g] = (r - r.mean()) / (r.std() + 1e-6)
  raw = adv.group_advantages(jnp.asarray(rewards), jnp.asarray(groups), std_normalize=False)
  np.testing.assert_allclose(raw, centred, atol=1e-6)
  # GRPO as published (the default) divides by the group's std: larger steps
  # at one lr than SAO's reward-unit advantages when rewards are in [0, 1].
  np.testing.assert_allclose(
    adv.group_advantages(jnp.asarray(rewards), jnp.asarray(groups)), scaled, atol=1e-5
  )
  assert np.abs(scaled).sum() > np.abs(centred).sum()


def test_budget_and_eval_samples_are_validated():
  # (rl.group_std_normalize is a bool field: ml_collections refuses other types.)
  from experiments import runner

  for field, bad in (("rl.max_generated_tokens", -1), ("eval.samples_per_task", 0)):
    c = runner.load_config("sao_tiny", {})
    configuration.validate(c, num_devices=8)
    node, leaf = c, field.split(".")
    for p in leaf[:-1]:
      node = node[p]
    node[leaf[-1]] = bad
    with pytest.raises(configuration.ConfigError, match=field.replace(".", r"\.")):
      configuration.validate(c, num_devices=8)


def test_pass_at_1_stderr_is_over_tasks_of_their_success_rates():
  from sao_jax.train import evaluation

  class T:  # the fields summarize reads
    def __init__(self, prompt_id, reward):
      self.prompt_id, self.total_reward, self.num_turns = prompt_id, reward, 1
      self.action_mask = np.array([0, 1, 1], bool)
      self.finish_reason = "done"

    def __len__(self):
      return 3

  # 3 tasks x 2 samples: success rates 1, 0.5, 0.
  trajs = [T(0, 1.0), T(1, 0.0), T(0, 1.0), T(2, 0.0), T(1, 1.0), T(2, 0.0)]
  r = evaluation.summarize(trajs)
  assert r["tasks"] == 3 and r["samples"] == 6 and r["mean_generated"] == 2
  assert r["pass@1"] == pytest.approx(0.5)
  assert r["pass@1_stderr"] == pytest.approx(np.std([1, 0.5, 0], ddof=1) / np.sqrt(3))


def test_pass_at_1_says_how_many_samples_gave_no_episode(capsys):
  """A prompt too long for max_len leaves no episode: the result and a warning
  line say how many, never a silently smaller evaluation set."""
  from fakes import EchoEnv, random_params
  from runs import load_config_module

  from sao_jax.envs.base import Task
  from sao_jax.envs.tokenizer import CharTokenizer
  from sao_jax.models import config as mcfg
  from sao_jax.train import evaluation

  class OddTasksTooLong(EchoEnv):
    def task(self, i):
      task = super().task(i)
      return Task(i, "q" * 40 + "\n", None, task.meta) if i % 2 else task

  tok = CharTokenizer()
  cfg = mcfg.tiny(vocab_size=tok.vocab_size)
  # The tiny run's config with the evaluation this test measures: 4 tasks on
  # 4 slots at temperature 1, turns of 4 tokens in max_len 32, the raw
  # format, no tool-output cap, swap policy and decode steps fixed. Training groups
  # of 4 (a GRPO arm's) must not multiply evaluation's episodes.
  config = load_config_module("sao_tiny.py").get_config()
  config.eval.update(num_tasks=4, slots=4, temperature=1.0, samples_per_task=1, decode_steps=8)
  config.rollout.update(
    max_len=32,
    max_turn_tokens=4,
    kv_cache="dense",
    top_k=0,
    top_p=1.0,
    samples_per_prompt=4,
    swap_policy="keep",
    env_workers=4,
    env_timeout=60.0,
  )
  config.env.update(chat_format="raw", max_tool_output_tokens=0)
  r = evaluation.pass_at_1(config, cfg, random_params(cfg, 0.02), OddTasksTooLong(), tok, seed=0)
  assert r["samples_dropped"] == 2 and r["tasks"] == 2 and r["samples"] == 2
  assert "2 of 4 samples gave no episode" in capsys.readouterr().out


def test_token_budget_counts_value_pretraining_rollouts_and_stops_rl(tmp_path):
  """Sync SAO: after RL step 1 the count is the warm-up's tokens plus that batch's."""
  from experiments import runner
  from sao_jax.data import store
  from sao_jax.train import trainer

  overrides = dict(runner.SMOKE_OVERRIDES, **{"rl.steps": 4, "rl.max_generated_tokens": 1})
  config = runner.load_config("sao_sync", overrides)
  summary = trainer.train(config, str(tmp_path))
  shard = tmp_path / "trajectories" / "value_pretrain.array_record"
  warmup, _ = store.read_valid_trajectories([str(shard)], 10**6, config.rollout.max_len)
  warmup_tokens = sum(int(t.action_mask.sum()) for t in warmup)
  assert len(warmup) == config.value_pretrain.num_trajectories and warmup_tokens > 0
  rl = [r for r in runner.read_metrics(str(tmp_path)) if r["stage"] == "rl"]
  # The budget (1 token) was spent by the warm-up: one RL step, then stop.
  assert summary["rl_steps"] == 1 and [r["step"] for r in rl] == [1]
  # In sync mode step 1 trains on exactly the trajectories generated for it.
  assert rl[0]["rollout/generated_tokens_total"] == warmup_tokens + rl[0]["policy/tokens"]
  assert summary["generated_tokens"] == rl[0]["rollout/generated_tokens_total"]
