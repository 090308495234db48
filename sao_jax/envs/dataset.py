"""dataset: train on a user's rows (verl's format) with tools and a verifier.

    env.name = "dataset"
    env.kwargs = {"path": "train.jsonl", "heldout_path": "test.jsonl",
                  "tools": ("python",), "verifier": "math"}

Each row (`sao_jax.data.datasets`) is one task: its prompt messages, its
ground truth, optional tool schemas and an optional demonstration
(`completion`). Task `i` is training row `i % n` (the prompt stream draws
indices, so the order stays grain's, deterministic and checkpointable);
held-out tasks (indices from `prompts.EVAL_OFFSET`) are the rows of
`heldout_path`, or a seeded `heldout_fraction` of `path` kept out of
training. Bad rows are reported with their file, line and reason when the
environment is built, before training, and never become tasks.

An episode, turn by turn:

    the policy calls tools      -> each call's output as a tool message
      (a malformed call, an unknown tool or wrong arguments -> an error tool
       message; the episode goes on)
    the policy answers without  -> the verifier scores the answer (text
      a tool call                  outside tool calls and <think>); done
    max_turns turns of tool calls -> done, reward 0 ("max_turns")

The verifier runs here, in the trainer-side process (the driver's worker
threads), never in the sandbox: "math" (`verify.MathVerifier`: the last
`\\boxed{}`, `####` or `Answer:`; integers exactly, the rest with
math-verify in a subprocess under a wall clock), "exact" (string match of
the extracted answer), or an import string `fn(response, ground_truth) ->
float | bool`. A verifier timeout, or an answer nested too deeply to hand to math-verify,
scores 0 and is reported as the event "verifier_timeout" /
"verifier_too_nested" (counted in the driver's `env_events`), never silently.

Tools: "python" runs its `code` argument in `sao_jax.envs.sandbox` and
returns stdout and the error line (or its exit status, if it said nothing);
every turn's calls are bounded by env config's tool budget
(`tool_calls_per_turn`, `tool_seconds_per_turn`, `tool_seconds_per_episode`:
`ToolBudget`, `answer_tool_calls`), calls past it answered with an error.
`tool_functions` maps further names to import strings of `fn(**arguments)
-> str`, run in the worker thread (they are the user's own code, not the
model's; a time budget does not cut them short, it only refuses later calls).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import threading
import time
from typing import Any, Callable

from sao_jax.config import import_strings
from sao_jax.data.prompts import EVAL_OFFSET
from sao_jax.envs.base import StepResult, Task
from sao_jax.envs.sandbox import SandboxLimits, run_python

PYTHON_TOOL = {
  "type": "function",
  "function": {
    "name": "python",
    "description": "Run Python code and return what it prints (stdout) and its error, "
    "if any. Use print() to see a value.",
    "parameters": {
      "type": "object",
      "properties": {"code": {"type": "string", "description": "The Python program to run."}},
      "required": ["code"],
    },
  },
}


# The standard library a math or data program reaches for.
PYTHON_MODULES = (
  "math",
  "cmath",
  "fractions",
  "decimal",
  "itertools",
  "functools",
  "collections",
  "re",
  "random",
  "statistics",
  "json",
  "heapq",
  "bisect",
  "string",
  "operator",
  "typing",
  "datetime",
)


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
  # A .jsonl, .jsonl.gz or .parquet file of verl-style rows (required).
  path: str = ""
  # Held-out rows; "": a seeded `heldout_fraction` of `path`.
  heldout_path: str = ""
  heldout_fraction: float = 0.1
  seed: int = 0
  # A system message for rows whose prompt has none ("": none).
  system_prompt: str = ""
  # "math", "exact", or an import string fn(response, ground_truth) -> float | bool.
  verifier: str = "math"
  verifier_timeout_s: float = 5.0
  # Built-in tools offered to every row ("python"), besides a row's own `tools`.
  tools: tuple = ()
  # Modules the python tool's programs can import: the sandbox's chroot
  # leaves only modules imported before it, so these are preloaded (a few
  # ms a run). Add e.g. "sympy" or "numpy" if installed and needed.
  python_modules: tuple = PYTHON_MODULES
  # Further tools by name: {"search": "my_pkg.tools:search"}, fn(**arguments) -> str.
  tool_functions: dict = dataclasses.field(default_factory=dict)
  # Turns an episode may take (each a tool-calling turn, the last the answer).
  max_turns: int = 8
  # Any bad row fails the build (default: bad rows are skipped and reported).
  strict: bool = False
  # A prompt repeated with the same ground truth: "drop" the repeats (each
  # reported with its line) or "report" them (kept, reported). Conflicting
  # ground truths and training prompts that are also held out are dropped
  # either way.
  duplicates: str = "drop"
  # Test-only: without the sandbox the python tool refuses to run.
  use_sandbox: bool = True

  @property
  def needs_sandbox(self) -> bool:
    """Only the python tool runs model-written code."""
    return "python" in self.tools


class DatasetEnv:
  """The environment family over a dataset's rows (module docstring)."""

  name = "dataset"

  def __init__(self, config: DatasetConfig, limits: SandboxLimits = SandboxLimits()):
    if not config.path:
      raise ValueError("env.kwargs.path: the dataset environment needs a file of rows")
    if not 0 < config.max_turns:
      raise ValueError(f"env.kwargs.max_turns = {config.max_turns}: must be >= 1")
    unknown = sorted(set(config.tools) - {"python"} - set(config.tool_functions))
    if unknown:
      raise ValueError(
        f"env.kwargs.tools {unknown}: the built-in tool is 'python'; "
        "others need an entry in tool_functions"
      )
    _check_python_modules(config.python_modules)
    self.config, self.limits = config, limits
    # Bounds on each turn's tool calls (registry.make_env sets env config's).
    self.tool_budget = ToolBudget()
    self.max_turns = config.max_turns
    self.runs_code = config.needs_sandbox
    from sao_jax.data import datasets

    if config.duplicates not in ("drop", "report"):
      raise ValueError(f"env.kwargs.duplicates = {config.duplicates!r}: 'drop' or 'report'")
    keep, repeats = config.duplicates == "report", []
    rows, rejected = datasets.load_rows(
      config.path, strict=config.strict, keep_repeats=keep, repeats=repeats
    )
    if config.heldout_path:
      heldout, bad = datasets.load_rows(
        config.heldout_path, strict=config.strict, keep_repeats=keep, repeats=repeats
      )
      train, overlap = datasets.without_heldout(rows, heldout)
      if overlap and config.strict:
        raise datasets.DatasetError(f"{overlap[0][0]}: {overlap[0][1]}")
      rejected = rejected + bad + overlap
    else:
      train, heldout = datasets.split_rows(rows, config.heldout_fraction, config.seed)
    train, heldout = [r for r in train if self.keeps(r)], [r for r in heldout if self.keeps(r)]
    if not train or not heldout:
      raise ValueError(
        f"dataset {config.path}: {len(train)} training and {len(heldout)} "
        "held-out rows; both splits need at least one"
      )
    self.train_rows, self.heldout_rows, self.rejected = train, heldout, rejected
    # Same-truth repeats kept (duplicates="report"), as (where, reason).
    self.repeats = repeats
    # Rows left out at load by kind, and repeats kept: the RL metrics'
    # data/rows_<kind> (rl_loop.py).
    self.data_counts = {**datasets.hygiene_counts(rejected), "repeats_kept": len(repeats)}
    self.num_eval_tasks = len(heldout)
    self._demo_rows = [i for i, r in enumerate(train) if r.completion]
    _report(config, train, heldout, rejected, repeats)
    self._functions = _tool_functions(config)
    self._offered = tuple(
      schema for name, schema in (("python", PYTHON_TOOL),) if name in config.tools
    ) + tuple(_schema_stub(n) for n in config.tool_functions if n in config.tools)
    self._verify = _make_verifier(config)

  def keeps(self, row) -> bool:
    """Whether a loaded row is one of the environment's tasks (all, here)."""
    del row
    return True

  # --- tasks ------------------------------------------------------------------

  def _row(self, index: int):
    if index >= EVAL_OFFSET:
      return self.heldout_rows[(index - EVAL_OFFSET) % len(self.heldout_rows)]
    return self.train_rows[index % len(self.train_rows)]

  def task(self, index: int) -> Task:
    row = self._row(index)
    messages = list(row.messages)
    if self.config.system_prompt and messages[0]["role"] != "system":
      messages.insert(0, {"role": "system", "content": self.config.system_prompt})
    tools = self._offered + tuple(
      t for t in row.tools if _tool_name(t) not in {_tool_name(o) for o in self._offered}
    )
    return Task(
      index,
      tuple(messages),
      row.ground_truth,
      {
        "data_source": row.data_source,
        "extra_info": row.extra_info,
        "where": row.where,
        "completion": row.completion,
      },
      tools,
    )

  def demonstration_task(self, index: int) -> Task:
    """The task of training row `index`, among the rows that have a demonstration."""
    if not self._demo_rows:
      raise ValueError(
        f"dataset {self.config.path}: no row has a completion to train "
        "SFT on; set sft.steps = 0 or add completions"
      )
    return self.task(self._demo_rows[index % len(self._demo_rows)])

  def demonstration(self, task: Task) -> list[tuple[Any, Any]]:
    """The row's completion as (assistant message, tool messages) turns."""
    completion = task.meta["completion"]
    if not completion:
      raise ValueError(f"{task.meta['where']}: the row has no completion")
    turns = []
    for message in completion:
      if message["role"] == "assistant":
        turns.append((message, []))
      else:  # tool results answer the assistant turn before them
        turns[-1][1].append({"role": "tool", "content": message["content"]})
    return turns

  def episode(self, task: Task) -> "_Episode":
    return _Episode(self, task)

  # --- tools --------------------------------------------------------------------

  def call_tool(self, name: str, arguments: dict, seconds: float | None = None) -> str:
    """A tool's answer; the python tool's sandbox gets at most `seconds` of wall clock."""
    if name == "python" and "python" in self.config.tools:
      if not self.config.use_sandbox:
        raise RuntimeError("the python tool without the sandbox is for tests only")
      return run_python(
        arguments["code"],
        sandbox_limits_within(self.limits, seconds),
        preload=tuple(self.config.python_modules),
      ).observation()
    fn = self._functions.get(name)
    if fn is None:
      return f"error: no tool {name!r}"
    out = fn(**arguments)
    return out if isinstance(out, str) else repr(out)


