"""The environment and task protocols: what the library reads of a user's environment.

An environment family (`EnvironmentProtocol`) turns an integer index into a task
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

Both protocols are duck-typed (`typing.Protocol`): an environment needs only
`task`, `episode` and `demonstration`, a task only `index` and `prompt`.
Everything else is optional with a default (`ENV_OPTIONAL`, `TASK_OPTIONAL`),
read through one helper each (`task_tools`, `runs_code`, ...); make_env
checks the required ones, on the environment and on its first task, before
any stage runs.
"""

from __future__ import annotations

import dataclasses
import numbers
import types
from typing import Any, Protocol, Sequence


@dataclasses.dataclass(frozen=True)
class Task:
  """The built-in environments' task: one `TaskProtocol` (any other object that has
  its required attributes is one too)."""

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

  def __new__(
    cls,
    text: str,
    *,
    parsed=None,
    tool_calls: tuple = (),
    tool_errors: tuple = (),
    tool_sequence: tuple = (),
  ):
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


# --- the protocols ---------------------------------------------------------------------
#
# What the library reads of an environment and of the tasks it hands out. A required
# member is read unconditionally: a missing one is refused when the environment is built
# (`environment_problem`, `task_problem`; sao_jax/envs/registry.py make_env), not when a
# stage first meets it. An optional member is read only through its helper below, which
# holds its default, so a user's plain object needs none of them.

PROTOCOLS = "sao_jax/envs/base.py"

# The task protocol's required attributes: name -> what it is.
TASK_REQUIRED = {
  "index": "the int it was made from, the trajectory's prompt_id",
  "prompt": "the prompt text or chat messages",
}
# Its optional attributes: name -> (default, what it is). None reads as the default too.
TASK_OPTIONAL = {
  "answer": (None, "the reference answer, for the environment's grader and env.reward"),
  "meta": (types.MappingProxyType({}), "a dict of what else the environment reads"),
  "tools": ((), "the OpenAI-style function schemas the policy may call; (): none"),
}
# The environment protocol's required methods: name -> what it is.
ENV_REQUIRED = {
  "task": "task(index) -> the task at index, deterministic and cheap",
  "episode": "episode(task) -> a fresh Episode of the task",
  "demonstration": "demonstration(task) -> [(action, observation), ...] for the SFT start",
}
# Its optional attributes: name -> (default, what it is).
ENV_OPTIONAL = {
  "name": ("the class's name", "a short name for logs"),
  "max_turns": (None, "the most action turns of an episode; the episodes end themselves"),
  "runs_code": (True, "whether episodes run model-written code: the sandbox check runs first"),
  "num_eval_tasks": (None, "the size of a finite held-out set, which caps eval.num_tasks"),
  "demonstration_task": (
    "task",
    "demonstration_task(index) -> a training task that has a demonstration, for SFT's draw index",
  ),
  "frozen": (
    "the environment itself",
    "frozen() -> the view evaluation and value pretraining use (one that does not drift)",
  ),
}


class TaskProtocol(Protocol):
  """What a task is: any object with an int `index` and a `prompt`.

  `Task` is one; so is a user's plain dataclass of (index, prompt, answer).
  The optional attributes (`TASK_OPTIONAL`): absent (or None), a task has
  answer None (only the environment's own code and env.reward read it),
  meta {} (read through `task_meta`) and tools () (no tools; read through
  `task_tools`).
  """

  index: int
  prompt: str | Sequence[dict]


