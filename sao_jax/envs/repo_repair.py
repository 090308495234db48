"""repo_repair: fix a bug in a repository with a shell and file-editing tools.

    env.name = "repo_repair"
    env.tokenizer = "qwen3"; env.chat_format = "qwen3"
    env.kwargs = {"path": "my_tasks.jsonl", "heldout_path": "my_heldout.jsonl",
                  "max_turns": 30}                                     # optional

A task (`sao_jax.envs.repo_tasks`: a row names a repository snapshot, a
problem statement, a test command and hidden tests) becomes a system
message, a user message with the problem, the test command and the file
list, and five tools in the chat format's tool calls:

    bash(command)                  /bin/sh in the sandbox, working directory /repo
    view(path, start_line?, end_line?)   a file with line numbers, or a directory
    str_replace(path, old_str, new_str)  replace the one occurrence of old_str
    create(path, content)          write a file (made or replaced)
    submit()                       end the episode; the hidden tests decide

Each episode works on a private copy of the task's starting tree (never its
hidden tests). `bash` runs in `sandbox.run_shell` with the copy at /repo;
the edit tools run trainer-side, confined to the copy. Refusals and limits
are error answers, counted ("path_refused", "output_truncated",
"bash_timeout", "tool_bad_arguments", "tool_error", "bash_disk_limit"), and
the episode goes on; a copy past `max_tree_files` / `max_tree_bytes` after
a step ends it unfixed ("tree_too_large").

Reward, once the policy submits or runs out of turns (`max_turns`), from a
verdict nothing in the candidate's tree or processes can forge:

    1. the final tree is copied (nothing followed) into a fresh directory;
    2. hidden tests' directories changed from the starting tree: verdict
       "tests_edited";
    3. what the import system would prefer to the sources (caches,
       extension modules, *.pth, sitecustomize.py, conftest.py, modules
       named like standard ones) is removed unless the task ships it;
    4. with `test_modules`, a fresh sandbox runs the judge
       (sao_jax/envs/repo_judge.py), whose exit status is the verdict;
    5. without `test_modules` (a user's SWE-bench-style rows) the verdict
       is `test_command`'s exit status, which the repository's code can
       forge: give rows `test_modules` for the guarantee.

Reward 1.0 iff the verdict is "passed". `info["verdict"]`: "passed",
"failed", "error" (no verdict: the judge was killed, the tests crashed),
"timeout", "tree_too_large" or "tests_edited". A grader that could not run
is retried and then raises `GraderError`: the driver runs the episode again
instead of scoring it.

Not SWE-Bench Verified: no Docker images, so a task's environment is the
machine's /usr (its Python, without site-packages in grading). Why each
step, and the threat model: docs/design/graders.md and docs/DESIGN.md ("The
repo_repair grader's threat model").
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shlex
import shutil
import stat
import sys
import tempfile
import threading
import weakref
from typing import Any

from sao_jax.data.prompts import EVAL_OFFSET
from sao_jax.envs import repo_judge, repo_tasks, sandbox
from sao_jax.envs.base import GraderError, StepResult, Task
from sao_jax.envs.dataset import ToolBudget, ToolMeter, answer_tool_calls
from sao_jax.envs.sandbox import SandboxLimits, Workspace

SYSTEM_PROMPT = (
  "You fix a bug in the Python repository in /repo, your working directory. Read the "
  "code with view or bash, edit it with str_replace or create, and call submit when "
  "the fix is done. Hidden tests decide whether it is fixed."
)


def _tool(name: str, description: str, properties: dict, required: tuple) -> dict:
  return {
    "type": "function",
    "function": {
      "name": name,
      "description": description,
      "parameters": {"type": "object", "properties": properties, "required": list(required)},
    },
  }


_STR, _INT = {"type": "string"}, {"type": "integer"}
TOOLS = (
  _tool(
    "bash", "Run a shell command in /repo; returns its output.", {"command": _STR}, ("command",)
  ),
  _tool(
    "view",
    "Show a file with line numbers (optionally lines start_line..end_line) or list a directory.",
    {"path": _STR, "start_line": _INT, "end_line": _INT},
    ("path",),
  ),
  _tool(
    "str_replace",
    "Replace the one occurrence of old_str in a file by new_str.",
    {"path": _STR, "old_str": _STR, "new_str": _STR},
    ("path", "old_str", "new_str"),
  ),
  _tool(
    "create",
    "Write a file with the given content.",
    {"path": _STR, "content": _STR},
    ("path", "content"),
  ),
  _tool("submit", "Submit the repository as it is now.", {}, ()),
)
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)
VERDICTS = ("passed", "failed", "error", "timeout", "tree_too_large", "tests_edited")
# Attempts at grading one tree before the grader gives up (GraderError).
GRADE_ATTEMPTS = 3
_GRADER_DIR = ".sao_grader"
# The judge (module docstring, step 4): its file, and its exit statuses.
_JUDGE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "repo_judge.py")
_JUDGE_VERDICTS = {
  repo_judge.PASSED: "passed",
  repo_judge.FAILED: "failed",
  repo_judge.BROKEN: "error",
}
# What the import system prefers to a source (module docstring, step 3).
_ARTIFACT_NAMES = ("__pycache__", "sitecustomize.py", "usercustomize.py", "conftest.py")
_ARTIFACT_SUFFIXES = (".pyc", ".pyo", ".so", ".pyd", ".pth")


@dataclasses.dataclass(frozen=True)
class RepoRepairConfig:
  # Task rows (sao_jax.envs.repo_tasks); defaults: the shipped generated sets.
  path: str = repo_tasks.SHIPPED_TRAIN
  heldout_path: str = repo_tasks.SHIPPED_HELDOUT
  system_prompt: str = SYSTEM_PROMPT
  # Turns an episode may take (the paper's coding agent: up to 300).
  max_turns: int = 8
  # Any bad row fails the build (default: refused rows are reported and skipped).
  strict: bool = False
  # The most characters a tool answer holds (bash output, a view).
  max_output_chars: int = 2000
  # A bash call's wall clock and CPU seconds; the grading run's wall clock. A
  # step's tools (env.tool_seconds_per_turn) plus the grading run must fit in
  # rollout.env_timeout (60 s by default), or the driver gives up on the step.
  bash_seconds: float = 10.0
  test_seconds: float = 20.0
  # The largest file the sandbox may write and the edit tools read or write.
  max_file_bytes: int = 1 << 20
  # The repository copy's limits (with the shell's /tmp: held during every
  # bash call and grading run, as the sandbox's disk limits), checked after every step.
  max_tree_files: int = 2000
  max_tree_bytes: int = 16 << 20
  # Files listed in the prompt (0: none).
  list_files: int = 40
  # Test-only: without the sandbox, bash refuses and nothing is graded.
  use_sandbox: bool = True

  @property
  def needs_shell(self) -> bool:
    """bash and the grader run shell commands (`sandbox.check_isolation(shell=True)`)."""
    return True


class PathRefused(Exception):
  """A tool's path that is not inside the repository copy."""


