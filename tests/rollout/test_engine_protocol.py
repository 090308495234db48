"""The engine protocol (sao_jax/rollout/engine_protocol.py): what the driver
asks of its engine, checked when the driver is built."""

import numpy as np
import pytest

from sao_jax.rollout import engine_protocol
from sao_jax.rollout.driver import RolloutDriver
from sao_jax.rollout.engine import PolicyEngine


class _Partial:
  """An engine of a user's with every required member but `decode`."""
  max_concurrent_decodes, max_prefill_length = 2, 64

  def init_decode_state(self):
    return None

  def reset_slots(self, state, slots_mask):
    return state

  def step(self, state, tokens, valid):
    return state, np.zeros(2, np.int32), np.zeros(2, np.float32)

  def collect(self, state, chunk):
    return state, chunk


def test_the_real_engine_has_every_member_the_driver_uses():
  for name in (engine_protocol.REQUIRED_METHODS + tuple(engine_protocol.OPTIONAL)):
    if name in ("record_routing", "rollout", "cfg", "prefill_buckets"):
      continue  # instance attributes, set by the constructor
    assert callable(getattr(PolicyEngine, name)), name
  assert engine_protocol.engine_problem(_Partial()) == (
      "has no method 'decode' (sao_jax/rollout/engine_protocol.py EngineProtocol)")


def test_a_driver_refuses_an_engine_without_a_required_member_in_one_line():
  with pytest.raises(TypeError) as e:
    RolloutDriver(_Partial(), None, None, iter(()), None)
  message = str(e.value)
  assert "\n" not in message
  assert message.startswith("RolloutDriver: engine _Partial has no method 'decode'")


def test_an_engine_missing_an_attribute_is_named():
  class NoSlots(_Partial):
    max_concurrent_decodes = property(lambda self: (_ for _ in ()).throw(AttributeError()))

    def decode(self, state, tokens, budgets, steps, stop_token):
      return state, None

  assert engine_protocol.engine_problem(NoSlots()) == (
      "has no attribute 'max_concurrent_decodes' (sao_jax/rollout/engine_protocol.py "
      "EngineProtocol)")
