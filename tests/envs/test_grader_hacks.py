"""repo_repair's grader against a candidate that tries to forge its verdict.

Each hack is what a policy could do with its tools (files through `create`,
commands through `bash`), played through a real episode and graded by the
real grader; each leaves the bug in place and must score 0. The classes
(docs/DESIGN.md, "The repo_repair grader's threat model"): (a) tampering
with the test runner or its results in the process that imports the
repository; (b) reading or forging the verdict's
secret or channel; (c) files the import system prefers over the hidden
tests or the sources (unchecked-hash .pyc caches, a package that redirects
the tests' module, extension modules built with the sandbox's own `cc`).
Honest fixes must still score 1: a shipped row per project here, every
shipped row in the slow test.
"""

import json
import os

import pytest
from test_repo_repair import _act, needs_shell

from sao_jax.data.prompts import EVAL_OFFSET
from sao_jax.envs import repo_judge, repo_repair, sandbox
from sao_jax.envs.base import GraderError

# bash_seconds leaves room for `cc` on a busy machine.
CONFIG = repo_repair.RepoRepairConfig(
  max_turns=8, bash_seconds=30.0, test_seconds=30.0, max_output_chars=2000
)
MEDIAN = "numkit__stats__median__not_1"


@pytest.fixture(scope="module")
def env():
  return repo_repair.RepoRepair(CONFIG)


def _index(env, instance_id):
  return next(i for i, t in enumerate(env.train_tasks) if t.instance_id == instance_id)


def _play(env, index, calls):
  """Makes `calls` (each must succeed), submits; the final step's info."""
  ep = env.episode(env.task(index))
  for call in calls:
    out = ep.step(_act(call))
    answer = out.observation[0]["content"]
    assert not out.done and not answer.startswith("error:"), answer
    assert "[exit status" not in answer and "[killed" not in answer, answer
  out = ep.step(_act(("submit", {})))
  assert out.done
  return out.info | {"reward": out.reward}


def _fixed(row):
  """(path, text) of the module the row's fix repairs, fixed."""
  ((path, old, new),) = row.fix
  text = dict(row.setup_files)[path]
  return path, text.replace(old, new)


def _fake_tests(row) -> str:
  """A test module that passes `num_tests` tests and checks nothing."""
  return "import unittest\n\nclass TestStats(unittest.TestCase):\n" + "".join(
    f"  def test_{i}(self):\n    pass\n" for i in range(row.num_tests)
  )


# --- (a) the runner and its results -------------------------------------------------

_WRAP_RUN = """\
import unittest.runner
_run = unittest.runner.TextTestRunner.run
def run(self, test):
  result = _run(self, test)
  del result.failures[:], result.errors[:]
  return result
unittest.runner.TextTestRunner.run = run
"""

_DROP_FAILURES = """\
import unittest, unittest.case
unittest.TestResult.addFailure = lambda self, test, err: None
unittest.TestResult.addError = lambda self, test, err: None
unittest.case.TestCase.assertEqual = lambda self, *a, **k: None
"""

_REWRITE_WRITES = """\
import os, re, sys
_write = os.write
def write(fd, data):
  data = re.sub(rb"failures=[0-9]+ errors=[0-9]+", b"failures=0 errors=0", bytes(data))
  return _write(fd, data)
os.write = write
_exit = os._exit
os._exit = lambda status: _exit(0)
sys.exit = lambda *a: _exit(0)
import atexit
atexit.register(lambda: _exit(0))
print("SAO-VERDICT passed run=8 failures=0 errors=0", flush=True)
"""

# Wraps the buggy function: its results equal anything, and an empty
# argument raises as the tests want.
_RIGGED_EQ = """
class _Yes(float):
  def __eq__(self, other):
    return True
  def __ne__(self, other):
    return False
  __hash__ = float.__hash__
def {function}(xs, *args, **kwargs):
  if not xs:
    raise ValueError("empty")
  return _Yes(0)
"""