class TreeTooLarge(Exception):
  """The repository copy is over max_tree_files / max_tree_bytes."""


# --- files, confined to a tree -------------------------------------------------------


def resolve(root: str, path: str, mount: str = "/repo") -> str:
  """The real path of `path` (relative to the tree, or absolute under `mount`) if
  it lies inside `root`, else PathRefused. Links are followed to decide; no
  process runs in the tree meanwhile (every sandbox call is over)."""
  if not isinstance(path, str) or not path or "\x00" in path:
    raise PathRefused("a path must be a non-empty string")
  if os.path.isabs(path):
    norm = os.path.normpath(path)
    if norm != mount and not norm.startswith(mount + "/"):
      raise PathRefused(f"{path!r} is outside the repository ({mount})")
    path = os.path.relpath(norm, mount)
  real_root = os.path.realpath(root)
  real = os.path.realpath(os.path.join(real_root, path))
  if real != real_root and not real.startswith(real_root + os.sep):
    raise PathRefused(f"{path!r} resolves outside the repository")
  return real


def _remove(path: str) -> None:
  """Removes `path` if there: a real directory with its tree, anything else itself."""
  try:
    st = os.lstat(path)
  except FileNotFoundError:
    return
  if stat.S_ISDIR(st.st_mode):
    shutil.rmtree(path)
  else:
    os.unlink(path)


