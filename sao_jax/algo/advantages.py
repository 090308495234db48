"""Advantage estimators for SAO and its baselines (docs/DESIGN.md section 2).

All estimators take batch-major arrays `[B, T]` over a token sequence
x_0 .. x_{T-1}. `action_mask[b, t]` is True where x_t was sampled from the
policy; prompt, observation and padding positions are False and always get a
zero advantage and a zero return. `values[b, t]` is the critic's estimate of
the return from emitting x_t onward, `rewards[b, t]` is nonzero only on
action tokens.

SAO's estimator, `skip_observation_gae`, is one reverse `lax.scan` whose body
is a handful of fused element-wise ops. The ablation arms are written with a
generic first-order linear recurrence, `reverse_linear_recurrence`, run
backwards in time. `benchmarks/gae.py` measures the kernel against rlax
(its figures, and what was tried to make it faster on CPU:
benchmarks/RESULTS.md#kernels).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def reverse_linear_recurrence(a: Array, b: Array) -> Array:
  """Solves y_t = a_t * y_{t+1} + b_t backwards along the last axis, y_T = 0.

  Args:
    a: decay coefficients, shape `[B, T]`.
    b: inputs, same shape and dtype as `a`.

  Returns:
    y, `[B, T]`.
  """
  chex.assert_equal_shape([a, b])

  def step(y_next, ab):
    a_t, b_t = ab
    y_t = a_t * y_next + b_t
    return y_t, y_t

  _, y = jax.lax.scan(step, jnp.zeros(a.shape[:-1], a.dtype), (a.T, b.T), reverse=True)
  return y.T


def _same_as_next(segment_ids: Array | None, shape) -> Array:
  """True where position t + 1 belongs to the same packed sequence as t.

  Without segment ids the whole row is one sequence. The last position of a
  row, and the last position of each segment, are False: recursions reset
  there, so one packed sequence never bootstraps from the next.
  """
  if segment_ids is None:
    same = jnp.ones(shape, bool)
  else:
    chex.assert_shape(segment_ids, shape)
    same = jnp.pad(segment_ids[:, 1:] == segment_ids[:, :-1], ((0, 0), (0, 1)))
  return same.at[:, -1].set(False)


def _check_inputs(rewards, values, action_mask):
  chex.assert_rank([rewards, values, action_mask], 2)
  chex.assert_equal_shape([rewards, values, action_mask])
  chex.assert_type([rewards, values], float)
  chex.assert_type(action_mask, bool)


# ----------------------------------------------------------------------------
# SAO's estimator.
# ----------------------------------------------------------------------------


def skip_observation_gae(
  rewards: Array,
  values: Array,
  action_mask: Array,
  gamma: float,
  lam: float,
  segment_ids: Array | None = None,
) -> tuple[Array, Array]:
  """Token-level GAE over action tokens only, skipping observations.

  Let i_0 < ... < i_{K-1} be the action positions of a row. Then

      delta_k = r[i_k] + gamma * V[i_{k+1}] - V[i_k]     (V[i_K] := 0)
      A_k     = delta_k + gamma * lam * A_{k+1}          (A_K := 0)
      R_k     = A_k + V[i_k]

  i.e. textbook GAE on the compressed sequence of action tokens, scattered
  back. The last token of turn j bootstraps from the first token of turn
  j + 1; observation tokens between them neither discount nor contribute.
  After the last action token the value is 0 (the episode ended). Prompt,
  observation and padding positions get advantage 0 and return 0.

  As a reverse scan: walking t = T-1 .. 0 with a carry (next_value,
  next_advantage) that starts at (0, 0), an action token computes its delta
  and advantage from the carry and replaces it; any other token passes the
  carry through untouched.

  Args:
    rewards: float `[B, T]`, per-token rewards (on action tokens).
    values: float `[B, T]`, critic values V(x_<t) for emitting x_t onward.
    action_mask: bool `[B, T]`, True on policy-sampled tokens.
    gamma: discount per action token.
    lam: GAE lambda.
    segment_ids: optional int `[B, T]` for packed rows: each segment is its
      own episode (terminal after its last action token).

  Returns:
    (advantages, returns), both float `[B, T]`, zero off action tokens.
  """
  _check_inputs(rewards, values, action_mask)
  same_next = _same_as_next(segment_ids, rewards.shape)

  def step(carry, x):
    r_t, v_t, is_action, keep = x  # [B] each
    # A new segment starts after t: its carry must not reach t.
    next_value, next_advantage = jax.tree.map(lambda c: jnp.where(keep, c, 0.0), carry)
    advantage = r_t + gamma * next_value - v_t + gamma * lam * next_advantage
    carry = (jnp.where(is_action, v_t, next_value), jnp.where(is_action, advantage, next_advantage))
    return carry, jnp.where(is_action, advantage, 0.0)

  zeros = jnp.zeros(rewards.shape[:1], values.dtype)
  _, advantages = jax.lax.scan(
    step, (zeros, zeros), (rewards.T, values.T, action_mask.T, same_next.T), reverse=True
  )
  advantages = advantages.T  # [B, T]
  returns = jnp.where(action_mask, advantages + values, 0.0)
  return advantages, returns


# ----------------------------------------------------------------------------
# Ablation arms.
# ----------------------------------------------------------------------------


def action_span(action_mask: Array, segment_ids: Array | None = None) -> Array:
  """bool `[B, T]`: True from the first to the last action token of each sequence.

  The positions whose values token-level GAE uses (observations between
  turns included), i.e. where its critic is regressed.
  """
  return _action_span(action_mask, _same_as_next(segment_ids, action_mask.shape))


def _action_span(action_mask: Array, same_next: Array) -> Array:
  """True from the first to the last action token of each (packed) sequence."""
  m = action_mask.astype(jnp.float32)
  seen_after = reverse_linear_recurrence(same_next.astype(jnp.float32), m) > 0
  same_prev = jnp.flip(jnp.pad(same_next[:, :-1], ((0, 0), (1, 0))), 1)
  seen_before = (
    jnp.flip(reverse_linear_recurrence(same_prev.astype(jnp.float32), jnp.flip(m, 1)), 1) > 0
  )
  return seen_before & seen_after


def token_gae(
  rewards: Array,
  values: Array,
  action_mask: Array,
  gamma: float,
  lam: float,
  segment_ids: Array | None = None,
) -> tuple[Array, Array]:
  """Naive token-level GAE: observation tokens stay in the recursion.

  Over every position t from the first to the last action token of a row,

      delta_t = r_t + gamma * V_{t+1} - V_t     (V after the last action := 0)
      A_t     = delta_t + gamma * lam * A_{t+1}

  so an observation token between two turns discounts the bootstrap and
  injects its own value. Advantages are masked to action tokens; returns
  R_t = A_t + V_t are given on the whole span (`action_span`), observation
  tokens included: the arm bootstraps through those values, so its critic
  must be trained on them too, or the ablation measures an untrained critic
  rather than the estimator. This is the ablation arm that skip-observation
  GAE improves on.
  """
  _check_inputs(rewards, values, action_mask)
  m = action_mask.astype(values.dtype)
  same_next = _same_as_next(segment_ids, rewards.shape)
  span = _action_span(action_mask, same_next).astype(values.dtype)
  keep = same_next.astype(values.dtype)
  next_v = keep * jnp.concatenate([(values * span)[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
  delta = span * (rewards + gamma * next_v - values)
  g = reverse_linear_recurrence(span * keep * (gamma * lam), delta)
  return m * g, span * (g + values)


def step_gae(
  rewards: Array,
  values: Array,
  action_mask: Array,
  gamma: float,
  lam: float,
  step_value: Literal["mean", "last"] = "mean",
  segment_ids: Array | None = None,
) -> tuple[Array, Array]:
  """Step-level GAE: one step is one model turn (a maximal run of actions).

  A step's reward is the sum of its tokens' rewards, its value the mean of
  its token values (`step_value="mean"`) or the value at its last token
  (`"last"`). GAE runs over the sequence of steps (terminal value 0 after
  the last step), and each step's advantage and return (A_j + V_j) are
  broadcast to all of its tokens. Zero off action tokens.
  """
  _check_inputs(rewards, values, action_mask)
  if step_value not in ("mean", "last"):
    raise ValueError(f"step_value must be 'mean' or 'last', got {step_value!r}")
  dt = values.dtype
  m = action_mask.astype(dt)
  keep = _same_as_next(segment_ids, rewards.shape).astype(dt)
  prev_m = jnp.pad((m * keep)[:, :-1], ((0, 0), (1, 0)))
  next_m = jnp.pad(m[:, 1:], ((0, 0), (0, 1))) * keep
  is_start = m * (1.0 - prev_m)
  is_end = m * (1.0 - next_m)
  in_run = m * keep  # a run continues from t to t + 1

  # Reverse recurrences that reset outside a run and are read at its start.
  step_reward = reverse_linear_recurrence(in_run, m * rewards)
  if step_value == "mean":
    run_sum = reverse_linear_recurrence(in_run, m * values)
    run_len = reverse_linear_recurrence(in_run, m)
    step_v = run_sum / jnp.maximum(run_len, 1.0)
  else:
    step_v = reverse_linear_recurrence(m * (1.0 - is_end), is_end * values)

  # GAE on the compressed sequence of steps, represented at start positions.
  adv_start, ret_start = skip_observation_gae(
    is_start * step_reward, is_start * step_v, is_start > 0, gamma, lam, segment_ids=segment_ids
  )

  # Broadcast forward from each step's start over its run.
  def broadcast(x):
    flipped = reverse_linear_recurrence(jnp.flip(m * (1.0 - is_start), 1), jnp.flip(x, 1))
    return m * jnp.flip(flipped, 1)

  return broadcast(adv_start), broadcast(ret_start)


# ----------------------------------------------------------------------------
# Critic-free baselines.
# ----------------------------------------------------------------------------


def group_advantages(
  rewards: Array, group_ids: Array, eps: float = 1e-6, std_normalize: bool = True
) -> Array:
  """GRPO's group-normalised advantage: A = (R - mean_G) / (std_G + eps).

  With `std_normalize=False` the advantage is R - mean_G, in reward units
  like SAO's value-baseline advantages (the "Dr. GRPO" form): an
  experiment that compares the two estimators at one actor lr can switch
  GRPO's rescaling off, so the step sizes differ only by the baseline.

  Args:
    rewards: float `[B]`, one scalar reward per sample.
    group_ids: int `[B]`, samples of the same prompt share an id.
    eps: added to the (population) standard deviation.
    std_normalize: divide by the group's standard deviation (GRPO as published).

  Returns:
    float `[B]`; broadcast it to the sample's action tokens.

  Raises:
    ValueError: when called with concrete inputs and some group has a single
      member (its advantage would be identically 0: GRPO needs G >= 2).
  """
  chex.assert_rank([rewards, group_ids], 1)
  chex.assert_equal_shape([rewards, group_ids])
  chex.assert_type(rewards, float)
  chex.assert_type(group_ids, int)
  if not isinstance(group_ids, jax.core.Tracer):
    ids, counts = np.unique(np.asarray(group_ids), return_counts=True)
    if np.any(counts < 2):
      raise ValueError(
        "group_advantages needs at least 2 samples per group; groups "
        f"{ids[counts < 2].tolist()} have one. Use samples_per_prompt >= 2 "
        "or a value / running-mean baseline."
      )
  same = (group_ids[:, None] == group_ids[None, :]).astype(rewards.dtype)  # [B, B]
  count = same.sum(1)
  mean = (same @ rewards) / count
  if not std_normalize:
    return rewards - mean
  var = (same * (rewards[None, :] - mean[:, None]) ** 2).sum(1) / count
  return (rewards - mean) / (jnp.sqrt(var) + eps)


class RunningMeanState(NamedTuple):
  buffer: Array  # [W] float, a ring buffer of the last W rewards
  count: Array  # [] int32, rewards seen, saturating at W
  index: Array  # [] int32, next slot to write


def running_mean_init(window: int, dtype=jnp.float32) -> RunningMeanState:
  """An empty running-mean baseline over the last `window` rewards."""
  if window < 1:
    raise ValueError(f"window must be >= 1, got {window}")
  return RunningMeanState(
    jnp.zeros((window,), dtype), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
  )


def running_mean_update(state: RunningMeanState, rewards: Array) -> tuple[RunningMeanState, Array]:
  """A = R - mean of the last W rewards seen before this batch.

  The baseline is 0 before any reward is seen. The batch's rewards are then
  pushed into the window (only its last W when B > W).

  Returns:
    (new_state, advantages `[B]`).
  """
  chex.assert_rank(rewards, 1)
  chex.assert_type(rewards, float)
  window = state.buffer.shape[0]
  baseline = jnp.where(state.count > 0, state.buffer.sum() / jnp.maximum(state.count, 1), 0.0)
  advantages = rewards - baseline
  recent = rewards[-window:]
  slots = (state.index + jnp.arange(recent.shape[0])) % window
  buffer = state.buffer.at[slots].set(recent.astype(state.buffer.dtype))
  new_state = RunningMeanState(
    buffer,
    jnp.minimum(state.count + recent.shape[0], window).astype(jnp.int32),
    ((state.index + recent.shape[0]) % window).astype(jnp.int32),
  )
  return new_state, advantages


# ----------------------------------------------------------------------------
# The estimators by name (`rl.advantage`): one record each.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Estimator:
  """An advantage estimator as the train step and the trainer use it.

  A critic estimator has `gae(rewards, values, action_mask, gamma, lam,
  segment_ids) -> (advantages, returns)`, run inside the jitted step on the
  critic's values; `critic_span` regresses the critic on every position the
  recursion reads (the span from a segment's first to last action token),
  not only on action tokens. A critic-free estimator has a host-side
  `baseline(state, rewards [B], group_ids [B], rl_config) -> (state,
  advantages [B])`, run by the trainer on each batch's total rewards; its
  state starts as `init_state(rl_config)` and is checkpointed as a list of
  arrays. `min_group` is the smallest `rollout.samples_per_prompt` it needs.

  Adding an estimator is one record in `ESTIMATORS` (and its kernel here).
  """

  name: str
  gae: Callable | None = None
  critic_span: bool = False
  baseline: Callable | None = None
  init_state: Callable | None = None
  min_group: int = 1

  def __post_init__(self):
    if (self.gae is None) == (self.baseline is None):
      raise ValueError(f"estimator {self.name!r}: exactly one of gae and baseline")

  @property
  def uses_critic(self) -> bool:
    return self.gae is not None


def _step_gae(step_value):
  def gae(rewards, values, action_mask, gamma, lam, segment_ids=None):
    return step_gae(rewards, values, action_mask, gamma, lam, step_value, segment_ids=segment_ids)

  return gae


def _group_baseline(state, rewards, group_ids, rl_config):
  adv = group_advantages(
    jnp.asarray(rewards), jnp.asarray(group_ids), std_normalize=rl_config.group_std_normalize
  )
  return state, np.asarray(adv)


def _running_mean_baseline(state, rewards, group_ids, rl_config):
  del group_ids, rl_config
  state, adv = running_mean_update(
    RunningMeanState(*(jnp.asarray(x) for x in state)), jnp.asarray(rewards)
  )
  return [np.asarray(x) for x in state], np.asarray(adv)


ESTIMATORS: dict[str, Estimator] = {
  e.name: e
  for e in (
    Estimator("value", gae=skip_observation_gae),
    Estimator("token_gae", gae=token_gae, critic_span=True),
    Estimator("step_gae_mean", gae=_step_gae("mean")),
    Estimator("step_gae_last", gae=_step_gae("last")),
    Estimator("group", baseline=_group_baseline, min_group=2),
    Estimator(
      "running_mean",
      baseline=_running_mean_baseline,
      init_state=lambda rl: [np.asarray(x) for x in running_mean_init(rl.running_mean_window)],
    ),
  )
}


def estimator(name: str) -> Estimator:
  """The estimator called `name`; ValueError listing the known ones."""
  if name not in ESTIMATORS:
    raise ValueError(f"advantage {name!r} is unknown; known: {sorted(ESTIMATORS)}")
  return ESTIMATORS[name]
