"""repo_repair: the tools, their confinement, the grader's independence, the task rows.

The chain test (configs/repo_repair_tiny.py cut to one step of each stage) runs
with SAO_REPO_REPAIR_CHAIN_TEST=1 (about 110 s of CPU).

Every tool call is driven the way the rollout driver drives it: an `Action`
whose tool calls the chat format parsed (or failed to parse). The shell
checks need the sandbox's shell isolation; they skip with the reason where
this machine refuses mount namespaces.
"""

import gzip
import json
import os
import tarfile

import ml_collections
import pytest

from sao_jax.envs import chat, registry, repo_repair, repo_tasks, sandbox
from sao_jax.envs.base import Action, GraderError
from sao_jax.envs.demonstrations import demonstration_trajectory

_APPLIED, _MOUNT_ERROR = sandbox.shell_isolation()
needs_shell = pytest.mark.skipif(
  "chroot" not in _APPLIED or "mounts" not in _APPLIED,
  reason=f"no isolated shell here ({_MOUNT_ERROR or ', '.join(_APPLIED)})",
)

CONFIG = repo_repair.RepoRepairConfig(
  max_turns=6, bash_seconds=2.0, test_seconds=30.0, max_output_chars=300
)


@pytest.fixture(scope="module")
def env():
  return repo_repair.RepoRepair(CONFIG)


def _act(*calls, errors=()):
  """A turn of tool calls: (name, arguments) pairs, and (reason, message) errors."""
  parsed = tuple(chat.ToolCall(n, a) for n, a in calls)
  return Action(
    "turn", tool_calls=parsed, tool_errors=tuple(errors), tool_sequence=tuple(errors) + parsed
  )


def _task_index(env, instance_id_part):
  return next(i for i, t in enumerate(env.train_tasks) if instance_id_part in t.instance_id)


def _fix_calls(env, index):
  """The demonstration's calls (view, str_replace, submit), as (name, arguments)."""
  return [
    (a["tool_calls"][0]["name"], a["tool_calls"][0]["arguments"])
    for a, _ in env.demonstration(env.task(index))
  ]


# --- the tools ---------------------------------------------------------------------


@needs_shell
def test_bash_runs_in_the_repository_copy_and_edits_persist(env):
  ep = env.episode(env.task(0))
  out = ep.step(_act(("bash", {"command": "pwd; ls; echo made > new.txt; id -u"})))
  text = out.observation[0]["content"]
  assert text.startswith("/repo\nconvkit\n") and not out.done
  assert os.path.isfile(os.path.join(ep.root, "new.txt"))  # the copy, not a scratch dir
  seen = ep.step(_act(("view", {"path": "new.txt"}), ("view", {"path": "/repo/new.txt"})))
  assert [m["content"] for m in seen.observation] == ["     1\tmade\n"] * 2
  # The hidden tests are nowhere in the tree, nor is the trainer's package.
  out = ep.step(_act(("bash", {"command": f"ls -a; ls tests; ls {repo_tasks.CORPUS_DIR}"})))
  text = out.observation[0]["content"]
  assert "tests" not in text.split("\n")[:6] and "No such file" in text
  assert "test_convert" not in text


@needs_shell
def test_output_cap_timeouts_and_fork_bombs_are_counted_not_fatal(env):
  ep = env.episode(env.task(0))
  out = ep.step(_act(("bash", {"command": "yes | head -c 100000"})))
  assert out.observation[0]["content"].endswith("...[truncated]")
  assert len(out.observation[0]["content"]) < 400
  assert "output_truncated" in out.info["events"]
  out = ep.step(_act(("bash", {"command": "sleep 100"})))
  assert "wall-clock" in out.observation[0]["content"] and "bash_timeout" in out.info["events"]
  out = ep.step(_act(("bash", {"command": "f() { f | f & }; f"})))
  assert not out.done  # whatever the bomb did, it is over and the episode goes on
  # A command far over an argument's size limit, a NUL, a lone surrogate: answered.
  out = ep.step(
    _act(
      ("bash", {"command": "echo " + "y" * 300_000 + " | wc -c"}),
      ("bash", {"command": "echo \x00"}),
      ("create", {"path": "a", "content": "\ud800"}),
    )
  )
  answers = [m["content"] for m in out.observation]
  assert answers[0] == "300001\n" and all(a.startswith("error:") for a in answers[1:])
  out = ep.step(_act(("bash", {"command": "echo alive"})))
  assert out.observation[0]["content"] == "alive\n"