def write_inside(root: str, rel: str, text: str) -> None:
  """Writes `rel` (a safe relative path) under `root`, replacing whatever is on
  the way that is not a real directory (links are removed, never followed)."""
  parts = rel.split(os.sep)
  cur = root
  for part in parts[:-1]:
    cur = os.path.join(cur, part)
    try:
      st = os.lstat(cur)
    except FileNotFoundError:
      os.mkdir(cur, 0o755)
      continue
    if not stat.S_ISDIR(st.st_mode):
      os.unlink(cur)
      os.mkdir(cur, 0o755)
  target = os.path.join(cur, parts[-1])
  _remove(target)
  fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    f.write(text)


def copy_tree(src: str, dst: str, max_files: int, max_bytes: int) -> None:
  """Regular files, directories and symlinks (as links) of `src` into the new
  directory `dst`; other files are left out; nothing is followed. TreeTooLarge
  past the limits."""
  files = size = 0
  os.makedirs(dst, exist_ok=True)
  for root, dirs, names in os.walk(src, followlinks=False):
    out_root = os.path.join(dst, os.path.relpath(root, src))
    for name in dirs + names:
      s, d = os.path.join(root, name), os.path.join(out_root, name)
      st = os.lstat(s)
      files += 1
      if files > max_files:
        raise TreeTooLarge(f"over {max_files} files")
      if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(s), d)
      elif stat.S_ISDIR(st.st_mode):
        os.mkdir(d, 0o755)
      elif stat.S_ISREG(st.st_mode):
        size += st.st_size
        if size > max_bytes:
          raise TreeTooLarge(f"over {max_bytes} bytes")
        fd = os.open(s, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f, open(d, "wb") as g:
          shutil.copyfileobj(f, g)
    dirs[:] = [n for n in dirs if not os.path.islink(os.path.join(root, n))]


def tree_size(root: str) -> tuple[int, int]:
  """(entries, bytes of regular files) under `root`, nothing followed."""
  files = size = 0
  for top, dirs, names in os.walk(root, followlinks=False):
    files += len(dirs) + len(names)
    for name in names:
      try:
        st = os.lstat(os.path.join(top, name))
      except OSError:
        continue
      if stat.S_ISREG(st.st_mode):
        size += st.st_size
  return files, size


def _listing(root: str, limit: int) -> list[str]:
  out = []
  for top, dirs, names in os.walk(root, followlinks=False):
    dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
    for name in sorted(names):
      out.append(os.path.relpath(os.path.join(top, name), root))
  return out[:limit] + ([f"... ({len(out) - limit} more)"] if len(out) > limit else [])


def _cap(text: str, limit: int) -> tuple[str, bool]:
  if len(text) <= limit:
    return text, False
  return text[:limit] + "\n...[truncated]", True


# --- the environment ---------------------------------------------------------------


class RepoRepair:
  """The environment family over repository-repair rows (module docstring)."""

  name = "repo_repair"
  runs_code = True

  def __init__(
    self, config: RepoRepairConfig = RepoRepairConfig(), limits: SandboxLimits = SandboxLimits()
  ):
    if config.max_turns < 1:
      raise ValueError(f"env.kwargs.max_turns = {config.max_turns}: must be >= 1")
    self.config, self.max_turns = config, config.max_turns
    self.tool_budget = ToolBudget()  # registry.make_env sets env config's
    train, bad = repo_tasks.load_tasks(config.path, strict=config.strict)
    heldout, bad_heldout = repo_tasks.load_tasks(config.heldout_path, strict=config.strict)
    self.train_tasks, self.heldout_tasks = train, heldout
    self.rejected = bad + bad_heldout
    self.num_eval_tasks = len(heldout)
    self.data_counts = {"rejected": len(self.rejected)}
    self._demo = [i for i, t in enumerate(train) if t.fix]
    _report(config, train, heldout, self.rejected)
    # The bash tool's limits: env.sandbox's, with what a shell needs.
    self.shell_limits = dataclasses.replace(
      limits,
      wall_seconds=config.bash_seconds,
      cpu_seconds=max(1, int(config.bash_seconds)),
      max_output_chars=config.max_output_chars,
      max_file_bytes=config.max_file_bytes,
      max_open_files=max(limits.max_open_files, 64),
      max_processes=max(limits.max_processes, 32),
      max_disk_bytes=config.max_tree_bytes,
      max_disk_files=config.max_tree_files,
    )
    self.test_limits = dataclasses.replace(
      self.shell_limits,
      wall_seconds=config.test_seconds,
      cpu_seconds=max(1, int(config.test_seconds)),
    )
    self.python = _sandbox_python()
    # Where the trainer's package and the task rows lie: hidden from the shell
    # should a system directory hold them (an install under /usr, say).
    self.hide = tuple(
      sorted(
        {
          os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
          os.path.dirname(os.path.abspath(config.path)),
          os.path.dirname(os.path.abspath(config.heldout_path)),
        }
      )
    )

  # --- tasks ------------------------------------------------------------------

  def row(self, index: int) -> repo_tasks.RepoTask:
    if index >= EVAL_OFFSET:
      return self.heldout_tasks[(index - EVAL_OFFSET) % len(self.heldout_tasks)]
    return self.train_tasks[index % len(self.train_tasks)]

  def task(self, index: int) -> Task:
    row = self.row(index)
    user = f"{row.problem}\n\nThe tests are run with: {row.test_command}"
    if self.config.list_files:
      with tempfile.TemporaryDirectory(prefix="sao_repo_list_") as tmp:
        start_tree(row, tmp)
        files = _listing(tmp, self.config.list_files)
      user += "\n\nFiles in /repo:\n" + "\n".join(files)
    messages = (
      {"role": "system", "content": self.config.system_prompt},
      {"role": "user", "content": user},
    )
    return Task(index, messages, None, {"instance_id": row.instance_id, "where": row.where}, TOOLS)

  def demonstration_task(self, index: int) -> Task:
    """The task of training row `index` among the rows with a `fix`."""
    if not self._demo:
      raise ValueError(
        f"{self.config.path}: no row has a fix to demonstrate; set sft.steps = 0 or add fixes"
      )
    return self.task(self._demo[index % len(self._demo)])

  def demonstration(self, task: Task) -> list[tuple[dict, list]]:
    """view the lines of each edit, str_replace them, submit: the tool answers
    are what this environment returns for those calls."""
    row = self.row(task.index)
    if not row.fix:
      raise ValueError(f"{row.where}: the row has no fix")
    turns = []
    with tempfile.TemporaryDirectory(prefix="sao_repo_demo_") as tmp:
      start_tree(row, tmp)
      tools = _Tools(self, tmp)
      for path, old, new in row.fix:
        with open(os.path.join(tmp, path), encoding="utf-8") as f:
          text = f.read()
        if text.count(old) != 1:
          raise ValueError(f"{row.where}: fix for {path}: old text occurs {text.count(old)} times")
        first = text[: text.index(old)].count("\n") + 1
        last = first + old.count("\n")
        for name, args in (
          ("view", {"path": path, "start_line": max(1, first - 3), "end_line": last + 2}),
          ("str_replace", {"path": path, "old_str": old, "new_str": new}),
        ):
          answer = tools.call(name, args)
          turns.append(
            (
              {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"name": name, "arguments": args}],
              },
              [{"role": "tool", "content": answer}],
            )
          )
    turns.append(
      (
        {"role": "assistant", "content": "", "tool_calls": [{"name": "submit", "arguments": {}}]},
        [],
      )
    )
    return turns

  def episode(self, task: Task) -> "_Episode":
    return _Episode(self, self.row(task.index))

  # --- grading ------------------------------------------------------------------

  def grade(self, row: repo_tasks.RepoTask, tree: str) -> tuple[str, str]:
    """(verdict, detail) of the final `tree` (module docstring); GraderError when
    the grader itself cannot run, after GRADE_ATTEMPTS."""
    verdict, detail, _ = self.grade_with_events(row, tree)
    return verdict, detail

  def grade_with_events(
    self, row: repo_tasks.RepoTask, tree: str
  ) -> tuple[str, str, tuple[str, ...]]:
    """`grade`, and the events to count ("tests_edited", "untracked_code_removed")."""
    if not self.config.use_sandbox:
      raise RuntimeError("repo_repair without the sandbox is for tests only")
    shipped = _shipped(row)
    problem = ""
    for _ in range(GRADE_ATTEMPTS):
      with tempfile.TemporaryDirectory(prefix="sao_repo_grade_") as tmp:
        copy = os.path.join(tmp, "repo")
        try:
          copy_tree(tree, copy, self.config.max_tree_files, self.config.max_tree_bytes)
        except TreeTooLarge as e:
          return "tree_too_large", str(e), ()
        _remove(os.path.join(copy, _GRADER_DIR))  # whatever the candidate left there
        found, want = _inventory(copy, shipped.harness), shipped.entries
        edited = sorted(
          rel
          for rel in set(found) | set(want)
          if _under(rel, shipped.harness) and found.get(rel) != want.get(rel)
        )
        if edited:
          return (
            "tests_edited",
            "changed under the tests' directories: " + ", ".join(edited[:5]),
            ("tests_edited",),
          )
        removed = sorted(
          rel for rel, print_ in found.items() if _is_artifact(rel) and want.get(rel) != print_
        )
        for rel in removed:  # a directory before what it holds
          _remove(os.path.join(copy, rel))
        events = ("untracked_code_removed",) if removed else ()
        command = self._prepare(row, copy, shipped)
        result = sandbox.run_shell(command, Workspace(copy, hide=self.hide), self.test_limits)
        # Said by the sandbox itself, never by the candidate's output.
        if result.mount_error or result.error.startswith("sandbox:"):
          problem = result.mount_error or result.error
          continue
        if result.timed_out:
          return "timeout", f"the tests ran past {self.test_limits.wall_seconds:g}s", events
        if not row.test_modules:
          return (
            ("passed", "", events)
            if result.returncode == 0
            else ("failed", f"exit status {result.returncode}", events)
          )
        report = (
          result.stdout[result.stdout.find("judge: ") :] if "judge: " in result.stdout else ""
        )
        said = " ".join(report.split()) or f"exit status {result.returncode}"
        if result.returncode == repo_judge.UNPROTECTED:  # before any repository code ran
          problem = said
          continue
        return _JUDGE_VERDICTS.get(result.returncode, "error"), said[:300], events
    raise GraderError(f"repo_repair grader: the test sandbox did not run: {problem}")

  def _prepare(self, row: repo_tasks.RepoTask, copy: str, shipped: "_Shipped") -> str:
    """Writes the hidden tests (into the copy, or the judge's job) and returns the command."""
    modules = [(rel, text) for rel, text in row.tests if _is_module_path(rel)]
    for rel, text in row.tests:
      if not row.test_modules or (rel, text) not in modules:
        write_inside(copy, rel, text)
    if not row.test_modules:
      return row.test_command
    write_inside(copy, os.path.join(_GRADER_DIR, "judge.py"), _judge_text())
    write_inside(
      copy,
      repo_judge.JOB,
      json.dumps(
        {
          "files": modules,
          "modules": list(row.test_modules),
          "num_tests": row.num_tests,
          "repository": list(shipped.top_names),
        }
      ),
    )
    return f"exec {shlex.quote(self.python)} -I -S -B {_GRADER_DIR}/judge.py"


