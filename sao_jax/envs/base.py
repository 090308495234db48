"""The environment protocol: what a task must implement to be rolled out.

An environment family (`Environment`) turns an integer index into a task
(deterministically: the prompt stream is a grain dataset of indices), gives
the prompt of a task, and opens an `Episode` for it. The rollout driver then
alternates: the policy writes one action (a turn, ended by the chat
format's turn-end token), `Episode.step` returns the observation to append,
a reward and whether the episode ended. The chat format
(`sao_jax.envs.chat`) renders the prompt once and each observation as its
bridge to the next turn; the transcript is never re-tokenized, so the
trained tokens are exactly the sampled ones.

A prompt is text, or chat messages (`[{"role": "system" | "user" |
"assistant", "content": str}]`) with the task's `tools` (OpenAI-style
function schemas) for a chat format. An observation is text, or messages
(`[{"role": "tool" | "user", "content": str}]`: tool results and user
turns). The action an episode receives is an `Action`: a `str` (the turn's
text, without the turn end) that also carries the tool calls parsed from
the sampled ids and the malformed ones.

Demonstrations (`Environment.demonstration`) are full transcripts for the
supervised warm start, as alternating (action, observation) pairs; an
action is text or an assistant message (with `tool_calls`), an observation
text or messages.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence


@dataclasses.dataclass(frozen=True)
class Task:
  index: int
  prompt: str | Sequence[dict]
  answer: Any = None
  meta: dict = dataclasses.field(default_factory=dict)
  # Function schemas the policy may call (rendered by the chat format).
  tools: tuple = ()


class Action(str):
  """One sampled turn: its text (a `str`), plus what the chat format parsed.

  `tool_calls` holds the well-formed calls of declared tools
  (`sao_jax.envs.chat.ToolCall`), `tool_errors` a `(reason, message)` for
  each malformed one (bad JSON, unknown tool, wrong arguments, cut off), so
  that an environment can answer it with an error; `parsed` is the whole
  `chat.ParsedTurn` (content and reasoning apart from the calls).
  `tool_sequence` holds both kinds in the order the turn wrote them (each
  a `ToolCall` or a `(reason, message)`), the order tool responses answer
  in; empty, it is the errors, then the calls.
  Environments that take plain text use it as the `str` it is.
  """

  def __new__(cls, text: str, *, parsed=None, tool_calls: tuple = (),
              tool_errors: tuple = (), tool_sequence: tuple = ()):
    self = super().__new__(cls, text)
    self.parsed, self.tool_calls, self.tool_errors = parsed, tool_calls, tool_errors
    self.tool_sequence = tool_sequence or tuple(tool_errors) + tuple(tool_calls)
    return self


@dataclasses.dataclass(frozen=True)
class StepResult:
  observation: str | Sequence[dict]
  reward: float
  done: bool
  info: dict = dataclasses.field(default_factory=dict)


class Episode(Protocol):

  def step(self, action: str) -> StepResult:
    """Consumes one action turn (an `Action`: text, without the turn-end token)."""


class Environment(Protocol):
  name: str
  max_turns: int

  def task(self, index: int) -> Task:
    """The task at `index` (deterministic)."""

  def episode(self, task: Task) -> Episode:
    """A fresh episode of `task`."""

  def demonstration(self, task: Task) -> Sequence[tuple[str | dict, str | Sequence[dict]]]:
    """A correct transcript: [(action, observation), ...] for the SFT start."""


class GraderError(Exception):
  """The grader itself failed (not the answer): raised by `Episode.step`.

  For failures that are nobody's answer's fault (a sandbox that could not
  start, a trusted program that died without a verdict) after the
  environment's own bounded retries. The rollout driver does not score the
  episode: it counts a `grader_error` and runs the episode again from its
  prompt (sao_jax/rollout/driver.py), so a right answer is never trained on
  as a wrong one.
  """
