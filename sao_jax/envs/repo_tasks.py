"""repo_tasks: repository-repair task rows, their reader, and the offline generator.

A row (one JSON object per line of a .jsonl / .jsonl.gz file, or a parquet
row), SWE-bench's fields under their SWE-bench names where there is one:

    {"instance_id": "numkit__stats__median__compare_1",     # optional, unique
     "repo": "path/to/snapshot",          # a directory or a .tar / .tar.gz / .tgz
     "problem_statement": "The test ... fails ...",
     "test_command": "python3 -m unittest tests.test_stats",
     "tests": {"tests/test_stats.py": "<file text>"},     # hidden: added at grading
     "test_modules": ["tests.test_stats"],   # optional: graded by the trusted runner
     "num_tests": 8,                         # optional: with test_modules
     "setup_files": {"numkit/stats.py": "<file text>"},   # optional: over the snapshot
     "fix": [{"path": ..., "old": ..., "new": ...}]}      # optional: the demonstration

`repo` is relative to the row file's directory unless absolute. The
starting tree of a task is the snapshot with `setup_files` written over it;
`tests` are never in it. With `test_modules` a judge process holds them
in its memory and runs them against the repository's code in another
process, and `num_tests` of them must pass (`sao_jax.envs.repo_repair`,
`sao_jax.envs.repo_judge`); without, the tests are written into a copy of
the final tree and the verdict is the exit status of `test_command`, which
the repository's code can forge. `fix` is a list of exact replacements (`old` occurs once in
the file) that repair the starting tree: the demonstration for SFT is then
`view` of the lines, `str_replace`, `submit`. A user's SWE-bench-style rows
need only repo, problem_statement, test_command and tests.

`load_tasks` reads rows with `sao_jax.data.datasets.read_rows` (line cap,
UTF-8, JSON; bad rows kept apart as (file:line, reason)), and refuses a row
whose snapshot does not exist, whose paths escape the tree, or whose
fields have the wrong types.

The generator (SWE-smith's idea, at toy scale) injects bugs into a small
shipped corpus of real modules with real unittest tests
(`sao_jax/envs/task_data/repo_corpus/<project>/{repo,tests}`): it mutates one spot of
one function at a time (an operator swapped, a comparison loosened or
tightened, an integer constant off by one, `and`/`or` swapped, a `not`
dropped, an `if` dropped), runs the project's tests on every mutant in a
subprocess, and keeps the mutants that make a test fail that the original
passes (mutants that hang are dropped). The problem statement quotes the
first failing test and its error. Functions are split between training and
held-out rows (every fifth function held out), so a held-out bug is never
in a function trained on. Output is byte-for-byte the same for the same
corpus and Python (tests/envs/test_repo_repair.py regenerates and compares):

    python -m sao_jax.envs.repo_tasks --out_dir=sao_jax/envs/task_data/repo_repair
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import gzip
import json
import os
import subprocess
import sys
import tarfile
from typing import Any

from sao_jax.data import datasets

CORPUS_DIR = os.path.join(os.path.dirname(__file__), "task_data", "repo_corpus")
SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "task_data", "repo_repair")
SHIPPED_TRAIN = os.path.join(SHIPPED_DIR, "train.jsonl.gz")
SHIPPED_HELDOUT = os.path.join(SHIPPED_DIR, "heldout.jsonl.gz")
# Every HELDOUT_EVERY-th function (in (project, module, function) order) is held out.
HELDOUT_EVERY = 5
# The most a row's text fields may hold (a hidden test file, a problem).
MAX_TEXT_CHARS = 200_000
_TARBALL = (".tar", ".tar.gz", ".tgz")


@dataclasses.dataclass(frozen=True)
class RepoTask:
  instance_id: str
  repo: str  # absolute: a directory or a tarball
  problem: str
  test_command: str
  tests: tuple[tuple[str, str], ...]  # (relative path, text), hidden
  test_modules: tuple[str, ...] = ()
  num_tests: int = 0
  setup_files: tuple[tuple[str, str], ...] = ()
  fix: tuple[tuple[str, str, str], ...] = ()  # (path, old, new)
  where: str = ""


# --- rows ------------------------------------------------------------------------


def safe_relative(path: Any, field: str) -> str:
  """`path` as a normalised relative path inside a tree, or BadRow."""
  if not isinstance(path, str) or not path or "\x00" in path:
    raise datasets.BadRow(f"{field}: a path must be a non-empty string")
  norm = os.path.normpath(path)
  if os.path.isabs(path) or norm == "." or norm.split(os.sep)[0] == "..":
    raise datasets.BadRow(f"{field}: {path!r} is not a path inside the repository")
  return norm


def _text(value: Any, field: str, required: bool = True) -> str:
  if value is None and not required:
    return ""
  if not isinstance(value, str) or (required and not value.strip()):
    raise datasets.BadRow(f"{field} must be a non-empty string")
  if len(value) > MAX_TEXT_CHARS:
    raise datasets.BadRow(f"{field} is over {MAX_TEXT_CHARS} characters")
  return value


def _files(value: Any, field: str, required: bool) -> tuple[tuple[str, str], ...]:
  if value is None and not required:
    return ()
  if not isinstance(value, dict) or (required and not value):
    raise datasets.BadRow(f"{field} must be an object of path -> file text")
  return tuple(
    (safe_relative(k, field), _text(v, f"{field}[{k!r}]", required=False)) for k, v in value.items()
  )


def parse_task(row: Any, where: str, base_dir: str = "") -> RepoTask:
  """A validated `RepoTask` of one row, or BadRow with the reason."""
  if not isinstance(row, dict):
    raise datasets.BadRow("not a JSON object")
  repo = row.get("repo")
  if not isinstance(repo, str) or not repo:
    raise datasets.BadRow("repo must be a path (a directory or a tarball)")
  repo = os.path.normpath(os.path.join(base_dir, repo))
  if not (os.path.isdir(repo) or (os.path.isfile(repo) and repo.endswith(_TARBALL))):
    raise datasets.BadRow(f"repo {row['repo']!r}: no such directory or .tar/.tar.gz/.tgz file")
  if not os.path.isdir(repo):
    try:
      with tarfile.open(repo) as tar:
        _tar_members(tar, repo)
    except (OSError, tarfile.TarError) as e:
      raise datasets.BadRow(f"repo {row['repo']!r}: not a readable tarball ({e})") from None
  instance_id = row.get("instance_id", where)
  if not isinstance(instance_id, str):
    raise datasets.BadRow("instance_id must be a string")
  modules = row.get("test_modules") or []
  if not isinstance(modules, list) or not all(
    isinstance(m, str) and m and all(p.isidentifier() for p in m.split(".")) for m in modules
  ):
    raise datasets.BadRow("test_modules must be a list of dotted module names")
  num_tests = row.get("num_tests", 0)
  if isinstance(num_tests, bool) or not isinstance(num_tests, int) or num_tests < 0:
    raise datasets.BadRow("num_tests must be a non-negative integer")
  fix = row.get("fix") or []
  if not isinstance(fix, list):
    raise datasets.BadRow("fix must be a list of {path, old, new}")
  edits = []
  for k, e in enumerate(fix):
    if (
      not isinstance(e, dict)
      or not isinstance(e.get("old"), str)
      or not e["old"]
      or (not isinstance(e.get("new"), str))
    ):
      raise datasets.BadRow(f"fix {k}: needs path, a non-empty old and a new string")
    edits.append((safe_relative(e.get("path"), f"fix {k}"), e["old"], e["new"]))
  return RepoTask(
    instance_id=instance_id,
    repo=repo,
    problem=_text(row.get("problem_statement"), "problem_statement"),
    test_command=_text(row.get("test_command"), "test_command"),
    tests=_files(row.get("tests"), "tests", required=True),
    test_modules=tuple(modules),
    num_tests=num_tests,
    setup_files=_files(row.get("setup_files"), "setup_files", required=False),
    fix=tuple(edits),
    where=where,
  )


def load_tasks(path: str, strict: bool = False) -> tuple[list[RepoTask], list[tuple[str, str]]]:
  """(tasks, [(where, reason)] of the refused rows) of a row file; repeated
  instance ids are refused after the first."""
  base = os.path.dirname(os.path.abspath(path))
  tasks, rejected = datasets.read_rows(path, lambda v, w: parse_task(v, w, base), strict=strict)
  seen, kept = set(), []
  for t in tasks:
    if t.instance_id in seen:
      if strict:
        raise datasets.DatasetError(f"{t.where}: duplicate instance_id {t.instance_id!r}")
      rejected.append((t.where, f"duplicate instance_id {t.instance_id!r}"))
      continue
    seen.add(t.instance_id)
    kept.append(t)
  return kept, rejected


def extract_snapshot(repo: str, dest: str) -> None:
  """The snapshot's files into the empty directory `dest` (a copy of a
  directory, symlinks kept as links; a tarball's regular files and dirs
  only, nothing outside `dest`)."""
  import shutil

  if os.path.isdir(repo):
    shutil.copytree(
      repo,
      dest,
      symlinks=True,
      dirs_exist_ok=True,
      ignore=shutil.ignore_patterns("__pycache__", ".git"),
    )
    return
  with tarfile.open(repo) as tar:
    tar.extractall(dest, members=_tar_members(tar, repo), filter="data")


def _tar_members(tar: tarfile.TarFile, repo: str) -> list[tarfile.TarInfo]:
  """The regular files and directories of a snapshot tarball; BadRow for a
  member whose path leaves the tree."""
  members = []
  for m in tar.getmembers():
    if os.path.normpath(m.name) == "." or not (m.isfile() or m.isdir()):
      continue
    safe_relative(m.name, f"repo {repo}")
    members.append(m)
  return members


# --- mutation ----------------------------------------------------------------------


_BINOPS = {
  ast.Add: ("+", "-"),
  ast.Sub: ("-", "+"),
  ast.Mult: ("*", "/"),
  ast.Div: ("/", "*"),
  ast.FloorDiv: ("//", "/"),
  ast.Mod: ("%", "//"),
}
_COMPARE = {
  ast.Lt: ("<", "<="),
  ast.LtE: ("<=", "<"),
  ast.Gt: (">", ">="),
  ast.GtE: (">=", ">"),
  ast.Eq: ("==", "!="),
  ast.NotEq: ("!=", "=="),
  ast.In: ("in", "not in"),
  ast.NotIn: ("not in", "in"),
}
_BOOLOPS = {ast.And: ("and", "or"), ast.Or: ("or", "and")}


@dataclasses.dataclass(frozen=True)
class Mutant:
  function: str
  kind: str  # "binop", "compare", "constant", "boolop", "not", "augassign", "drop_if"
  source: str


def _offsets(source: str) -> list[int]:
  starts, pos = [], 0
  for line in source.splitlines(keepends=True):
    starts.append(pos)
    pos += len(line)
  starts.append(pos)
  return starts


def mutants(source: str) -> list[Mutant]:
  """Every single-spot mutant of the top-level functions of `source`, in source order."""
  tree = ast.parse(source)
  starts = _offsets(source)

  def at(line, col):  # ast columns are UTF-8 byte offsets; the corpus is ASCII
    return starts[line - 1] + col

  def span(node):
    return at(node.lineno, node.col_offset), at(node.end_lineno, node.end_col_offset)

  out: list[Mutant] = []

  def swap_between(fn, kind, a, b, old, new):
    lo, hi = span(a)[1], span(b)[0]
    gap = source[lo:hi]
    if gap.strip(" ()") != old:
      return
    k = lo + gap.index(old)
    out.append(Mutant(fn, kind, source[:k] + new + source[k + len(old) :]))

  for fn in tree.body:
    if not isinstance(fn, ast.FunctionDef):
      continue
    body = (
      fn.body[1:]
      if (
        fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
      )
      else fn.body
    )
    nodes = [n for stmt in body for n in ast.walk(stmt)]
    nodes.sort(
      key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0), type(n).__name__)
    )
    for node in nodes:
      if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        swap_between(fn.name, "binop", node.left, node.right, *_BINOPS[type(node.op)])
      elif isinstance(node, ast.AugAssign) and type(node.op) in _BINOPS:
        old, new = _BINOPS[type(node.op)]
        swap_between(fn.name, "augassign", node.target, node.value, old + "=", new + "=")
      elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
        swap_between(
          fn.name, "compare", node.left, node.comparators[0], *_COMPARE[type(node.ops[0])]
        )
      elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
        swap_between(fn.name, "boolop", node.values[0], node.values[1], *_BOOLOPS[type(node.op)])
      elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        lo, hi = span(node)
        olo, ohi = span(node.operand)
        out.append(Mutant(fn.name, "not", source[:lo] + source[olo:ohi] + source[hi:]))
      elif (
        isinstance(node, ast.Constant)
        and type(node.value) is int
        and node.lineno == node.end_lineno
      ):
        lo, hi = span(node)
        for value in (node.value + 1, node.value - 1):
          if value >= 0:
            out.append(Mutant(fn.name, "constant", source[:lo] + str(value) + source[hi:]))
    for stmt in ast.walk(fn):
      for field in ("body", "orelse"):
        block = getattr(stmt, field, None)
        if not isinstance(block, list) or len(block) < 2:
          continue
        for child in block:
          if isinstance(child, ast.If) and not (stmt is fn and child is fn.body[0]):
            lo, hi = starts[child.lineno - 1], starts[child.end_lineno]
            out.append(Mutant(fn.name, "drop_if", source[:lo] + source[hi:]))
  kept = []
  for m in out:
    if m.source == source:
      continue
    try:
      ast.parse(m.source)
    except SyntaxError:
      continue
    kept.append(m)
  return kept


def reverse_edit(original: str, mutant: str) -> tuple[str, str, int, int]:
  """(old, new, first line, last line) of a replacement that turns `mutant` back
  into `original`: the changed lines, widened by context lines until `old`
  occurs exactly once in `mutant`; the line numbers are `old`'s in `mutant`."""
  a, b = original.splitlines(keepends=True), mutant.splitlines(keepends=True)
  p = 0
  while p < min(len(a), len(b)) and a[p] == b[p]:
    p += 1
  q = 0
  while q < min(len(a), len(b)) - p and a[-1 - q] == b[-1 - q]:
    q += 1
  lo, hi_b, hi_a = p, len(b) - q, len(a) - q
  while True:
    old = "".join(b[lo:hi_b])
    if old and mutant.count(old) == 1:
      return old, "".join(a[lo:hi_a]), lo + 1, max(hi_b, lo + 1)
    if lo > 0:
      lo -= 1
    elif hi_b < len(b):
      hi_b, hi_a = hi_b + 1, hi_a + 1
    else:
      raise ValueError("no unique context for the edit")


