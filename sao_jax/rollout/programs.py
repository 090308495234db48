"""The rollout engine's compiled programs, each jitted in one place.

`PolicyEngine` runs these programs and `launch/compile.py` lowers the very
same ones for a TPU topology, so the AOT report's memory figures are those
of what the driver runs. `EnginePrograms` holds what they are built from
(model, sampling, slots, max_len, layout; `for_rollout` reads them from a
config's rollout section, for the engine and launch/compile.py alike); each
of its program methods
returns a new jitted callable -- function, static args, in / out shardings
and donation -- which the engine caches per static key:

  step(kv)                 `_step`: append `[B, W]` tokens, sample each row's
                           next token: the driver's appends and one-token
                           decodes (`PolicyEngine.step`), batch_sampler's
                           prefill. Donates cache and lengths.
  decode(kv, steps, stop)  `_decode`: up to `steps` one-token steps in a
                           while loop with per-slot stops: the driver's
                           decode (`PolicyEngine.decode`). Donates cache
                           and lengths.
  init_state(batch)        an empty decode state, created in its shardings.
  copy_params()            params copied into the engine's own buffers.
  reset_lengths()          lengths set to 0 where a mask says.
  set_lengths()            lengths set where a mask says (a cache cut back).

`step` and `decode` take a `top_n`: None (the driver's programs: the run's
`SamplingConfig` and the engine's `KeyStream`, sampling.ConfigSampler), or
an int for the server's (`serve_step` / `serve_decode`): the key argument
is a `SlotSampling` of per-slot arrays (sampling.SlotSampler), and with
`top_n` > 0 the programs also return each sample's `top_n` likeliest ids
and log-probs. The bodies are shared; only the sampler differs.

There is one layout (layout.py): a mesh and rules, a mesh of one device for
a single-device engine. `kv` is the cache prefix a step attends over (None:
the whole cache; module docstring of engine.py, "Cache sizing").

The KV cache is a strategy (kv_cache.py, `EnginePrograms.kv_cache`): the
empty cache, its shardings and bytes, and the arguments a program takes
after the lengths are the strategy's; `BODIES` holds each kind's step and
decode bodies. A paged engine's programs take the page table `[slots,
pages_per_slot]` after the lengths, (params, pool, lengths, table, ...),
and there `kv` names the table's first ceil(kv / page) columns: the slots'
pages a step attends over. New entries go straight into their pages: no
prefix copy, no write-back.
`capacity()` says how many live tokens the cache holds (the pool's pages x
page size, or slots x max_len), in all and per slot group.
`step_args` and `decode_args` give the abstract arguments to lower `step`
and `decode` at, and `context` the mesh and rules to trace them under (the
mesh's devices name the target platform: a mesh of TPU devices compiles the
TPU paths on a CPU host).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.config import sections
from sao_jax.models import decoding, head_vocab, kv_layout, paged, precision, routing
from sao_jax.models import sharding as shd
from sao_jax.models.config import ModelConfig
from sao_jax.rollout import kv_cache as kv_cache_lib
from sao_jax.rollout import layout
from sao_jax.rollout import sampling as sampling_lib

Array = jax.Array


class EnginePrograms:
  """The jitted programs of an engine of `slots` x `max_len` on one layout.

  The layout: `mesh` with `rules` (default `layout.rollout_rules(mesh)`)
  and `shardings` (default the KV cache's `shardings` of those), or
  `device` alone: a one-device mesh over it (`layout.one_device_mesh`;
  launch/compile.py's one-chip engine passes an abstract TPU device).
  The KV cache: `kv_cache`, a name in kv_cache.KV_CACHES (None: "paged"
  when `page_size` is given, else "dense"), with `page_size` and
  `num_pages` (0: the dense cache's size, rounded up to whole pages a
  group) for a paged one.
  """

  def __init__(
    self,
    cfg: ModelConfig,
    sampling: sampling_lib.SamplingConfig,
    slots: int,
    max_len: int,
    *,
    mesh=None,
    rules=None,
    shardings=None,
    device=None,
    kv_cache: str | None = None,
    page_size: int | None = None,
    num_pages: int = 0,
    record_routing: bool = False,
  ):
    if mesh is not None and device is not None:
      raise ValueError("EnginePrograms takes a mesh or a device, not both")
    # The engine holds its params in the compute dtype (precision.py: the
    # same forward as the trainer's from float32 master weights, half the bytes).
    cfg = precision.serving_config(cfg)
    self.cfg, self.sampling, self.slots, self.max_len = cfg, sampling, slots, max_len
    # Routing replay (rl.routing_replay): step and decode also return the
    # MoE expert choices of every token they feed, [slots, W, M * k].
    if record_routing and cfg.num_moe_layers == 0:
      raise ValueError("record_routing needs a model with MoE layers")
    self.record_routing = record_routing
    self.mesh = layout.one_device_mesh(device) if mesh is None else mesh
    self.rules = tuple(
      tuple(r) for r in (layout.rollout_rules(self.mesh) if rules is None else rules)
    )
    # What differs between a dense and a paged cache (kv_cache.py).
    self.kv_cache: kv_cache_lib.KVCache = kv_cache_lib.build(
      kv_cache, cfg, slots, max_len, self.groups, page_size=page_size, num_pages=num_pages
    )
    self.shardings: layout.EngineShardings = (
      self.kv_cache.shardings(self.mesh, self.rules) if shardings is None else shardings
    )

  @classmethod
  def for_rollout(
    cls,
    cfg: ModelConfig,
    rollout: sections.Rollout,
    *,
    mesh=None,
    rules=None,
    device=None,
    record_routing: bool = False,
  ) -> "EnginePrograms":
    """The programs of the engine a rollout section describes: its sampling,
    slots, max_len and cache (dense, or paged: page_size, kv_pages), on
    `mesh` with `rules` or on `device` (neither: the first local device)."""
    sampling = sampling_lib.SamplingConfig(rollout.temperature, rollout.top_k, rollout.top_p)
    return cls(
      cfg,
      sampling,
      rollout.slots,
      rollout.max_len,
      mesh=mesh,
      rules=rules,
      device=device,
      kv_cache=rollout.kv_cache,
      page_size=rollout.page_size,
      num_pages=rollout.kv_pages,
      record_routing=record_routing,
    )

  # The KV cache's figures (kv_cache.py; a dense cache: no pages, page_size None).

  @property
  def paged(self) -> bool:
    return self.kv_cache.paged

  @property
  def page_size(self) -> int | None:
    return self.kv_cache.page_size

  @property
  def num_pages(self) -> int:
    return self.kv_cache.num_pages

  @property
  def pages_per_slot(self) -> int:
    return self.kv_cache.pages_per_slot

  @property
  def groups(self) -> int:
    """Slot groups: how many ways slots (and a paged engine's pool) split
    over the mesh's batch axes; each group's pages serve only its slots."""
    return layout.batch_groups(self.mesh, self.rules)

  def capacity(self) -> dict:
    """How many live tokens the engine's KV cache holds, in all and per slot group.

    Paged: `num_pages` x `page_size` positions shared by the slots (per
    group: its part of the pool); dense: every slot's `max_len`. Also the
    fraction of slots x max_len (what a dense cache of the same slots
    holds), how many max_len trajectories a group's part holds (a paged
    group needs >= 1: paging.PagePool), and the cache's bytes on each device.
    """
    groups, dense = self.groups, self.slots * self.max_len
    tokens, abstract = self.kv_cache.live_tokens, self.kv_cache.abstract()
    per_device = shd.shard_bytes(abstract, self.shardings.cache)
    total_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract))
    out = {
      "kind": self.kv_cache.kind,
      "slots": self.slots,
      "max_len": self.max_len,
      "groups": groups,
      "slots_per_group": self.slots // groups,
      "live_tokens": tokens,
      "live_tokens_per_group": tokens // groups,
      "dense_tokens": dense,
      "fraction_of_dense": tokens / dense,
      "max_len_trajectories_per_group": tokens / groups / self.max_len,
      "bytes": total_bytes,
      "bytes_per_token": total_bytes / tokens,
      "bytes_per_device": per_device,
    }
    out.update(self.kv_cache.describe())
    return out

  def context(self):
    """What the programs are traced under: the mesh and rules the model's
    activation constraints resolve against (thread-local, both)."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(self.mesh))
    stack.enter_context(nn.logical_axis_rules(self.rules))
    return stack

  # --- the programs ---------------------------------------------------------

  def step(self, kv: int | None, top_n: int | None = None):
    """`_step` jitted: (params, cache, lengths, tokens, valid, key) ->
    (cache, lengths, tokens, log-probs); paged: (params, pool, lengths,
    table, tokens, valid, key) -> (pool, lengths, tokens, log-probs).
    `top_n` None: the driver's program (the run's `SamplingConfig`, the
    engine's key); an int: the server's, whose key argument is a
    `SlotSampling` and which, with `top_n` > 0, also returns each row's
    `top_n` likeliest ids and log-probs `[slots, top_n]` after the log-probs.
    With `record_routing`, the fed tokens' routing `[slots, W, M * k]` last."""
    s, cache = self.shardings, self.kv_cache
    sampler, key_sharding, extra = self._sampler(top_n)
    outs = (
      (s.cache, s.slots, s.slots, s.slots) + extra + ((s.tokens,) if self.record_routing else ())
    )
    return jax.jit(
      functools.partial(
        BODIES[cache.kind].step, self.cfg, sampler, cache.static_kv(kv), record=self.record_routing
      ),
      in_shardings=(
        s.params,
        s.cache,
        s.slots,
        *cache.table_shardings(s),
        s.tokens,
        s.tokens,
        key_sharding,
      ),
      out_shardings=outs,
      donate_argnums=(1, 2),
    )

  def decode(self, kv: int | None, steps: int, stop: int, top_n: int | None = None):
    """`_decode` jitted: (params, cache, lengths, tokens, budgets, KeyStream) ->
    (cache, lengths, pending tokens, sampled tokens, log-probs, counts,
    KeyStream). `stop` -1: budgets only. Paged: the table after the lengths.
    `top_n` as for `step`: an int takes a `SlotSampling` (returned as given;
    its stop ids end a row too) and with `top_n` > 0 returns the top ids and
    log-probs `[slots, steps, top_n]` after the KeyStream's place. With
    `record_routing`, the routing of the token fed at each iteration
    `[slots, steps, M * k]` last."""
    s, cache = self.shardings, self.kv_cache
    sampler, key_sharding, extra = self._sampler(top_n)
    outs = (
      (s.cache, s.slots, s.slots, s.tokens, s.tokens, s.slots, key_sharding)
      + extra
      + ((s.tokens,) if self.record_routing else ())
    )
    return jax.jit(
      functools.partial(
        BODIES[cache.kind].decode,
        self.cfg,
        sampler,
        cache.static_kv(kv),
        int(steps),
        int(stop),
        record=self.record_routing,
      ),
      in_shardings=(
        s.params,
        s.cache,
        s.slots,
        *cache.table_shardings(s),
        s.slots,
        s.slots,
        key_sharding,
      ),
      out_shardings=outs,
      donate_argnums=(1, 2),
    )

  def _sampler(self, top_n: int | None):
    """(sampler, its key argument's shardings, the shardings of its extra
    outputs) of the driver's programs (None) or the server's (`top_n`)."""
    s = self.shardings
    if top_n is None:
      return sampling_lib.ConfigSampler(self.sampling), s.replicated, ()
    slots = sampling_lib.SlotSampling(s.slots, s.slots, s.tokens, s.slots, s.tokens)
    return (
      sampling_lib.SlotSampler(self.sampling.top_k, int(top_n)),
      slots,
      (s.tokens, s.tokens) if top_n else (),
    )

  def init_state(self, batch: int | None = None):
    """() -> (cache, lengths, pending tokens) of `batch` slots (default all),
    zeros, created in place shard by shard: the whole cache never exists on
    one device. (Another `batch` than `slots` is a lane's, on one device.)
    Paged: the cache is the pool of `num_pages` pages."""
    s, b, cache = self.shardings, batch or self.slots, self.kv_cache
    return jax.jit(
      lambda: (cache.init(b), jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32)),
      out_shardings=(s.cache, s.slots, s.slots),
    )

  def copy_params(self):
    """params -> a copy in fresh buffers of the engine's param shardings, in
    the compute dtype (the cast of a new version, once: precision.py)."""
    cast = lambda t: jax.tree.map(jnp.copy, precision.cast_for_serving(self.cfg, t))
    return jax.jit(cast, out_shardings=self.shardings.params)

  def reset_lengths(self):
    """(lengths, mask) -> lengths with 0 where mask."""
    s = self.shardings.slots
    return jax.jit(lambda l, m: jnp.where(m, 0, l), in_shardings=(s, s), out_shardings=s)

  def set_lengths(self):
    """(lengths, mask, new) -> lengths with `new` where mask (a cache cut back)."""
    s = self.shardings.slots
    return jax.jit(lambda l, m, n: jnp.where(m, n, l), in_shardings=(s, s, s), out_shardings=s)

  # --- abstract arguments, to lower a program without allocating ------------

  def step_args(self, params, width: int) -> tuple:
    """`step(kv)`'s arguments for the decode state's cache and `[slots, width]` tokens.

    `params`: the params' ShapeDtypeStructs (e.g. the trainer's abstract
    policy, which `load_params` copies); placed here in the engine's layout
    and compute dtype.
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
    return self._state_args(params) + (
      self._placed(vec, "slots"),
      self._placed(vec, "slots"),
      self._placed(stream, "replicated"),
    )

  def _state_args(self, params) -> tuple:
    """(params, cache, lengths), and the cache's arguments after them (a
    paged engine's page table)."""
    cache = self.kv_cache
    lengths = jax.ShapeDtypeStruct((self.slots,), jnp.int32)
    params = jax.eval_shape(functools.partial(precision.cast_for_serving, self.cfg), params)
    table = tuple(
      jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=sh)
      for t, sh in zip(cache.abstract_table(), cache.table_shardings(self.shardings))
    )
    return (
      self._placed(params, "params"),
      self._placed(cache.abstract(), "cache"),
      self._placed(lengths, "slots"),
    ) + table

  def _placed(self, tree, field: str):
    """`tree`'s ShapeDtypeStructs on the shardings' `field`."""
    sh = getattr(self.shardings, field)
    if isinstance(sh, jax.sharding.Sharding):
      return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)