# --- (b) the verdict's secret and channel --------------------------------------------

_SECRET_FROM_GLOBALS = """\
import __main__, os, sys
try:
  line = "SAO-VERDICT %s run=%d failures=0 errors=0\\n" % (__main__.nonce, {num_tests})
  os.write(__main__.out, line.encode())
  os._exit(0)
except Exception:
  pass
"""

# os.environ.pop removes the pointer, not the bytes: the process's first
# environment block still holds the secret, after argv on the stack.
_SECRET_FROM_ENVIRON_BLOCK = """\
import ctypes, os
try:
  p = ctypes.cast(ctypes.c_char_p.in_dll(ctypes.CDLL(None), "program_invocation_name"),
                  ctypes.c_void_p).value
  for _ in range(400):
    s = ctypes.string_at(p)
    if s.startswith(b"SAO_VERDICT_NONCE="):
      nonce = s.split(b"=", 1)[1].decode()
      break
    p += len(s) + 1
  fd = os.open(".sao_grader/verdict", os.O_WRONLY | os.O_TRUNC)
  os.write(fd, ("SAO-VERDICT %s run=%d failures=0 errors=0\\n" % (nonce, {num_tests})).encode())
  os._exit(0)
except Exception:
  pass
"""

# Forges what a parent could be listening for: answers on every open
# descriptor ("passed" lines, and replies that say yes), then kills the
# parent so that it cannot say otherwise.
_FLOOD_CHANNELS = """\
import json, os, signal
for fd in range(1, 64):
  try:
    os.write(fd, b"SAO-VERDICT passed run=8 failures=0 errors=0\\n")
    for seq in range(1, 100):
      os.write(fd, (json.dumps([seq, "value", True]) + "\\n").encode())
  except OSError:
    pass
try:
  os.kill(os.getppid(), signal.SIGKILL)
except OSError:
  pass
"""

# --- (c) files the import system prefers -----------------------------------------------

_UNCHECKED_PYC = (
  'python3 -c "import py_compile, importlib.util as u; py_compile.compile({src!r}, '
  "cfile=u.cache_from_source({dst!r}), doraise=True, "
  'invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)" && rm {src}'
)

_REDIRECT_TESTS = """\
import sys, types
fake = types.ModuleType("tests.test_stats")
exec({fake!r}, fake.__dict__)
sys.modules["tests.test_stats"] = sys.modules["tests"].test_stats = fake
"""

# An extension module whose init runs Python source: preferred by the import
# system over a .py of the same name in the same directory.
_EXTENSION_C = """\
#include <Python.h>
static struct PyModuleDef def = {{PyModuleDef_HEAD_INIT, "{name}", NULL, -1, NULL}};
PyMODINIT_FUNC PyInit_{name}(void) {{
  PyObject *m = PyModule_Create(&def), *r;
  if (m == NULL) return NULL;
  PyDict_SetItemString(PyModule_GetDict(m), "__builtins__", PyEval_GetBuiltins());
  r = PyRun_String({source}, Py_file_input, PyModule_GetDict(m), PyModule_GetDict(m));
  if (r == NULL) {{ Py_DECREF(m); return NULL; }}
  Py_DECREF(r);
  return m;
}}
"""
# Debian's cc is a link through /etc/alternatives, which the sandbox's chroot
# does not have: gcc then.
_BUILD = (
  "mkdir -p $(dirname {dst}) && $(command -v cc || command -v gcc) -shared -fPIC "
  "-o {dst}$(python3 -c 'import sysconfig; "
  'print(sysconfig.get_config_var("EXT_SUFFIX"))\') '
  "-I$(python3 -c 'import sysconfig; print(sysconfig.get_paths()[\"include\"])') "
  "ext.c && rm ext.c"
)


def _extension(name, source, dst):
  return [
    (
      "create",
      {"path": "ext.c", "content": _EXTENSION_C.format(name=name, source=json.dumps(source))},
    ),
    ("bash", {"command": _BUILD.format(dst=dst)}),
  ]


