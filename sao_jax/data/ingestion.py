"""The ingestion queue between the rollout thread and the trainer.

Where the async loop's two threads meet: the driver's rollout thread puts,
the trainer's main thread takes. It is not the only threaded code: the
driver's environment workers, the engine's decode lanes and a fleet
rollout's shard writer run threads too (docs/DESIGN.md section 3 lists
them). A bounded `queue.Queue` gives backpressure: when the trainer falls
behind, `put` blocks the rollout thread. Every record is validated on the way in; a bad
one is dropped with a counted reason, never trained on and never a crash.
What is enqueued is the canonical copy that was validated (see
`trajectory.checked`), not the producer's object: the trainer gets exactly
the dtypes it was checked in, and a producer that reuses or mutates its
arrays after `put` cannot change a record already accepted.
An optional `max_staleness` drops trajectories whose oldest token lags the
current policy version by more than that many versions (off for SAO).
An optional `identity` (identity.Published: a fleet trainer's) drops those
another run or other params produced (identity.REJECT_REASONS).
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import Callable

from sao_jax.data.identity import Published
from sao_jax.data.trajectory import Trajectory, checked


def check(
  traj: Trajectory,
  vocab_size: int,
  max_length: int,
  current_version: int,
  max_staleness: int | None = None,
  routing_shape: tuple[int, int, int] | None = None,
  identity: Published | None = None,
) -> tuple[Trajectory | None, str | None, str | None]:
  """Ingestion's validation, the one place for it (the queue's `put` and the
  fleet's ShardFeed): (canonical copy, None, None) if `traj` is accepted,
  else (None, reason, error). `reason` is one of trajectory.REJECT_REASONS,
  "stale" (its oldest token lags `current_version` by more than
  `max_staleness` versions) or "validation_error" (validation raised: a
  bug, or an object whose own methods raise), and `error` is that
  exception's repr, else None. Never raises. `routing_shape` (M, k, E):
  the trainer replays MoE routing, so a record must carry it
  (`trajectory.checked`). `identity`: the trainer's run and published
  fingerprints, which the record's must match (identity.REJECT_REASONS).
  """
  try:
    canon, reason = checked(
      traj, vocab_size, max_length, current_version=current_version, routing_shape=routing_shape
    )
  except Exception as e:  # noqa: BLE001
    return None, "validation_error", repr(e)
  if reason is not None:
    return None, reason, None
  if max_staleness is not None:
    oldest = int(canon.policy_version[canon.action_mask].min())
    if current_version - oldest > max_staleness:
      return None, "stale", None
  if identity is not None:
    reason = identity.check(canon)
    if reason is not None:
      return None, reason, None
  return canon, None, None


class TrajectoryQueue:
  def __init__(
    self,
    maxsize: int,
    vocab_size: int,
    max_length: int,
    current_version: Callable[[], int],
    max_staleness: int | None = None,
    routing_shape: tuple[int, int, int] | None = None,
    identity: Published | None = None,
  ):
    self._q: queue.Queue = queue.Queue(maxsize)
    self._vocab, self._max_len = vocab_size, max_length
    self._version = current_version
    self.max_staleness = max_staleness
    self.routing_shape = routing_shape
    self.identity = identity
    self.rejected: collections.Counter = collections.Counter()
    self.accepted = 0
    # repr of the last exception validation raised (counted as
    # "validation_error"): a label must stay a fixed metric name, the
    # detail goes here for debugging.
    self.last_error: str | None = None
    self._lock = threading.Lock()

  def put(self, traj: Trajectory, block: bool = True) -> bool:
    """Validates and enqueues the canonical copy (blocking when full).

    False if rejected; the reason is counted in `rejected` (one of
    trajectory.REJECT_REASONS, identity.REJECT_REASONS, or "stale" or
    "validation_error").
    """
    canon = self.check(traj)
    if canon is None:
      return False
    self._q.put(canon, block=block)
    with self._lock:
      self.accepted += 1
    return True

  def check(self, traj: Trajectory) -> Trajectory | None:
    """The canonical copy of `traj` if it is accepted, else None with the
    reason counted in `rejected`: `put`'s validation (module-level `check`)
    without enqueueing."""
    canon, reason, error = check(
      traj,
      self._vocab,
      self._max_len,
      self._version(),
      self.max_staleness,
      self.routing_shape,
      self.identity,
    )
    if reason is not None:
      with self._lock:
        self.rejected[reason] += 1
        if error is not None:
          self.last_error = error
    return canon

  def get(self, timeout: float | None = None) -> Trajectory:
    """Blocks for the next trajectory; raises queue.Empty after `timeout`."""
    return self._q.get(timeout=timeout)

  def qsize(self) -> int:
    return self._q.qsize()

  def drain(self) -> list[Trajectory]:
    out = []
    while True:
      try:
        out.append(self._q.get_nowait())
      except queue.Empty:
        return out