# --- the programs' bodies ------------------------------------------------------


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


def _step(cfg, sampler, kv, params, cache, lengths, tokens, valid, rng, *, record=False):
  """Appends tokens, samples each row's next token from its last valid one.

  `kv` None attends over the whole cache. Otherwise the model runs on the
  cache prefix `[0, kv)`, which holds every valid position (the caller
  picks kv so), and only the valid new entries are written back: entries a
  padding token would have written are never read before being overwritten
  (sao_jax/models/transformer.py), so the result is the same.
  """
  if kv is None:
    last_logits, cache, new_lengths, *chosen = decoding.extend_last(
      cfg, params, cache, tokens, lengths, valid, record_routing=record
    )
  else:
    live = kv_layout.map_kv(lambda c: jax.lax.slice_in_dim(c, 0, kv, axis=c.ndim - 3), cache)
    last_logits, live, new_lengths, *chosen = decoding.extend_last(
      cfg, params, live, tokens, lengths, valid, record_routing=record
    )
    cache = kv_layout.map_kv(functools.partial(_write_back, lengths, valid), cache, live)
  # last_logits [B, V]: after each row's last valid token (a chunked prefill
  # with cfg.prefill_chunk, never [B, W, V]).
  return (cache, new_lengths, *_draw(cfg, sampler.step(last_logits, rng)), *chosen)


