"""Environments and tokenizers by name, from the config's `env` section."""

from __future__ import annotations

from sao_jax.envs.python_tool import PythonTool, PythonToolConfig
from sao_jax.envs.sandbox import SandboxLimits
from sao_jax.envs.tokenizer import CharTokenizer, HFTokenizer


def make_tokenizer(env_config):
  path = env_config.get("tokenizer_path")
  return HFTokenizer(path) if path else CharTokenizer()


def make_env(env_config):
  name = env_config.name
  kwargs = dict(env_config.get("kwargs", {}))
  if name == "python_tool":
    limits = SandboxLimits(**dict(env_config.get("sandbox", {})))
    return PythonTool(PythonToolConfig(**kwargs), limits)
  raise ValueError(f"Unknown environment {name!r}; known: python_tool")
