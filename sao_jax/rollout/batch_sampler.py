"""The engine as a plain sampler: prompts in, continuations out (benchmarks and tests).

`generate_batch(engine, prompts, max_new_tokens)` continues each prompt by
up to `max_new_tokens` tokens with one `step` (every prompt's prefill, one
bucketed width) and one `decode` loop for the rest: two host calls, on the
engine's own decode state of all its slots and its own key stream, so it
samples exactly what `step` then `decode` sample.

`LaneSampler(engine, lanes)` does the same in `lanes` lanes. On XLA:CPU one
program mostly keeps one core busy, and separate programs overlap only when
they are launched from separate threads; a lane is a decode state of
`ceil(slots / lanes)` slots with its own key stream (lane i's base key is
`fold_in(the engine's next key, i)`), whose prefill and decode loop run
from its own thread. Each lane samples exactly as a one-lane engine of its
size would; the tokens differ from one lane only through the keys.
Throughput: benchmarks/RESULTS.md#rollout-engine. Lanes need a one-device
engine with a dense cache and no routing records.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools

import jax
import numpy as np

from sao_jax.rollout import slot_loop
from sao_jax.rollout.engine import PolicyEngine
from sao_jax.rollout.sampling import KeyStream, take


def _check(engine: PolicyEngine, prompts, max_new_tokens: int) -> None:
  """Raises ValueError for prompts the engine cannot continue by `max_new_tokens`."""
  n, b = len(prompts), engine.max_concurrent_decodes
  if not 0 < n <= b:
    raise ValueError(f"generate_batch takes 1 to {b} prompts (the engine's slots), got {n}")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  lens = np.array([len(p) for p in prompts])
  if lens.min() < 1 or lens.max() + max_new_tokens > engine.max_prefill_length:
    raise ValueError(
      f"prompts of {lens.min()}..{lens.max()} tokens plus {max_new_tokens} new "
      f"ones do not fit max_len {engine.max_prefill_length} (or a prompt is empty)"
    )


def _prefill_rows(engine: PolicyEngine, prompts, slots: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens, valid) `[slots, longest prompt]`: prompt i in row i, the rest empty."""
  return slot_loop.prefill_feed(dict(enumerate(prompts)), slots, engine.max_prefill_length)


def _continue(prompts, max_new_tokens: int, stop_token: int | None, first, first_lp, decode):
  """(tokens, log-probs, counts) of `prompts` from their first samples and `decode(first,
  budgets, steps)`, which returns the collected chunk of the rest."""
  n, slots = len(prompts), len(first)
  out = np.zeros((n, max_new_tokens), np.int32)
  out_lp = np.zeros((n, max_new_tokens), np.float32)
  out[:, 0], out_lp[:, 0] = first[:n], first_lp[:n]
  counts = np.ones((n,), np.int32)
  if max_new_tokens > 1:
    budgets = np.zeros((slots,), np.int32)
    budgets[:n] = max_new_tokens - 1
    if stop_token is not None:
      budgets[:n] = np.where(first[:n] == stop_token, 0, budgets[:n])
    chunk = decode(first, budgets, max_new_tokens - 1)
    out[:, 1:], out_lp[:, 1:] = chunk.tokens[:n], chunk.logprobs[:n]
    counts += chunk.counts[:n]
  return out, out_lp, counts


