"""Demonstration transcripts as Trajectory records (the SFT warm start's data)."""

from __future__ import annotations

import numpy as np

from sao_jax.data.trajectory import Trajectory
from sao_jax.envs.base import Environment, Task


def demonstration_trajectory(env: Environment, task: Task, tokenizer) -> Trajectory:
  """A correct episode of `task` in the driver's token layout.

  Actions end with the turn-end token and are action tokens (log-prob 0,
  version 0: they were not sampled); the episode reward sits on the last
  action token, as the driver would put it.
  """
  bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
  tokens, mask, turn_starts = bos + tokenizer.encode(task.prompt), [], []
  mask = [False] * len(tokens)
  for action, observation in env.demonstration(task):
    turn_starts.append(len(tokens))
    ids = tokenizer.encode(action) + [tokenizer.turn_end_id]
    tokens += ids
    mask += [True] * len(ids)
    obs = tokenizer.encode(observation)
    tokens += obs
    mask += [False] * len(obs)
  tokens, mask = np.asarray(tokens, np.int32), np.asarray(mask, bool)
  rewards = np.zeros(len(tokens), np.float32)
  rewards[np.flatnonzero(mask)[-1]] = 1.0
  return Trajectory(tokens=tokens, action_mask=mask,
                    rollout_logprobs=np.zeros(len(tokens), np.float32),
                    policy_version=np.where(mask, 0, -1).astype(np.int32),
                    rewards=rewards, turn_starts=np.asarray(turn_starts, np.int32),
                    prompt_id=task.index)
