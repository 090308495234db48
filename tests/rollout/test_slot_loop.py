"""The slot loop's one body (sao_jax/rollout/slot_loop.py): the feeds of a prefill and
a decode call, and a chunk's samples in order."""

import types

import numpy as np

from sao_jax.rollout import slot_loop


def test_a_prefill_feeds_each_slot_its_pending_input_up_to_the_width():
  tokens, valid = slot_loop.prefill_feed({0: [5, 6, 7], 2: [9]}, 4, max_width=8)
  assert tokens.shape == valid.shape == (4, 3) and tokens.dtype == np.int32
  np.testing.assert_array_equal(tokens, [[5, 6, 7], [0, 0, 0], [9, 0, 0], [0, 0, 0]])
  np.testing.assert_array_equal(valid.sum(1), [3, 0, 1, 0])
  # An input longer than the width is cut there: the rest is the next call's.
  tokens, valid = slot_loop.prefill_feed({1: list(range(1, 11))}, 2, max_width=4)
  np.testing.assert_array_equal(tokens[1], [1, 2, 3, 4])
  assert valid[1].all() and not valid[0].any()


def test_a_decode_feeds_pending_tokens_and_budgets_and_others_sit_out():
  tokens, budgets = slot_loop.decode_feed({1: (42, 3), 3: (7, 1)}, 4)
  np.testing.assert_array_equal(tokens, [0, 42, 0, 7])
  np.testing.assert_array_equal(budgets, [0, 3, 0, 1])
  assert tokens.dtype == budgets.dtype == np.int32


def test_a_chunks_samples_come_slot_by_slot_in_order():
  chunk = types.SimpleNamespace(
    tokens=np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]]),
    logprobs=-np.arange(9, dtype=np.float32).reshape(3, 3),
    counts=np.array([2, 0, 3]),
  )
  got = list(slot_loop.samples(chunk, [2, 0, 1]))
  assert got == [
    (2, 0, 7, -6.0),
    (2, 1, 8, -7.0),
    (2, 2, 9, -8.0),
    (0, 0, 1, -0.0),
    (0, 1, 2, -1.0),
  ]
  assert all(type(t) is int and type(lp) is float for _, _, t, lp in got)
