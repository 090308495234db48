"""code_fix: a small coding agent task: fix a one-line bug so the tests pass.

The prompt shows a numbered function with a bug (a wrong operator or
constant). Actions, one per turn:

    run               runs the unit tests in the sandbox; observation: the log
    show              observation: the current code
    edit N <line>     replaces line N (indentation kept); observation: ok
    submit            ends the episode: reward 1 if the tests pass

    prompt:  "fix f\n0 def f(x):\n1  return x+3\n"
    action:  "run"               observation: ">fail f(1)=4 want 5\n"
    action:  "edit 1 return x+4" observation: ">ok\n"
    action:  "run"               observation: ">pass 3/3\n"
    action:  "submit"            -> reward 1

The tests run in the sandbox every time (the agent's code is untrusted).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sao_jax.envs.base import StepResult, Task
from sao_jax.envs.sandbox import SandboxLimits, run_python

_OPS = ("+", "-", "*")
_TEST_INPUTS = (1, 2, 5)


@dataclasses.dataclass(frozen=True)
class CodeFixConfig:
  seed: int = 0
  max_const: int = 9
  max_turns: int = 8


def _render(lines: list[str]) -> str:
  return "".join(f"{i} {line}\n" for i, line in enumerate(lines))


def _test_program(lines: list[str], cases) -> str:
  checks = ", ".join(f"({x}, {want})" for x, want in cases)
  return ("\n".join(lines) + "\n"
          f"cases = [{checks}]\n"
          "bad = [(x, f(x), w) for x, w in cases if f(x) != w]\n"
          "print('fail f(%d)=%s want %d' % bad[0] if bad else 'pass %d/%d' % "
          "(len(cases), len(cases)))\n")


class _Episode:

  def __init__(self, env: "CodeFix", task: Task):
    self._env, self._task = env, task
    self._lines = list(task.meta["buggy"])
    self._turns = 0

  def _run_tests(self) -> str:
    return run_python(_test_program(self._lines, self._task.meta["cases"]),
                      self._env.limits).observation().strip()

  def step(self, action: str) -> StepResult:
    self._turns += 1
    action = action.strip()
    if action == "submit":
      passed = self._run_tests().startswith("pass")
      return StepResult("", float(passed), True, {"correct": passed})
    if action == "run":
      obs = self._run_tests()
    elif action == "show":
      obs = _render(self._lines).replace("\n", ";")
    elif action.startswith("edit "):
      parts = action.split(" ", 2)
      if len(parts) == 3 and parts[1].isdigit() and int(parts[1]) < len(self._lines):
        i = int(parts[1])
        indent = self._lines[i][:len(self._lines[i]) - len(self._lines[i].lstrip())]
        self._lines[i] = indent + parts[2].strip()
        obs = "ok"
      else:
        obs = "error: edit N text"
    else:
      obs = "error: run, show, edit or submit"
    info = {"correct": False}
    done = self._turns >= self._env.max_turns
    if done:
      info["finish_reason"] = "max_turns"
    return StepResult(">" + obs[:60] + "\n", 0.0, done, info)


class CodeFix:
  name = "code_fix"

  def __init__(self, config: CodeFixConfig = CodeFixConfig(),
               limits: SandboxLimits = SandboxLimits(cpu_seconds=1, wall_seconds=3.0)):
    self.config, self.limits, self.max_turns = config, limits, config.max_turns

  def task(self, index: int) -> Task:
    rng = np.random.default_rng([self.config.seed, index])
    op = _OPS[int(rng.integers(len(_OPS)))]
    const = int(rng.integers(2, self.config.max_const + 1))
    if rng.random() < 0.5:  # wrong operator
      bug_op, bug_const = _OPS[(_OPS.index(op) + 1 + int(rng.integers(2))) % 3], const
    else:  # wrong constant
      bug_op, bug_const = op, const + int(rng.choice([-1, 1]))
    fixed = ["def f(x):", f" return x{op}{const}"]
    buggy = ["def f(x):", f" return x{bug_op}{bug_const}"]
    cases = [(x, eval(f"{x}{op}{const}")) for x in _TEST_INPUTS]  # pylint: disable=eval-used
    return Task(index, "fix f\n" + _render(buggy), None,
                {"buggy": buggy, "fixed": fixed, "cases": cases})

  def episode(self, task: Task) -> _Episode:
    return _Episode(self, task)

  def demonstration(self, task: Task) -> list[tuple[str, str]]:
    buggy, fixed, cases = task.meta["buggy"], task.meta["fixed"], task.meta["cases"]
    fail = next((x, eval(f"{x}{buggy[1].split('x', 1)[1]}"), w)  # pylint: disable=eval-used
                for x, w in cases if eval(f"{x}{buggy[1].split('x', 1)[1]}") != w)
    return [("run", ">fail f(%d)=%s want %d\n" % fail),
            (f"edit 1 {fixed[1].strip()}", ">ok\n"),
            ("run", f">pass {len(cases)}/{len(cases)}\n"),
            ("submit", "")]