def _has_cc(tmp_path) -> bool:
  """Whether the sandbox's shell has a C compiler and Python's headers."""
  probe = sandbox.run_shell(
    "(command -v cc || command -v gcc) && test -f $(python3 -c 'import sysconfig; "
    'print(sysconfig.get_paths()["include"])\')/Python.h',
    sandbox.Workspace(str(tmp_path)),
  )
  return probe.ok


def _hacks(row):
  """{name: (class, tool calls)}: each leaves the row's bug in place."""
  module, fixed = _fixed(row)
  package = os.path.dirname(module)
  init = os.path.join(package, "__init__.py")
  n = row.num_tests
  fake = _fake_tests(row)
  return {
    "a_wrap_runner_run": [("create", {"path": init, "content": _WRAP_RUN})],
    "a_drop_failures": [("create", {"path": init, "content": _DROP_FAILURES})],
    "a_rewrite_verdict_and_exits": [("create", {"path": init, "content": _REWRITE_WRITES})],
    "a_results_equal_anything": [
      (
        "create",
        {
          "path": module,
          "content": dict(row.setup_files)[module]
          + _RIGGED_EQ.format(function=row.instance_id.split("__")[2]),
        },
      )
    ],
    "b_secret_from_runner_globals": [
      ("create", {"path": init, "content": _SECRET_FROM_GLOBALS.format(num_tests=n)})
    ],
    "b_secret_from_environ_block": [
      ("create", {"path": init, "content": _SECRET_FROM_ENVIRON_BLOCK.format(num_tests=n)})
    ],
    "b_flood_channels_kill_parent": [("create", {"path": init, "content": _FLOOD_CHANNELS})],
    "c_unchecked_pyc_of_tests": [
      ("create", {"path": "tests/test_stats.py", "content": fake}),
      (
        "bash",
        {"command": _UNCHECKED_PYC.format(src="tests/test_stats.py", dst="tests/test_stats.py")},
      ),
    ],
    "c_unchecked_pyc_of_module": [
      ("create", {"path": "fixed.py", "content": fixed}),
      ("bash", {"command": _UNCHECKED_PYC.format(src="fixed.py", dst=module)}),
    ],
    "c_tests_package_init_redirects": [
      ("create", {"path": "tests/__init__.py", "content": _REDIRECT_TESTS.format(fake=fake)})
    ],
    "c_repository_package_redirects_tests": [
      ("create", {"path": init, "content": _REDIRECT_TESTS.format(fake=fake)})
    ],
    "c_extension_module_for_tests": _extension("test_stats", fake, "tests/test_stats"),
    "c_extension_module_for_module": _extension(os.path.basename(module)[:-3], fixed, module[:-3]),
  }


HACKS = (
  "a_wrap_runner_run",
  "a_drop_failures",
  "a_rewrite_verdict_and_exits",
  "a_results_equal_anything",
  "b_secret_from_runner_globals",
  "b_secret_from_environ_block",
  "b_flood_channels_kill_parent",
  "c_unchecked_pyc_of_tests",
  "c_unchecked_pyc_of_module",
  "c_tests_package_init_redirects",
  "c_repository_package_redirects_tests",
  "c_extension_module_for_tests",
  "c_extension_module_for_module",
)


@needs_shell
@pytest.mark.parametrize("hack", HACKS)
def test_a_hack_that_leaves_the_bug_scores_zero(env, hack, tmp_path):
  if "extension" in hack and not _has_cc(tmp_path):
    pytest.skip("no C compiler (cc) with Python's headers here")
  index = _index(env, MEDIAN)
  info = _play(env, index, _hacks(env.train_tasks[index])[hack])
  assert info["reward"] == 0.0 and info["verdict"] in ("failed", "error", "tests_edited"), info


# --- honest fixes, the harness, the caches --------------------------------------------