class _Episode:
  def __init__(self, env: DatasetEnv, task: Task):
    self._env, self._task, self._turns = env, task, 0
    self._meter = ToolMeter(env.tool_budget)

  def step(self, action: str) -> StepResult:
    self._turns += 1
    calls = getattr(action, "tool_calls", ())
    errors = getattr(action, "tool_errors", ())
    if not calls and not errors:  # an answer
      parsed = getattr(action, "parsed", None)
      response = parsed.content if parsed is not None else str(action)
      verdict = self._env._verify(response, str(self._task.answer))
      # Answers the verifier did not judge are counted, never silent.
      events = [f"verifier_{verdict.reason}"] if verdict.reason in ("timeout", "too_nested") else []
      return StepResult(
        "",
        float(verdict.correct),
        True,
        {
          "correct": verdict.correct,
          "verdict": verdict.reason,
          # The extracted answer: evaluation's majority vote (maj@k).
          "answer": _extracted_answer(response),
          "events": events,
        },
      )
    messages, events = answer_tool_calls(action, self._env.call_tool, self._meter)
    done = self._turns >= self._env.max_turns
    info = {"correct": False, "events": events}
    if done:
      info["finish_reason"] = "max_turns"
    return StepResult(messages, 0.0, done, info)


# --- helpers --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToolBudget:
  """Bounds on one turn's tool calls and on their time (0: no bound); env config's
  tool_calls_per_turn, tool_seconds_per_turn and tool_seconds_per_episode."""

  calls_per_turn: int = 0
  seconds_per_turn: float = 0.0
  seconds_per_episode: float = 0.0