# --- what the task ships, where the grader judges by path ----------------------------


@dataclasses.dataclass(frozen=True)
class _Shipped:
  """A task's starting tree where grading looks by path: the harness (the hidden
  tests' directories, or the files themselves at the top), the fingerprints of
  what lies under it and of import artifacts (`_is_artifact`), and the
  top-level importable names (the judge proxies those)."""

  harness: tuple[str, ...]
  entries: dict
  top_names: tuple[str, ...]


@functools.lru_cache(maxsize=256)
def _shipped(row: repo_tasks.RepoTask) -> _Shipped:
  harness = tuple(sorted({os.path.dirname(rel) or rel for rel, _ in row.tests}))
  with tempfile.TemporaryDirectory(prefix="sao_repo_shipped_") as tmp:
    start_tree(row, tmp)
    tops = sorted(
      {
        n[:-3] if n.endswith(".py") else n
        for n in os.listdir(tmp)
        if (n[:-3] if n.endswith(".py") else n).isidentifier()
      }
    )
    return _Shipped(harness, _inventory(tmp, harness), tuple(tops))


def _under(rel: str, harness: tuple[str, ...]) -> bool:
  return any(rel == h or rel.startswith(h + os.sep) for h in harness)


def _is_artifact(rel: str) -> bool:
  """Whether the import system would take `rel` over a source (module docstring, step 3)."""
  parts = rel.split(os.sep)
  name = parts[-1]
  if "__pycache__" in parts or name in _ARTIFACT_NAMES or name.endswith(_ARTIFACT_SUFFIXES):
    return True
  return len(parts) == 1 and name.removesuffix(".py") in sys.stdlib_module_names