# --- running a project's tests on its mutants ----------------------------------------

# Runs in a subprocess: the project's tests against each mutant of one module,
# imported fresh each time. A mutant whose tests run past `max_lines` traced
# lines is "timeout": a count, not a clock, so the outcome is the same however
# loaded the machine is (the alarm only backs it up, for a hang in C code).
_WORKER = r"""
import importlib, io, json, signal, sys, types, unittest
job = json.load(sys.stdin)
sys.path.insert(0, job["repo"])
sys.path.insert(0, job["tests_dir"])
class Hang(KeyboardInterrupt):
  pass
def alarm(signum, frame):
  raise Hang()
signal.signal(signal.SIGALRM, alarm)
lines = [0]
def local(frame, event, arg):
  if event == "line":
    lines[0] += 1
    if lines[0] > job["max_lines"]:
      raise Hang()
  return local
def trace(frame, event, arg):
  return local if frame.f_code.co_filename == job["module_file"] else None
results = []
for source in job["sources"]:
  for name in [n for n in sys.modules if n == job["module"] or n == job["test_module"]]:
    del sys.modules[name]
  module = types.ModuleType(job["module"])
  module.__file__ = job["module_file"]
  try:
    exec(compile(source, job["module_file"], "exec"), module.__dict__)
  except Exception as e:
    results.append({"status": "fail", "test": "", "error": type(e).__name__})
    continue
  sys.modules[job["module"]] = module
  signal.setitimer(signal.ITIMER_REAL, job["seconds"])
  lines[0] = 0
  sys.settrace(trace)
  try:
    tests = unittest.defaultTestLoader.loadTestsFromName(job["test_module"])
    result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(tests)
  except Hang:
    results.append({"status": "timeout"})
    continue
  finally:
    sys.settrace(None)
    signal.setitimer(signal.ITIMER_REAL, 0)
  bad = sorted(result.failures + result.errors, key=lambda f: f[0].id())
  if not bad:
    results.append({"status": "pass", "run": result.testsRun})
    continue
  test, text = bad[0]
  last = [line for line in text.strip().splitlines() if line.strip()][-1]
  results.append({"status": "fail", "test": test.id(), "error": last, "run": result.testsRun})
print(json.dumps(results))
"""