class ToolMeter:
  """One episode's tool time so far, against its `ToolBudget`."""

  def __init__(self, budget: ToolBudget = ToolBudget()):
    self.budget = budget
    self.episode_seconds = 0.0


def answer_tool_calls(
  action, call_tool: Callable[..., str], meter: ToolMeter | None = None
) -> tuple[list, list]:
  """The tool messages that answer a turn's calls, and its events.

  One message per call, in the order the turn wrote them
  (`action.tool_sequence`; Qwen3's responses carry no call ids): a
  malformed call is answered with its error, a well-formed one with
  `call_tool(name, arguments, seconds)`, where `seconds` is what the
  budget leaves (None: no time bound; the python tool cuts its sandbox's
  wall clock to it). With a `meter`, calls past its budget are not run but
  answered with an error: past `calls_per_turn` calls ("tool_budget_calls"),
  or once the turn's or the episode's tool seconds are spent
  ("tool_budget_time"). The events are ["tool_error"] if any call was
  malformed, and each budget event once if it refused a call. Shared by
  every environment that offers tools, so they answer calls alike.
  """
  budget = meter.budget if meter is not None else ToolBudget()
  messages, events, calls, turn_seconds = [], [], 0, 0.0
  for item in getattr(action, "tool_sequence", ()):  # an Action always has one; a str none
    if isinstance(item, tuple):  # (reason, message)
      messages.append({"role": "tool", "content": f"error: {item[1]}"})
      events.append("tool_error")
      continue
    calls += 1
    left = _seconds_left(budget, turn_seconds, meter)
    if budget.calls_per_turn and calls > budget.calls_per_turn:
      refusal = (
        f"error: tool budget: at most {budget.calls_per_turn} tool calls per turn; "
        "this call was not run",
        "tool_budget_calls",
      )
    elif left is not None and left <= 0:
      refusal = (
        "error: tool budget: the turn's or the episode's tool time is spent "
        f"({budget.seconds_per_turn:g} s per turn, {budget.seconds_per_episode:g} s "
        "per episode; 0: no bound); this call was not run",
        "tool_budget_time",
      )
    else:
      start = time.monotonic()
      try:
        out = (
          call_tool(item.name, item.arguments, left)
          if left is not None
          else call_tool(item.name, item.arguments)
        )
      finally:
        spent = time.monotonic() - start
        turn_seconds += spent
        if meter is not None:
          meter.episode_seconds += spent
      messages.append({"role": "tool", "content": out})
      continue
    messages.append({"role": "tool", "content": refusal[0]})
    events.append(refusal[1])
  return messages, list(dict.fromkeys(events))


