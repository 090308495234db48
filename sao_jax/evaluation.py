"""pass@1 on held-out tasks: one sampled episode per task, success = reward > 0."""

from __future__ import annotations

import numpy as np

from sao_jax.data import prompts as prompt_data
from sao_jax.rollout.driver import RolloutDriver
from sao_jax.rollout.engine import PolicyEngine, SamplingConfig


def pass_at_1(model_cfg, params, env, tokenizer, *, num_tasks: int, slots: int, max_len: int,
              max_turn_tokens: int, temperature: float = 1.0, seed: int = 0) -> dict:
  """Samples one episode of each of the first `num_tasks` held-out tasks."""
  engine = PolicyEngine(model_cfg, params, slots=slots, max_len=max_len,
                        sampling=SamplingConfig(temperature=temperature), seed=seed)
  trajs = []
  driver = RolloutDriver(engine, env, tokenizer, iter(prompt_data.eval_indices(num_tasks)),
                         trajs.append, max_turn_tokens=max_turn_tokens)
  try:
    driver.run()
  finally:
    driver.stop()
  rewards = np.array([t.total_reward for t in trajs])
  return {
      "pass@1": float((rewards > 0).mean()),
      "tasks": len(trajs),
      "mean_length": float(np.mean([len(t) for t in trajs])),
      "mean_turns": float(np.mean([t.num_turns for t in trajs])),
  }
