"""Fault injection: the failures a long run meets, on purpose and on schedule.

The fault suite (tests/faults/), the kill-and-resume test
(tests/train/test_trainer.py) and the soak run (benchmarks/soak.py) drive the real
trainer with the config's `faults` section turned on; everywhere else every
field is 0 and nothing here is in the path. Each `*_every` rate is "every
n-th event", counted across threads, so a run's faults are reproducible in
number if not in timing; the other two fields name an RL step:

    env_error_every      an environment step raises
    env_garbage_every    an environment step returns a non-StepResult
    malformed_every      a finished trajectory is corrupted before the
                         ingestion queue (cycling through the kinds in
                         CORRUPTIONS: each must be rejected with its reason)
    nonfinite_every      an RL batch gets a NaN reward after validation: the
                         update must be skipped
    nonfinite_from_step  every batch from this RL step on is NaN: the run
                         must stop cleanly
    rollout_crash_every  the rollout thread dies (raises) instead of
                         emitting a trajectory: the trainer must restart it
                         or stop with the error
    sigkill_after_rl_step
                         the trainer process SIGKILLs itself once RL step n
                         is done (its metrics written and, at a checkpoint
                         step, its asynchronous save started, not waited
                         for): a kill at a known step, whatever the
                         machine's speed, for the resume test
    sigterm_after_rl_step
                         the trainer sends itself SIGTERM once RL step n is
                         done: a preemption notice at a known step
    sigterm_after_sft_step
                         the same after SFT step n
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import threading
from typing import Callable

import numpy as np

from sao_jax.config import sections
from sao_jax.data.trajectory import Trajectory


class InjectedFault(RuntimeError):
  """Raised where a fault was injected (never caught by the fault's target)."""


def _out_of_vocab(t: Trajectory, vocab_size: int):
  t.tokens = t.tokens.copy()
  t.tokens[0] = vocab_size + 5


def _overflow_after_cast(t: Trajectory, vocab_size: int):
  del vocab_size
  t.rewards = t.rewards.astype(np.float64)
  t.rewards[np.flatnonzero(t.action_mask)[-1]] = 1e300  # finite in float64, inf in float32


def _nan_logprob(t: Trajectory, vocab_size: int):
  del vocab_size
  t.rollout_logprobs = t.rollout_logprobs.copy()
  t.rollout_logprobs[np.flatnonzero(t.action_mask)[0]] = np.nan


def _length_mismatch(t: Trajectory, vocab_size: int):
  del vocab_size
  t.action_mask = t.action_mask[:-1]


def _bad_turn_starts(t: Trajectory, vocab_size: int):
  del vocab_size
  t.turn_starts = np.asarray([len(t) + 3], np.int32)


def _positive_logprob(t: Trajectory, vocab_size: int):
  del vocab_size
  t.rollout_logprobs = t.rollout_logprobs.copy()
  t.rollout_logprobs[np.flatnonzero(t.action_mask)[0]] = 0.5


CORRUPTIONS: tuple[Callable[[Trajectory, int], None], ...] = (
  _out_of_vocab,
  _overflow_after_cast,
  _nan_logprob,
  _length_mismatch,
  _bad_turn_starts,
  _positive_logprob,
)


class _Counter:
  """A thread-safe event counter: `hit()` is True on every n-th call."""

  def __init__(self, every: int):
    self.every, self._count, self._lock = every, itertools.count(1), threading.Lock()
    self.injected = 0

  def hit(self) -> bool:
    if not self.every:
      return False
    with self._lock:
      fire = next(self._count) % self.every == 0
      self.injected += fire
    return fire


class _FaultyEpisode:
  def __init__(self, episode, injector: "FaultInjector"):
    self._episode, self._injector = episode, injector

  def step(self, action: str):
    if self._injector.env_error.hit():
      raise InjectedFault("injected environment error")
    if self._injector.env_garbage.hit():
      return {"observation": None, "reward": float("nan")}
    return self._episode.step(action)


class _FaultyEnv:
  """The wrapped environment; everything but `episode` passes through."""

  def __init__(self, env, injector: "FaultInjector"):
    self._env, self._injector = env, injector

  def __getattr__(self, name):
    return getattr(self._env, name)

  def episode(self, task):
    return _FaultyEpisode(self._env.episode(task), self._injector)


class FaultInjector:
  """The config's `faults` section (sections.Faults, every field 0: a no-op)
  put to work: the schedules are the section's fields, read from it (this
  class declares none of its own); the counters are what it injected."""

  def __init__(self, spec: sections.Faults | None = None):
    self.spec = spec or sections.Faults()
    self.env_error = _Counter(self.spec.env_error_every)
    self.env_garbage = _Counter(self.spec.env_garbage_every)
    self.malformed = _Counter(self.spec.malformed_every)
    self.nonfinite = _Counter(self.spec.nonfinite_every)
    self.crash = _Counter(self.spec.rollout_crash_every)
    self._kinds = itertools.cycle(CORRUPTIONS)
    self.nonfinite_batches = 0
    self.malformed_accepted = 0

  @property
  def active(self) -> bool:
    return any(dataclasses.astuple(self.spec))

  def wrap_env(self, env):
    if not (self.spec.env_error_every or self.spec.env_garbage_every):
      return env
    return _FaultyEnv(env, self)

  def wrap_emit(self, emit: Callable[[Trajectory], object], vocab_size: int):
    """`emit` as the rollout driver calls it, corrupting / crashing on schedule."""
    if not (self.spec.malformed_every or self.spec.rollout_crash_every):
      return emit

    def faulty_emit(t: Trajectory):
      if self.crash.hit():
        raise InjectedFault("injected rollout thread crash")
      if not self.malformed.hit():
        return emit(t)
      t = dataclasses.replace(t)
      next(self._kinds)(t, vocab_size)
      accepted = emit(t)
      self.malformed_accepted += bool(accepted)  # a corrupted record got in: a bug
      return accepted

    return faulty_emit

  def poison_batch(self, step: int, batch: dict) -> dict:
    """A NaN reward on an action token of a packed batch, on schedule."""
    late = self.spec.nonfinite_from_step and step >= self.spec.nonfinite_from_step
    if not (late or self.nonfinite.hit()):
      return batch
    batch = dict(batch, rewards=np.array(batch["rewards"], copy=True))
    rows, cols = np.nonzero(batch["action_mask"])
    batch["rewards"][rows[-1], cols[-1]] = np.nan
    self.nonfinite_batches += 1
    return batch

  def after_rl_step(self, step: int) -> None:
    """Ends the process with SIGKILL (nothing flushed, nothing cleaned up), or
    sends it SIGTERM (a preemption notice), once RL step `step` is done, on
    schedule."""
    if self.spec.sigkill_after_rl_step and step == self.spec.sigkill_after_rl_step:
      print(f"[faults] SIGKILL after RL step {step}", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    if self.spec.sigterm_after_rl_step and step == self.spec.sigterm_after_rl_step:
      _sigterm(f"RL step {step}")

  def after_sft_step(self, step: int) -> None:
    """Sends the process SIGTERM once SFT step `step` is done, on schedule."""
    if self.spec.sigterm_after_sft_step and step == self.spec.sigterm_after_sft_step:
      _sigterm(f"SFT step {step}")

  def counts(self) -> dict[str, int]:
    return {
      "env_error": self.env_error.injected,
      "env_garbage": self.env_garbage.injected,
      "malformed": self.malformed.injected,
      "rollout_crash": self.crash.injected,
      "nonfinite_batch": self.nonfinite_batches,
      "malformed_accepted": self.malformed_accepted,
    }


def _sigterm(after: str) -> None:
  print(f"[faults] SIGTERM after {after}", flush=True)
  os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice (train/preemption.py)