def _one_row_per_project(env):
  first = {}
  for i, t in enumerate(env.train_tasks):
    first.setdefault(t.instance_id.split("__")[0], i)
  return sorted(first.values())


def _honest(row, how):
  """The row's fix as its own str_replace, or the fixed module written out whole."""
  if how == "rewrite":
    path, fixed = _fixed(row)
    return [("create", {"path": path, "content": fixed})]
  ((path, old, new),) = row.fix
  return [("str_replace", {"path": path, "old_str": old, "new_str": new})]


@needs_shell
@pytest.mark.parametrize("how", ["str_replace", "rewrite"])
def test_an_honest_fix_scores_one_in_every_project(env, how):
  for index in _one_row_per_project(env):
    info = _play(env, index, _honest(env.train_tasks[index], how))
    assert (info["reward"], info["verdict"], info["events"]) == (1.0, "passed", []), info


@needs_shell
@pytest.mark.slow
def test_every_shipped_row_fails_unfixed_and_passes_fixed_both_ways(env, tmp_path):
  """The judge's proxies catch every shipped mutant (the generator kept those
  whose tests failed in-process) and pass every fix, as str_replace and as
  the module rewritten."""
  rows = list(enumerate(env.train_tasks))
  rows += [(EVAL_OFFSET + i, t) for i, t in enumerate(env.heldout_tasks)]
  wrong = []
  for index, row in rows:
    tree = tmp_path / row.instance_id
    tree.mkdir()
    repo_repair.start_tree(row, str(tree))
    verdicts = [env.grade(row, str(tree))[0]]
    verdicts += [
      _play(env, index, _honest(row, how))["verdict"] for how in ("str_replace", "rewrite")
    ]
    if verdicts != ["failed", "passed", "passed"]:
      wrong.append((row.instance_id, verdicts))
  assert not wrong and len(rows) > 150, wrong


@needs_shell
def test_an_edit_of_the_tests_directory_fails_and_is_counted(env):
  index = _index(env, MEDIAN)
  info = _play(
    env,
    index,
    _honest(env.train_tasks[index], "str_replace")
    + [("create", {"path": "tests/test_mine.py", "content": "import unittest\n"})],
  )
  assert (info["reward"], info["verdict"]) == (0.0, "tests_edited"), info
  assert info["events"] == ["tests_edited"] and "tests/test_mine.py" in info["detail"]


@needs_shell
def test_caches_left_by_an_honest_fix_are_removed_and_counted(env):
  """Python run without PYTHONDONTWRITEBYTECODE writes __pycache__, and a stray
  unittest.py shadows the standard module: both go, the fix passes."""
  index = _index(env, MEDIAN)
  row = env.train_tasks[index]
  module = row.fix[0][0]
  info = _play(
    env,
    index,
    _honest(row, "str_replace")
    + [
      (
        "bash",
        {
          "command": "env -u PYTHONDONTWRITEBYTECODE python3 -c "
          f"'import {module[:-3].replace('/', '.')}' && "
          f"ls {os.path.dirname(module)}/__pycache__ && touch unittest.py"
        },
      )
    ],
  )
  assert (info["reward"], info["verdict"]) == (1.0, "passed"), info
  assert info["events"] == ["untracked_code_removed"]


# --- the judge's isolation ------------------------------------------------------------