@needs_shell
def test_paths_outside_the_copy_are_refused_and_counted(env, tmp_path):
  outside = tmp_path / "secret.txt"
  outside.write_text("secret\n")
  ep = env.episode(env.task(0))
  ep.step(_act(("bash", {"command": f"ln -s {outside} leak; ln -s {tmp_path} leakdir"})))
  attempts = [
    ("view", {"path": "../../../../../../etc/passwd"}),
    ("view", {"path": str(outside)}),
    ("view", {"path": "leak"}),
    ("str_replace", {"path": "leak", "old_str": "secret", "new_str": "x"}),
    ("create", {"path": "leakdir/new.txt", "content": "x"}),
    ("create", {"path": "/etc/evil", "content": "x"}),
  ]
  out = ep.step(_act(*attempts))
  answers = [m["content"] for m in out.observation]
  assert all(a.startswith("error:") for a in answers), answers
  assert out.info["events"] == ["path_refused"]
  assert outside.read_text() == "secret\n" and sorted(os.listdir(tmp_path)) == ["secret.txt"]


def test_malformed_and_wrong_calls_get_error_answers(env):
  ep = env.episode(env.task(0))
  out = ep.step(
    _act(
      ("view", {"path": 5}),
      ("view", {}),
      ("rm_rf", {"path": "/"}),
      ("str_replace", {"path": "convkit/convert.py", "old_str": "", "new_str": "x"}),
      ("view", {"path": "convkit/convert.py", "start_line": 500}),
      errors=[("bad_json", "not JSON")],
    )
  )
  answers = [m["content"] for m in out.observation]
  assert len(answers) == 6 and all(a.startswith("error:") for a in answers), answers
  assert set(out.info["events"]) == {"tool_error", "tool_bad_arguments"} and not out.done
  out = ep.step(Action("no tools at all"))
  assert out.info["events"] == ["no_tool_call"] and not out.done
  # An edit that matches twice is refused; one that matches once is made.
  out = ep.step(
    _act(("str_replace", {"path": "convkit/convert.py", "old_str": "return", "new_str": "x"}))
  )
  assert "occurs" in out.observation[0]["content"]


# --- grading ---------------------------------------------------------------------


@needs_shell
def test_the_fix_scores_one_and_the_unfixed_tree_zero(env):
  index = _task_index(env, "numkit__stats__median")
  calls = _fix_calls(env, index)
  ep = env.episode(env.task(index))
  for name, args in calls[:-1]:
    assert not ep.step(_act((name, args))).done
  out = ep.step(_act(calls[-1]))
  assert (out.reward, out.done, out.info["verdict"]) == (1.0, True, "passed")
  out = env.episode(env.task(index)).step(_act(("submit", {})))
  assert (out.reward, out.info["verdict"]) == (0.0, "failed")
  assert not os.path.exists(os.path.dirname(ep.root))  # the copy is gone with the episode


