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
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import Callable

from sao_jax.data.trajectory import Trajectory, checked


class TrajectoryQueue:

  def __init__(self, maxsize: int, vocab_size: int, max_length: int,
               current_version: Callable[[], int], max_staleness: int | None = None):
    self._q: queue.Queue = queue.Queue(maxsize)
    self._vocab, self._max_len = vocab_size, max_length
    self._version = current_version
    self.max_staleness = max_staleness
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
    trajectory.REJECT_REASONS, or "stale" or "validation_error").
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
    reason counted in `rejected`: `put`'s validation without enqueueing,
    for consumers that keep their own order (the fleet's ShardFeed)."""
    version = self._version()
    canon = None
    try:
      canon, reason = checked(traj, self._vocab, self._max_len, current_version=version)
    except Exception as e:  # pylint: disable=broad-except
      # A bug, or an object whose own methods raise: still a counted reject.
      reason = "validation_error"
      with self._lock:
        self.last_error = repr(e)
    if reason is None and self.max_staleness is not None:
      oldest = int(canon.policy_version[canon.action_mask].min())
      if version - oldest > self.max_staleness:
        reason = "stale"
    if reason is not None:
      with self._lock:
        self.rejected[reason] += 1
      return None
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