def generate_batch(
  engine: PolicyEngine, prompts, max_new_tokens: int, *, stop_token: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Continues each prompt by up to `max_new_tokens` tokens: one `step`, one `decode`.

  Args:
    engine: the sampler; its slots are emptied, nothing else of its state is kept.
    prompts: up to `max_concurrent_decodes` int token sequences, each of at
      least one token.
    max_new_tokens: tokens to sample per prompt; prompt plus new tokens must
      fit in `max_len`.
    stop_token: ends a row early once sampled (kept); None: never.

  Returns:
    (tokens int32 `[N, max_new_tokens]`, their log-probs float32 `[N,
    max_new_tokens]`, counts int32 `[N]`): row n is valid for its first
    counts[n] entries (all of them without a stop token).
  """
  _check(engine, prompts, max_new_tokens)
  state = engine.init_decode_state()
  state, first, first_lp, _ = engine.step(
    state, *_prefill_rows(engine, prompts, engine.max_concurrent_decodes)
  )

  def decode(tokens, budgets, steps):
    s, chunk = engine.decode(state, tokens, budgets, steps=steps, stop_token=stop_token)
    return engine.collect(s, chunk)[1]

  return _continue(prompts, max_new_tokens, stop_token, first, first_lp, decode)


class LaneSampler:
  """`generate_batch` in `lanes` concurrent lanes of one engine (module docstring).

  Lane threads trace new programs without the caller's thread-local JAX
  settings (e.g. a `jax.default_matmul_precision` context).
  """

  def __init__(self, engine: PolicyEngine, lanes: int = 1):
    slots = engine.max_concurrent_decodes
    if not 1 <= lanes <= slots:
      raise ValueError(f"lanes must be between 1 and slots ({slots}), got {lanes}")
    engine.kv_cache.check_engine(lanes)
    if lanes > 1 and engine.record_routing:
      raise ValueError("record_routing is for lanes=1 (generate_batch's lanes return no routing)")
    if lanes > 1 and engine.mesh.size > 1:
      raise ValueError(
        "lanes > 1 is for a single-device engine; a sharded engine's step already spans its mesh"
      )
    self.engine, self.lanes = engine, lanes
    self._pool = (
      cf.ThreadPoolExecutor(lanes, thread_name_prefix="engine-lane") if lanes > 1 else None
    )

  def generate_batch(
    self, prompts, max_new_tokens: int, *, stop_token: int | None = None
  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`generate_batch`'s contract; the prompts are dealt to the lanes in order,
    `ceil(N / lanes)` each, every lane a program of `ceil(slots / lanes)` slots."""
    if self.lanes == 1:
      return generate_batch(self.engine, prompts, max_new_tokens, stop_token=stop_token)
    engine, n = self.engine, len(prompts)
    _check(engine, prompts, max_new_tokens)
    params, version = engine.snapshot()
    lane = -(-engine.max_concurrent_decodes // self.lanes)  # slots a lane
    run = functools.partial(
      self._lane, params, version, max_new_tokens=max_new_tokens, stop_token=stop_token, slots=lane
    )
    per = -(-n // self.lanes)  # prompts a lane: every lane works, in programs of `lane` slots
    groups = [list(prompts[i : i + per]) for i in range(0, n, per)]
    key = engine.next_key()
    streams = [
      KeyStream.start(jax.random.fold_in(key, i), engine.shardings.replicated)
      for i in range(len(groups))
    ]
    futures = [self._pool.submit(run, g, rng=r) for g, r in zip(groups, streams)]
    cf.wait(futures)  # no lane left running when another's failure is raised
    parts = [f.result() for f in futures]
    return tuple(np.concatenate(x) for x in zip(*parts))

  def _lane(
    self, params, version, prompts, *, max_new_tokens: int, stop_token: int | None, slots: int, rng
  ):
    """`generate_batch` of `prompts` in a decode state of `slots` slots; `rng` is the
    lane's `KeyStream`: the prefill takes its next key and the decode loop the ones after."""
    engine = self.engine
    state = engine.init_decode_state(slots)
    key, rng = take(rng)
    state, first, first_lp, _ = engine.step_with(
      params, state, *_prefill_rows(engine, prompts, slots), key
    )

    def decode(tokens, budgets, steps):
      s, chunk, _ = engine.decode_with(
        params, version, state, tokens, budgets, steps, stop_token, rng
      )
      return engine.collect(s, chunk)[1]

    return _continue(prompts, max_new_tokens, stop_token, first, first_lp, decode)
