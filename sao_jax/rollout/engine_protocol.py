"""The engine protocol: what the rollout driver asks of the engine it drives.

`PolicyEngine` (engine.py) is the one implementation in this package; an
engine of a user's (a remote sampler, another cache) that the driver should
run episodes on implements these members. The driver checks them when it
is built (`engine_problem`), so a missing one is one line naming it, not an
AttributeError in the rollout thread once generation has started.

Decode states and chunks are the engine's own values: the driver only hands
back what `init_decode_state`, `step`, `decode` and `collect` returned.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class EngineProtocol(Protocol):
  """The members RolloutDriver uses on every run (PolicyEngine's docstrings
  say what each does); `OPTIONAL` lists those it uses only in some.

  Attributes:
    max_concurrent_decodes: slots.
    max_prefill_length: the longest sequence a slot holds (max_len).
  """
  max_concurrent_decodes: int
  max_prefill_length: int

  def init_decode_state(self) -> Any: ...

  def reset_slots(self, state: Any, slots_mask: np.ndarray) -> Any: ...

  def step(self, state: Any, tokens: np.ndarray, valid: np.ndarray): ...

  def decode(self, state: Any, tokens, budgets, steps: int, stop_token): ...

  def collect(self, state: Any, chunk: Any): ...


REQUIRED_METHODS = ("init_decode_state", "reset_slots", "step", "decode", "collect")
REQUIRED_ATTRIBUTES = ("max_concurrent_decodes", "max_prefill_length")
# The members the driver reads only in some runs: when each is needed.
OPTIONAL = {
    "update_params": "a weight swap (driver.update_params), with load_params",
    "load_params": "a weight swap: the copy into the engine's own buffers",
    "reserve": "a paged cache: pages for a slot before it is fed",
    "release_pages": "a paged cache: a slot's pages given back",
    "rollout": "a driver built without a rollout section: the engine's is used",
    "cfg": "routing records (record_routing): the model's MoE layer count",
    "prefill_buckets": "static batching: the widest append",
    "record_routing": "routing replay; absent means False",
}


def engine_problem(engine) -> str | None:
  """What `engine` lacks of EngineProtocol's required members, as one clause
  ("has no method 'decode' ..."), or None when it has them all."""
  for name in REQUIRED_METHODS:
    if not callable(getattr(engine, name, None)):
      return f"has no method {name!r} (sao_jax/rollout/engine_protocol.py EngineProtocol)"
  for name in REQUIRED_ATTRIBUTES:
    if not hasattr(engine, name):
      return f"has no attribute {name!r} (sao_jax/rollout/engine_protocol.py EngineProtocol)"
  return None