def run_mutants(
  repo: str,
  tests_dir: str,
  module: str,
  module_file: str,
  test_module: str,
  sources: list[str],
  max_lines: int = 20_000,
  seconds: float = 30.0,
) -> list[dict]:
  """The project's tests on each source of `module`: [{"status": "pass" | "fail" |
  "timeout", "test": first failing test id, "error": its last traceback line}]."""
  job = {
    "repo": repo,
    "tests_dir": tests_dir,
    "module": module,
    "module_file": module_file,
    "test_module": test_module,
    "sources": sources,
    "max_lines": max_lines,
    "seconds": seconds,
  }
  out = subprocess.run(
    [sys.executable, "-I", "-c", _WORKER],
    input=json.dumps(job),
    capture_output=True,
    text=True,
    check=True,
    cwd=tests_dir,
    env={"PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"},
  )
  return json.loads(out.stdout)


# --- writing the rows ------------------------------------------------------------------


def _test_source(test_text: str, test_id: str) -> str:
  """The source of test method `...Class.method` in the test file."""
  cls, method = test_id.split(".")[-2:]
  lines = test_text.splitlines(keepends=True)
  for node in ast.walk(ast.parse(test_text)):
    if isinstance(node, ast.ClassDef) and node.name == cls:
      for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == method:
          return "".join(lines[item.lineno - 1 : item.end_lineno])
  return ""


