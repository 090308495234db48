"""The engine interface: what the rollout driver and the serving batcher ask of an engine.

`Engine` is an abstract base class. Its required members are the slot
loop's: `init_decode_state`, `reset_slots`, `step`, `decode`, `collect`
(abstract methods) and `max_concurrent_decodes`, `max_prefill_length`
(attributes an implementation sets). Every other member is an optional
capability declared here with its default, so a caller reads it directly
and an engine without the capability behaves as the default says (a
dense cache, no weight swaps, no per-request sampling, no prefix sharing,
no routing records). `PolicyEngine` (engine.py) and `VllmEngine`
(vllm_backend.py) implement it; a user's engine subclasses it.

`engine_problem` names, in one line, the first required member an object
lacks (or that it is not an `Engine`): the driver and the batcher refuse
such an engine when they are built, not in their thread once generation
has started. Decode states and chunks are the engine's own values: callers
only hand back what `init_decode_state`, `step`, `decode` and `collect`
returned. The design: docs/design/engine.md.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from sao_jax.rollout import kv_cache as kv_cache_lib

REQUIRED_METHODS = ("init_decode_state", "reset_slots", "step", "decode", "collect")
REQUIRED_ATTRIBUTES = ("max_concurrent_decodes", "max_prefill_length")
_WHERE = "(sao_jax/rollout/engine_protocol.py Engine)"


class Engine(abc.ABC):
  """A sampler over slots of token sequences (`PolicyEngine` documents each member).

  Required attributes (set by the implementation):
    max_concurrent_decodes: slots.
    max_prefill_length: the longest sequence a slot holds (max_len).

  Optional capabilities, with their defaults:
    version: the params' version the next sample comes from (0).
    rollout: the engine's rollout section, which a driver built without one
      uses (None: the driver must be given one).
    cfg: the model (None); the driver reads its MoE layer count when
      `record_routing`.
    record_routing: `step` and `decode` return the MoE expert choices of
      the tokens they feed (False).
    sampling: the engine's own `SamplingConfig` (None: temperature 1, no
      top-p), what a serving request without its own sampling gets.
    kv_cache: the KV cache's strategy (rollout/kv_cache.py); default a cache
      without pages, whose reservations always succeed.
    per_request_sampling: `serve_step` / `serve_decode` sample each slot
      with its request's distribution (False).
    shares_prefixes: `share_prefix` / `register_prefix` share pages
      between slots' common prefixes (False).
    can_rewind: `rewind` may cut a slot's cache back (False).
  """

  max_concurrent_decodes: int
  max_prefill_length: int

  version: int = 0
  rollout: Any = None
  cfg: Any = None
  record_routing: bool = False
  sampling: Any = None
  kv_cache: kv_cache_lib.KVCache = kv_cache_lib.KVCache()
  per_request_sampling: bool = False
  shares_prefixes: bool = False
  can_rewind: bool = False

  # --- required: the slot loop -------------------------------------------------

  @abc.abstractmethod
  def init_decode_state(self) -> Any:
    """An empty decode state: every slot free."""

  @abc.abstractmethod
  def reset_slots(self, state: Any, slots_mask: np.ndarray) -> Any:
    """`state` with the masked slots emptied (their pages, if any, given back)."""

  @abc.abstractmethod
  def step(self, state: Any, tokens: np.ndarray, valid: np.ndarray):
    """Appends each slot's valid tokens, samples one: (state, tokens, log-probs, version)."""

  @abc.abstractmethod
  def decode(self, state: Any, tokens, budgets, *, steps: int, stop_token):
    """Starts up to `steps` decode steps per budgeted slot: (state, chunk)."""

  @abc.abstractmethod
  def collect(self, state: Any, chunk: Any):
    """The samples of a `decode` chunk on the host: (state, chunk)."""

  # --- optional: weight swaps ----------------------------------------------------

  def load_params(self, params):
    """`params` copied into the engine's own layout (for `update_params(copied=True)`)."""
    raise NotImplementedError(f"{type(self).__name__} does not swap weights")

  def update_params(self, params, version: int, *, copied: bool = False) -> None:
    """New params for the samples of the next call on."""
    raise NotImplementedError(f"{type(self).__name__} does not swap weights")

  # --- optional: pages (a cache without pages has every slot's max_len) -----------

  def reserve(self, state: Any, slot: int, tokens: int) -> bool:
    """Pages for slot `slot`'s first `tokens` positions, allocated now.

    False (nothing allocated) when its group of the pool has too few free
    pages: the caller waits, or frees some. A dense engine has every slot's
    max_len positions: always True. Host-side only; the table reaches the
    device with the next call.
    """
    return self.kv_cache.reserve(state, slot, tokens)

  def trim_pages(self, state: Any, slot: int, tokens: int) -> None:
    """A paged engine's slot gives back its pages past its first `tokens`
    positions (host-side only); a dense engine's: nothing to give."""
    self.kv_cache.trim(state, slot, tokens)

  def release_pages(self, state: Any, slots_mask: np.ndarray) -> None:
    """A paged engine's slots give their pages back (host-side only): the
    slots' caches are gone, so they must be reset before they are fed
    again (`reset_slots` does both). A dense engine's: nothing to give."""
    self.kv_cache.release(state, slots_mask)

  # --- optional: prefixes and per-request sampling (serving) -----------------------

  def rewind(self, state: Any, slot: int, length: int) -> Any:
    """Slot `slot`'s cache cut back to its first `length` positions (`can_rewind`)."""
    raise NotImplementedError(f"{type(self).__name__} cannot cut a cache back")

  def share_prefix(self, state: Any, slot: int, tokens) -> Any:
    """Empty slot `slot` starts with the pages others hold of `tokens`' start
    (`shares_prefixes`); by default it shares nothing."""
    del slot, tokens
    return state

  def register_prefix(self, state: Any, slot: int, tokens) -> None:
    """Offers slot `slot`'s cached `tokens` to `share_prefix`; by default nothing is kept."""
    del state, slot, tokens

  def serve_step(self, state: Any, tokens: np.ndarray, valid: np.ndarray, slots, *, top_n: int = 0):
    """`step` with each slot's own sampling (`per_request_sampling`)."""
    raise NotImplementedError(f"{type(self).__name__} samples only with its own distribution")

  def serve_decode(
    self, state: Any, tokens, budgets, slots, *, steps: int, stop_token, top_n: int = 0
  ):
    """`decode` with each slot's own sampling (`per_request_sampling`)."""
    raise NotImplementedError(f"{type(self).__name__} samples only with its own distribution")


def engine_problem(engine) -> str | None:
  """What `engine` lacks of `Engine`'s required members, as one clause
  ("has no method 'decode' ..."), or None when it is a complete `Engine`."""
  for name in REQUIRED_METHODS:
    if not callable(getattr(engine, name, None)):
      return f"has no method {name!r} {_WHERE}"
  for name in REQUIRED_ATTRIBUTES:
    if not hasattr(engine, name):
      return f"has no attribute {name!r} {_WHERE}"
  if not isinstance(engine, Engine):
    return f"is not a subclass of Engine {_WHERE}, which declares its optional members"
  return None
