"""python_tool: multi-step arithmetic word problems solved with a Python tool.

A task is a chain of operations read left to right (not by precedence):

    prompt:  "14 plus 5 times 3 minus 4\n"

The agent works one step per turn by writing Python that the sandbox runs,
and reads the printed result as the observation; it ends with an answer:

    action:      "py print(14+5)\n"     observation: ">19\n"
    action:      "py print(19*3)\n"     observation: ">57\n"
    action:      "py print(57-4)\n"     observation: ">53\n"
    action:      "ans 53\n"             -> done, reward 1 if 53 is right

Any Python is accepted (the sandbox decides what it does); an action that is
neither `py ...` nor `ans ...` gets an error observation. The number of
operations is long-tailed (1 + a geometric draw, capped), so trajectory
lengths are too. Episodes end at the answer or after `max_turns` actions
(reward 0).

The answer is checked in the trainer, never in the sandbox, and its form is
strict (`parse_answer`): `ans`, one space, then one integer in canonical
decimal (ASCII digits, an optional `-`, no leading zeros, no `+`, `_`, `-0`,
fractions or exponents, at most 100 digits) and nothing else. Python's
`int()` would also take `+53`, `053`, `5_3`, full-width or Arabic-Indic
digits and extra spaces: a policy would drift towards whichever spelling it
met first, and a lenient parser invites probing (a list of numbers, an
expression). One canonical spelling, and one guess per episode: any action
starting with `ans` ends it.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from sao_jax.envs.base import StepResult, Task
from sao_jax.envs.sandbox import SandboxLimits, run_python

_OPS = (("plus", "+"), ("minus", "-"), ("times", "*"))
# `[0-9]`, not `\d` (which matches any Unicode digit); `fullmatch`, not `$`
# (which also matches before a trailing newline).
_ANSWER = re.compile(r"ans (0|-?[1-9][0-9]{0,99})")


def parse_answer(action: str) -> int | None:
  """The integer of a well-formed `ans N` action (already stripped), else None."""
  m = _ANSWER.fullmatch(action)
  return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True)
class PythonToolConfig:
  seed: int = 0
  max_ops: int = 5
  # P(one more operation): the tail of the length distribution.
  continue_prob: float = 0.45
  max_start: int = 30
  max_operand: int = 9
  max_turns: int = 10
  use_sandbox: bool = True


class _Episode:
  def __init__(self, env: "PythonTool", task: Task):
    self._env, self._task, self._turns = env, task, 0

  def step(self, action: str) -> StepResult:
    self._turns += 1
    action = action.strip()
    if action.startswith("ans"):  # any answer ends the episode: one guess
      value = parse_answer(action)
      correct = value is not None and value == self._task.answer
      return StepResult("", float(correct), True, {"correct": correct})
    if action.startswith("py"):
      obs = self._env.run_code(action[2:].strip())
    else:
      obs = "error: use py or ans"
    info = {"correct": False}
    done = self._turns >= self._env.max_turns
    if done:
      info["finish_reason"] = "max_turns"
    return StepResult(">" + obs.strip()[:40] + "\n", 0.0, done, info)


class PythonTool:
  """The environment family; `task(i)` is deterministic in (seed, i)."""

  name = "python_tool"

  def __init__(
    self,
    config: PythonToolConfig = PythonToolConfig(),
    limits: SandboxLimits = SandboxLimits(cpu_seconds=1, wall_seconds=3.0),
  ):
    self.config = config
    self.limits = limits
    self.max_turns = config.max_turns

  def task(self, index: int) -> Task:
    c = self.config
    rng = np.random.default_rng([c.seed, index])
    n_ops = 1
    while n_ops < c.max_ops and rng.random() < c.continue_prob:
      n_ops += 1
    value = int(rng.integers(2, c.max_start + 1))
    words, steps = [str(value)], []
    for _ in range(n_ops):
      word, sym = _OPS[int(rng.integers(len(_OPS)))]
      x = int(rng.integers(2, c.max_operand + 1))
      steps.append((value, sym, x))
      value = eval(f"{value}{sym}{x}")  # noqa: S307
      words += [word, str(x)]
    return Task(index, " ".join(words) + "\n", value, {"steps": steps, "n_ops": n_ops})

  def episode(self, task: Task) -> _Episode:
    return _Episode(self, task)

  def demonstration(self, task: Task) -> list[tuple[str, str]]:
    turns = [
      (f"py print({a}{sym}{x})", f">{eval(f'{a}{sym}{x}')}\n")  # noqa: S307
      for a, sym, x in task.meta["steps"]
    ]
    return turns + [(f"ans {task.answer}", "")]

  def run_code(self, code: str) -> str:
    if not self.config.use_sandbox:
      raise RuntimeError("python_tool without the sandbox is for tests only")
    return run_python(code, self.limits).observation()