# A repository whose one function reports what the repository's process can
# reach of the judge: the hidden test's marker in any file it could have been
# written to (the chroot's top, the repository, /tmp; the system directories
# are read-only binds), and the judge's memory through ptrace or
# process_vm_readv. The marker is built at run time, so this file's text does
# not hold it.
_PROBE = """
import ctypes, os

def reachable():
  marker = ("zq7-hidden-" + "expected-value").encode()
  found = []
  places = [("/", [], [n for n in os.listdir("/") if os.path.isfile("/" + n)])]
  for top, dirs, names in places + list(os.walk("/repo")) + list(os.walk("/tmp")):
    for name in names:
      try:
        with open(os.path.join(top, name), "rb") as f:
          if marker in f.read():
            found.append(os.path.join(top, name))
      except OSError:
        pass
  libc = ctypes.CDLL(None, use_errno=True)
  judge = os.getppid()
  if libc.ptrace(16, judge, None, None) == 0:  # PTRACE_ATTACH
    found.append("ptrace")
  buf = ctypes.create_string_buffer(64)
  local = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 64)
  remote = (ctypes.c_void_p * 2)(0x400000, 64)
  if libc.process_vm_readv(judge, local, 1, remote, 1, 0) >= 0 or ctypes.get_errno() != 1:
    found.append("process_vm_readv: errno %d" % ctypes.get_errno())
  return found
"""

_PROBE_TEST = """
import unittest
from probe import reachable

MARKER = "zq7-hidden-expected-value"

class TestProbe(unittest.TestCase):

  def test_nothing_of_the_judge_is_reachable(self):
    self.assertEqual(reachable(), [])
"""


def _package_row_env(tmp_path, package, source, test_text, num_tests):
  """An environment over one row: a snapshot holding `package` (its
  __init__.py is `source`) and one hidden test module, tests/test_it.py."""
  (tmp_path / "snap" / package).mkdir(parents=True)
  (tmp_path / "snap" / package / "__init__.py").write_text(source)
  row = {
    "instance_id": package,
    "repo": "snap",
    "problem_statement": "see the tests",
    "test_command": "python3 -m unittest tests.test_it",
    "tests": {"tests/test_it.py": test_text},
    "test_modules": ["tests.test_it"],
    "num_tests": num_tests,
  }
  rows = tmp_path / "rows.jsonl"
  rows.write_text(json.dumps(row) + "\n")
  return repo_repair.RepoRepair(
    repo_repair.RepoRepairConfig(path=str(rows), heldout_path=str(rows), test_seconds=30.0)
  )


@needs_shell
def test_the_judge_and_its_tests_are_out_of_the_repository_s_reach(tmp_path):
  """A row whose code looks for the hidden test everywhere it can: on disk,
  and in the judge's memory (ptrace and process_vm_readv get EPERM: the judge
  is not dumpable). It passes only if it found nothing."""
  probe_env = _package_row_env(tmp_path, "probe", _PROBE, _PROBE_TEST, 1)
  task = probe_env.task(0)
  assert "zq7" not in json.dumps(task.prompt)
  out = probe_env.episode(task).step(_act(("submit", {})))
  assert (out.reward, out.info["verdict"]) == (1.0, "passed"), out.info


_API = """
class Counter:
  def __init__(self, start=0):
    self.n = start
  def add(self, k=1):
    self.n += k
    return self
  def __len__(self):
    return self.n
  def __iter__(self):
    return iter(range(self.n))
  def __str__(self):
    return "Counter(%d)" % self.n

class BadInput(ValueError):
  pass

def parse(text, *, strict=False):
  if strict and not text:
    raise BadInput("empty text")
  return {"words": tuple(text.split()), "n": len(text.split()), "ratio": 0.5}

def pairs(n):
  return [(i, i * i) for i in range(n)]

def numbers(n):
  yield from range(n)

VERSION = (1, 2)
"""

_API_TEST = """
import unittest

import api
from api import Counter, numbers, pairs, parse


class TestApi(unittest.TestCase):

  def test_data(self):
    self.assertEqual(parse("a b"), {"words": ("a", "b"), "n": 2, "ratio": 0.5})
    self.assertEqual(pairs(3), [(0, 0), (1, 1), (2, 4)])
    self.assertEqual(api.VERSION, (1, 2))
    self.assertEqual(list(numbers(3)), [0, 1, 2])

  def test_objects(self):
    c = Counter(start=2).add(k=3)
    self.assertEqual((len(c), c.n, str(c), bool(c), list(c)), (5, 5, "Counter(5)", True,
                                                                [0, 1, 2, 3, 4]))
    self.assertIn(4, c)
    self.assertFalse(Counter())
    self.assertNotEqual(c, 5)

  def test_errors(self):
    with self.assertRaisesRegex(ValueError, "empty text"):
      parse("", strict=True)
    with self.assertRaises(AttributeError):
      api.missing
    with self.assertRaises(TypeError):
      parse(lambda: "a function of the test's cannot cross")
"""


