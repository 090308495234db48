"""pass@1 on held-out tasks, with its standard error.

Each of the first `num_tasks` held-out tasks is sampled `samples_per_task`
times; a sample succeeds when its total reward reaches 1, the full reward
of every environment here (a partial credit such as online_style's
`quality_credit` is not a success). pass@1 is the mean over
tasks of each task's success rate, and its standard error is the spread of
those per-task rates over tasks, std / sqrt(num_tasks), so it covers both
the choice of tasks and the sampling (at temperature 1 one sample per task
leaves about 2.5 points of error on 400 tasks; more samples per task shrink
the sampling part).
"""

from __future__ import annotations

import collections

import numpy as np

from sao_jax.data import prompts as prompt_data
from sao_jax.rollout.driver import RolloutDriver
from sao_jax.rollout.engine import PolicyEngine, SamplingConfig


def pass_at_1(model_cfg, params, env, tokenizer, *, num_tasks: int, slots: int, max_len: int,
              max_turn_tokens: int, temperature: float = 1.0, seed: int = 0,
              samples_per_task: int = 1, **driver_options) -> dict:
  """Samples `samples_per_task` episodes of each of the first `num_tasks` held-out tasks.

  An environment with a finite held-out set (`env.num_eval_tasks`, e.g. a
  dataset's held-out rows) is evaluated on at most that many tasks, so no
  task is counted twice. `driver_options` go to the `RolloutDriver` (the
  chat format, the tool-output cap).
  """
  limit = getattr(env, "num_eval_tasks", None)
  if limit is not None:
    num_tasks = min(num_tasks, int(limit))
  engine = PolicyEngine(model_cfg, params, slots=slots, max_len=max_len,
                        sampling=SamplingConfig(temperature=temperature), seed=seed)
  trajs = []
  prompts = [i for i in prompt_data.eval_indices(num_tasks) for _ in range(samples_per_task)]
  driver = RolloutDriver(engine, env, tokenizer, iter(prompts), trajs.append,
                         max_turn_tokens=max_turn_tokens, **driver_options)
  try:
    driver.run()
  finally:
    driver.stop()
  return summarize(trajs)


# The full reward of every environment here: an episode that earns it solved its task.
SUCCESS_REWARD = 1.0


def solved(total_reward):
  """Whether an episode's total reward (or an array of them) counts as a success."""
  return total_reward >= SUCCESS_REWARD


def summarize(trajs) -> dict:
  """pass@1, its standard error over tasks, and episode shape of sampled episodes."""
  by_task = collections.defaultdict(list)
  for t in trajs:
    by_task[t.prompt_id].append(float(solved(t.total_reward)))
  rates = np.array([np.mean(v) for v in by_task.values()])
  stderr = float(rates.std(ddof=1) / np.sqrt(len(rates))) if len(rates) > 1 else float("nan")
  return {
      "pass@1": float(rates.mean()),
      "pass@1_stderr": stderr,
      "tasks": len(rates),
      "samples": len(trajs),
      "mean_length": float(np.mean([len(t) for t in trajs])),
      # Sampled (action) tokens per episode: what a generated-token budget counts.
      "mean_generated": float(np.mean([int(np.sum(t.action_mask)) for t in trajs])),
      "mean_turns": float(np.mean([t.num_turns for t in trajs])),
  }