@needs_shell
@pytest.mark.parametrize(
  "hack",
  [
    "fake_unittest",
    "exit_at_import",
    "forged_verdict",
    "own_tests",
    "background_fix",
    "link_tests_out",
  ],
)
def test_nothing_the_candidate_ran_can_change_the_verdict(env, hack, tmp_path):
  """Each hack leaves the bug in place: the verdict stays "failed" or "error"."""
  index = _task_index(env, "numkit__stats__median")
  row = env.train_tasks[index]
  module = row.fix[0][0]
  ep = env.episode(env.task(index))
  command = {
    "fake_unittest": "printf 'import os\\nprint(\"OK\")\\nos._exit(0)\\n' > unittest.py",
    "exit_at_import": f"printf 'import os\\nos._exit(0)\\n' | cat - {module} > m && mv m {module}",
    "forged_verdict": (
      f"printf 'import os\\nprint(\"SAO-VERDICT x run={row.num_tests} "
      "failures=0 errors=0\")\\nos._exit(0)\\n' | cat - "
      f"{module} > m && mv m {module}; mkdir .sao_grader; "
      f"echo 'SAO-VERDICT x run={row.num_tests} failures=0 errors=0' > "
      ".sao_grader/verdict"
    ),
    "own_tests": "mkdir tests; printf 'import unittest\\nclass T(unittest.TestCase):\\n"
    "  def test_ok(self): pass\\n' > tests/test_stats.py",
    "background_fix": "(sleep 1; rm -rf numkit) > /dev/null 2>&1 &",
    "link_tests_out": f"ln -s {tmp_path} tests",
  }[hack]
  out = ep.step(_act(("bash", {"command": command})))
  assert not out.done, out
  out = ep.step(_act(("submit", {})))
  assert out.reward == 0.0 and out.info["verdict"] in ("failed", "error", "tests_edited"), out.info
  assert os.listdir(tmp_path) == []  # the grader never wrote through the candidate's link


@needs_shell
def test_a_grader_that_cannot_run_raises_grader_error(env, monkeypatch):
  monkeypatch.setattr(sandbox, "_MOUNTNS", False)
  ep = env.episode(env.task(0))
  with pytest.raises(GraderError, match="did not run"):
    ep.step(_act(("submit", {})))


@needs_shell
def test_without_mount_namespaces_the_shell_says_why_and_is_refused(monkeypatch, tmp_path):
  monkeypatch.setattr(sandbox, "_MOUNTNS", False)
  result = sandbox.run_shell("touch ran", sandbox.Workspace(str(tmp_path)))
  assert result.mount_error and "not run" in result.stdout and not os.listdir(tmp_path)
  assert "chroot" not in result.isolation and "mounts" not in result.isolation
  sandbox.shell_isolation.cache_clear()
  try:
    with pytest.raises(RuntimeError, match="chroot"):
      sandbox.check_isolation(False, shell=True)
  finally:
    sandbox.shell_isolation.cache_clear()


@needs_shell
def test_hidden_host_directories_are_empty_in_the_shell(tmp_path):
  hidden = next(
    (
      os.path.join("/usr/share", d)
      for d in sorted(os.listdir("/usr/share"))
      if os.path.isdir(os.path.join("/usr/share", d)) and os.listdir(os.path.join("/usr/share", d))
    ),
    None,
  )
  if hidden is None:
    pytest.skip("no non-empty directory under /usr/share")
  result = sandbox.run_shell(
    f"ls {hidden} | wc -l; ls -d /usr/bin", sandbox.Workspace(str(tmp_path), hide=(hidden,))
  )
  assert result.stdout.split() == ["0", "/usr/bin"], result


# --- demonstrations and the registry ---------------------------------------------------


@needs_shell
def test_demonstration_is_the_environment_s_own_transcript(env):
  from sao_jax.envs import tokenizer as tokenizers

  index = _task_index(env, "seqkit")
  task = env.task(index)
  demo = env.demonstration(task)
  assert [a["tool_calls"][0]["name"] for a, _ in demo] == ["view", "str_replace", "submit"]
  ep = env.episode(task)
  for action, observation in demo:
    call = action["tool_calls"][0]
    out = ep.step(_act((call["name"], call["arguments"])))
    if not out.done:
      assert out.observation == observation
  assert out.reward == 1.0
  tok = tokenizers.TOKENIZERS["qwen3"]()
  traj = demonstration_trajectory(env, task, tok, chat.make_format("qwen3", tok))
  assert traj.action_mask.sum() > 0 and traj.rewards.sum() == 1.0


