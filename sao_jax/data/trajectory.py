"""The Trajectory record: the contract between rollout and trainer.

Host side, ragged numpy, one finished episode:

    tokens            int32[T]    prompt, actions, observations
    action_mask       bool[T]     True where the policy sampled the token
    rollout_logprobs  float32[T]  log-prob under the sampling distribution (0 off-action)
    policy_version    int32[T]    version whose logits produced the token (-1 off-action)
    rewards           float32[T]  per-token rewards, on action tokens only
    turn_starts       int32[K]    index of the first token of each action turn
    routing           int16[T, M, k] or None: the engine's MoE expert choices
                      for each token it fed (-1 rows: none recorded), for
                      routing replay (`rl.routing_replay`, models/routing.py)

plus the prompt id (and group id for GRPO arms), why it finished, timing,
and whose params sampled it (sao_jax/data/identity.py): `run_id`, the
trainer run that published them ("" when unknown), and `fingerprints`,
{version: fingerprint} for the versions its action tokens used (a subset:
a version it has none for is unknown). A record written before these
existed reads back without them; a fleet trainer refuses it, counted
`missing_run_id` (in-process sources and offline reads check nothing).

A record can come from another process or another machine, so nothing about
it is trusted. `canonicalize` returns a copy in exactly the types the trainer
uses (the dtypes above; Python int, str and float scalars), and refuses a
field that cannot be cast without changing its meaning: float tokens are not
silently truncated, ints outside int32 are not wrapped, an int mask is not
taken for a bool one. `validate` checks every invariant the trainer relies on
AFTER that cast, so a float64 reward of 1e39, finite before the cast and inf
after, is refused rather than trained on. `checked` returns the canonical
copy with the verdict, so a consumer trains on exactly what was validated
(and a producer that later mutates its arrays cannot change it).

A bad record gets a short snake_case reason (`REJECT_REASONS`), which the
ingestion queue counts as the metric `queue/rejected_<reason>`.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from sao_jax.data import identity

# "env_*": the rollout driver ends an episode whose environment raised, timed
# out or returned something unusable with these, rather than crashing.
FINISH_REASONS = ("done", "max_turns", "length", "env_error", "env_timeout", "env_garbage")
# Finish reasons of episodes that the environment broke (sao_jax/rollout/driver.py).
ENV_FAULTS = FINISH_REASONS[3:]

ARRAY_FIELDS = (
  "tokens",
  "action_mask",
  "rollout_logprobs",
  "policy_version",
  "rewards",
  "turn_starts",
)
# Arrays a record may leave out (None): routing replay's expert choices.
OPTIONAL_ARRAY_FIELDS = ("routing",)
# The per-token arrays: all of length T (turn_starts has its own length K).
_PER_TOKEN = ARRAY_FIELDS[:5]

# Every reason `validate` / `checked` can return.
REJECT_REASONS = (
  # structure
  "not_numpy",
  "bad_rank",
  "length_mismatch",
  "empty",
  "too_long",
  # dtypes (a field that cannot be cast to its canonical dtype losslessly)
  "bad_token_dtype",
  "bad_mask_dtype",
  "bad_logprob_dtype",
  "bad_version_dtype",
  "bad_reward_dtype",
  "bad_turn_starts_dtype",
  # values (checked after the cast)
  "token_out_of_vocab",
  "no_action_tokens",
  "action_without_prompt",
  "nonfinite_rollout_logprobs",
  "nonfinite_rewards",
  "positive_logprob",
  "logprob_off_action",
  "reward_off_action",
  "bad_policy_version",
  "version_from_future",
  # turns
  "too_many_turns",
  "turn_start_out_of_range",
  "turn_starts_not_increasing",
  "turn_start_off_action",
  "missing_first_turn_start",
  # scalars
  "bad_prompt_id",
  "bad_group_id",
  "bad_finish_reason",
  "bad_time",
  # identity (sao_jax/data/identity.py)
  "bad_run_id",
  "bad_fingerprints",
  # routing replay (`checked(..., routing_shape=)`)
  "bad_routing",
  "missing_routing",
  "routing_out_of_range",
)

_INT32 = np.iinfo(np.int32)
_INT64 = np.iinfo(np.int64)


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
  routing: np.ndarray | None = None
  run_id: str = ""
  fingerprints: dict = dataclasses.field(default_factory=dict)

  def __len__(self) -> int:
    return int(self.tokens.shape[0])

  @property
  def total_reward(self) -> float:
    return float(self.rewards.sum())

  @property
  def num_turns(self) -> int:
    return int(self.turn_starts.shape[0])


class InvalidTrajectory(ValueError):
  """Raised by `canonicalize`; `reason` is one of REJECT_REASONS."""

  def __init__(self, reason: str):
    super().__init__(reason)
    self.reason = reason


def _shape(t) -> int:
  """T, after the checks that need no values: every array a 1-D ndarray."""
  arrays = [getattr(t, f, None) for f in ARRAY_FIELDS]
  if any(not isinstance(a, np.ndarray) for a in arrays):
    raise InvalidTrajectory("not_numpy")
  if any(a.ndim != 1 for a in arrays):
    raise InvalidTrajectory("bad_rank")
  n = arrays[0].shape[0]
  if any(a.shape[0] != n for a in arrays[: len(_PER_TOKEN)]):
    raise InvalidTrajectory("length_mismatch")
  return n


def _int32(a: np.ndarray, dtype_reason: str, range_reason: str) -> np.ndarray:
  # Range-checked in the source dtype: a cast first would wrap 2**32 to 0.
  if a.dtype.kind not in "iu":
    raise InvalidTrajectory(dtype_reason)
  if a.size and (int(a.min()) < _INT32.min or int(a.max()) > _INT32.max):
    raise InvalidTrajectory(range_reason)
  return np.array(a, np.int32)  # a plain ndarray copy, even of a subclass


def _float32(a: np.ndarray, dtype_reason: str) -> np.ndarray:
  # Overflow becomes inf here on purpose: `validate` then refuses it as
  # non-finite, which is what the trainer would have seen.
  if a.dtype.kind not in "iuf":
    raise InvalidTrajectory(dtype_reason)
  with np.errstate(over="ignore", invalid="ignore"):
    return np.array(a, np.float32)


def _int_scalar(x, reason: str) -> int:
  # bool is an int in Python, but a bool id is a bug upstream, not an id.
  if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
    raise InvalidTrajectory(reason)
  x = int(x)
  if not _INT64.min <= x <= _INT64.max:  # ids go into numpy arrays and JSON
    raise InvalidTrajectory(reason)
  return x


def _time(x) -> float:
  if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
    raise InvalidTrajectory("bad_time")
  try:
    x = float(x)
  except OverflowError:
    raise InvalidTrajectory("bad_time") from None
  if not math.isfinite(x):
    raise InvalidTrajectory("bad_time")
  return x


def canonicalize(t) -> Trajectory:
  """A fresh copy of `t` in the trainer's types, or InvalidTrajectory(reason).

  Refuses what the cast cannot carry faithfully (wrong kind of dtype, rank,
  ints outside int32, non-integral ids, non-string finish reason, non-finite
  times) but not bad values that survive the cast: `validate` checks those
  on the result. The copy never aliases `t`'s arrays.
  """
  _shape(t)
  tokens = _int32(t.tokens, "bad_token_dtype", "token_out_of_vocab")
  if t.action_mask.dtype != np.bool_:  # strict: 0/1 ints are not silently a mask
    raise InvalidTrajectory("bad_mask_dtype")
  mask = np.array(t.action_mask, np.bool_)
  logprobs = _float32(t.rollout_logprobs, "bad_logprob_dtype")
  version = _int32(t.policy_version, "bad_version_dtype", "bad_policy_version")
  rewards = _float32(t.rewards, "bad_reward_dtype")
  turn_starts = _int32(t.turn_starts, "bad_turn_starts_dtype", "turn_start_out_of_range")
  finish_reason = getattr(t, "finish_reason", "done")
  if not isinstance(finish_reason, str):
    raise InvalidTrajectory("bad_finish_reason")
  routing = _routing(getattr(t, "routing", None), tokens.shape[0])
  return Trajectory(
    routing=routing,
    tokens=tokens,
    action_mask=mask,
    rollout_logprobs=logprobs,
    policy_version=version,
    rewards=rewards,
    turn_starts=turn_starts,
    prompt_id=_int_scalar(getattr(t, "prompt_id", None), "bad_prompt_id"),
    group_id=_int_scalar(getattr(t, "group_id", -1), "bad_group_id"),
    finish_reason=str(finish_reason),
    start_time=_time(getattr(t, "start_time", 0.0)),
    end_time=_time(getattr(t, "end_time", 0.0)),
    env_seconds=_time(getattr(t, "env_seconds", 0.0)),
    run_id=_run_id(getattr(t, "run_id", "")),
    fingerprints=_fingerprints(getattr(t, "fingerprints", None)),
  )


_VERSION_KEY = re.compile(r"^-?[0-9]{1,10}$")


def _run_id(x) -> str:
  if not isinstance(x, str) or (x and not identity.RUN_ID.match(x)):
    raise InvalidTrajectory("bad_run_id")
  return str(x)


def _fingerprints(x) -> dict[int, str]:
  """{version: fingerprint} as ints and hex strings; a JSON object's keys
  (decimal strings, as the store writes them) are taken as ints."""
  if x is None:
    return {}
  if not isinstance(x, dict):
    raise InvalidTrajectory("bad_fingerprints")
  out = {}
  for k, v in x.items():
    if isinstance(k, str) and _VERSION_KEY.match(k):
      k = int(k)
    if (
      isinstance(k, (bool, np.bool_))
      or not isinstance(k, (int, np.integer))
      or not _INT32.min <= int(k) <= _INT32.max
    ):
      raise InvalidTrajectory("bad_fingerprints")
    if not isinstance(v, str) or not identity.FINGERPRINT.match(v):
      raise InvalidTrajectory("bad_fingerprints")
    out[int(k)] = str(v)
  return out


_INT16 = np.iinfo(np.int16)


def _routing(r, n: int) -> np.ndarray | None:
  """An int16 copy of a routing record `[n, M, k]` (None stays None)."""
  if r is None:
    return None
  if not isinstance(r, np.ndarray) or r.ndim != 3 or r.shape[0] != n or r.dtype.kind not in "iu":
    raise InvalidTrajectory("bad_routing")
  if r.size and (int(r.min()) < -1 or int(r.max()) > _INT16.max):
    raise InvalidTrajectory("routing_out_of_range")
  return np.array(r, np.int16)


def _check_routing(t: Trajectory, shape: tuple[int, int, int]) -> str | None:
  """`t.routing` is `[T, M, k]` of experts below E (rows all -1: none), for
  `shape` = (M, k, E) of the model that replays it."""
  m, k, e = shape
  if t.routing is None:
    return "missing_routing"
  if t.routing.shape[1:] != (m, k):
    return "bad_routing"
  none = (t.routing == -1).all(axis=(1, 2))
  rest = t.routing[~none]
  if rest.size and (rest.min() < 0 or rest.max() >= e):
    return "routing_out_of_range"
  return None


def _check_turns(t: Trajectory) -> str | None:
  """turn_starts: strictly increasing indices of action tokens, the first at
  the first action token (so every action token belongs to some turn)."""
  ts, mask = t.turn_starts, t.action_mask
  actions = np.flatnonzero(mask)
  if ts.shape[0] > actions.shape[0]:
    return "too_many_turns"
  if ts.shape[0] == 0:
    return "missing_first_turn_start"
  if ts.min() < 0 or ts.max() >= mask.shape[0]:
    return "turn_start_out_of_range"
  if np.any(np.diff(ts) <= 0):
    return "turn_starts_not_increasing"
  if not np.all(mask[ts]):
    return "turn_start_off_action"
  if ts[0] != actions[0]:
    return "missing_first_turn_start"
  return None


def _check_values(t: Trajectory, vocab_size: int, current_version: int | None) -> str | None:
  """The invariants, on a canonical trajectory (so dtypes are known)."""
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
  if t.fingerprints and not set(t.fingerprints) <= set(np.unique(ver[t.action_mask]).tolist()):
    return "bad_fingerprints"  # a version no token used
  reason = _check_turns(t)
  if reason is not None:
    return reason
  if t.finish_reason not in FINISH_REASONS:
    return "bad_finish_reason"
  return None


def checked(
  t,
  vocab_size: int,
  max_length: int,
  current_version: int | None = None,
  routing_shape: tuple[int, int, int] | None = None,
) -> tuple[Trajectory | None, str | None]:
  """(canonical copy, None) if `t` is well-formed, else (None, reason).

  Length is checked before anything is copied, so an oversized record costs
  no more than its shape. Raises only on a bug (or an object whose own
  methods raise); callers that must not crash catch that too.
  `routing_shape` (M, k, E): the consumer replays MoE routing, so `t` must
  carry a routing record of that model's shape.
  """
  try:
    n = _shape(t)
    if n == 0:
      return None, "empty"
    if n > max_length:
      return None, "too_long"
    c = canonicalize(t)
  except InvalidTrajectory as e:
    return None, e.reason
  reason = _check_values(c, vocab_size, current_version)
  if reason is None and routing_shape is not None:
    reason = _check_routing(c, routing_shape)
  return (None, reason) if reason is not None else (c, None)


def validate(t, vocab_size: int, max_length: int, current_version: int | None = None) -> str | None:
  """None if `t` is well-formed once canonicalized, else a short reason."""
  return checked(t, vocab_size, max_length, current_version)[1]
