"""code_fix: a small coding agent task: fix a one-line bug so the tests pass.

The prompt shows a numbered function with a bug (a wrong operator or
constant). Actions, one per turn:

    run               runs the unit tests in the sandbox; observation: the log
    show              observation: the current code
    edit N <line>     replaces line N (indentation kept); observation: ok
    submit            ends the episode: reward 1 if the tests pass, the
                      shown ones and fresh held-out ones

    prompt:  "fix f\n0 def f(x):\n1  return x+3\n"
    action:  "run"               observation: ">fail f(1)=4 want 5\n"
    action:  "edit 1 return x+4" observation: ">ok\n"
    action:  "run"               observation: ">pass 3/3\n"
    action:  "submit"            -> reward 1

The tests run in the sandbox every time (the agent's code is untrusted).
Verification is out of the agent's reach: the sandboxed harness only calls
`f` on the test inputs and prints the results as one JSON line; the wanted
values never enter the sandbox; the trainer parses that line strictly
(`_parse_record`) and compares exact ints itself; and `submit` also tests
`hidden_cases` inputs drawn afresh for every submission, whose wanted
values are computed only after the sandbox has exited. `run` checks the
shown inputs only: `>fail f(1)=4 want 5`, `>pass 3/3`; a run whose output
is no record shows `>error: output ...` or `>error: no test result`, a
crash its error line.

Why a forged record gains nothing: docs/design/graders.md.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import random
from typing import TYPE_CHECKING

import numpy as np

from sao_jax.envs.base import StepResult, Task
from sao_jax.envs.sandbox import SandboxLimits, run_python

if TYPE_CHECKING:
  from sao_jax.envs.sandbox import SandboxResult

_OPS = ("+", "-", "*")
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_TEST_INPUTS = (1, 2, 5)
# Held-out inputs are drawn from here; two distinct points already rule out
# every other `x op c` (two different lines meet at most once).
_HIDDEN_RANGE = (-1000, 1000)
# How much of a non-int result the log shows, and the most a record may be:
# the record of an honest run is far shorter, anything longer is not one.
_SHOWN_CHARS = 24
_MAX_RECORD_CHARS = 4096
# Drawn by the OS: the agent's code cannot predict it from any seed.
_SYSTEM_RANDOM = random.SystemRandom()


@dataclasses.dataclass(frozen=True)
class CodeFixConfig:
  seed: int = 0
  max_const: int = 9
  max_turns: int = 8
  # Inputs `submit` tests beyond the shown ones, new for every submission.
  # At least 2: with none, a record forged from the shown tests' wanted
  # values (which `run` reveals) would earn the reward.
  hidden_cases: int = 4

  def __post_init__(self):
    if self.hidden_cases < 2:
      raise ValueError(f"code_fix needs hidden_cases >= 2, got {self.hidden_cases}")


def _render(lines: list[str]) -> str:
  return "".join(f"{i} {line}\n" for i, line in enumerate(lines))


# Defined before the agent's code, called after it. It only calls `f` and
# prints what came back; nothing it prints is trusted (the module
# docstring; docs/design/graders.md), so it needs no protection for the reward's sake. It binds the
# builtins it uses when it is defined, so that code which shadows or patches
# them (`type`, `ascii`, `sys.stdout`) cannot relabel a float as an int by
# accident or by a simple patch. It writes the JSON by hand: after the
# sandbox's chroot only modules already loaded can be imported (`sys` is,
# `json` is not). A shown string keeps printable ASCII but quotes and
# backslashes, so it needs no escaping.
_HARNESS_DEF = """\
def _sao_harness(inputs, _type=type, _int=int, _ascii=ascii, _out=__import__("sys").stdout):
  out = []
  for x in inputs:
    v = f(x)
    if _type(v) is _int:
      out.append("%d" % v)
    else:
      s = _ascii(v)[:{shown}]
      s = "".join(c if " " <= c <= "~" and c not in "\\\\\\"" else "?" for c in s)
      out.append('"' + s + '"')
  _out.write("[" + ",".join(out) + "]\\n")
  _out.flush()
"""


def _test_program(lines: list[str], inputs) -> str:
  """The harness, the agent's code, the call on `inputs`: no wanted values."""
  return (
    _HARNESS_DEF.format(shown=_SHOWN_CHARS)
    + "\n".join(lines)
    + f"\n_sao_harness({tuple(inputs)!r})\n"
  )


def _reject_constant(text):
  raise ValueError(f"not an int: {text}")


def _parse_record(stdout: str, n: int) -> list | None:
  """The harness's results for `n` inputs, or None if `stdout` is not exactly that.

  Strict on purpose: exactly one line, a flat JSON list of `n` entries, each
  an exact `int` or a short printable-ASCII string (a non-int result, kept
  only for the log and never a pass). JSON's `true`/`false` become bools and
  floats, NaN and Infinity are refused, so none of them can pass as an int;
  a truncated or oversized output is no record. Whatever the agent's code
  printed besides the record makes the whole output invalid.
  """
  if (
    len(stdout) > _MAX_RECORD_CHARS
    or not stdout.endswith("\n")
    or stdout.count("\n") != 1
    or not stdout.startswith("[")
  ):
    return None
  try:
    values = json.loads(stdout, parse_float=_reject_constant, parse_constant=_reject_constant)
  except (ValueError, RecursionError):
    return None
  if type(values) is not list or len(values) != n:
    return None
  for v in values:
    ok_int = type(v) is int
    ok_str = type(v) is str and len(v) <= _SHOWN_CHARS and v.isascii() and v.isprintable()
    if not (ok_int or ok_str):
      return None
  return values


def _verdict(result: SandboxResult, inputs, wanted) -> tuple[bool, str]:
  """(all passed, the log line), comparing in the trainer on exact ints."""
  if not result.ok:
    return False, result.observation().strip()
  got = _parse_record(result.stdout, len(inputs))
  if got is None:
    out = result.stdout.strip()
    return False, "error: output " + out if out else "error: no test result"
  for x, g, w in zip(inputs, got, wanted):
    if not (type(g) is int and g == w):
      return False, "fail f(%d)=%s want %d" % (x, g, w)
  return True, "pass %d/%d" % (len(inputs), len(inputs))


class _Episode:
  def __init__(self, env: "CodeFix", task: Task):
    self._env, self._task = env, task
    self._lines = list(task.meta["buggy"])
    self._turns = 0

  def _run_tests(self, hidden: int = 0) -> tuple[bool, str]:
    """Runs the shown tests plus `hidden` fresh held-out ones: (passed, log)."""
    meta = self._task.meta
    inputs = [x for x, _ in meta["cases"]]
    inputs += _SYSTEM_RANDOM.sample(range(_HIDDEN_RANGE[0], _HIDDEN_RANGE[1] + 1), hidden)
    result = run_python(_test_program(self._lines, inputs), self._env.limits)
    # Only now, with the sandbox gone, are the held-out wanted values computed.
    wanted = [w for _, w in meta["cases"]]
    wanted += [_APPLY[meta["op"]](x, meta["const"]) for x in inputs[len(wanted) :]]
    return _verdict(result, inputs, wanted)

  def step(self, action: str) -> StepResult:
    self._turns += 1
    action = action.strip()
    if action == "submit":
      passed, _ = self._run_tests(self._env.config.hidden_cases)
      return StepResult("", float(passed), True, {"correct": passed})
    if action == "run":
      _, obs = self._run_tests()
    elif action == "show":
      obs = _render(self._lines).replace("\n", ";")
    elif action.startswith("edit "):
      parts = action.split(" ", 2)
      if len(parts) == 3 and parts[1].isdigit() and int(parts[1]) < len(self._lines):
        i = int(parts[1])
        indent = self._lines[i][: len(self._lines[i]) - len(self._lines[i].lstrip())]
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

  def __init__(
    self,
    config: CodeFixConfig = CodeFixConfig(),
    limits: SandboxLimits = SandboxLimits(cpu_seconds=1, wall_seconds=3.0),
  ):
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
    cases = [(x, eval(f"{x}{op}{const}")) for x in _TEST_INPUTS]  # noqa: S307
    return Task(
      index,
      "fix f\n" + _render(buggy),
      None,
      {"buggy": buggy, "fixed": fixed, "cases": cases, "op": op, "const": const},
    )

  def episode(self, task: Task) -> _Episode:
    return _Episode(self, task)

  def demonstration(self, task: Task) -> list[tuple[str, str]]:
    buggy, fixed, cases = task.meta["buggy"], task.meta["fixed"], task.meta["cases"]
    fail = next(
      (x, eval(f"{x}{buggy[1].split('x', 1)[1]}"), w)  # noqa: S307
      for x, w in cases
      if eval(f"{x}{buggy[1].split('x', 1)[1]}") != w  # noqa: S307
    )
    return [
      ("run", ">fail f(%d)=%s want %d\n" % fail),
      (f"edit 1 {fixed[1].strip()}", ">ok\n"),
      ("run", f">pass {len(cases)}/{len(cases)}\n"),
      ("submit", ""),
    ]
