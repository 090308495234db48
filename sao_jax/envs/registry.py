"""Environments and tokenizers by name, from the config's `env` section.

Environments that execute model-written code (python_tool, code_fix) are
only made after `sandbox.check_isolation` has logged which isolation applies
on this machine; it refuses when model code would run unisolated, unless the
config says `env.allow_unisolated = True`.
"""

from __future__ import annotations

import dataclasses

from sao_jax.envs import sandbox
from sao_jax.envs.code_fix import CodeFix, CodeFixConfig
from sao_jax.envs.online_style import OnlineStyle, OnlineStyleConfig
from sao_jax.envs.python_tool import PythonTool, PythonToolConfig
from sao_jax.envs.sandbox import SandboxLimits
from sao_jax.envs.tokenizer import CharTokenizer, HFTokenizer


def make_tokenizer(env_config):
  path = env_config.get("tokenizer_path")
  return HFTokenizer(path) if path else CharTokenizer()


def make_env(env_config):
  name = env_config.name
  kwargs = dict(env_config.get("kwargs", {}))
  limits = SandboxLimits(**dict(env_config.get("sandbox", {})))
  if name in ("python_tool", "code_fix") and kwargs.get("use_sandbox", True):
    sandbox.check_isolation(bool(env_config.get("allow_unisolated", False)), limits)
  if name not in ENV_CONFIGS:
    raise ValueError(f"Unknown environment {name!r}; known: {ENVIRONMENTS}")
  env_kwargs = ENV_CONFIGS[name](**kwargs)
  if name == "python_tool":
    return PythonTool(env_kwargs, limits)
  if name == "code_fix":
    return CodeFix(env_kwargs, limits)
  return OnlineStyle(env_kwargs)


# Each environment's `env.kwargs`, as a dataclass.
ENV_CONFIGS = {"python_tool": PythonToolConfig, "code_fix": CodeFixConfig,
               "online_style": OnlineStyleConfig}
ENVIRONMENTS = tuple(ENV_CONFIGS)


def kwargs_defaults(name: str) -> dict:
  """The default `env.kwargs` of environment `name` ({} if unknown)."""
  config = ENV_CONFIGS.get(name)
  if config is None:
    return {}
  return {f.name: f.default for f in dataclasses.fields(config)
          if f.default is not dataclasses.MISSING}
