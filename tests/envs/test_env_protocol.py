"""The environment and task protocols (sao_jax/envs/base.py), checked when an env is built.

A user writes tasks as whatever they like (here a plain dataclass of index,
prompt and answer, no `tools`, no `meta`) and an environment without the
optional attributes (`name`, `max_turns`, `runs_code`, ...): it builds, and
its demonstrations (the SFT stage's data) are made from it. An environment
that lacks a required method, or whose tasks lack a required attribute,
fails in `registry.make_env` with one line naming the class, the member and
what it should be. Every built-in environment passes the same check.
"""

import json
import textwrap

import ml_collections
import pytest

from sao_jax.config.sections import ConfigError
from sao_jax.data.trajectory import validate
from sao_jax.envs import base, registry, sandbox
from sao_jax.envs.base import Action
from sao_jax.envs.demonstrations import demonstration_trajectory
from sao_jax.envs.tokenizer import CharTokenizer

PLAIN_ENV = """
import dataclasses

from sao_jax.envs.base import StepResult


@dataclasses.dataclass(frozen=True)
class Task:  # what any user may write: no tools, no meta
  index: int
  prompt: str
  answer: str


class Echo:  # no name, max_turns, runs_code, frozen, ...: only the required methods
  def task(self, index):
    return Task(index, f"say {index}\\n", str(index))

  def episode(self, task):
    return Episode(task)

  def demonstration(self, task):
    return [(task.answer, "")]


class Episode:
  def __init__(self, task):
    self.task = task

  def step(self, action):
    return StepResult("", float(action.strip() == self.task.answer), True, {})


class NoDemonstration(Echo):
  demonstration = None


class PromptlessTask:
  def __init__(self, index):
    self.index = index


class Promptless(Echo):
  def task(self, index):
    return PromptlessTask(index)


class TextIndex(Echo):
  def task(self, index):
    return Task(str(index), "say it\\n", "it")


class Failing(Echo):
  def task(self, index):
    raise KeyError(index)


def make_env(kind="Echo"):
  return globals()[kind]()


def half(task, response, info):
  return 0.5
"""


@pytest.fixture
def user_env(tmp_path):
  """The import string of PLAIN_ENV's factory, a file outside the repository."""
  path = tmp_path / "plain_env.py"
  path.write_text(textwrap.dedent(PLAIN_ENV))
  return f"{path}:make_env"


def _build(name, **fields):
  # allow_unisolated: the user env runs code by default (no runs_code), and a
  # machine without an isolating sandbox would refuse it before the check.
  return registry.make_env(
    ml_collections.ConfigDict({"name": name, "kwargs": {}, "allow_unisolated": True, **fields})
  )


def test_a_plain_dataclass_task_without_tools_makes_demonstrations(user_env):
  env = _build(user_env)
  task = base.demonstration_task(env, 3)  # as the SFT stage draws it
  assert not hasattr(task, "tools") and not hasattr(task, "meta")
  assert base.task_tools(task) == () and dict(base.task_meta(task)) == {}
  tok = CharTokenizer()
  traj = demonstration_trajectory(env, task, tok)
  assert validate(traj, tok.vocab_size, 64) is None
  assert traj.prompt_id == 3 and traj.rewards.sum() == 1.0
  assert tok.decode(traj.tokens[~traj.action_mask].tolist()) == "say 3\n"
  actions = traj.tokens[traj.action_mask].tolist()
  assert actions[-1] == tok.turn_end_id and tok.decode(actions[:-1]) == "3"
  # The optional attributes' defaults, read through the helpers.
  assert base.env_name(env) == "Echo" and base.runs_code(env)
  assert base.num_eval_tasks(env) is None and base.frozen_view(env) is env
  episode = env.episode(task)
  assert episode.step(Action("3")).reward == 1.0


def test_a_plain_env_with_a_replaced_reward(user_env):
  env = _build(user_env, reward=user_env.replace(":make_env", ":half"))
  assert env.name == "Echo+reward" and base.frozen_view(env).name == "Echo+reward"
  assert env.episode(env.task(0)).step(Action("nope")).reward == 0.5
  traj = demonstration_trajectory(env, env.task(1), CharTokenizer())
  assert traj.prompt_id == 1


@pytest.mark.parametrize(
  "kind,message",
  [
    (
      "NoDemonstration",
      r"environment sao_jax_user_\w+:NoDemonstration has no method "
      r"'demonstration' \(demonstration\(task\) -> \[\(action, observation\), "
      r"\.\.\.\] for the SFT start; sao_jax/envs/base.py EnvironmentProtocol\)",
    ),
    (
      "Promptless",
      r"environment sao_jax_user_\w+:Promptless: its tasks \(PromptlessTask\) have "
      r"no attribute 'prompt' \(the prompt text or chat messages; "
      r"sao_jax/envs/base.py TaskProtocol\)",
    ),
    ("TextIndex", r"its tasks \(Task\) have an index of type str \(the int it was made from"),
    (
      "Failing",
      r"environment sao_jax_user_\w+:Failing: task\(0\) failed: KeyError: 0 "
      r"\(.*plain_env\.py:\d+\)",
    ),
  ],
)
def test_a_missing_member_fails_the_build_in_one_line(user_env, kind, message):
  with pytest.raises(ConfigError, match=message) as e:
    _build(user_env, kwargs={"kind": kind})
  assert "\n" not in str(e.value)
  assert str(e.value).startswith(f"env.name = {user_env!r}: environment ")


def test_the_driver_refuses_a_task_the_protocol_refuses():
  assert base.task_problem(base.Task(0, "hi\n")) is None
  assert base.task_problem({"prompt": "hi\n"}).startswith("no attribute 'index'")
  assert base.task_problem(base.Task(True, "hi\n")).startswith("an index of type bool")
  assert base.task_problem(base.Task(0, None)).startswith("a prompt of type NoneType")


def _dataset_rows(tmp_path):
  path = tmp_path / "rows.jsonl"
  rows = [
    {
      "prompt": [{"role": "user", "content": f"{i}+1?"}],
      "reward_model": {"ground_truth": str(i + 1)},
    }
    for i in range(8)
  ]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


@pytest.mark.parametrize("name", sorted(registry.ENVIRONMENTS))
def test_the_builtin_environments_pass_the_check(name, tmp_path, monkeypatch):
  # The isolation check is the sandbox's concern (tests/envs/test_sandbox.py):
  # here a machine without one must not refuse the code-running built-ins.
  monkeypatch.setattr(sandbox, "check_isolation", lambda *args, **kwargs: None)
  kwargs = {"path": _dataset_rows(tmp_path)} if name == "dataset" else {}
  if name == "humaneval":
    kwargs = {"problems": (0,)}
  env = _build(name, kwargs=kwargs)  # make_env runs the check
  assert base.environment_problem(env) is None
  task = env.task(0)
  assert base.task_problem(task) is None
  assert isinstance(base.task_tools(task), (list, tuple)) and base.env_name(env)
  assert isinstance(base.runs_code(env), bool)