def _error_line(error: str) -> str:
  """An error line that does not depend on the Python version: an assertion's
  message, else the exception's type."""
  if error.startswith("AssertionError"):
    return error
  return error.split(":", 1)[0] or error


def problem_statement(test_path: str, test_id: str, test_text: str, error: str) -> str:
  cls, method = test_id.split(".")[-2:]
  source = "".join(
    "    " + line if line.strip() else line
    for line in _test_source(test_text, test_id).splitlines(keepends=True)
  )
  return (
    f"The test `{test_path}::{cls}::{method}` fails:\n\n{source}\n"
    f"It fails with: {_error_line(error)}\n\n"
    "Find the bug in the repository's code and fix it. The tests themselves are not "
    "in the repository; they will be run after you submit. Do not add or change "
    "tests."
  )


def _projects(corpus: str) -> list[tuple[str, str, str, str]]:
  """(project, module path in repo, module name, test file path in tests/) in order."""
  out = []
  for project in sorted(os.listdir(corpus)):
    repo = os.path.join(corpus, project, "repo")
    tests = os.path.join(corpus, project, "tests")
    if not os.path.isdir(repo) or not os.path.isdir(tests):
      continue
    test_files = sorted(f for f in os.listdir(tests) if f.startswith("test_") and f.endswith(".py"))
    for test_file in test_files:
      module = test_file[len("test_") : -len(".py")]
      rel = os.path.join(project, module + ".py")
      if os.path.isfile(os.path.join(repo, rel)):
        out.append((project, rel, f"{project}.{module}", test_file))
  return out


