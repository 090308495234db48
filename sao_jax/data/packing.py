"""Packing trajectories into fixed `[R, L]` rows, with a few length buckets.

A packed row holds one or more trajectories back to back, then padding:

    index     0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
    token     P  P  a  a  a  o  o  a  a  P  P  P  a  a  .  .
    segment   1  1  1  1  1  1  1  1  1  2  2  2  2  2  0  0
    position  0  1  2  3  4  5  6  7  8  0  1  2  3  4  0  0
    action    .  .  x  x  x  .  .  x  x  .  .  .  x  x  .  .
    (P prompt, a action, o observation / tool output, . padding)

`segment_ids` tell sequences apart (0 is padding) for attention and for the
advantage recursions; `positions` restart per sequence. The row count R is
fixed by the config and L is the smallest bucket that fits the batch, so the
train step compiles once per bucket. Everything the losses need is a per-
token field of the same shape.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from sao_jax.data.trajectory import Trajectory

FIELDS = (
  "tokens",
  "positions",
  "segment_ids",
  "action_mask",
  "rollout_logprobs",
  "rewards",
  "policy_version",
  "baseline_advantages",
)


def _first_fit(lengths: Sequence[int], rows: int, width: int) -> list[list[int]] | None:
  """Trajectory indices per row (longest first, first row with room), or None."""
  free = [width] * rows
  layout = [[] for _ in range(rows)]
  for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
    for r in range(rows):
      if lengths[i] <= free[r]:
        free[r] -= lengths[i]
        layout[r].append(i)
        break
    else:
      return None
  return layout


def action_width(counts: Sequence[int], width: int) -> int:
  """A, the `action_index` width for rows of `width` with these action counts.

  The smallest multiple of width/8 that holds the row with the most action
  tokens, so the train step compiles at most eight head widths per length
  bucket (in practice one or two: a task's share of action tokens is
  steady).
  """
  step = max(width // 8, 1)
  most = max(max(counts, default=0), 1)
  return min(-(-most // step) * step, width)


def pack(
  trajs: Sequence[Trajectory],
  rows: int,
  buckets: Sequence[int],
  baseline_advantages: Sequence[float] | None = None,
  row_ids: Sequence[int] | None = None,
  action_index: bool = False,
  routing: tuple[int, int] | None = None,
) -> dict[str, np.ndarray]:
  """Packs `trajs` into `[rows, L]` arrays, L the smallest bucket that fits.

  Args:
    trajs: the trajectories (each at most `max(buckets)` tokens).
    rows: R, fixed.
    buckets: increasing row lengths.
    baseline_advantages: optional per-trajectory scalar advantage (GRPO,
      running mean), broadcast to the trajectory's action tokens.
    row_ids: optional; build only these rows, in this order (a host's share
      of a multi-host batch, sao_jax/train/distributed.py). The layout and L are
      still those of the whole batch, so every host agrees on them.
    action_index: also return `action_index` `[R, A]` int32: each row's
      action-token positions in order, then -1. The policy computes its
      vocabulary-wide head only there (`policy.token_logprobs`): with a
      large vocabulary the head is most of a small model's step, and most
      tokens of an agentic row are prompt and tool output. A
      (`action_width`) is decided by the whole batch, like L.
    routing: (M, k): also return `routing` `[R, L, M, k]` int16, each token's
      recorded MoE expert choices (routing replay; every trajectory must
      carry them, `trajectory.checked(..., routing_shape=)`), -1 at padding
      and at tokens the engine never fed.

  Returns:
    A dict of numpy arrays `[R, L]` (see FIELDS), `[len(row_ids), L]` with
    `row_ids`; and `action_index` `[R, A]` if asked.

  Raises:
    ValueError: if the trajectories do not fit in R rows of the largest bucket.
  """
  lengths = [len(t) for t in trajs]
  for width in sorted(buckets):
    layout = _first_fit(lengths, rows, width)
    if layout is not None:
      break
  else:
    raise ValueError(
      f"{len(trajs)} trajectories ({sum(lengths)} tokens, longest "
      f"{max(lengths, default=0)}) do not fit {rows} rows of {max(buckets)}."
    )
  if action_index:
    counts = [sum(int(np.sum(trajs[i].action_mask)) for i in members) for members in layout]
    actions = action_width(counts, width)
  if routing is not None and any(
    t.routing is None or t.routing.shape[1:] != tuple(routing) for t in trajs
  ):
    raise ValueError(
      f"routing replay: every trajectory needs a routing record [T, {routing[0]}, {routing[1]}]"
    )
  if row_ids is not None:
    layout = [layout[r] for r in row_ids]
  out = _fill(trajs, layout, width, baseline_advantages, routing)
  built = len(layout)
  if action_index:
    out["action_index"] = np.full((built, actions), -1, np.int32)
    for r in range(built):
      where = np.flatnonzero(out["action_mask"][r])
      out["action_index"][r, : len(where)] = where
  return out


def _fill(trajs, layout, width: int, baseline_advantages, routing) -> dict[str, np.ndarray]:
  """The `[len(layout), width]` arrays of FIELDS: row r holds `layout[r]`'s
  trajectories back to back, segment ids from 1, zeros (version -1) after."""
  built = len(layout)
  out = {
    "tokens": np.zeros((built, width), np.int32),
    "positions": np.zeros((built, width), np.int32),
    "segment_ids": np.zeros((built, width), np.int32),
    "action_mask": np.zeros((built, width), bool),
    "rollout_logprobs": np.zeros((built, width), np.float32),
    "rewards": np.zeros((built, width), np.float32),
    "policy_version": np.full((built, width), -1, np.int32),
    "baseline_advantages": np.zeros((built, width), np.float32),
  }
  if routing is not None:
    out["routing"] = np.full((built, width) + tuple(routing), -1, np.int16)
  for r, members in enumerate(layout):
    start = 0
    for seg, i in enumerate(members, start=1):
      t, n = trajs[i], len(trajs[i])
      span = slice(start, start + n)
      out["tokens"][r, span] = t.tokens
      out["positions"][r, span] = np.arange(n)
      out["segment_ids"][r, span] = seg
      out["action_mask"][r, span] = t.action_mask
      out["rollout_logprobs"][r, span] = t.rollout_logprobs
      out["rewards"][r, span] = t.rewards
      out["policy_version"][r, span] = t.policy_version
      if routing is not None:
        out["routing"][r, span] = t.routing
      if baseline_advantages is not None:
        out["baseline_advantages"][r, span] = np.where(t.action_mask, baseline_advantages[i], 0.0)
      start += n
  return out