def _paged_step(
  cfg, sampler, cols, params, pool, lengths, table, tokens, valid, rng, *, record=False
):
  """`_step` on a page pool: the model writes into the slots' pages and
  attends over the table's first `cols` columns (None: all)."""
  table = table if cols is None else table[:, :cols]
  last_logits, pool, new_lengths, *chosen = decoding.extend_last(
    cfg, params, pool, tokens, lengths, valid, table, record_routing=record
  )
  return (pool, new_lengths, *_draw(cfg, sampler.step(last_logits, rng)), *chosen)


def _draw(cfg, drawn) -> tuple:
  """A sampler's (tokens, log-probs, extra) as a program returns them: tokens
  (and top ids) as tokenizer ids, the extra outputs (top ids, top log-probs)
  after the log-probs, nothing where there are none.

  Programs put them before the routing; the driver's (no extra) are
  (tokens, log-probs) as before.
  """
  tok, logp, extra = drawn
  ids = lambda columns: head_vocab.token_ids(cfg, columns)  # head columns -> tokenizer ids
  return (ids(tok), logp) + ((ids(extra[0]), extra[1]) if extra else ())


def _decode_loop(
  cfg,
  sampler,
  steps,
  stop_token,
  params,
  live,
  lengths,
  tokens,
  budgets,
  rng,
  table=None,
  record=False,
):
  """The while loop of `_decode` over a cache (`live`) or a pool with `table`.

  `sampler` (sampling.py: `ConfigSampler`, `SlotSampler`) draws from the
  logits with `rng` (a `KeyStream`, or a `SlotSampling`). Returns (live,
  new lengths, pending tokens, counts, sampled tokens, log-probs, advanced
  rng), then the sampler's extra outputs `[B, steps, ...]` (top ids and
  log-probs), then with `record` the routing of the token fed at each
  iteration `[B, steps, M * k]`.
  """
  b = tokens.shape[0]
  put = lambda out, new, k: jax.lax.dynamic_update_slice_in_dim(out, new[:, None], k, 1)

  def cond(carry):
    k, alive = carry[0], carry[4]
    return (k < steps) & alive.any()

  def body(carry):
    k, live, lens, tok, alive, count, out_tok, out_lp, extra, *out_r = carry
    logits, live, lens, *chosen = decoding.extend(
      cfg, params, live, tok[:, None], lens, alive[:, None], table, record_routing=record
    )
    if record:  # [B, 1, M*k] into column k
      out_r = [jax.lax.dynamic_update_slice_in_dim(out_r[0], chosen[0], k, 1)]
    # The k-th key's draw.
    new, lp, *top = _draw(cfg, sampler.at(logits[:, 0], drawn, k, rng))
    out_tok = put(out_tok, jnp.where(alive, new, 0), k)
    out_lp = put(out_lp, jnp.where(alive, lp, 0.0), k)
    extra = tuple(put(e, t, k) for e, t in zip(extra, top))
    count = count + alive.astype(jnp.int32)
    tok = jnp.where(alive, new, tok)
    alive = alive & (count < budgets) & ~sampler.stopped(new, stop_token, rng)
    return (k + 1, live, lens, tok, alive, count, out_tok, out_lp, extra, *out_r)

  carry = (
    jnp.int32(0),
    live,
    lengths,
    tokens,
    budgets > 0,
    jnp.zeros((b,), jnp.int32),
    jnp.zeros((b, steps), jnp.int32),
    jnp.zeros((b, steps), jnp.float32),
    sampler.extra(b, steps),
  )
  if record:
    carry += (
      jnp.full((b, steps, cfg.num_moe_layers * cfg.experts_per_token), routing.NONE, jnp.int32),
    )
  drawn = sampler.ahead(rng, steps, b)  # [steps, B, 1]: every iteration's, drawn at once
  ran, live, new_lengths, tok, _, count, out_tok, out_lp, extra, *out_r = jax.lax.while_loop(
    cond, body, carry
  )
  return (live, new_lengths, tok, count, out_tok, out_lp, sampler.advance(rng, ran), *extra, *out_r)


