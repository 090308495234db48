"""Sampling: the exact distribution tokens are drawn from, and the engine's key stream.

`sampling_logprobs` is the distribution after temperature, top-k and top-p
(renormalised); `sample` draws from it by a two-level inverse CDF
(`draw`) and returns each token's log-prob under it, the log-prob the RL
step's ratio is taken against. `KeyStream` is the engine's counter-based key sequence: draw n
uses `fold_in(base, n)`, so a decode loop draws all of its iterations'
uniforms at once (`uniforms`) and still samples exactly what as many
one-token steps (each taking its key with `take`) would.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  temperature: float = 1.0
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1.0: off

  def __post_init__(self):
    if self.temperature <= 0:
      raise ValueError(f"temperature must be > 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def sampling_logprobs(logits: Array, sampling: SamplingConfig) -> Array:
  """log-probs `[..., V]` of the distribution tokens are actually drawn from."""
  x = logits.astype(jnp.float32) / sampling.temperature
  if sampling.top_k:
    kth = jax.lax.top_k(x, sampling.top_k)[0][..., -1:]
    x = jnp.where(x < kth, -jnp.inf, x)
  if sampling.top_p < 1.0:
    x = nucleus(x, sampling.top_p)
  return jax.nn.log_softmax(x, -1)


def nucleus(x: Array, top_p) -> Array:
  """Log-weights `x` `[..., V]` with -inf outside the nucleus: the smallest set of
  top tokens whose mass reaches `top_p` (a float, or an array broadcasting
  against `[..., 1]`)."""
  probs = jax.nn.softmax(x, -1)
  sorted_p = jnp.sort(probs, -1)[..., ::-1]
  before = jnp.cumsum(sorted_p, -1) - sorted_p
  cutoff = jnp.min(jnp.where(before < top_p, sorted_p, jnp.inf), -1, keepdims=True)
  return jnp.where(probs < cutoff, -jnp.inf, x)


def sample(logits: Array, rng, sampling: SamplingConfig) -> tuple[Array, Array]:
  """(tokens `[B]`, their log-probs `[B]`) from logits `[B, V]`.

  Inverse-CDF sampling: one uniform a row, and the token is the first whose
  cumulative probability exceeds it. Gumbel-max (`jax.random.categorical`)
  draws V uniforms a row; on XLA:CPU those random bits are a visible share
  of a decode step of the tiny model (benchmarks/RESULTS.md#rollout-engine). A token masked by top-k / top-p is never drawn
  (`draw`).
  """
  return sample_with(logits, row_uniforms(rng, logits.shape[0]), sampling)


def row_uniforms(key, rows: int) -> Array:
  """`[rows, 1]` float32 uniforms: `sample`'s draw, and each iteration's of `uniforms`."""
  return jax.random.uniform(key, (rows, 1), jnp.float32)


def sample_with(logits: Array, u: Array, sampling: SamplingConfig) -> tuple[Array, Array]:
  """`sample` with its uniforms `u` `[B, 1]` given (drawn ahead by a decode loop).

  At temperature alone the draw reads the scaled logits as they are (the
  log-probs over the vocabulary are never materialised: at Qwen3's 151,669
  columns those passes cost a decode step more than the head's matmul);
  with top-k or top-p it draws from `sampling_logprobs`.
  """
  if sampling.top_k or sampling.top_p < 1.0:
    x = sampling_logprobs(logits, sampling)
  else:
    x = logits.astype(jnp.float32) / sampling.temperature
  return draw(x, u)


# Columns per block of the two-level inverse CDF (`draw`).
BLOCK = 1024


def draw(x: Array, u: Array) -> tuple[Array, Array]:
  """(tokens `[B]`, log-probs `[B]`): inverse-CDF draws from softmax(x).

  x `[B, V]` log-weights, unnormalised (-inf on tokens that cannot be
  drawn), u `[B, 1]` in [0, 1). Two levels, so that one pass over the row
  finds the token: the mass of each block of `BLOCK` columns, their
  cumulative sum, the block where u of the total falls, then the cumulative
  sum inside that block alone. Each token's probability is its weight over
  the total, as in one flat cumulative sum; only the rounding differs.
  Where rounding leaves no block above u * total the row takes its most
  likely token, and where it leaves no token of the chosen block above it,
  the block's last possible token (both need u within an ulp of a boundary).
  The log-prob is x - max - log(total), as `jax.nn.log_softmax` has it.
  """
  b, v = x.shape
  blocks = -(-v // BLOCK)
  m = jnp.max(x, -1, keepdims=True)
  xb = jnp.pad(x, ((0, 0), (0, blocks * BLOCK - v)), constant_values=-jnp.inf)
  xb = xb.reshape(b, blocks, BLOCK)
  mass = jnp.sum(jnp.exp(xb - m[..., None]), -1)  # [B, blocks]
  cum = jnp.cumsum(mass, -1)
  total = cum[:, -1:]
  target = u * total
  above = cum > target
  blk = jnp.argmax(above, -1)
  before = jnp.take_along_axis(cum - mass, blk[:, None], -1)  # [B, 1]
  xin = jnp.take_along_axis(xb, blk[:, None, None], 1)[:, 0]  # [B, BLOCK]
  w = jnp.exp(xin - m)
  possible = xin > -jnp.inf
  inside = ((before + jnp.cumsum(w, -1)) > target) & possible
  last = BLOCK - 1 - jnp.argmax(possible[:, ::-1], -1)
  col = jnp.where(inside.any(-1), jnp.argmax(inside, -1), last)
  tokens = jnp.where(above.any(-1), blk * BLOCK + col, jnp.argmax(x, -1)).astype(jnp.int32)
  logp = jnp.take_along_axis(x, tokens[:, None], -1)[:, 0] - m[:, 0] - jnp.log(total[:, 0])
  return tokens, logp


def inverse_cdf(logp: Array, u: Array) -> Array:
  """The tokens `draw` takes from log-probs `logp` `[B, V]` (-inf: never) with `u` `[B, 1]`."""
  return draw(logp, u)[0]


class KeyStream(NamedTuple):
  """The engine's sampling keys: draw n uses `fold_in(base, n)`.

  Counter-based rather than a chain of splits, so a decode loop can make
  all of its iterations' uniforms in one batched draw before the loop
  (`programs.py`'s decode loop) and still draw exactly what as many one-token steps would.
  Both fields are device arrays, so the count advances on the device and an
  asynchronous `decode` needs no transfer to know where the next call
  starts.
  """

  base: Array  # a PRNG key
  draws: Array  # int32 scalar, draws taken so far

  def key(self, ahead=0):
    """The key of the draw `ahead` draws after the next one (an int or int array)."""
    return jax.random.fold_in(self.base, self.draws + ahead)

  @classmethod
  def start(cls, key, device) -> "KeyStream":
    """A stream of no draws on `key`, committed to `device` (a device or a sharding).

    Committed, so that a jitted call sees the same argument placement on
    an engine's first call as on its later ones (an uncommitted key would
    compile each program a second time).
    """
    return jax.device_put(cls(key, jnp.int32(0)), device)


@jax.jit
def take(stream: KeyStream) -> tuple[Array, KeyStream]:
  """(the next draw's key, the stream after it)."""
  return stream.key(), stream._replace(draws=stream.draws + 1)


def uniforms(stream: KeyStream, steps: int, rows: int) -> Array:
  """`[steps, rows, 1]`: the uniforms of the stream's next `steps` draws, one batched call.

  Row k equals what `sample` draws with `take`'s k-th key (vmap of the same
  threefry calls: tests/rollout/test_rollout.py checks the loop against one-token
  steps).
  """
  keys = jax.vmap(stream.key)(jnp.arange(steps, dtype=stream.draws.dtype))
  return jax.vmap(lambda k: row_uniforms(k, rows))(keys)


# --- per-slot sampling: a served batch, each slot its own request -----------------
#
# The server's batcher (serving/batcher.py) batches requests that each carry
# their own temperature, top_p, seed and stop ids. They arrive as arrays, one
# entry a slot, so one compiled program serves every mix of values. A slot's
# draws come from its request's own key stream: draw n of a request uses
# `fold_in(its key, n)`, n counting the tokens the request has sampled, so a
# seeded request samples the same tokens whatever else is batched with it.
#
# The distribution a slot samples from, and the log-prob it records, is the
# behaviour distribution, as `sampling_logprobs` has it for the driver: the
# logits over the temperature, the engine's top-k, the request's nucleus,
# renormalised. Temperature 0 is greedy: the argmax, drawn with probability
# 1, so its log-prob is 0 (the behaviour distribution is a point mass; an
# importance ratio against it is the policy's probability of the argmax).


class SlotSampling(NamedTuple):
  """Each slot's sampling, arrays with one row a slot (numpy on the host, device in a program)."""

  temperature: Array  # [B] float32; 0: greedy
  top_p: Array  # [B] float32; 1: off
  keys: Array  # [B, 2] uint32: the key data of each slot's request stream
  draws: Array  # [B] int32: draws the slot's request has taken
  stops: Array  # [B, S] int32: ids that end the slot's turn once sampled (-1: none)


def seed_key(seed: int):
  """The key data `[2]` uint32 of a 64-bit seed (`jax.random.key` keeps only 32 bits
  of it where x64 is off)."""
  return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)


def slot_logweights(logits: Array, slots: SlotSampling, top_k: int) -> Array:
  """`[B, V]` unnormalised log-weights of each slot's behaviour distribution
  (a greedy slot's: its logits, of which it takes the argmax)."""
  t = jnp.where(slots.temperature > 0, slots.temperature, 1.0)
  x = logits.astype(jnp.float32) / t[:, None]
  if top_k:
    kth = jax.lax.top_k(x, top_k)[0][..., -1:]
    x = jnp.where(x < kth, -jnp.inf, x)
  inside = slots.top_p < 1.0
  # The sort over the vocabulary runs only when some slot asks for a nucleus.
  return jax.lax.cond(
    inside.any(),
    lambda x: jnp.where(inside[:, None], nucleus(x, slots.top_p[:, None]), x),
    lambda x: x,
    x,
  )


def slot_uniforms(slots: SlotSampling, steps: int) -> Array:
  """`[steps, B, 1]`: row k is each slot's draw `draws + k` of its own stream."""
  keys = jax.random.wrap_key_data(slots.keys)

  def one(key, draws):
    return jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(key, draws + k), (1,)))(
      jnp.arange(steps, dtype=draws.dtype)
    )  # [steps, 1]

  return jnp.swapaxes(jax.vmap(one)(keys, slots.draws), 0, 1)