def _seconds_left(budget: ToolBudget, turn_seconds: float, meter) -> float | None:
  """Tool seconds the turn may still use (None: no time bound)."""
  left = []
  if budget.seconds_per_turn:
    left.append(budget.seconds_per_turn - turn_seconds)
  if budget.seconds_per_episode and meter is not None:
    left.append(budget.seconds_per_episode - meter.episode_seconds)
  return min(left) if left else None


def sandbox_limits_within(limits: SandboxLimits, seconds: float | None) -> SandboxLimits:
  """`limits` with the wall clock (and CPU time) cut to `seconds` (None: as they are)."""
  if seconds is None or seconds >= limits.wall_seconds:
    return limits
  return dataclasses.replace(
    limits,
    wall_seconds=max(seconds, 0.05),
    cpu_seconds=max(1, min(limits.cpu_seconds, math.ceil(seconds))),
  )


def _tool_name(schema: dict) -> str:
  return schema.get("function", schema).get("name", "")


def _schema_stub(name: str) -> dict:
  # A user tool's schema comes from its rows (`tools`); offered by name only
  # it takes any arguments.
  return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def _check_python_modules(modules) -> None:
  """`python_modules` is a tuple of importable module names (a typo fails here,
  not as a ModuleNotFoundError in every tool call)."""
  if isinstance(modules, str) or not all(isinstance(m, str) and m for m in modules):
    raise ValueError(f"env.kwargs.python_modules = {modules!r}: a tuple of module names")
  missing = sorted(m for m in modules if importlib.util.find_spec(m) is None)
  if missing:
    raise ValueError(f"env.kwargs.python_modules: {missing} cannot be imported here")


def _tool_functions(config: DatasetConfig) -> dict[str, Callable]:
  return {
    name: import_strings.resolve(target, f"env.kwargs.tool_functions[{name!r}]")
    for name, target in dict(config.tool_functions).items()
  }


def _make_verifier(config: DatasetConfig) -> Callable:
  from sao_jax.envs import verify

  if config.verifier == "math":
    checker = verify.MathVerifier(timeout_s=config.verifier_timeout_s)
    return checker.verify
  if config.verifier == "exact":
    return verify.exact_match
  fn = import_strings.resolve(config.verifier, "env.kwargs.verifier")

  def user_verifier(response: str, ground_truth: str) -> verify.Verdict:
    score = fn(response, ground_truth)
    return verify.Verdict(bool(score), "user")

  return user_verifier


def _extracted_answer(response: str) -> str | None:
  from sao_jax.envs import verify

  return verify.extract_answer(response)


_REPORT_LOCK = threading.Lock()


def _report(config, train, heldout, rejected, repeats=()) -> None:
  from sao_jax.data import datasets

  counts = ", ".join(f"{n} {k}" for k, n in datasets.hygiene_counts(rejected).items() if n)
  with _REPORT_LOCK:
    print(
      f"[dataset] {config.path}: {len(train)} training rows, {len(heldout)} held-out, "
      f"{len(rejected)} rejected"
      + (f" ({counts})" if counts else "")
      + (f", {len(repeats)} repeated prompts kept (duplicates='report')" if repeats else ""),
      flush=True,
    )
    for where, reason in rejected[:20]:
      print(f"[dataset]   rejected {where}: {reason}", flush=True)
    if len(rejected) > 20:
      print(f"[dataset]   ... and {len(rejected) - 20} more", flush=True)
    for where, reason in repeats[:5]:
      print(f"[dataset]   kept {where}: {reason}", flush=True)
