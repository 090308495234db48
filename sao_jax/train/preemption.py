"""SIGTERM as a preemption notice: checkpoint at the next RL step, then stop.

Kubernetes (a JobSet pod, a GKE node drain, a spot VM's reclaim) sends
SIGTERM and waits `terminationGracePeriodSeconds` before SIGKILL. Without a
handler a single trainer process dies at once, and a `jax.distributed` one
has its SIGTERM caught by JAX's preemption notifier and trains on until the
SIGKILL: either way the job resumes from its last periodic checkpoint and the
steps since are lost. `Notice` turns the signal into a checkpoint at a step
boundary:

  * one process: a SIGTERM handler sets a flag, and `reached(step)` is true
    at the first step boundary after it;
  * several processes: JAX's own notifier (installed by
    `jax.distributed.initialize`) receives the signal, and
    `multihost_utils.reached_preemption_sync_point(step)` agrees on one step
    every process saves at (the step after the largest any has reached), so
    the collective save cannot deadlock on processes at different steps.

SFT, value pretraining and the RL loop ask at every step (`stop_if_noticed`);
on a notice the step's checkpoint is written (unless the step just wrote
its periodic one) and the run stops with `StopTraining` (exit status 1: a
preempted job did not finish, and its restart resumes from that
checkpoint; closing the run waits for the save).
"""

from __future__ import annotations

import signal
import threading
from typing import Callable

import jax
from jax.experimental import multihost_utils

from sao_jax.train.stopping import StopTraining


class Notice:
  """Whether a preemption notice has arrived; a context manager around a loop."""

  def __init__(self):
    self._flag = threading.Event()
    self._previous = None

  def __enter__(self) -> "Notice":
    # Python runs signal handlers in the main thread only; a loop elsewhere
    # (a test's thread) keeps the process's handler as it is.
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_term)
    return self

  def __exit__(self, *exc) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None

  def _on_term(self, signum, frame) -> None:
    self._flag.set()

  def reached(self, step: int) -> bool:
    """True at the step the run should checkpoint and stop at (every process
    must call this at every step, with increasing steps)."""
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self._flag.is_set()


def stop_if_noticed(
  notice: Notice, stage: str, step: int, run, checkpoint: Callable | None
) -> None:
  """At the end of `stage` step `step` (every process, every step): on a
  notice, `checkpoint()` writes the step's checkpoint (None: the step has
  just written its periodic one) and StopTraining is raised, naming the
  `run`'s checkpoint."""
  if not notice.reached(step):
    return
  if checkpoint is not None:
    checkpoint()
  raise StopTraining(
    f"preempted (SIGTERM) after {stage} step {step}: checkpoint {run.meta['ckpt_step']} "
    "written; start the run again to resume"
  )