def test_make_env_builds_it_with_the_shell_check(monkeypatch):
  seen = []
  monkeypatch.setattr(
    sandbox, "check_isolation", lambda allow, limits, shell=False: seen.append(shell)
  )
  env = registry.make_env(
    ml_collections.ConfigDict(
      {"name": "repo_repair", "kwargs": {"max_turns": 3}, "tool_calls_per_turn": 4}
    )
  )
  assert seen == [True] and env.max_turns == 3 and env.tool_budget.calls_per_turn == 4
  assert env.num_eval_tasks == len(env.heldout_tasks) > 0
  task = env.task(0)
  assert [t["function"]["name"] for t in task.tools] == list(repo_repair.TOOL_NAMES)
  assert "test_" not in task.prompt[1]["content"].split("Files in /repo:")[1]


# --- rows and the generator ----------------------------------------------------------------


def test_the_generator_reproduces_the_shipped_sets_byte_for_byte(tmp_path):
  train, heldout = repo_tasks.generate(out_dir=str(tmp_path), repo_base=repo_tasks.SHIPPED_DIR)
  for shipped in (repo_tasks.SHIPPED_TRAIN, repo_tasks.SHIPPED_HELDOUT):
    with open(shipped, "rb") as f, open(tmp_path / os.path.basename(shipped), "rb") as g:
      assert f.read() == g.read(), shipped
  assert len(train) > 100 and len(heldout) > 20
  # A held-out bug is never in a function trained on.
  function = lambda r: r["instance_id"].rsplit("__", 1)[0]
  assert not {function(r) for r in train} & {function(r) for r in heldout}
  # Every kept mutant breaks a test, and the reverse edit is exact.
  for row in train[:5] + heldout[:5]:
    ((path, text),) = row["setup_files"].items()
    fix = row["fix"][0]
    with open(os.path.join(repo_tasks.SHIPPED_DIR, row["repo"], path), encoding="utf-8") as f:
      assert text.replace(fix["old"], fix["new"]) == f.read()
    assert "fails with" in row["problem_statement"]


def test_mutants_are_single_spot_edits():
  source = (
    'def f(xs, n):\n  """Doc."""\n  if n < 0 and xs:\n    return -1\n'
    "  total = 0\n  for x in xs:\n    total += x * 2\n  return total\n"
  )
  kinds = {m.kind for m in repo_tasks.mutants(source)}
  assert kinds == {"compare", "boolop", "constant", "augassign", "binop", "drop_if"}
  for m in repo_tasks.mutants(source):
    old, new, _, _ = repo_tasks.reverse_edit(source, m.source)
    assert m.source.count(old) == 1 and m.source.replace(old, new) == source


def _user_repo(tmp_path):
  repo = tmp_path / "snap"
  (repo / "pkg").mkdir(parents=True)
  (repo / "pkg" / "__init__.py").write_text("")
  (repo / "pkg" / "add.py").write_text("def add(a, b):\n  return a - b\n")
  with tarfile.open(tmp_path / "snap.tar.gz", "w:gz") as tar:
    tar.add(repo, arcname=".")
  return repo


def test_user_rows_load_with_bad_rows_refused_by_line_and_reason(tmp_path):
  _user_repo(tmp_path)
  good = {
    "repo": "snap.tar.gz",
    "problem_statement": "add subtracts",
    "test_command": "python3 -m unittest tests.test_add",
    "tests": {
      "tests/test_add.py": "import unittest\nfrom pkg.add import add\n"
      "class T(unittest.TestCase):\n  def test_add(self):\n"
      "    self.assertEqual(add(2, 3), 5)\n"
    },
    "fix": [{"path": "pkg/add.py", "old": "a - b", "new": "a + b"}],
  }
  lines = [
    json.dumps(dict(good, instance_id="a")),
    "{not json",
    json.dumps([1, 2]),
    json.dumps(dict(good, instance_id="b", repo="missing_dir")),
    json.dumps(dict(good, instance_id="c", tests={"../escape.py": "x"})),
    json.dumps(dict(good, instance_id="d", setup_files={"/etc/x": "x"})),
    json.dumps(dict(good, instance_id="e", num_tests="5")),
    json.dumps(dict(good, instance_id="a")),
    json.dumps(dict(good, instance_id="f", problem_statement="")),
    json.dumps(dict(good, instance_id="g", repo="snap")),
  ]
  path = tmp_path / "rows.jsonl"
  path.write_text("\n".join(lines) + "\n")
  tasks, rejected = repo_tasks.load_tasks(str(path))
  assert [t.instance_id for t in tasks] == ["a", "g"]
  reasons = {where.rsplit(":", 1)[1]: reason for where, reason in rejected}
  assert sorted(reasons, key=int) == ["2", "3", "4", "5", "6", "7", "8", "9"]
  assert reasons["2"].startswith("bad JSON") and reasons["3"] == "not a JSON object"
  assert "no such directory" in reasons["4"] and "not a path inside" in reasons["5"]
  assert "not a path inside" in reasons["6"] and "num_tests" in reasons["7"]
  assert "duplicate instance_id" in reasons["8"] and "problem_statement" in reasons["9"]
  with pytest.raises(repo_tasks.datasets.DatasetError, match=":2: bad JSON"):
    repo_tasks.load_tasks(str(path), strict=True)


