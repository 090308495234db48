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
    probs = jax.nn.softmax(x, -1)
    sorted_p = jnp.sort(probs, -1)[..., ::-1]
    # Keep the smallest set of top tokens whose mass reaches top_p.
    before = jnp.cumsum(sorted_p, -1) - sorted_p
    cutoff = jnp.min(jnp.where(before < sampling.top_p, sorted_p, jnp.inf), -1, keepdims=True)
    x = jnp.where(probs < cutoff, -jnp.inf, x)
  return jax.nn.log_softmax(x, -1)


def sample(logits: Array, rng, sampling: SamplingConfig) -> tuple[Array, Array]:
  """(tokens `[B]`, their log-probs `[B]`) from logits `[B, V]`.

  Inverse-CDF sampling: one uniform a row, and the token is the first whose
  cumulative probability exceeds it. Gumbel-max (`jax.random.categorical`)
  draws V uniforms a row; on XLA:CPU those random bits were 8% of a decode
  step of the tiny model. A token masked by top-k / top-p is never drawn
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