def _decode(
  cfg, sampler, kv, steps, stop_token, params, cache, lengths, tokens, budgets, rng, *, record=False
):
  """`PolicyEngine.decode`'s loop: up to `steps` one-token steps, per-slot stops.

  With `kv` the loop runs on the cache prefix `[0, kv)` (the caller picks
  kv to hold every position the loop can write) and writes the new entries
  back once at the end, rather than once per token.

  Returns (cache, lengths, pending tokens `[B]`, sampled tokens `[B, steps]`,
  their log-probs, counts `[B]`, the advanced `KeyStream`).
  """
  live = (
    cache
    if kv is None
    else kv_layout.map_kv(lambda c: jax.lax.slice_in_dim(c, 0, kv, axis=c.ndim - 3), cache)
  )
  live, new_lengths, tok, count, out_tok, out_lp, rng, *outs = _decode_loop(
    cfg, sampler, steps, stop_token, params, live, lengths, tokens, budgets, rng, record=record
  )
  if kv is None:
    cache = live
  else:
    fed = jnp.arange(steps)[None] < count[:, None]  # [B, steps]: the positions written
    cache = kv_layout.map_kv(functools.partial(_write_back, lengths, fed), cache, live)
  return (cache, new_lengths, tok, out_tok, out_lp, count, rng, *outs)