@needs_shell
def test_a_user_row_is_graded_by_its_test_command(tmp_path):
  _user_repo(tmp_path)
  row = {
    "instance_id": "u1",
    "repo": "snap.tar.gz",
    "problem_statement": "add subtracts",
    "test_command": "python3 -m unittest tests.test_add",
    "tests": {
      "tests/test_add.py": "import unittest\nfrom pkg.add import add\n"
      "class T(unittest.TestCase):\n  def test_add(self):\n"
      "    self.assertEqual(add(2, 3), 5)\n"
    },
    "fix": [{"path": "pkg/add.py", "old": "a - b", "new": "a + b"}],
  }
  path = tmp_path / "rows.jsonl.gz"
  with gzip.open(path, "wt") as f:
    f.write(json.dumps(row) + "\n")
  env = repo_repair.RepoRepair(repo_repair.RepoRepairConfig(path=str(path), heldout_path=str(path)))
  task = env.task(0)
  assert env.episode(task).step(_act(("submit", {}))).info["verdict"] == "failed"
  ep = env.episode(task)
  for action, _ in env.demonstration(task):
    out = ep.step(_act((action["tool_calls"][0]["name"], action["tool_calls"][0]["arguments"])))
  assert out.reward == 1.0 and out.info["verdict"] == "passed"


# --- the chain on CPU -------------------------------------------------------------------


@needs_shell
@pytest.mark.skipif(
  os.environ.get("SAO_REPO_REPAIR_CHAIN_TEST") != "1",
  reason=(
    "the chain at Qwen3's vocabulary and a 1024-token context costs ~110 s of CPU, over "
    "the suite's budget: SAO_REPO_REPAIR_CHAIN_TEST=1 runs it"
  ),
)
def test_tiny_config_runs_sft_then_rl(tmp_path):
  """configs/repo_repair_tiny.py, cut to a few steps: SFT on the demonstrations,
  value pretraining, SAO steps and the held-out evaluation all run."""
  from runs import load_config_module

  from sao_jax.train import trainer

  c = load_config_module("repo_repair_tiny.py").get_config()
  c.sharding.mesh = {"data": 8}
  c.sft.steps, c.sft.batch_size = 1, 8
  c.value_pretrain.steps, c.value_pretrain.num_trajectories = 1, 8
  c.rl.steps, c.rl.batch_size = 1, 8
  c.rollout.slots = 8
  c.rollout.max_len, c.data.buckets = 1024, (1024,)
  c.rollout.max_turn_tokens, c.env.max_tool_output_tokens = 24, 32
  c.env.kwargs = dict(c.env.kwargs, max_turns=2)
  c.eval.num_tasks, c.eval.slots = 8, 8
  c.log_every, c.tensorboard = 1, False
  c.checkpoint.every = 100
  summary = trainer.train(c, str(tmp_path / "run"))
  assert summary["rl_steps"] == 1 and 0.0 <= summary["final_pass@1"] <= 1.0
  with open(tmp_path / "run" / "metrics.jsonl", encoding="utf-8") as f:
    stages = {json.loads(line)["stage"] for line in f}
  assert {"sft", "value_pretrain", "rl", "eval"} <= stages
