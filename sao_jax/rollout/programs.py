"""The rollout engine's compiled programs, each jitted in one place.

`PolicyEngine` runs these programs and `launch/compile.py` lowers the very
same ones for a TPU topology, so the AOT report's memory figures are those
of what the driver runs. `EnginePrograms` holds what they are built from
(model, sampling, slots, max_len, layout); each of its program methods
returns a new jitted callable -- function, static args, in / out shardings
and donation -- which the engine caches per static key:

  step(kv, prefix)         `_step`: append `[B, W]` tokens, sample each row's
                           next token. The engine's prefill and one-token
                           `generate`, and the driver's appends (`step`).
                           Donates cache (and, sharded, lengths).
  decode(kv, steps, stop)  `_decode`: up to `steps` one-token steps in a
                           while loop with per-slot stops: the driver's
                           decode (`PolicyEngine.decode`). Donates cache
                           (and, sharded, lengths).
  insert()                 `_insert`: a batch-1 prefill's cache into a slot.
  init_state()             an empty decode state, created in its shardings.
  init_prefix()            an empty batch-1 prefill cache.
  copy_params()            params copied into the engine's own buffers.
  reset_lengths()          lengths set to 0 where a mask says.

The last four exist only with a mesh (a single-device engine makes those
arrays eagerly). `kv` is the cache prefix a step attends over (None: the
whole cache; module docstring of engine.py, "Cache sizing"). `step_args`
and `decode_args` give the abstract arguments to lower `step` and `decode`
at, and `context` the mesh / rules / target platform to trace them under.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models import attention, decoding
from sao_jax.models.config import ModelConfig
from sao_jax.rollout import sampling as sampling_lib

if TYPE_CHECKING:
  from sao_jax.rollout.engine import EngineShardings

Array = jax.Array


@dataclasses.dataclass(frozen=True, eq=False)  # its fields hold meshes and pytrees
class EnginePrograms:
  """The jitted programs of an engine of `slots` x `max_len` on one layout.

  `shardings` (with `mesh` and `rules`) for a sharded engine, from
  `engine.engine_shardings`; else `device`, the single device (its
  platform is the one the model is traced for: a TPU device compiles the
  TPU paths on a CPU host).
  """
  cfg: ModelConfig
  sampling: sampling_lib.SamplingConfig
  slots: int
  max_len: int
  mesh: Any = None  # jax.sharding.Mesh, or None: one device
  rules: Any = None  # logical-axis rules, with a mesh
  shardings: EngineShardings | None = None
  device: Any = None  # the device of an unsharded engine

  def __post_init__(self):
    if (self.mesh is None) != (self.shardings is None) or (self.mesh is None) == (
        self.device is None):
      raise ValueError("EnginePrograms takes a mesh with rules and shardings, or a device")

  def context(self):
    """What the programs are traced under: the mesh and rules the model's
    activation constraints resolve against, or the single device's platform."""
    if self.mesh is None:
      return attention.compiling_for(self.device.platform)
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(self.mesh))  # thread-local, like the rules
    stack.enter_context(nn.logical_axis_rules(self.rules))
    return stack

  # --- the programs ---------------------------------------------------------

  def step(self, kv: int | None, *, prefix: bool = False):
    """`_step` jitted: (params, cache, lengths, tokens, valid, key) ->
    (cache, lengths, tokens, log-probs). `prefix`: on a batch-1 prefill
    cache (slots replicated), not the decode state's."""
    body = functools.partial(_step, self.cfg, self.sampling, kv)
    s = self.shardings
    if s is None:
      return jax.jit(body, donate_argnums=(1,))
    cache = s.prefix_cache if prefix else s.cache
    vec = s.replicated if prefix else s.slots
    tok = s.replicated if prefix else s.tokens
    return jax.jit(body, in_shardings=(s.params, cache, vec, tok, tok, s.replicated),
                   out_shardings=(cache, vec, vec, vec), donate_argnums=(1, 2))

  def decode(self, kv: int | None, steps: int, stop: int):
    """`_decode` jitted: (params, cache, lengths, tokens, budgets, KeyStream) ->
    (cache, lengths, pending tokens, sampled tokens, log-probs, counts,
    KeyStream). `stop` -1: budgets only."""
    body = functools.partial(_decode, self.cfg, self.sampling, kv, int(steps), int(stop))
    s = self.shardings
    if s is None:
      return jax.jit(body, donate_argnums=(1,))
    return jax.jit(body, in_shardings=(s.params, s.cache, s.slots, s.slots, s.slots,
                                       s.replicated),
                   out_shardings=(s.cache, s.slots, s.slots, s.tokens, s.tokens, s.slots,
                                  s.replicated), donate_argnums=(1, 2))

  def insert(self):
    """`_insert` jitted; the decode state's arrays donated."""
    s = self.shardings
    placed = {} if s is None else {"out_shardings": (s.cache, s.slots, s.slots, s.slots)}
    return jax.jit(_insert, donate_argnums=(0, 2, 3, 4), **placed)

  def init_state(self):
    """() -> (cache, lengths, next tokens, active), zeros, created in place
    shard by shard: the whole cache never exists on one device."""
    s, b, n = self._sharded(), self.slots, self.max_len
    return jax.jit(lambda: (decoding.init_cache(self.cfg, b, n), jnp.zeros((b,), jnp.int32),
                            jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool)),
                   out_shardings=(s.cache, s.slots, s.slots, s.slots))

  def init_prefix(self):
    """() -> (batch-1 cache, length `[1]`), zeros, slots replicated."""
    s, n = self._sharded(), self.max_len
    return jax.jit(lambda: (decoding.init_cache(self.cfg, 1, n), jnp.zeros((1,), jnp.int32)),
                   out_shardings=(s.prefix_cache, s.replicated))

  def copy_params(self):
    """params -> a copy in fresh buffers of the engine's param shardings."""
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=self._sharded().params)

  def reset_lengths(self):
    """(lengths, mask) -> lengths with 0 where mask."""
    return jax.jit(lambda l, m: jnp.where(m, 0, l), out_shardings=self._sharded().slots)

  def _sharded(self) -> EngineShardings:
    if self.shardings is None:
      raise ValueError("only a sharded engine jits this program")
    return self.shardings

  # --- abstract arguments, to lower a program without allocating ------------

  def step_args(self, params, width: int) -> tuple:
    """`step(kv)`'s arguments for the decode state's cache and `[slots, width]` tokens.

    `params`: the params' ShapeDtypeStructs (e.g. the trainer's abstract
    policy, which `load_params` copies); placed here in the engine's layout.
    """
    tokens = self._placed(jax.ShapeDtypeStruct((self.slots, width), jnp.int32), "tokens")
    valid = self._placed(jax.ShapeDtypeStruct((self.slots, width), jnp.bool_), "tokens")
    key = self._placed(jax.eval_shape(lambda: jax.random.key(0)), "replicated")
    return self._state_args(params) + (tokens, valid, key)

  def decode_args(self, params) -> tuple:
    """`decode(kv, steps, stop)`'s arguments: `step_args`' state, `[slots]`
    pending tokens and budgets, and a `KeyStream`."""
    vec = jax.ShapeDtypeStruct((self.slots,), jnp.int32)
    stream = jax.eval_shape(lambda: sampling_lib.KeyStream(jax.random.key(0), jnp.int32(0)))
    return self._state_args(params) + (self._placed(vec, "slots"), self._placed(vec, "slots"),
                                       self._placed(stream, "replicated"))

  def _state_args(self, params) -> tuple:
    cache = jax.eval_shape(lambda: decoding.init_cache(self.cfg, self.slots, self.max_len))
    lengths = jax.ShapeDtypeStruct((self.slots,), jnp.int32)
    return (self._placed(params, "params"), self._placed(cache, "cache"),
            self._placed(lengths, "slots"))

  def _placed(self, tree, field: str):
    """`tree`'s ShapeDtypeStructs on the shardings' `field` (one device unsharded)."""
    if self.shardings is None:
      device = jax.sharding.SingleDeviceSharding(self.device)
      return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                          tree)
    sh = getattr(self.shardings, field)
    if isinstance(sh, jax.sharding.Sharding):
      return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)


