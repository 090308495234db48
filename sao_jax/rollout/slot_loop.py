"""The slot loop's one body: what an engine call feeds each slot and what it hands back.

The rollout driver (driver.py), the serving batcher and the plain sampler
(batch_sampler.py) run slots of an `engine_protocol.Engine` the same way: a
prefill `step` feeds slots with pending input, as many tokens each as the
longest pending input (capped at a width, the rest next call), and samples
one token a slot; a `decode` call feeds each decoding slot its pending token
(the last one sampled) with a budget, and its collected chunk holds each
slot's samples in order. Who prefills, the budgets, and what a sample does
to its slot are each caller's. These functions are pure: host values in,
numpy arrays (or the chunk's samples) out.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np


def prefill_feed(
  pending: Mapping[int, Sequence[int]], slots: int, max_width: int
) -> tuple[np.ndarray, np.ndarray]:
  """(tokens int32, valid bool) `[slots, width]` of one prefill `step`.

  Row i holds the first `width` tokens of `pending[i]` (slot i's input not
  yet in its cache), valid where fed; rows of slots not in `pending` are
  empty. `width` is the longest pending input, at most `max_width`.
  """
  width = min(max(len(p) for p in pending.values()), max_width)
  tokens = np.zeros((slots, width), np.int32)
  valid = np.zeros((slots, width), bool)
  for i, p in pending.items():
    chunk = p[:width]
    tokens[i, : len(chunk)], valid[i, : len(chunk)] = chunk, True
  return tokens, valid


def decode_feed(rows: Mapping[int, tuple[int, int]], slots: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens, budgets) int32 `[slots]` of one `decode` call: `rows[i]` is slot i's
  (pending token, budget); other slots sit out (budget 0)."""
  tokens = np.zeros((slots,), np.int32)
  budgets = np.zeros((slots,), np.int32)
  for i, (token, budget) in rows.items():
    tokens[i], budgets[i] = token, budget
  return tokens, budgets


def samples(chunk, slots: Iterable[int]) -> Iterator[tuple[int, int, int, float]]:
  """(slot, k, token, log-prob) of a collected `decode` chunk: each of `slots` in
  turn, its `chunk.counts[slot]` samples in order."""
  for i in slots:
    for k in range(int(chunk.counts[i])):
      yield i, k, int(chunk.tokens[i, k]), float(chunk.logprobs[i, k])