def sample_slots(logits: Array, u: Array, slots: SlotSampling, top_k: int, top_n: int):
  """(tokens `[B]`, log-probs `[B]`, top) of each slot's behaviour distribution.

  `u` `[B, 1]`: each slot's uniform. `top` is () for `top_n` 0, else (ids
  `[B, top_n]`, log-probs `[B, top_n]`) of the most likely tokens under the
  same distribution (-inf past its support: a greedy slot's holds only the
  argmax, at 0).
  """
  x = slot_logweights(logits, slots, top_k)
  greedy = slots.temperature <= 0
  tok, logp = draw(x, u)
  tok = jnp.where(greedy, jnp.argmax(x, -1).astype(tok.dtype), tok)
  logp = jnp.where(greedy, 0.0, logp)
  if not top_n:
    return tok, logp, ()
  lp = jax.nn.log_softmax(x, -1)
  top_lp, top_ids = jax.lax.top_k(lp, top_n)
  point = jnp.where(jnp.arange(top_n) == 0, 0.0, -jnp.inf)  # a greedy slot's point mass
  top_lp = jnp.where(greedy[:, None], point[None], top_lp)
  top_ids = jnp.where(greedy[:, None] & (jnp.arange(top_n) == 0)[None], tok[:, None], top_ids)
  return tok, logp, (top_ids.astype(jnp.int32), top_lp)


