"""The Trajectory record: the contract between rollout and trainer.

Host side, ragged numpy, one finished episode:

    tokens            int32[T]    prompt, actions, observations
    action_mask       bool[T]     True where the policy sampled the token
    rollout_logprobs  float32[T]  log-prob under the sampling distribution (0 off-action)
    policy_version    int32[T]    version whose logits produced the token (-1 off-action)
    rewards           float32[T]  per-token rewards, on action tokens only
    turn_starts       int32[K]    index of the first token of each action turn

plus the prompt id (and group id for GRPO arms), why it finished, and timing.
`validate` checks every invariant the trainer relies on and returns a short
reason string for a bad record (counted by the ingestion queue), or None.
"""

from __future__ import annotations

import dataclasses

import numpy as np

FINISH_REASONS = ("done", "max_turns", "length")


@dataclasses.dataclass
class Trajectory:
  tokens: np.ndarray
  action_mask: np.ndarray
  rollout_logprobs: np.ndarray
  policy_version: np.ndarray
  rewards: np.ndarray
  turn_starts: np.ndarray
  prompt_id: int
  group_id: int = -1
  finish_reason: str = "done"
  start_time: float = 0.0
  end_time: float = 0.0
  env_seconds: float = 0.0

  def __len__(self) -> int:
    return int(self.tokens.shape[0])

  @property
  def total_reward(self) -> float:
    return float(self.rewards.sum())

  @property
  def num_turns(self) -> int:
    return int(self.turn_starts.shape[0])


def validate(t: Trajectory, vocab_size: int, max_length: int,
             current_version: int | None = None) -> str | None:
  """None if `t` is well-formed, else a short reason (a metric label)."""
  fields = ("tokens", "action_mask", "rollout_logprobs", "policy_version", "rewards")
  arrays = [getattr(t, f, None) for f in fields]
  if any(not isinstance(a, np.ndarray) for a in arrays):
    return "not_numpy"
  if any(a.ndim != 1 for a in arrays):
    return "bad_rank"
  n = arrays[0].shape[0]
  if any(a.shape[0] != n for a in arrays):
    return "length_mismatch"
  if n == 0:
    return "empty"
  if n > max_length:
    return "too_long"
  if not np.issubdtype(t.tokens.dtype, np.integer):
    return "bad_token_dtype"
  if t.action_mask.dtype != np.bool_:
    return "bad_mask_dtype"
  if t.tokens.min() < 0 or t.tokens.max() >= vocab_size:
    return "token_out_of_vocab"
  if not t.action_mask.any():
    return "no_action_tokens"
  if t.action_mask[0]:
    return "action_without_prompt"
  for name in ("rollout_logprobs", "rewards"):
    if not np.all(np.isfinite(getattr(t, name))):
      return f"nonfinite_{name}"
  lp = t.rollout_logprobs
  if np.any(lp[t.action_mask] > 1e-5):
    return "positive_logprob"
  if np.any(lp[~t.action_mask] != 0):
    return "logprob_off_action"
  if np.any(t.rewards[~t.action_mask] != 0):
    return "reward_off_action"
  ver = t.policy_version
  if np.any(ver[~t.action_mask] != -1) or np.any(ver[t.action_mask] < 0):
    return "bad_policy_version"
  if current_version is not None and ver.max() > current_version:
    return "version_from_future"
  if t.finish_reason not in FINISH_REASONS:
    return "bad_finish_reason"
  return None