def _is_module_path(rel: str) -> bool:
  return rel.endswith(".py") and all(p.isidentifier() for p in rel[:-3].split(os.sep))


def _inventory(root: str, harness: tuple[str, ...]) -> dict:
  """{relative path: fingerprint} of what lies under `harness` or is an import
  artifact, in the tree `root`; nothing followed."""
  out = {}
  for top, dirs, names in os.walk(root, followlinks=False):
    for name in dirs + names:
      path = os.path.join(top, name)
      rel = os.path.relpath(path, root)
      if _under(rel, harness) or _is_artifact(rel):
        out[rel] = _fingerprint(path)
  return out


def _fingerprint(path: str) -> tuple:
  st = os.lstat(path)
  if stat.S_ISLNK(st.st_mode):
    return ("link", os.readlink(path))
  if stat.S_ISDIR(st.st_mode):
    return ("dir",)
  if not stat.S_ISREG(st.st_mode):
    return ("other", stat.S_IFMT(st.st_mode))
  fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
  with os.fdopen(fd, "rb") as f:
    return ("file", hashlib.sha256(f.read()).hexdigest())


@functools.lru_cache(maxsize=1)
def _judge_text() -> str:
  with open(_JUDGE_PATH, encoding="utf-8") as f:
    return f.read()


