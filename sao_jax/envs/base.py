"""The environment protocol: what a task must implement to be rolled out.

An environment family (`Environment`) turns an integer index into a task
(deterministically: the prompt stream is a grain dataset of indices), gives
the prompt text of a task, and opens an `Episode` for it. The rollout driver
then alternates: the policy writes one action (a turn, ended by the turn-end
token), `Episode.step` returns the observation text to append, a reward and
whether the episode ended. Observations are tokenized once and appended to
the slot's token prefix; the transcript is never re-tokenized.

Demonstrations (`Environment.demonstration`) are full transcripts for the
supervised warm start, as alternating (action, observation) pairs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence


@dataclasses.dataclass(frozen=True)
class Task:
  index: int
  prompt: str
  answer: Any = None
  meta: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepResult:
  observation: str
  reward: float
  done: bool
  info: dict = dataclasses.field(default_factory=dict)


class Episode(Protocol):

  def step(self, action: str) -> StepResult:
    """Consumes one action turn (text, without the turn-end token)."""


class Environment(Protocol):
  name: str
  max_turns: int

  def task(self, index: int) -> Task:
    """The task at `index` (deterministic)."""

  def episode(self, task: Task) -> Episode:
    """A fresh episode of `task`."""

  def demonstration(self, task: Task) -> Sequence[tuple[str, str]]:
    """A correct transcript: [(action, observation), ...] for the SFT start."""