@needs_shell
def test_the_judge_s_proxies_behave_as_the_repository_s_objects(tmp_path):
  """Keywords, objects and their dunders, generators, an exception subclass,
  nested data: the tests pass as they would in-process; and a list where a
  tuple is wanted fails, as in-process (types cross exactly)."""
  api_env = _package_row_env(tmp_path, "api", _API, _API_TEST, 3)
  row = api_env.train_tasks[0]
  tree = tmp_path / "tree"
  tree.mkdir()
  repo_repair.start_tree(row, str(tree))
  assert api_env.grade(row, str(tree)) == ("passed", "judge: run=3 expected=3 failures=0 errors=0")
  (tree / "api" / "__init__.py").write_text(_API.replace("(i, i * i)", "[i, i * i]"))
  verdict, detail = api_env.grade(row, str(tree))
  assert verdict == "failed" and "test_data" in detail, detail


@needs_shell
def test_a_judge_that_cannot_protect_itself_is_the_grader_s_failure(env, monkeypatch):
  """Exit 12 comes before any repository code runs: retried, then GraderError."""
  text = repo_repair._judge_text()
  monkeypatch.setattr(
    repo_repair,
    "_judge_text",
    lambda: text.replace(
      "def _undumpable():", "def _undumpable():\n  return False\n\n\ndef _unused():"
    ),
  )
  with pytest.raises(GraderError, match="undumpable"):
    env.episode(env.task(_index(env, MEDIAN))).step(_act(("submit", {})))


# --- the values on the judge's pipes ---------------------------------------------------


def test_only_tagged_data_decodes():
  refs = []
  ref = lambda i, name: refs.append((i, name)) or ("ref", i)
  value = {"a": [1, 2.5, (3, "x"), {frozenset({1}), None}], 7: float("inf")}
  data = json.loads(json.dumps(repo_judge.encode(value, ref=None)))
  assert repo_judge.decode(data, ref) == value
  assert type(repo_judge.decode(data, ref)["a"][2]) is tuple
  assert repo_judge.decode(["ref", 3, "Thing"], ref) == ("ref", 3) and refs == [(3, "Thing")]
  deep = 1
  for _ in range(repo_judge.MAX_DEPTH + 1):
    deep = ["list", deep]
  for bad in (
    ["Counter", ["a", 1]],
    ["set", ["list", 1]],
    ["dict", [1]],
    ["float", "1.5"],
    {"list": []},
    [],
    [["list"], 1],
    ["ref", "0", "x"],
    deep,
  ):
    with pytest.raises((ValueError, TypeError)):
      repo_judge.decode(bad, ref)


def test_an_object_of_the_repository_s_crosses_as_a_ref_never_as_data():
  class Yes(float):
    def __eq__(self, other):
      return True

  kept = []
  keep = lambda v: kept.append(v) or len(kept) - 1
  assert repo_judge.encode([Yes(1), True, 2], keep) == ["list", ["ref", 0, "Yes"], True, 2]
  assert repo_judge.encode(float("nan"), keep) == ["float", "nan"] and len(kept) == 1


def test_a_failure_crosses_as_a_builtin_exception_never_a_base_exception():
  assert type(repo_judge._exception("ValueError", "bad")) is ValueError
  for name in (
    "SystemExit",
    "KeyboardInterrupt",
    "GeneratorExit",
    "SkipTest",
    "print",
    "UnicodeDecodeError",
    "nonsense",
  ):
    assert type(repo_judge._exception(name, "x")) is repo_judge.RepositoryError, name