def _decode_in_place(cfg, page: int) -> bool:
  """The paged decode loop works on the pool in place: where its one-token
  steps run the Pallas kernel (tests force it on CPU)."""
  return paged.kernel_usable(cfg, 1, page)


def _paged_decode(
  cfg,
  sampler,
  cols,
  steps,
  stop_token,
  params,
  pool,
  lengths,
  table,
  tokens,
  budgets,
  rng,
  *,
  record=False,
):
  """`_decode` on a page pool, over the table's first `cols` columns (None: all).

  Where a decode step runs the Pallas paged-attention kernel (compiling for
  TPU), the loop reads and writes the pages in place. Elsewhere the step
  would gather every slot's pages once per token; the loop instead runs the
  dense loop on the pages gathered once (`paged.view`: the dense cache's
  prefix) and writes the new entries back into their pages at the end
  (`paged.write_view`), as the dense engine's bucketed loop does.
  """
  table = table if cols is None else table[:, :cols]
  if _decode_in_place(cfg, kv_layout.kv_leaves(pool)[0].shape[-2]):
    pool, new_lengths, tok, count, out_tok, out_lp, rng, *outs = _decode_loop(
      cfg,
      sampler,
      steps,
      stop_token,
      params,
      pool,
      lengths,
      tokens,
      budgets,
      rng,
      table,
      record=record,
    )
  else:
    live = kv_layout.map_kv(lambda leaf: paged.view(leaf, table), pool)
    live, new_lengths, tok, count, out_tok, out_lp, rng, *outs = _decode_loop(
      cfg, sampler, steps, stop_token, params, live, lengths, tokens, budgets, rng, record=record
    )
    fed = jnp.arange(steps)[None] < count[:, None]  # [B, steps]: the positions written
    pool = kv_layout.map_kv(
      lambda leaf, v: paged.write_view(leaf, v, table, lengths, fed), pool, live
    )
  return (pool, new_lengths, tok, out_tok, out_lp, count, rng, *outs)


class Bodies(NamedTuple):
  """A KV cache kind's program bodies (`EnginePrograms.step`, `.decode`)."""

  step: Callable
  decode: Callable


# Each kv_cache.KV_CACHES kind's bodies.
BODIES = {"dense": Bodies(_step, _decode), "paged": Bodies(_paged_step, _paged_decode)}
