"""Environments by built-in name or import string, and a replaced reward.

The user's package lives outside the repository (tmp_path), as it would:
`env.name` names its factory, `env.kwargs` reach it, `env.reward` replaces
its reward, and an unknown name fails validation with one line.
"""

import sys
import textwrap

import pytest
from test_configs import load_config_module

from sao_jax.envs import registry
from sao_jax.envs.base import Action, StepResult
from sao_jax.train import configuration

USER_ENV = """
from sao_jax.envs.base import StepResult, Task

class Echo:
  name = "echo"
  runs_code = False

  def __init__(self, word="hi", max_turns=2):
    self.word, self.max_turns = word, max_turns

  def task(self, index):
    return Task(index, f"say {self.word}\\n", self.word)

  def episode(self, task):
    return Episode(task)

  def demonstration(self, task):
    return [(task.answer, "")]

class Episode:
  def __init__(self, task):
    self.task = task

  def step(self, action):
    return StepResult("", float(action.strip() == self.task.answer), True, {})

def make_env(**kwargs):
  return Echo(**kwargs)

def half(task, response, info):
  return 0.5 if response else 0.0
"""


@pytest.fixture
def user_pkg(tmp_path, monkeypatch):
  pkg = tmp_path / "user_site" / "my_tasks"
  pkg.mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "env.py").write_text(textwrap.dedent(USER_ENV))
  monkeypatch.syspath_prepend(str(tmp_path / "user_site"))
  yield pkg
  for name in [m for m in sys.modules if m.startswith("my_tasks")]:
    del sys.modules[name]


def _config(**fields):
  c = load_config_module("sao_tiny.py").get_config()
  for field, value in fields.items():
    configuration.set_field(c, field, value)
  return c


def test_module_import_string_builds_the_users_env_with_its_kwargs(user_pkg):
  c = _config(**{"env.name": "my_tasks.env:make_env", "env.kwargs": {"word": "yo"}})
  configuration.validate(c, num_devices=8)
  env = registry.make_env(c.env)
  task = env.task(3)
  assert task.prompt == "say yo\n"
  assert env.episode(task).step(Action("yo")).reward == 1.0


def test_file_import_string_and_a_replaced_reward(user_pkg):
  path = str(user_pkg / "env.py")
  c = _config(**{"env.name": f"{path}:make_env", "env.reward": f"{path}:half"})
  configuration.validate(c, num_devices=8)
  env = registry.make_env(c.env)
  result = env.episode(env.task(0)).step(Action("wrong"))
  assert isinstance(result, StepResult) and result.done and result.reward == 0.5
  # Loading the same file twice gives the same module (one class, not two).
  assert type(registry.make_env(c.env)._env) is type(env._env)


@pytest.mark.parametrize(
  "field,value,message",
  [
    ("env.name", "pythn_tool", "env.name = 'pythn_tool': not a built-in environment"),
    ("env.name", "no_such_pkg.mod:make", "cannot import 'no_such_pkg.mod'"),
    ("env.name", "sao_jax.envs.registry:no_such_factory", "has no 'no_such_factory'"),
    ("env.reward", "sao_jax.envs.registry:nope", "env.reward"),
    ("env.kwargs", {"max_opz": 3}, "not options of 'python_tool'"),
    ("env.tokenizer", "gpt2", "env.tokenizer = 'gpt2': must be one of"),
    ("env.chat_format", "chatml", "env.chat_format = 'chatml': must be one of"),
    ("env.tool_calls_per_turn", -1, "env.tool_calls_per_turn = -1: must be an integer >= 0"),
    (
      "env.tool_seconds_per_turn",
      60.0,
      r"env.tool_seconds_per_turn = 60.0: must be < rollout.env_timeout \(60\)",
    ),
  ],
)
def test_unknown_env_names_fail_validation_in_one_line(field, value, message):
  with pytest.raises(configuration.ConfigError, match=message) as e:
    configuration.validate(_config(**{field: value}), num_devices=8)
  assert "\n" not in str(e.value)
  if field == "env.name" and ":" not in value:
    assert all(name in str(e.value) for name in registry.ENVIRONMENTS)


