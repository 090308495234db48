"""Demonstration transcripts as Trajectory records (the SFT warm start's data)."""

from __future__ import annotations

import numpy as np

from sao_jax.data.trajectory import Trajectory
from sao_jax.envs import base, chat
from sao_jax.envs.base import Environment, TaskProtocol


def demonstration_trajectory(
  env: Environment, task: TaskProtocol, tokenizer, chat_format=None
) -> Trajectory:
  """A correct episode of `task` in the driver's token layout.

  Built the way the driver builds a rollout: the prompt rendered once, each
  action turn with its turn end (action tokens, log-prob 0, version 0: they
  were not sampled), each observation but the last turn's as the format's
  bridge (not action tokens). The episode reward sits on the last action
  token, as the driver would put it. `chat_format` None: the toys' raw
  text format. `task` is any `TaskProtocol` (its tools read by
  `base.task_tools`: none if it has no `tools`).
  """
  fmt = chat_format if chat_format is not None else chat.RawFormat(tokenizer)
  tokens = list(fmt.prompt_ids(task.prompt, base.task_tools(task)))
  mask, turn_starts = [False] * len(tokens), []
  turns = list(env.demonstration(task))
  for k, (action, observation) in enumerate(turns):
    turn_starts.append(len(tokens))
    ids = fmt.demonstration_ids(action)  # as this format's policy samples the turn
    tokens += ids
    mask += [True] * len(ids)
    if k + 1 < len(turns):  # the last turn ends the episode: nothing follows it
      obs = fmt.observation_ids(observation)
      tokens += obs
      mask += [False] * len(obs)
  tokens, mask = np.asarray(tokens, np.int32), np.asarray(mask, bool)
  rewards = np.zeros(len(tokens), np.float32)
  rewards[np.flatnonzero(mask)[-1]] = 1.0
  return Trajectory(
    tokens=tokens,
    action_mask=mask,
    rollout_logprobs=np.zeros(len(tokens), np.float32),
    policy_version=np.where(mask, 0, -1).astype(np.int32),
    rewards=rewards,
    turn_starts=np.asarray(turn_starts, np.int32),
    prompt_id=task.index,
  )