# --- the programs' bodies ------------------------------------------------------


def _insert(cache, prefix_cache, lengths, next_tokens, active, slot, length, first):
  """`PolicyEngine.insert`'s body: prefix cache into `slot`; first < 0 keeps the pending token."""
  # The slot axis of a cache leaf [..., B, S, KVH, hd] is ndim - 4.
  cache = jax.tree.map(
      lambda c, p: jax.lax.dynamic_update_slice_in_dim(c, p.astype(c.dtype), slot, c.ndim - 4),
      cache, prefix_cache)
  next_tokens = next_tokens.at[slot].set(jnp.where(first >= 0, first, next_tokens[slot]))
  return (cache, lengths.at[slot].set(length[0]), next_tokens, active.at[slot].set(True))


def _write_back(lengths: Array, valid: Array, full: Array, live: Array) -> Array:
  """Copies the valid new entries of a cache prefix `live` into `full`.

  Args:
    lengths: int `[B]`, each slot's length before the step.
    valid: bool `[B, W]`, the step's valid tokens (a prefix of each row).
    full: `[..., B, S, KVH, hd]`, the whole cache leaf (donated: in place).
    live: `[..., B, kv, KVH, hd]`, its prefix after the step's writes.
  """
  ax = full.ndim - 3  # the positions axis; slots are ax - 1
  b, w = valid.shape
  positions = lengths[:, None] + jnp.arange(w, dtype=lengths.dtype)[None]  # [B, W]
  src = jnp.minimum(positions, live.shape[ax] - 1).reshape((1,) * (ax - 1) + (b, w, 1, 1))
  new = jnp.take_along_axis(live, src, axis=ax)  # [..., B, W, KVH, hd]
  dst = jnp.where(valid, positions, full.shape[ax])  # padding: out of range, dropped
  index = (slice(None),) * (ax - 1) + (jnp.arange(b)[:, None], dst)
  return full.at[index].set(new, mode="drop")


