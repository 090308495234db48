"""The engine interface (sao_jax/rollout/engine_protocol.py): what the driver and the
batcher ask of an engine, checked when they are built."""

import numpy as np
import pytest

from sao_jax.rollout import engine_protocol, kv_cache
from sao_jax.rollout.driver import RolloutDriver
from sao_jax.rollout.engine import PolicyEngine
from sao_jax.serving.batcher import Batcher


class _Partial:
  """An engine of a user's, not an `Engine`, with every required member but `decode`."""

  max_concurrent_decodes, max_prefill_length = 2, 64

  def init_decode_state(self):
    return None

  def reset_slots(self, state, slots_mask):
    return state

  def step(self, state, tokens, valid):
    return state, np.zeros(2, np.int32), np.zeros(2, np.float32)

  def collect(self, state, chunk):
    return state, chunk


class _Minimal(_Partial, engine_protocol.Engine):
  """The required members only: every optional one is `Engine`'s default."""

  def decode(self, state, tokens, budgets, *, steps, stop_token):
    return state, None


def test_the_real_engine_is_an_engine_with_its_capabilities_declared():
  assert issubclass(PolicyEngine, engine_protocol.Engine)
  assert not PolicyEngine.__abstractmethods__
  assert PolicyEngine.per_request_sampling and PolicyEngine.shares_prefixes
  assert engine_protocol.engine_problem(_Partial()) == (
    "has no method 'decode' (sao_jax/rollout/engine_protocol.py Engine)"
  )


def test_an_engine_with_the_required_members_only_gets_the_declared_defaults():
  e = _Minimal()
  assert engine_protocol.engine_problem(e) is None
  assert (e.version, e.rollout, e.cfg, e.sampling) == (0, None, None, None)
  assert not (e.record_routing or e.per_request_sampling or e.shares_prefixes or e.can_rewind)
  assert type(e.kv_cache) is kv_cache.KVCache and not e.kv_cache.paged
  assert e.reserve(None, 0, 10**6)  # a cache without pages has every slot's max_len
  assert e.share_prefix("state", 0, [1, 2, 3]) == "state"  # shares nothing
  with pytest.raises(NotImplementedError, match="_Minimal does not swap weights"):
    e.update_params({}, 1)
  with pytest.raises(NotImplementedError, match="own distribution"):
    e.serve_step(None, None, None, None)


def test_an_engine_must_subclass_engine_even_with_every_required_member():
  class Duck(_Partial):
    decode = _Minimal.decode

  assert engine_protocol.engine_problem(Duck()) == (
    "is not a subclass of Engine (sao_jax/rollout/engine_protocol.py Engine), which "
    "declares its optional members"
  )


def test_a_driver_refuses_an_engine_without_a_required_member_in_one_line():
  with pytest.raises(TypeError) as e:
    RolloutDriver(_Partial(), None, None, iter(()), None)
  message = str(e.value)
  assert "\n" not in message
  assert message.startswith("RolloutDriver: engine _Partial has no method 'decode'")


def test_a_batcher_refuses_an_engine_without_a_required_member_in_one_line():
  with pytest.raises(TypeError) as e:
    Batcher(_Partial(), 0)
  assert str(e.value) == (
    "Batcher: engine _Partial has no method 'decode' (sao_jax/rollout/engine_protocol.py Engine)"
  )


def test_an_engine_missing_an_attribute_is_named():
  class NoSlots(_Minimal):
    max_concurrent_decodes = property(lambda self: (_ for _ in ()).throw(AttributeError()))

  assert engine_protocol.engine_problem(NoSlots()) == (
    "has no attribute 'max_concurrent_decodes' (sao_jax/rollout/engine_protocol.py Engine)"
  )