class EnvironmentProtocol(Protocol):
  """What an environment is: `task`, `episode` and `demonstration` (`ENV_REQUIRED`).

  The optional attributes (`ENV_OPTIONAL`) are read only through `env_name`,
  `runs_code`, `num_eval_tasks`, `demonstration_task` and `frozen_view`:
  absent, an environment is named by its class, runs code (True), has no
  finite held-out set (None), demonstrates every task (`task`) and is its
  own frozen view. `max_turns` is informative (no library code reads it).
  Two hooks have no default, only a meaning when present: `tool_budget`
  (make_env sets the config's per-turn tool bounds on it) and `train_rows`
  with `heldout_rows` (what model.vocab_subset = 'env' reads).
  """

  def task(self, index: int) -> TaskProtocol:
    """The task at `index` (deterministic; cheap: it runs on the driver thread)."""

  def episode(self, task: TaskProtocol) -> Episode:
    """A fresh episode of `task`."""

  def demonstration(self, task: TaskProtocol) -> Sequence[tuple[str | dict, str | Sequence[dict]]]:
    """A correct transcript: [(action, observation), ...] for the SFT start."""


Environment = EnvironmentProtocol  # the name the rest of the library annotates with


def _optional(obj, table: dict, name: str):
  value = getattr(obj, name, None)
  return table[name][0] if value is None else value


def task_meta(task: TaskProtocol):
  """`task.meta`, or an empty read-only mapping."""
  return _optional(task, TASK_OPTIONAL, "meta")


def task_tools(task: TaskProtocol) -> Sequence[dict]:
  """`task.tools` (function schemas, as the task holds them), or () for a task that offers none."""
  return _optional(task, TASK_OPTIONAL, "tools")


def env_name(env) -> str:
  """`env.name`, or its class's name."""
  return getattr(env, "name", None) or type(env).__name__


def runs_code(env) -> bool:
  """`env.runs_code`, or True (the sandbox isolation check runs)."""
  return bool(_optional(env, ENV_OPTIONAL, "runs_code"))


def num_eval_tasks(env) -> int | None:
  """`env.num_eval_tasks`, or None (no finite held-out set)."""
  return _optional(env, ENV_OPTIONAL, "num_eval_tasks")


def demonstration_task(env, index: int) -> TaskProtocol:
  """SFT's training task for draw `index`: `env.demonstration_task`, or `env.task`."""
  pick = getattr(env, "demonstration_task", None)
  return (pick or env.task)(index)


def frozen_view(env):
  """`env.frozen()`, or `env` itself."""
  frozen = getattr(env, "frozen", None)
  return frozen() if frozen is not None else env


def class_path(obj) -> str:
  """`module:QualName` of `obj`'s class, as a user would find it."""
  cls = type(obj)
  return f"{cls.__module__}:{cls.__qualname__}"


def environment_problem(env) -> str | None:
  """What `env` lacks of `EnvironmentProtocol`, as a clause after "it", or None."""
  for name, what in ENV_REQUIRED.items():
    if not callable(getattr(env, name, None)):
      return f"has no method {name!r} ({what}; {PROTOCOLS} EnvironmentProtocol)"
  return None


def task_problem(task) -> str | None:
  """What `task` lacks of `TaskProtocol`, as a clause after "it has", or None."""
  for name, what in TASK_REQUIRED.items():
    if not hasattr(task, name):
      return f"no attribute {name!r} ({what}; {PROTOCOLS} TaskProtocol)"
  if isinstance(task.index, bool) or not isinstance(task.index, numbers.Integral):
    return (
      f"an index of type {type(task.index).__name__} "
      f"({TASK_REQUIRED['index']}; {PROTOCOLS} TaskProtocol)"
    )
  if not isinstance(task.prompt, (str, list, tuple)):
    return (
      f"a prompt of type {type(task.prompt).__name__} "
      f"({TASK_REQUIRED['prompt']}; {PROTOCOLS} TaskProtocol)"
    )
  return None


class GraderError(Exception):
  """The grader itself failed (not the answer): raised by `Episode.step`.

  For failures that are nobody's answer's fault (a sandbox that could not
  start, a trusted program that died without a verdict) after the
  environment's own bounded retries. The rollout driver does not score the
  episode: it counts a `grader_error` and runs the episode again from its
  prompt (sao_jax/rollout/driver.py), so a right answer is never trained on
  as a wrong one.
  """
