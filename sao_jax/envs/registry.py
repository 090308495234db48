"""Environments, tokenizers, chat formats and rewards from the config's `env` section.

`env.name` is a built-in environment (a record in `ENVIRONMENTS`) or an
import string naming a user's factory:

    env.name = "my_pkg.my_env:make_env"        # a module on sys.path
    env.name = "path/to/my_env.py:make_env"    # a file, relative to the cwd

The factory is called as `factory(**env.kwargs)` and returns an object with
the `sao_jax.envs.base.Environment` protocol. Import strings are resolved
with `importlib` in whichever process builds the environment (the trainer,
and each fleet rollout process), so nothing depends on a registration call
having run in that process. `env.reward = "pkg.module:fn"` replaces the
environment's reward by `fn(task, response, info) -> float` (`RewardOverride`),
evaluated in the rollout's environment workers, outside any sandbox.

Environments that execute model-written code are only made after
`sandbox.check_isolation` has logged which isolation applies on this
machine; it refuses when model code would run unisolated, unless the config
says `env.allow_unisolated = True`. A built-in declares this in its record;
a user's environment is checked unless it declares `runs_code = False`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import math
import numbers
import os
import sys
import traceback
from typing import Any, Callable

from sao_jax.envs import chat, sandbox
from sao_jax.envs.base import StepResult, Task
from sao_jax.envs.code_fix import CodeFix, CodeFixConfig
from sao_jax.envs.dataset import ToolBudget
from sao_jax.envs.online_style import OnlineStyle, OnlineStyleConfig
from sao_jax.envs.python_tool import PythonTool, PythonToolConfig
from sao_jax.envs.sandbox import SandboxLimits
from sao_jax.envs.tokenizer import TOKENIZERS, HFTokenizer
from sao_jax.config.sections import ConfigError


@dataclasses.dataclass(frozen=True)
class EnvSpec:
  """A built-in environment: its `env.kwargs` dataclass and its constructor.

  `build(kwargs_dataclass, sandbox_limits)` makes the environment;
  `runs_code` environments get the sandbox isolation check first (unless
  their kwargs say `use_sandbox=False`, a test-only switch).
  `chat_prompts` environments give chat messages (and may offer tools):
  they need a chat format that renders roles, not the toys' "raw".
  """
  name: str
  config: type
  build: Callable
  runs_code: bool = False
  chat_prompts: bool = False


def _builtin_specs():
  from sao_jax.envs import humaneval  # pylint: disable=g-import-not-at-top
  from sao_jax.envs import dataset, math_tool, repo_repair  # pylint: disable=g-import-not-at-top
  return (
      EnvSpec("python_tool", PythonToolConfig, PythonTool, runs_code=True),
      EnvSpec("code_fix", CodeFixConfig, CodeFix, runs_code=True),
      EnvSpec("online_style", OnlineStyleConfig, lambda c, limits: OnlineStyle(c)),
      EnvSpec("dataset", dataset.DatasetConfig, dataset.DatasetEnv, runs_code=True,
              chat_prompts=True),
      EnvSpec("humaneval", humaneval.HumanEvalConfig, humaneval.HumanEval, runs_code=True,
              chat_prompts=True),
      EnvSpec("math_tool", math_tool.MathToolConfig, math_tool.MathTool, runs_code=True,
              chat_prompts=True),
      EnvSpec("repo_repair", repo_repair.RepoRepairConfig, repo_repair.RepoRepair,
              runs_code=True, chat_prompts=True),
  )


ENVIRONMENTS: dict[str, EnvSpec] = {s.name: s for s in _builtin_specs()}


# --- import strings ------------------------------------------------------------


def is_import_string(name: str) -> bool:
  return isinstance(name, str) and ":" in name


def resolve(target: str, what: str = "env.name") -> Any:
  """The object an import string names: `pkg.module:attr` or `path/file.py:attr`.

  Raises ValueError with one line saying what could not be found. A file is
  loaded under a module name derived from its absolute path, so loading it
  twice (or in two threads' worth of builds) gives the same module.
  """
  module_name, sep, attr = target.rpartition(":")
  if not sep or not module_name or not attr:
    raise ValueError(f"{what} = {target!r}: an import string is 'pkg.module:name' or "
                     "'path/to/file.py:name'")
  if module_name.endswith(".py"):
    path = os.path.abspath(module_name)
    if not os.path.isfile(path):
      raise ValueError(f"{what} = {target!r}: no file {path}")
    key = "sao_jax_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    module = sys.modules.get(key)
    if module is None:
      spec = importlib.util.spec_from_file_location(key, path)
      module = importlib.util.module_from_spec(spec)
      sys.modules[key] = module
      try:
        spec.loader.exec_module(module)
      except Exception as e:  # pylint: disable=broad-except  # the user's code: one line
        del sys.modules[key]
        raise ValueError(f"{what} = {target!r}: loading {path} failed: {one_line(e)}") from None
      except BaseException:
        del sys.modules[key]
        raise
  else:
    try:
      module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
      if e.name and module_name.startswith(e.name):  # the module itself is missing
        raise ValueError(f"{what} = {target!r}: cannot import {module_name!r} ({e})") from None
      raise ValueError(f"{what} = {target!r}: importing {module_name!r} failed: "
                       f"{one_line(e)}") from None
    except Exception as e:  # pylint: disable=broad-except  # the user's code: one line
      raise ValueError(f"{what} = {target!r}: importing {module_name!r} failed: "
                       f"{one_line(e)}") from None
  if not hasattr(module, attr):
    raise ValueError(f"{what} = {target!r}: module {module_name!r} has no {attr!r}")
  return getattr(module, attr)


def one_line(e: BaseException) -> str:
  """`Type: message (file:line)` of an error in a user's code, on one line: the
  line is the SyntaxError's own, else the innermost frame of the traceback."""
  if isinstance(e, SyntaxError):
    where = f" ({e.filename}:{e.lineno})" if e.filename else ""
    message = e.msg
  else:
    frames = traceback.extract_tb(e.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    message = str(e)
  message = " ".join(message.split())
  if len(message) > 300:
    message = message[:300] + "..."
  return f"{type(e).__name__}: {message}{where}" if message else f"{type(e).__name__}{where}"


def check_env_name(name) -> None:
  """Raises ValueError (one line, the known names listed) for an unusable env.name."""
  if is_import_string(name):
    factory = resolve(name)
    if not callable(factory):
      raise ValueError(f"env.name = {name!r}: {type(factory).__name__} is not callable")
    return
  if name not in ENVIRONMENTS:
    raise ValueError(f"env.name = {name!r}: not a built-in environment "
                     f"({', '.join(sorted(ENVIRONMENTS))}) nor an import string "
                     "'pkg.module:factory'")


def kwargs_defaults(name: str) -> dict:
  """The default `env.kwargs` of built-in environment `name` ({} otherwise)."""
  spec = ENVIRONMENTS.get(name)
  if spec is None:
    return {}
  return {f.name: f.default for f in dataclasses.fields(spec.config)
          if f.default is not dataclasses.MISSING}


def builtin_kwargs(spec: EnvSpec, kwargs: dict):
  fields = {f.name for f in dataclasses.fields(spec.config)}
  unknown = sorted(set(kwargs) - fields)
  if unknown:
    raise ValueError(f"env.kwargs {unknown} are not options of {spec.name!r}; "
                     f"known: {sorted(fields)}")
  return spec.config(**kwargs)


# --- building ------------------------------------------------------------------


def make_tokenizer(env_config):
  """`env.tokenizer_path` (a user's tokenizer.json) if set, else `env.tokenizer` by name."""
  path = env_config.get("tokenizer_path")
  if path:
    return HFTokenizer(path)
  name = env_config.get("tokenizer", "char")
  if name not in TOKENIZERS:
    raise ValueError(f"env.tokenizer = {name!r}: one of {sorted(TOKENIZERS)}")
  return TOKENIZERS[name]()


# `env.chat_format` names: chat.FORMATS' keys; "raw" is the toys' text format.
CHAT_FORMATS = tuple(chat.FORMATS)


def make_format(env_config, tokenizer):
  """The chat format `env.chat_format` (default "raw") over `tokenizer`."""
  name = env_config.get("chat_format", "raw")
  if name not in CHAT_FORMATS:
    raise ValueError(f"env.chat_format = {name!r}: one of {CHAT_FORMATS}")
  options = {"enable_thinking": bool(env_config.get("thinking", True))} if name == "qwen3" else {}
  return chat.make_format(name, tokenizer, **options)


def make_env(env_config):
  """The environment of `env_config`, its reward replaced if `env.reward` is set."""
  name = env_config.name
  kwargs = dict(env_config.get("kwargs", {}))
  limits = SandboxLimits(**dict(env_config.get("sandbox", {})))
  allow = bool(env_config.get("allow_unisolated", False))
  try:
    check_env_name(name)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if is_import_string(name):
    try:
      env = resolve(name)(**kwargs)
      _check_first_task(env)
    except Exception as e:  # pylint: disable=broad-except  # the user's code: one line
      raise ConfigError(f"env.name = {name!r}: building the environment failed: "
                        f"{one_line(e)}") from None
    if getattr(env, "runs_code", True):
      sandbox.check_isolation(allow, limits)
  else:
    spec = ENVIRONMENTS[name]
    try:
      config = builtin_kwargs(spec, kwargs)
    except (TypeError, ValueError) as e:
      raise ConfigError(f"env.kwargs = {kwargs!r}: {e}") from None
    if spec.runs_code and getattr(config, "use_sandbox", True) and getattr(
        config, "needs_sandbox", True):
      sandbox.check_isolation(allow, limits, shell=getattr(config, "needs_shell", False))
    try:
      env = spec.build(config, limits)
    except (ImportError, OSError, ValueError) as e:  # a missing package, file or row: one line
      raise ConfigError(f"env.name = {name!r}: {e}") from None
  if hasattr(env, "tool_budget"):  # the built-ins that answer tool calls
    env.tool_budget = ToolBudget(int(env_config.get("tool_calls_per_turn", 0)),
                                 float(env_config.get("tool_seconds_per_turn", 0.0)),
                                 float(env_config.get("tool_seconds_per_episode", 0.0)))
  reward = env_config.get("reward", "")
  if reward:
    env = RewardOverride(env, resolve(reward, "env.reward"))
  return env


def _check_first_task(env) -> None:
  """A user environment's `task(0)` is a Task (the driver and SFT need its prompt
  and tools): checked at build time, not when SFT or rollout first meets it."""
  task = env.task(0)
  if not isinstance(task, Task):
    raise TypeError(f"env.task(0) returned a {type(task).__name__}, not a "
                    "sao_jax.envs.base.Task (index, prompt, answer, meta, tools)")


# --- a replaced reward ---------------------------------------------------------------


class RewardOverride:
  """`env` with its reward replaced by `fn(task, response, info) -> float`.

  The episode runs as the environment defines it; only the reward changes:
  every step pays 0 except the last, which pays `fn(task, response, info)`,
  where `response` is the episode's action turns joined by newlines (what
  an answer checker reads) and `info` the last step's info. `fn` runs in the
  rollout's environment worker threads, in the trainer-side process, never
  in a sandbox; a reward that is not a finite real number raises, which
  the driver counts as an environment fault (the episode pays 0).
  """

  def __init__(self, env, fn: Callable):
    self._env, self._fn = env, fn
    self.name = f"{getattr(env, 'name', 'env')}+reward"
    self.max_turns = env.max_turns

  def __getattr__(self, attr):  # task, demonstration, runs_code, num_eval_tasks, ...
    return getattr(self._env, attr)

  def frozen(self):
    """The frozen twin (online_style's evaluation view), with the same reward."""
    inner = self._env.frozen() if hasattr(self._env, "frozen") else self._env
    return RewardOverride(inner, self._fn)

  def episode(self, task: Task):
    return _OverriddenEpisode(self._env.episode(task), task, self._fn)


class _OverriddenEpisode:

  def __init__(self, episode, task: Task, fn: Callable):
    self._episode, self._task, self._fn, self._actions = episode, task, fn, []

  def step(self, action: str) -> StepResult:
    result = self._episode.step(action)
    self._actions.append(str(action))
    if not isinstance(result, StepResult) or not result.done:
      return result if not isinstance(result, StepResult) else dataclasses.replace(
          result, reward=0.0)
    reward = self._fn(self._task, "\n".join(self._actions), dict(result.info))
    if (isinstance(reward, bool) or not isinstance(reward, numbers.Real)
        or not math.isfinite(float(reward))):
      raise TypeError(f"env.reward returned {reward!r}, not a finite real number")
    return dataclasses.replace(result, reward=float(reward))