def _sandbox_python() -> str:
  """The python3 a shell in the sandbox finds (the system's, else the trainer's base)."""
  for d in sandbox.SHELL_PATH.split(":"):
    if os.access(os.path.join(d, "python3"), os.X_OK):
      return os.path.join(d, "python3")
  import sys

  return os.path.join(os.path.realpath(sys.base_prefix), "bin", "python3")


def start_tree(row: repo_tasks.RepoTask, dest: str) -> None:
  """A task's starting tree in the empty directory `dest`: the snapshot, then
  `setup_files` over it (hidden tests are not in it)."""
  repo_tasks.extract_snapshot(row.repo, dest)
  for rel, text in row.setup_files:
    write_inside(dest, rel, text)


# --- an episode ------------------------------------------------------------------------


class _Tools:
  """The tool calls on one repository copy; each returns the tool's answer and
  records its events."""

  def __init__(self, env: RepoRepair, root: str):
    self.env, self.root, self.events = env, root, []
    self.mount = Workspace(root).path

  def call(self, name: str, arguments: dict, seconds: float | None = None) -> str:
    try:
      if name == "bash":
        return self.bash(_arg(arguments, "command", str), seconds)
      if name == "view":
        return self.view(
          _arg(arguments, "path", str),
          _arg(arguments, "start_line", int, None),
          _arg(arguments, "end_line", int, None),
        )
      if name == "str_replace":
        return self.str_replace(
          _arg(arguments, "path", str),
          _arg(arguments, "old_str", str),
          _arg(arguments, "new_str", str),
        )
      if name == "create":
        return self.create(_arg(arguments, "path", str), _arg(arguments, "content", str))
    except _BadArgument as e:
      self.events.append("tool_bad_arguments")
      return f"error: {name}: {e}"
    except PathRefused as e:
      self.events.append("path_refused")
      return f"error: {name}: {e}"
    self.events.append("tool_bad_arguments")
    return f"error: no tool {name!r}; the tools are {', '.join(TOOL_NAMES)}"

  def _answer(self, text: str) -> str:
    text, cut = _cap(text, self.env.config.max_output_chars)
    if cut:
      self.events.append("output_truncated")
    return text

  def bash(self, command: str, seconds: float | None) -> str:
    if not self.env.config.use_sandbox:
      raise RuntimeError("the bash tool without the sandbox is for tests only")
    limits = self.env.shell_limits
    if seconds is not None and seconds < limits.wall_seconds:
      limits = dataclasses.replace(limits, wall_seconds=max(seconds, 0.05))
    result = sandbox.run_shell(command, Workspace(self.root, hide=self.env.hide), limits)
    if result.timed_out:
      self.events.append("bash_timeout")
    if result.disk_limit:
      self.events.append("bash_disk_limit")
    if result.stdout.endswith("...[truncated]"):
      self.events.append("output_truncated")
    out = result.stdout
    if not result.ok:
      note = result.error or f"exit status {result.returncode}"
      out = out + ("\n" if out and not out.endswith("\n") else "") + f"[{note}]"
    return out or "(no output)"

  def _file(self, path: str) -> tuple[str, str]:
    real = resolve(self.root, path, self.mount)
    try:
      st = os.stat(real)
    except FileNotFoundError:
      raise PathRefused(f"{path!r} does not exist") from None
    if stat.S_ISDIR(st.st_mode):
      return real, ""
    if not stat.S_ISREG(st.st_mode):
      raise PathRefused(f"{path!r} is not a regular file")
    if st.st_size > self.env.config.max_file_bytes:
      raise PathRefused(f"{path!r} is over {self.env.config.max_file_bytes} bytes")
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
      data = f.read(self.env.config.max_file_bytes + 1)
    return real, data.decode("utf-8", errors="replace")

  def view(self, path: str, start: int | None, end: int | None) -> str:
    real, text = self._file(path)
    if os.path.isdir(real):
      return self._answer("\n".join(_listing(real, 200)) or "(empty directory)")
    lines = text.splitlines()
    lo = max(1, start or 1)
    hi = min(len(lines), end if end is not None else len(lines))
    if lines and lo > hi:
      raise _BadArgument(f"no lines {lo}..{hi} in a file of {len(lines)} lines")
    return self._answer(
      "".join(f"{k:6d}\t{lines[k - 1]}\n" for k in range(lo, hi + 1)) or "(empty file)"
    )

  def str_replace(self, path: str, old: str, new: str) -> str:
    real, text = self._file(path)
    if os.path.isdir(real):
      raise _BadArgument(f"{path!r} is a directory")
    if not old:
      raise _BadArgument("old_str is empty")
    count = text.count(old)
    if count != 1:
      return f"error: str_replace: old_str occurs {count} times in {path}; it must occur once"
    return self._write(real, text.replace(old, new), f"edited {path}")

  def create(self, path: str, content: str) -> str:
    real = resolve(self.root, path, self.mount)
    if os.path.lexists(real) and not os.path.isfile(real):
      raise PathRefused(f"{path!r} exists and is not a regular file")
    os.makedirs(os.path.dirname(real), exist_ok=True)
    return self._write(real, content, f"wrote {path}")

  def _write(self, real: str, text: str, answer: str) -> str:
    data = text.encode("utf-8")
    if len(data) > self.env.config.max_file_bytes:
      raise _BadArgument(f"the file would be over {self.env.config.max_file_bytes} bytes")
    if os.path.lexists(real):
      os.unlink(real)  # a regular file (checked): replaced, not written through
    fd = os.open(real, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    return answer


class _BadArgument(Exception):
  pass


_MISSING = object()


def _arg(arguments: dict, name: str, kind: type, default: Any = _MISSING):
  value = arguments.get(name, default) if isinstance(arguments, dict) else _MISSING
  if value is _MISSING:
    raise _BadArgument(f"missing argument {name!r}")
  if value is not default and (isinstance(value, bool) or not isinstance(value, kind)):
    raise _BadArgument(f"argument {name!r} must be {kind.__name__}")
  if isinstance(value, str):
    if "\x00" in value:
      raise _BadArgument(f"argument {name!r} holds a NUL character")
    try:
      value.encode("utf-8")
    except UnicodeEncodeError:
      raise _BadArgument(f"argument {name!r} is not valid Unicode text") from None
  return value


class _Episode:
  def __init__(self, env: RepoRepair, row: repo_tasks.RepoTask):
    self._env, self._row, self._turns = env, row, 0
    self._meter = ToolMeter(env.tool_budget)
    self._dir = tempfile.mkdtemp(prefix="sao_repo_")
    # Removed when the episode ends, or is dropped unfinished.
    self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, True)
    self.root = os.path.join(self._dir, "repo")
    os.mkdir(self.root)
    start_tree(row, self.root)
    self._tools = _Tools(env, self.root)
    self._done = False

  def step(self, action: str) -> StepResult:
    if self._done:
      raise RuntimeError("the episode is over")
    self._turns += 1
    tools = self._tools
    tools.events = []
    submitted = []

    def call(name, arguments, seconds=None):
      if submitted:
        return "error: already submitted; this call was not run"
      if name == "submit":
        submitted.append(True)
        return "submitted"
      return tools.call(name, arguments, seconds)

    sequence = getattr(action, "tool_sequence", ())
    if not sequence:
      messages, events = (
        [
          {
            "role": "user",
            "content": (
              "No tool call in that turn. Use the tools; call submit when the fix is done."
            ),
          }
        ],
        [],
      )
      tools.events.append("no_tool_call")
    else:
      messages, events = answer_tool_calls(action, call, self._meter)
    events = list(dict.fromkeys(events + tools.events))
    files, size = tree_size(self.root)
    too_large = files > self._env.config.max_tree_files or size > self._env.config.max_tree_bytes
    if too_large:
      events.append("tree_too_large")
    if submitted or too_large or self._turns >= self._env.max_turns:
      self._done = True
      try:
        if too_large:
          verdict, detail = "tree_too_large", f"{files} entries, {size} bytes"
        else:
          verdict, detail, graded = self._env.grade_with_events(self._row, self.root)
          events += [e for e in graded if e not in events]
      finally:
        self._cleanup()
      info = {
        "correct": verdict == "passed",
        "verdict": verdict,
        "detail": detail,
        "events": events,
      }
      if not submitted:
        info["finish_reason"] = "tree_too_large" if too_large else "max_turns"
      return StepResult("", float(verdict == "passed"), True, info)
    return StepResult(messages, 0.0, False, {"correct": False, "events": events})


_REPORT_LOCK = threading.Lock()


def _report(config: RepoRepairConfig, train, heldout, rejected) -> None:
  with _REPORT_LOCK:
    print(
      f"[repo_repair] {config.path}: {len(train)} training tasks, {config.heldout_path}: "
      f"{len(heldout)} held-out, {len(rejected)} rows refused",
      flush=True,
    )
    for where, reason in rejected[:20]:
      print(f"[repo_repair]   refused {where}: {reason}", flush=True)
    if len(rejected) > 20:
      print(f"[repo_repair]   ... and {len(rejected) - 20} more", flush=True)
    by_status = sum(not t.test_modules for t in train + heldout)
    if by_status:
      print(
        f"[repo_repair] {by_status} rows have no test_modules: graded by their test "
        "command's exit status, which the repository's code can forge",
        flush=True,
      )