def generate(
  corpus: str = CORPUS_DIR, out_dir: str | None = None, repo_base: str | None = None
) -> tuple[list[dict], list[dict]]:
  """(training rows, held-out rows) of the corpus; written to out_dir if given.

  Rows name their snapshot relative to `repo_base` (default: out_dir, where
  the rows are read from; else the shipped sets' directory).
  """
  rows_by_split: dict[str, list[dict]] = {"train": [], "heldout": []}
  function_index = 0
  base = os.path.abspath(repo_base or out_dir or SHIPPED_DIR)
  for project, rel, module, test_file in _projects(corpus):
    repo = os.path.join(corpus, project, "repo")
    tests_dir = os.path.join(corpus, project, "tests")
    with open(os.path.join(repo, rel), encoding="utf-8") as f:
      original = f.read()
    with open(os.path.join(tests_dir, test_file), encoding="utf-8") as f:
      test_text = f.read()
    test_module = test_file[: -len(".py")]
    candidates = mutants(original)
    results = run_mutants(
      repo, tests_dir, module, rel, test_module, [original] + [m.source for m in candidates]
    )
    if results[0]["status"] != "pass":
      raise RuntimeError(f"{project}/{rel}: the original fails its tests: {results[0]}")
    num_tests = results[0]["run"]
    split_of = {}
    for name in dict.fromkeys(m.function for m in candidates):
      split_of[name] = "heldout" if function_index % HELDOUT_EVERY == HELDOUT_EVERY - 1 else "train"
      function_index += 1
    counts: dict[tuple[str, str], int] = {}
    for mutant, result in zip(candidates, results[1:]):
      if result["status"] != "fail" or not result["test"]:
        continue
      key = (mutant.function, mutant.kind)
      counts[key] = counts.get(key, 0) + 1
      old, new, _, _ = reverse_edit(original, mutant.source)
      test_path = f"tests/{test_file}"
      rows_by_split[split_of[mutant.function]].append(
        {
          "instance_id": f"{project}__{test_module[5:]}__{mutant.function}__{mutant.kind}_"
          f"{counts[key]}",
          "repo": os.path.relpath(repo, base),
          "problem_statement": problem_statement(
            test_path, result["test"], test_text, result["error"]
          ),
          "test_command": f"python3 -m unittest tests.{test_module}",
          "tests": {test_path: test_text},
          "test_modules": [f"tests.{test_module}"],
          "num_tests": num_tests,
          "setup_files": {rel: mutant.source},
          "fix": [{"path": rel, "old": old, "new": new}],
        }
      )
  train, heldout = rows_by_split["train"], rows_by_split["heldout"]
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
    for name, rows in (
      (os.path.basename(SHIPPED_TRAIN), train),
      (os.path.basename(SHIPPED_HELDOUT), heldout),
    ):
      text = "".join(json.dumps(row, sort_keys=True, ensure_ascii=True) + "\n" for row in rows)
      with open(os.path.join(out_dir, name), "wb") as raw:
        # No name and no time in the header: the same rows, the same bytes.
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
          f.write(text.encode("ascii"))
  return train, heldout


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out_dir", default=SHIPPED_DIR)
  parser.add_argument("--corpus", default=CORPUS_DIR)
  args = parser.parse_args(argv)
  train, heldout = generate(args.corpus, args.out_dir)
  print(f"{len(train)} training and {len(heldout)} held-out tasks in {args.out_dir}")


if __name__ == "__main__":
  main()
