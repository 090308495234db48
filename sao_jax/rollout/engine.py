"""PolicyEngine: the policy behind JetStream's Engine API, with log-probs and versions.

The engine owns a batched KV cache of `max_concurrent_decodes` slots and the
current params with their version. Its JetStream-shaped surface:

    prefix, first = engine.prefill(params=p, existing_prefix=None,
                                   padded_tokens=toks, true_length=n)
    state = engine.insert(prefix, state, slot)
    state, result = engine.generate(p, state)      # one token per active slot

and `load_params`, `init_decode_state`, `free_resource`, `max_concurrent_decodes`,
`max_prefill_length`, `samples_per_slot`. Each sampled token comes with its
log-prob under the exact sampling distribution (temperature, top-k, top-p
applied, renormalised) and the version of the params whose logits produced it.

The rollout driver uses the fused `step`: append any number of pending tokens
to chosen slots and sample each slot's next token, in one jitted call (the
same primitive as prefill and generate, so continuous batching can mix
observation appends with decoding). Lengths are bucketed so each width
compiles once.

`sao_jax/rollout/jetstream_bridge.py` (the `jetstream` extra) subclasses
JetStream's abstract Engine with this class; nothing here imports jetstream.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.models import decoding
from sao_jax.models.config import ModelConfig

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
  """(tokens `[B]`, their log-probs `[B]`) from logits `[B, V]`."""
  logp = sampling_logprobs(logits, sampling)
  tokens = jax.random.categorical(rng, logp, axis=-1)
  return tokens.astype(jnp.int32), jnp.take_along_axis(logp, tokens[:, None], -1)[:, 0]


class DecodeState(NamedTuple):
  cache: Any  # per layer {"k", "v"}: [slots, max_len, KVH, hd]
  lengths: Array  # [slots] int32, tokens in each slot's cache
  next_tokens: Array  # [slots] int32, sampled but not yet in the cache
  active: Array  # [slots] bool


class Prefix(NamedTuple):
  cache: Any  # batch-1 cache
  length: Array  # [1]


class ResultTokens(NamedTuple):
  tokens: np.ndarray  # [slots] or [1]
  logprobs: np.ndarray
  version: int


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
  for b in buckets:
    if n <= b:
      return b
  return buckets[-1]


class PolicyEngine:
  """The policy model behind the Engine API (see module docstring)."""

  samples_per_slot = 1

  def __init__(self, cfg: ModelConfig, params, *, slots: int, max_len: int,
               sampling: SamplingConfig = SamplingConfig(), seed: int = 0,
               version: int = 0, prefill_buckets: tuple[int, ...] = (8, 16, 32, 64, 128, 256),
               device=None):
    if max_len > cfg.max_seq_len:
      raise ValueError(f"max_len {max_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
    self.cfg = cfg
    self.sampling = sampling
    self.max_concurrent_decodes = slots
    self.max_prefill_length = max_len
    self.prefill_buckets = tuple(b for b in prefill_buckets if b < max_len) + (max_len,)
    self._device = device or jax.local_devices()[0]
    self._lock = threading.Lock()
    self._rng = jax.random.key(seed)
    self.params = self.load_params(params)
    self.version = version
    self._step = jax.jit(functools.partial(_step, cfg, sampling), donate_argnums=(1,))

  # --- params -----------------------------------------------------------

  def load_params(self, params):
    """A private, single-device copy (the trainer may donate its buffers)."""
    return jax.device_put(jax.tree.map(jnp.copy, params), self._device)

  def update_params(self, params, version: int, *, copied: bool = False) -> None:
    """Swaps in new params; `copied=True` when they come from `load_params`."""
    new = params if copied else self.load_params(params)
    with self._lock:
      self.params, self.version = new, int(version)

  def _next_rng(self):
    self._rng, rng = jax.random.split(self._rng)
    return rng

  # --- Engine API -------------------------------------------------------

  def init_decode_state(self) -> DecodeState:
    b = self.max_concurrent_decodes
    cache = decoding.init_cache(self.cfg, b, self.max_prefill_length)
    return jax.device_put(DecodeState(cache, jnp.zeros((b,), jnp.int32),
                                      jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool)),
                          self._device)

  def prefill(self, *, params=None, existing_prefix: Prefix | None = None,
              padded_tokens, true_length: int) -> tuple[Prefix, ResultTokens]:
    """Runs a prompt (appended to `existing_prefix` if given); samples one token."""
    params = self.params if params is None else params
    padded = jnp.asarray(padded_tokens, jnp.int32).reshape(1, -1)
    if existing_prefix is None:
      existing_prefix = Prefix(decoding.init_cache(self.cfg, 1, self.max_prefill_length),
                               jnp.zeros((1,), jnp.int32))
    valid = (jnp.arange(padded.shape[1]) < true_length)[None]
    cache, length, tok, logp = self._step(params, existing_prefix.cache, existing_prefix.length,
                                          padded, valid, self._next_rng())
    return Prefix(cache, length), ResultTokens(np.asarray(tok), np.asarray(logp), self.version)

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int,
             first_token: int | None = None) -> DecodeState:
    cache = jax.tree.map(lambda c, p: c.at[slot].set(p[0]), decode_state.cache, prefix.cache)
    nxt = decode_state.next_tokens
    if first_token is not None:
      nxt = nxt.at[slot].set(first_token)
    return DecodeState(cache, decode_state.lengths.at[slot].set(prefix.length[0]), nxt,
                       decode_state.active.at[slot].set(True))

  def free_resource(self, decode_state: DecodeState, slot: int) -> DecodeState:
    return decode_state._replace(active=decode_state.active.at[slot].set(False),
                                 lengths=decode_state.lengths.at[slot].set(0))

  def generate(self, params, decode_state: DecodeState) -> tuple[DecodeState, ResultTokens]:
    """One decode step: feeds each active slot's next token, samples the next."""
    params = self.params if params is None else params
    cache, lengths, tok, logp = self._step(
        params, decode_state.cache, decode_state.lengths, decode_state.next_tokens[:, None],
        decode_state.active[:, None], self._next_rng())
    tok = jnp.where(decode_state.active, tok, decode_state.next_tokens)
    state = DecodeState(cache, lengths, tok, decode_state.active)
    return state, ResultTokens(np.asarray(tok), np.asarray(logp), self.version)

  # --- the driver's fused step -------------------------------------------

  def step(self, state: DecodeState, tokens: np.ndarray, valid: np.ndarray):
    """Appends `tokens[b, :n_b]` to slot b's cache where `valid`, samples a next token.

    Args:
      state: the decode state.
      tokens: int `[slots, L]` (L is padded up to a bucket here).
      valid: bool `[slots, L]`, a prefix of each row.

    Returns:
      (new state, sampled tokens `[slots]`, log-probs `[slots]`, version).
      Rows with no valid token are unchanged and their samples meaningless.
    """
    with self._lock:
      params, version = self.params, self.version
    width = _bucket(tokens.shape[1], self.prefill_buckets)
    pad = width - tokens.shape[1]
    if pad:
      tokens = np.pad(tokens, ((0, 0), (0, pad)))
      valid = np.pad(valid, ((0, 0), (0, pad)))
    cache, lengths, tok, logp = self._step(params, state.cache, state.lengths,
                                           jnp.asarray(tokens, jnp.int32), jnp.asarray(valid),
                                           self._next_rng())
    tok, logp = jax.device_get((tok, logp))
    return state._replace(cache=cache, lengths=lengths), tok, logp, version

  def reset_slots(self, state: DecodeState, slots_mask: np.ndarray) -> DecodeState:
    """Empties the caches of the given slots (their lengths go to 0)."""
    return state._replace(lengths=jnp.where(jnp.asarray(slots_mask), 0, state.lengths))


def _step(cfg, sampling, params, cache, lengths, tokens, valid, rng):
  logits, cache, new_lengths = decoding.extend(cfg, params, cache, tokens, lengths, valid)
  last = jnp.maximum(valid.sum(1) - 1, 0)
  last_logits = jnp.take_along_axis(logits, last[:, None, None], 1)[:, 0]  # [B, V]
  tok, logp = sample(last_logits, rng, sampling)
  return cache, new_lengths, tok, logp
