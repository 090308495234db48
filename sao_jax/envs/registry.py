"""Environments, tokenizers, chat formats and rewards from the config's `env` section.

`env.name` is a built-in environment (a record in `ENVIRONMENTS`) or an
import string naming a user's factory:

    env.name = "my_pkg.my_env:make_env"        # a module on sys.path
    env.name = "path/to/my_env.py:make_env"    # a file, relative to the cwd

The factory is called as `factory(**env.kwargs)` and returns an object with
the `sao_jax.envs.base.EnvironmentProtocol`. Import strings are resolved
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

Every environment, built-in or a user's, is checked against the protocols
of `sao_jax.envs.base` once built (`check_protocol`): a missing method, or
a first task without `index` or `prompt`, fails here in one line.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable

from sao_jax.config import import_strings, sections
from sao_jax.config.sections import ConfigError, fail
from sao_jax.envs import base, chat, sandbox
from sao_jax.envs.base import StepResult, Task
from sao_jax.envs.code_fix import CodeFix, CodeFixConfig
from sao_jax.envs.dataset import ToolBudget
from sao_jax.envs.online_style import OnlineStyle, OnlineStyleConfig
from sao_jax.envs.python_tool import PythonTool, PythonToolConfig
from sao_jax.envs.sandbox import SandboxLimits
from sao_jax.envs.tokenizer import TOKENIZERS, HFTokenizer


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
  from sao_jax.envs import dataset, humaneval, math_tool, repo_repair

  return (
    EnvSpec("python_tool", PythonToolConfig, PythonTool, runs_code=True),
    EnvSpec("code_fix", CodeFixConfig, CodeFix, runs_code=True),
    EnvSpec("online_style", OnlineStyleConfig, lambda c, limits: OnlineStyle(c)),
    EnvSpec(
      "dataset", dataset.DatasetConfig, dataset.DatasetEnv, runs_code=True, chat_prompts=True
    ),
    EnvSpec(
      "humaneval", humaneval.HumanEvalConfig, humaneval.HumanEval, runs_code=True, chat_prompts=True
    ),
    EnvSpec(
      "math_tool", math_tool.MathToolConfig, math_tool.MathTool, runs_code=True, chat_prompts=True
    ),
    EnvSpec(
      "repo_repair",
      repo_repair.RepoRepairConfig,
      repo_repair.RepoRepair,
      runs_code=True,
      chat_prompts=True,
    ),
  )


ENVIRONMENTS: dict[str, EnvSpec] = {s.name: s for s in _builtin_specs()}


def check_env_name(name) -> None:
  """Raises ValueError (one line, the known names listed) for an unusable env.name."""
  if import_strings.is_import_string(name):
    factory = import_strings.resolve(name)
    if not callable(factory):
      raise ValueError(f"env.name = {name!r}: {type(factory).__name__} is not callable")
    return
  if name not in ENVIRONMENTS:
    raise ValueError(
      f"env.name = {name!r}: not a built-in environment "
      f"({', '.join(sorted(ENVIRONMENTS))}) nor an import string "
      "'pkg.module:factory'"
    )


def check_env_section(e) -> None:
  """Raises ConfigError (one line naming the field) when the env section `e`
  (sections.Env) names what this layer lacks: an environment (an import
  string is imported, not called, so a typo fails before the workdir
  exists; a built-in's kwargs are checked against its config dataclass), a
  chat format, a tokenizer, sandbox limits; or a built-in whose prompts or
  tools its chat format cannot render."""
  try:
    check_env_name(e.name)
  except ValueError as err:
    raise ConfigError(str(err)) from None
  if e.chat_format not in CHAT_FORMATS:
    fail("env.chat_format", e.chat_format, f"one of {CHAT_FORMATS}")
  if not e.tokenizer_path and e.tokenizer not in TOKENIZERS:
    fail("env.tokenizer", e.tokenizer, f"one of {sorted(TOKENIZERS)}")
  limits = {f.name for f in dataclasses.fields(SandboxLimits)}
  if set(e.sandbox) - limits:
    fail("env.sandbox", e.sandbox, f"a dict of SandboxLimits fields {sorted(limits)}")
  try:
    SandboxLimits(**dict(e.sandbox))  # each value in its range (SandboxLimits.validate)
  except ValueError as err:
    raise ConfigError(f"env.sandbox: {err}") from None
  if import_strings.is_import_string(e.name):
    return
  spec = ENVIRONMENTS[e.name]
  try:
    kwargs = builtin_kwargs(spec, dict(e.kwargs))
  except (TypeError, ValueError) as err:
    raise ConfigError(f"env.kwargs = {dict(e.kwargs)!r}: {err}") from None
  if spec.chat_prompts and e.chat_format == "raw":  # the toys' format takes text
    fail(
      "env.chat_format",
      e.chat_format,
      f"'qwen3', 'qwen3_5' or 'plain' for env.name = {e.name!r} (its prompts are chat messages)",
    )
  if getattr(kwargs, "tools", ()) and not chat.FORMATS[e.chat_format].renders_tools:
    fail(
      "env.chat_format",
      e.chat_format,
      f"a format that renders tools ('qwen3', 'qwen3_5') for env.kwargs.tools = "
      f"{tuple(kwargs.tools)}",
    )


def kwargs_defaults(name: str) -> dict:
  """The default `env.kwargs` of built-in environment `name` ({} otherwise)."""
  spec = ENVIRONMENTS.get(name)
  if spec is None:
    return {}
  return {
    f.name: f.default
    for f in dataclasses.fields(spec.config)
    if f.default is not dataclasses.MISSING
  }


def builtin_kwargs(spec: EnvSpec, kwargs: dict):
  fields = {f.name for f in dataclasses.fields(spec.config)}
  unknown = sorted(set(kwargs) - fields)
  if unknown:
    raise ValueError(
      f"env.kwargs {unknown} are not options of {spec.name!r}; known: {sorted(fields)}"
    )
  return spec.config(**kwargs)


# --- building ------------------------------------------------------------------


def make_tokenizer(env):
  """`env.tokenizer_path` (a user's tokenizer.json) if set, else `env.tokenizer` by name.

  `env`: the env section (sections.Env; a ConfigDict or dict of some of its
  fields is read as one, the rest at their defaults)."""
  e = sections.Env.of(env)
  if e.tokenizer_path:
    return HFTokenizer(e.tokenizer_path)
  if e.tokenizer not in TOKENIZERS:
    raise ValueError(f"env.tokenizer = {e.tokenizer!r}: one of {sorted(TOKENIZERS)}")
  return TOKENIZERS[e.tokenizer]()


# `env.chat_format` names: chat.FORMATS' keys; "raw" is the toys' text format.
CHAT_FORMATS = tuple(chat.FORMATS)


def make_format(env, tokenizer):
  """The chat format `env.chat_format` over `tokenizer` (`env` as in make_tokenizer)."""
  e = sections.Env.of(env)
  if e.chat_format not in CHAT_FORMATS:
    raise ValueError(f"env.chat_format = {e.chat_format!r}: one of {CHAT_FORMATS}")
  options = (
    {"enable_thinking": e.thinking}
    if "enable_thinking" in chat.format_options(e.chat_format)
    else {}
  )
  return chat.make_format(e.chat_format, tokenizer, **options)


def make_env(env):
  """The environment of the env section `env` (as in make_tokenizer), its
  reward replaced if `env.reward` is set; checked against the protocols."""
  e = sections.Env.of(env)
  name, kwargs = e.name, dict(e.kwargs)
  limits = SandboxLimits(**dict(e.sandbox))
  try:
    check_env_name(name)
  except ValueError as err:
    raise ConfigError(str(err)) from None
  if import_strings.is_import_string(name):
    try:
      built = import_strings.resolve(name)(**kwargs)
    except Exception as err:  # noqa: BLE001  # the user's code: one line
      raise ConfigError(
        f"env.name = {name!r}: building the environment failed: {import_strings.one_line(err)}"
      ) from None
    check_protocol(built, f"env.name = {name!r}")
    if base.runs_code(built):
      sandbox.check_isolation(e.allow_unisolated, limits)
  else:
    built = _build_builtin(ENVIRONMENTS[name], kwargs, limits, e.allow_unisolated)
    check_protocol(built, f"env.name = {name!r}")
  if hasattr(built, "tool_budget"):  # the built-ins that answer tool calls
    built.tool_budget = ToolBudget(
      e.tool_calls_per_turn, e.tool_seconds_per_turn, e.tool_seconds_per_episode
    )
  if e.reward:
    built = RewardOverride(built, import_strings.resolve(e.reward, "env.reward"))
  return built


def _build_builtin(spec: EnvSpec, kwargs: dict, limits: SandboxLimits, allow_unisolated: bool):
  try:
    config = builtin_kwargs(spec, kwargs)
  except (TypeError, ValueError) as err:
    raise ConfigError(f"env.kwargs = {kwargs!r}: {err}") from None
  if (
    spec.runs_code
    and getattr(config, "use_sandbox", True)
    and getattr(config, "needs_sandbox", True)
  ):
    sandbox.check_isolation(allow_unisolated, limits, shell=getattr(config, "needs_shell", False))
  try:
    return spec.build(config, limits)
  except (ImportError, OSError, ValueError) as err:  # a missing package, file or row: one line
    raise ConfigError(f"env.name = {spec.name!r}: {err}") from None


def check_protocol(env, where: str) -> None:
  """Raises ConfigError (one line) if `env` or its first task lacks a required member.

  The environment's methods and the attributes of `env.task(0)` (a training
  task: cheap, as the driver needs every `task` to be) are checked against
  `sao_jax.envs.base`'s protocols when the environment is built, so that a
  missing one fails here, naming the class, the member and what it should
  be, not in whichever stage first reads it.
  """
  head = f"{where}: environment {base.class_path(env)}"
  problem = base.environment_problem(env)
  if problem is not None:
    raise ConfigError(f"{head} {problem}")
  try:
    task = env.task(0)
  except Exception as e:  # noqa: BLE001  # the user's code: one line
    raise ConfigError(f"{head}: task(0) failed: {import_strings.one_line(e)}") from None
  problem = base.task_problem(task)
  if problem is not None:
    raise ConfigError(f"{head}: its tasks ({type(task).__name__}) have {problem}")


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
    self.name = f"{base.env_name(env)}+reward"

  def __getattr__(self, attr):  # task, demonstration, max_turns, runs_code, ...
    return getattr(self._env, attr)

  def frozen(self):
    """The frozen twin (online_style's evaluation view), with the same reward."""
    return RewardOverride(base.frozen_view(self._env), self._fn)

  def episode(self, task: Task):
    return _OverriddenEpisode(self._env.episode(task), task, self._fn)


class _OverriddenEpisode:
  def __init__(self, episode, task: Task, fn: Callable):
    self._episode, self._task, self._fn, self._actions = episode, task, fn, []

  def step(self, action: str) -> StepResult:
    result = self._episode.step(action)
    self._actions.append(str(action))
    if not isinstance(result, StepResult) or not result.done:
      return (
        result if not isinstance(result, StepResult) else dataclasses.replace(result, reward=0.0)
      )
    reward = self._fn(self._task, "\n".join(self._actions), dict(result.info))
    if (
      isinstance(reward, bool)
      or not isinstance(reward, numbers.Real)
      or not math.isfinite(float(reward))
    ):
      raise TypeError(f"env.reward returned {reward!r}, not a finite real number")
    return dataclasses.replace(result, reward=float(reward))