def test_a_reward_that_is_not_a_number_raises_for_the_driver_to_count(user_pkg, tmp_path):
  bad = tmp_path / "bad_reward.py"
  bad.write_text("def reward(task, response, info):\n  return 'lots'\n")
  c = _config(**{"env.name": "my_tasks.env:make_env", "env.reward": f"{bad}:reward"})
  env = registry.make_env(c.env)
  with pytest.raises(TypeError, match="not a finite real number"):
    env.episode(env.task(0)).step(Action("hi"))


@pytest.mark.parametrize(
  "source,message",
  [
    ("def make_env(:\n  pass\n", r"loading .*broken\.py failed: SyntaxError: .*broken\.py:1\)"),
    (
      "import no_such_module_anywhere\n",
      "loading .*broken.py failed: ModuleNotFoundError: No module named "
      r"'no_such_module_anywhere' \(.*broken\.py:1\)",
    ),
    (
      "x = 1\nundefined_name + 1\n",
      r"NameError: name 'undefined_name' is not defined .*broken\.py:2\)",
    ),
  ],
)
def test_a_broken_user_file_fails_in_one_line_with_its_line(tmp_path, source, message):
  path = tmp_path / "broken.py"
  path.write_text(source)
  c = _config(**{"env.name": f"{path}:make_env"})
  with pytest.raises(configuration.ConfigError, match=message) as e:
    configuration.validate(c, num_devices=8)
  assert "\n" not in str(e.value)
  with pytest.raises(configuration.ConfigError, match=message):
    registry.make_env(c.env)


def test_a_broken_user_package_and_factory_fail_in_one_line(user_pkg, tmp_path):
  (user_pkg / "bad.py").write_text("import my_tasks.env\nfrom my_tasks.env import nothing_here\n")
  (user_pkg / "raising.py").write_text(
    textwrap.dedent("""
      from sao_jax.envs.base import Task
      def make_env(**kwargs):
        return undefined_helper(**kwargs)
      class NoTools:
        name, max_turns = "nt", 1
        def task(self, index):
          return type("T", (), {"index": index, "prompt": "hi"})()
      def no_tools(**kwargs):
        return NoTools()
      """)
  )
  for name, message in [
    (
      "my_tasks.bad:make_env",
      r"importing 'my_tasks.bad' failed: ImportError: cannot import "
      r"name 'nothing_here' .*bad\.py:2\)",
    ),
    (
      "my_tasks.raising:make_env",
      r"building the environment failed: NameError: name "
      r"'undefined_helper' is not defined \(.*raising\.py:4\)",
    ),
    (
      "my_tasks.raising:no_tools",
      "environment my_tasks.raising:NoTools has no method "
      "'episode' .episode.task. -> a fresh Episode",
    ),
  ]:
    with pytest.raises(configuration.ConfigError, match=message) as e:
      c = _config(**{"env.name": name})
      configuration.validate(c, num_devices=8)
      registry.make_env(c.env)
    assert "\n" not in str(e.value)


def test_a_missing_or_rowless_dataset_fails_in_one_line(tmp_path):
  empty = tmp_path / "empty.jsonl"
  empty.write_text('{"prompt": ""}\n[1]\n')
  for path, message in [
    (tmp_path / "missing.jsonl", "missing.jsonl: cannot read"),
    (empty, r"empty.jsonl: no valid rows \(2 rejected; first: "),
  ]:
    c = _config(
      **{
        "env.name": "dataset",
        "env.chat_format": "qwen3",
        "env.tokenizer": "qwen3",
        "env.kwargs": {"path": str(path)},
      }
    )
    with pytest.raises(configuration.ConfigError, match=message) as e:
      registry.make_env(c.env)
    assert "\n" not in str(e.value) and str(e.value).startswith("env.name = 'dataset': ")