def slot_stopped(tokens: Array, slots: SlotSampling) -> Array:
  """`[B]` bool: the slot sampled one of its stop ids."""
  return jnp.any(tokens[:, None] == slots.stops, -1)


# --- samplers: how a program draws (programs.py) ----------------------------------


class ConfigSampler(NamedTuple):
  """The driver's: one `SamplingConfig` for every slot, the engine's `KeyStream`."""

  sampling: SamplingConfig

  def step(self, logits, stream):
    """One draw with the step's key; no extra outputs."""
    return sample(logits, stream, self.sampling) + ((),)

  def ahead(self, stream, steps: int, rows: int):
    return uniforms(stream, steps, rows)

  def at(self, logits, drawn, k, stream):
    del stream
    return sample_with(logits, drawn[k], self.sampling) + ((),)

  def stopped(self, tokens, stop_token: int, stream):
    del stream
    return tokens == stop_token

  def advance(self, stream, ran):
    return stream._replace(draws=stream.draws + ran)

  def extra(self, rows: int, steps: int) -> tuple:
    del rows, steps
    return ()


class SlotSampler(NamedTuple):
  """The server's: a `SlotSampling` a call, the engine's top-k, `top_n` alternatives."""

  top_k: int
  top_n: int

  def step(self, logits, slots: SlotSampling):
    return sample_slots(logits, slot_uniforms(slots, 1)[0], slots, self.top_k, self.top_n)

  def ahead(self, slots: SlotSampling, steps: int, rows: int):
    del rows
    return slot_uniforms(slots, steps)

  def at(self, logits, drawn, k, slots: SlotSampling):
    return sample_slots(logits, drawn[k], slots, self.top_k, self.top_n)

  def stopped(self, tokens, stop_token: int, slots: SlotSampling):
    return (tokens == stop_token) | slot_stopped(tokens, slots)

  def advance(self, slots: SlotSampling, ran):
    del ran  # the host counts each slot's draws (its request's tokens)
    return slots

  def extra(self, rows: int, steps: int) -> tuple:
    if not self.top_n:
      return ()
    return (
      jnp.zeros((rows, steps, self.top_n), jnp.int32),
      jnp.full((rows, steps, self.top_n), -jnp.inf, jnp.float32),
    )