def _step(cfg, sampling, kv, params, cache, lengths, tokens, valid, rng):
  """Appends tokens, samples each row's next token from its last valid one.

  `kv` None attends over the whole cache. Otherwise the model runs on the
  cache prefix `[0, kv)`, which holds every valid position (the caller
  picks kv so), and only the valid new entries are written back: entries a
  padding token would have written are never read before being overwritten
  (sao_jax/models/transformer.py), so the result is the same.
  """
  if kv is None:
    last_logits, cache, new_lengths = decoding.extend_last(cfg, params, cache, tokens, lengths,
                                                           valid)
  else:
    live = jax.tree.map(lambda c: jax.lax.slice_in_dim(c, 0, kv, axis=c.ndim - 3), cache)
    last_logits, live, new_lengths = decoding.extend_last(cfg, params, live, tokens, lengths,
                                                          valid)
    cache = jax.tree.map(functools.partial(_write_back, lengths, valid), cache, live)
  # last_logits [B, V]: after each row's last valid token (a chunked prefill
  # with cfg.prefill_chunk, never [B, W, V]).
  tok, logp = sampling_lib.sample(last_logits, rng, sampling)
  return cache, new_lengths, tok, logp


def _decode(cfg, sampling, kv, steps, stop_token, params, cache, lengths, tokens, budgets, rng):
  """`PolicyEngine.decode`'s loop: up to `steps` one-token steps, per-slot stops.

  With `kv` the loop runs on the cache prefix `[0, kv)` (the caller picks
  kv to hold every position the loop can write) and writes the new entries
  back once at the end, rather than once per token.

  Returns (cache, lengths, pending tokens `[B]`, sampled tokens `[B, steps]`,
  their log-probs, counts `[B]`, the advanced `KeyStream`).
  """
  b = tokens.shape[0]
  live = cache if kv is None else jax.tree.map(
      lambda c: jax.lax.slice_in_dim(c, 0, kv, axis=c.ndim - 3), cache)

  def cond(carry):
    k, alive = carry[0], carry[4]
    return (k < steps) & alive.any()

  def body(carry):
    k, live, lens, tok, alive, count, out_tok, out_lp = carry
    logits, live, lens = decoding.extend(cfg, params, live, tok[:, None], lens, alive[:, None])
    # The k-th key's draw.
    new, lp = sampling_lib.sample_with(logits[:, 0], uniforms[k], sampling)
    out_tok = jax.lax.dynamic_update_slice_in_dim(
        out_tok, jnp.where(alive, new, 0)[:, None], k, 1)
    out_lp = jax.lax.dynamic_update_slice_in_dim(
        out_lp, jnp.where(alive, lp, 0.0)[:, None], k, 1)
    count = count + alive.astype(jnp.int32)
    tok = jnp.where(alive, new, tok)
    alive = alive & (count < budgets) & (new != stop_token)
    return k + 1, live, lens, tok, alive, count, out_tok, out_lp

  carry = (jnp.int32(0), live, lengths, tokens, budgets > 0, jnp.zeros((b,), jnp.int32),
           jnp.zeros((b, steps), jnp.int32), jnp.zeros((b, steps), jnp.float32))
  uniforms = sampling_lib.uniforms(rng, steps, b)  # [steps, B, 1]: every iteration's, drawn at once
  ran, live, new_lengths, tok, _, count, out_tok, out_lp = jax.lax.while_loop(cond, body, carry)
  rng = rng._replace(draws=rng.draws + ran)
  if kv is None:
    cache = live
  else:
    fed = jnp.arange(steps)[None] < count[:, None]  # [B, steps]: the positions written
    cache = jax.tree.map(functools.partial(_write_back, lengths, fed), cache, live)
  return cache, new_lengths, tok, out_tok, out_lp, count, rng
