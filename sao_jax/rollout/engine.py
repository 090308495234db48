"""PolicyEngine: the policy as a sampler over slots, with log-probs and versions.

The engine owns a batched KV cache of `max_concurrent_decodes` slots of
`max_prefill_length` positions and the current params with their version.
It implements `engine_protocol.Engine`, what the rollout driver and the
serving batcher ask of an engine. Public names: `PolicyEngine`,
`DecodeState`, `DecodeChunk`, `default_kv_buckets`; layout.py's and
sampling.py's names stay importable from here.

Invariants:
  * every sampled token comes with its log-prob under the exact sampling
    distribution (temperature, top-k, top-p applied, renormalised) and the
    version of the params whose logits produced it; a swap lands between
    calls, never inside one;
  * `step` appends any number of pending tokens per slot and samples one;
    its widths are padded to `prefill_buckets` and the attended cache
    prefix to `kv_buckets`, so each (width, kv) pair compiles once;
  * `decode` (up to K one-token steps in one jitted loop, asynchronous
    until `collect`) draws the keys K one-token `step` calls would, and so
    samples the same tokens with the same log-probs;
  * sharded and single-device engines, dense and paged caches, sample the
    same tokens with the same log-probs (up to float reassociation);
  * `load_params` returns once the engine's own copy exists: the caller may
    donate its buffers at once.

Every program the engine jits is defined in programs.py (what
launch/compile.py lowers); the KV cache's strategy is kv_cache.py's; the
plain sampler over it is batch_sampler.py. The design (layout, weight sync,
the dense and paged caches): docs/design/engine.md.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from sao_jax.config import sections
from sao_jax.models.config import ModelConfig
from sao_jax.rollout import engine_protocol, layout
from sao_jax.rollout import kv_cache as kv_cache_lib

# The strategy's exception stays importable from here (tests, callers).
from sao_jax.rollout.kv_cache import PagePoolExhausted  # noqa: F401

# The layout's names stay importable from here (launch/compile.py, tests).
from sao_jax.rollout.layout import (
  EngineShardings,
  cache_bytes_per_device,  # noqa: F401
  cache_shardings,  # noqa: F401
  cache_spec,  # noqa: F401
  engine_shardings,  # noqa: F401
  param_bytes_per_device,  # noqa: F401
  rollout_rules,  # noqa: F401
)
from sao_jax.rollout.paging import PagePool
from sao_jax.rollout.programs import EnginePrograms

# Sampling and the key stream live in sampling.py; these names stay importable from here.
from sao_jax.rollout.sampling import (
  KeyStream,
  SamplingConfig,  # noqa: F401
  SlotSampling,
  inverse_cdf,  # noqa: F401
  sample,  # noqa: F401
  sampling_logprobs,  # noqa: F401
  take,
)

Array = jax.Array


class DecodeState(NamedTuple):
  # Leaves [..., slots, max_len, KVH, hd]: per layer, or stacked over layers;
  # a paged engine's: the page pool, leaves [..., KVH, pages, page_size, hd].
  cache: Any
  lengths: Array  # [slots] int32, tokens in each slot's cache
  next_tokens: Array  # [slots] int32, the pending tokens `decode` sampled last
  # numpy [slots] copy of `lengths` the engine keeps on the host, so that it
  # can pick the kv bucket without a device transfer.
  host_lengths: np.ndarray
  # A paged engine's: the host page allocator and table (paging.PagePool, one
  # object the states of one run share) and the table's device copy,
  # refreshed before a call whenever the allocator changed it.
  pages: PagePool | None = None
  page_table: Any = None
  # With record_routing: numpy [slots, W, M * k], the MoE expert choices of
  # the tokens the last `step` fed (row b's first fed[b] entries; the rest
  # is padding). None otherwise.
  routing: np.ndarray | None = None


class DecodeChunk(NamedTuple):
  """What one `PolicyEngine.decode` call sampled: up to `steps` tokens a slot.

  Device arrays until `PolicyEngine.collect` fetches them (numpy after).
  Row b holds `counts[b]` sampled tokens, in order; the rest is padding.
  """

  tokens: Any  # [slots, steps] int32
  logprobs: Any  # [slots, steps] float32, under the exact sampling distribution
  counts: Any  # [slots] int32
  version: int  # of the params whose logits produced every token of the chunk
  budgets: np.ndarray  # [slots] int32, the call's budgets (host side)
  # With record_routing: [slots, steps, M * k], column k the expert choices of
  # the token fed at iteration k (the pending token, then each sample but
  # the last); row b's first counts[b] columns are real. None otherwise.
  routing: Any = None
  # A served decode's (`serve_decode`) with top_n > 0: [slots, steps, top_n]
  # ids and log-probs of the likeliest tokens at each sample. None otherwise.
  top_ids: Any = None
  top_logprobs: Any = None


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
  for b in buckets:
    if n <= b:
      return b
  return buckets[-1]


def default_kv_buckets(max_len: int) -> tuple[int, ...]:
  """max_len / 8, / 4, / 2, max_len, keeping those of at least 1024 positions.

  Few buckets, because each multiplies the step's compiles by the number of
  width buckets; none below 1024, where the whole cache is cheap to attend.
  """
  return tuple(b for b in (max_len // 8, max_len // 4, max_len // 2) if b >= 1024) + (max_len,)


# --- the engine ---------------------------------------------------------------------


class PolicyEngine(engine_protocol.Engine):
  """The policy model as the rollout driver's sampler (docs/design/engine.md).

  Args:
    cfg, params: the model and its params (copied into the engine's layout).
    rollout: the config's rollout section (sao_jax/config/sections.py), of which
      the engine reads: slots (concurrent decode slots,
      `max_concurrent_decodes`); max_len (cache positions per slot,
      `max_prefill_length`); temperature, top_k, top_p (sampling);
      kv_cache, "dense" (each slot owns max_len positions) or "paged" (a
      shared pool of pages; kv_cache.py, "Paged"); page_size
      (positions a page holds, paged); kv_pages (pages in the pool; 0: the
      dense cache's size, slots x max_len / page_size; each group of slots,
      one per device of the batch axes, must hold one max_len trajectory);
      prefill_buckets (the widths a `step`'s tokens are padded to; max_len
      is always the last). Its mesh field is the factories' business
      (`factories.engine_mesh`): the engine takes the mesh it is given.
    seed: of the sampling key stream.
    version: of `params`.
    device: the device of a single-device engine (default: the first local
      one); its mesh is `layout.one_device_mesh(device)`.
    mesh, rules: the engine's layout (layout.py); `rules` default to
      `rollout_rules(mesh)`. No mesh: one device.
    kv_buckets: cache prefix lengths a step may attend over (module
      docstring); default `default_kv_buckets(max_len)`; max_len is always
      the last.
    record_routing: also return the MoE expert choices of every token the
      engine feeds (routing replay, `rl.routing_replay`): `state.routing`
      after `step`, `chunk.routing` after `decode` (models/routing.py).
  """

  per_request_sampling = True  # serve_step / serve_decode
  shares_prefixes = True  # share_prefix / register_prefix (a paged cache's pages)

  def __init__(
    self,
    cfg: ModelConfig,
    params,
    rollout: sections.Rollout,
    *,
    seed: int = 0,
    version: int = 0,
    device=None,
    mesh: Mesh | None = None,
    rules=None,
    kv_buckets: tuple[int, ...] | None = None,
    record_routing: bool = False,
  ):
    if not isinstance(rollout, sections.Rollout):
      raise TypeError(f"rollout must be a sections.Rollout, got {type(rollout).__name__}")
    slots, max_len = rollout.slots, rollout.max_len
    if max_len > cfg.max_seq_len:
      raise ValueError(f"max_len {max_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
    if mesh is not None and device is not None:
      raise ValueError("give the engine a device or a mesh, not both")
    self.rollout = rollout
    # Every jitted program of the engine (programs.py), also what launch/compile.py
    # lowers; it holds the layout (a mesh of one device without `mesh`).
    self.programs = EnginePrograms.for_rollout(
      cfg, rollout, mesh=mesh, rules=rules, device=device, record_routing=record_routing
    )
    self.record_routing = record_routing
    sampling = self.programs.sampling
    # The KV cache's strategy (kv_cache.py): what differs between dense and paged.
    self.kv_cache: kv_cache_lib.KVCache = self.programs.kv_cache
    self.kv_cache.check_engine(lanes=1)  # a pool too small for one slot group: refused now
    self.page_groups = self.programs.groups
    self.mesh: Mesh = self.programs.mesh
    self.rules = self.programs.rules
    self.shardings: EngineShardings = self.programs.shardings
    kv_buckets = default_kv_buckets(max_len) if kv_buckets is None else tuple(kv_buckets)
    if any(b < 1 for b in kv_buckets):
      raise ValueError(f"kv_buckets must be positive, got {kv_buckets}")
    self.cfg = self.programs.cfg  # params in the compute dtype (precision.py)
    self.sampling = sampling
    self.max_concurrent_decodes = slots
    self.max_prefill_length = max_len
    self.prefill_buckets = tuple(b for b in rollout.prefill_buckets if b < max_len) + (max_len,)
    self.kv_buckets = tuple(sorted({b for b in kv_buckets if b < max_len})) + (max_len,)
    self._lock = threading.Lock()
    self._rng = KeyStream.start(jax.random.key(seed), self.shardings.replicated)
    self._jits: dict[Any, Any] = {}
    self._jit_lock = threading.Lock()  # lanes (batch_sampler.py) build jits from their threads
    self.params = self.load_params(params)
    self.version = version

  # --- the KV cache (kv_cache.py) ------------------------------------------

  @property
  def paged(self) -> bool:
    """Whether the slots share a pool of pages (`rollout.kv_cache` "paged")."""
    return self.kv_cache.paged

  @property
  def page_size(self) -> int:
    """Positions a page holds; 0: dense."""
    return self.kv_cache.page_size or 0

  @property
  def kv_pages(self) -> int:
    """Pages in the pool, all slot groups together; 0: dense."""
    return self.kv_cache.num_pages

  # --- params -----------------------------------------------------------

  @property
  def param_shardings(self):
    """The params' NamedShardings."""
    return self.shardings.params

  def abstract_params(self):
    """ShapeDtypeStructs of the params with their shardings: the target to
    restore a versioned checkpoint straight into."""
    return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      nn.unbox(layout.abstract_params(self.cfg)),
      self.shardings.params,
    )

  def load_params(self, params):
    """A private copy in the engine's layout (the trainer may donate its buffers).

    Resharded on device, no host round trip, into fresh buffers, and
    complete when this returns, so the caller may donate `params` right
    after. Params on the engine's devices (the colocated trainer's, in its
    state shardings) go through one jitted copy with the engine's shardings
    as out_shardings: the reshard and the copy are one program. Params
    elsewhere (one device, another slice, or not a NamedSharding) are first
    moved with `jax.device_put(params, engine.param_shardings)`; that copy
    alone is not private: where source and target share devices,
    device_put hands back the source's buffers as shards (even with
    may_alias=False: a single-device array spread over a replicated layout
    keeps its buffer, and a replicated array split over "data" gives shards
    at the source's addresses), so the jitted copy follows it there too.
    """
    copy = self._jit("copy_params", self.programs.copy_params)
    devices = tuple(self.mesh.devices.flat)
    if not all(
      isinstance(x, jax.Array)
      and isinstance(x.sharding, NamedSharding)
      and tuple(x.sharding.mesh.devices.flat) == devices
      for x in jax.tree.leaves(params)
    ):
      params = jax.device_put(params, self.shardings.params)
    return jax.block_until_ready(copy(params))

  def update_params(self, params, version: int, *, copied: bool = False) -> None:
    """Swaps in new params; `copied=True` when they are the engine's already
    (from `load_params`, or restored into `abstract_params()`): then only
    moved if some leaf is not on `param_shardings`."""
    new = _place(params, self.shardings.params) if copied else self.load_params(params)
    with self._lock:
      self.params, self.version = new, int(version)

  def snapshot(self):
    """(params, version), read together: a swap lands between calls, never inside one."""
    with self._lock:
      return self.params, self.version

  def next_key(self):
    """The engine's next sampling key (its key stream advances by one)."""
    rng, self._rng = take(self._rng)
    return rng

  # --- the jitted programs ------------------------------------------------

  def _context(self):
    """The mesh and rules the programs trace under."""
    return self.programs.context()

  def _jit(self, key, build):
    """The jitted function cached under `key`, made by `build()` on first use.

    Under a lock, so lanes asking from their own threads share one jit
    object (two objects of one program would each compile it; two lanes
    calling a new one at once may still trace it twice).
    """
    with self._jit_lock:
      fn = self._jits.get(key)
      if fn is None:
        fn = self._jits[key] = build()
      return fn

  def _step(
    self, params, state, tokens, valid, rng, kv: int | None = None, top_n: int | None = None
  ):
    """`programs.step` on `state`'s cache, jitted once per kv bucket (and
    served `top_n`); shapes (widths, a lane's slots) re-trace it.

    Returns device arrays (new cache, new lengths, sampled tokens, log-probs);
    `cache` and `lengths` are donated. Committed arguments must be on the
    program's in_shardings: the engine's params and decode states are
    (load_params, init_decode_state and every program's out_shardings).
    """
    key = ("step", kv) if top_n is None else ("step", kv, top_n)
    fn = self._jit(key, lambda: self.programs.step(kv, top_n))
    table = self.kv_cache.call_args(state)
    with self._context():
      return fn(params, state.cache, state.lengths, *table, tokens, valid, rng)

  def _kv_bucket(self, need: int) -> int | None:
    """The cache prefix a step whose fed slots end at `need` attends over (None: all)."""
    kv = _bucket(max(need, 1), self.kv_buckets)
    return None if kv >= self.max_prefill_length else kv

  # --- the decode state -----------------------------------------------------

  def init_decode_state(self, slots: int | None = None) -> DecodeState:
    """An empty decode state; `slots` (one-device engines): a lane's, not all of them.

    Created in place, shard by shard: the whole cache never exists on one device.
    """
    b = slots or self.max_concurrent_decodes
    if b != self.max_concurrent_decodes and self.mesh.size > 1:
      raise ValueError("a sharded engine's decode state has all of its slots")
    arrays = self._jit(("init", b), lambda: self.programs.init_state(b))()
    state = DecodeState(*arrays, host_lengths=np.zeros((b,), np.int32))
    return self.kv_cache.attach(state, self.shardings)

  def reset_slots(self, state: DecodeState, slots_mask: np.ndarray) -> DecodeState:
    """Empties the caches of the given slots (their lengths go to 0; a paged
    engine's slots give their pages back)."""
    mask = np.asarray(slots_mask, bool)
    self.release_pages(state, mask)
    host = np.where(mask, 0, state.host_lengths).astype(np.int32)
    lengths = self._jit("reset", self.programs.reset_lengths)(state.lengths, mask)
    return state._replace(lengths=lengths, host_lengths=host)

  @property
  def can_rewind(self) -> bool:
    """Whether `rewind` may cut a slot's cache back: a model without recurrent
    layers, whose cache at a length is that of its first tokens alone."""
    return "linear" not in self.cfg.attention_kinds

  def rewind(self, state: DecodeState, slot: int, length: int) -> DecodeState:
    """Slot `slot`'s cache cut back to its first `length` positions (a prefix
    another request shares); the rest is overwritten as it is fed again.

    A paged engine gives back the pages past the kept positions, and where
    the cut falls inside a page other slots share, it falls to that page's
    start (paging.py, `PagePool.cut`): the positions kept are the state's
    `host_lengths[slot]`. Raises ValueError for a model with recurrent
    (Gated DeltaNet) layers, whose state is that of every cached token
    (`can_rewind`), and for a length beyond the slot's.
    """
    if not self.can_rewind:
      raise ValueError(
        "a model with recurrent (linear) layers cannot cut a cache back: its "
        "state is that of every cached token"
      )
    if not 0 <= length <= int(state.host_lengths[slot]):
      raise ValueError(
        f"slot {slot} holds {int(state.host_lengths[slot])} positions, cannot keep {length}"
      )
    return self._set_length(state, slot, self.kv_cache.cut(state, slot, length))

  def _set_length(self, state: DecodeState, slot: int, length: int) -> DecodeState:
    mask = np.arange(len(state.host_lengths)) == slot
    new = np.where(mask, length, state.host_lengths).astype(np.int32)
    lengths = self._jit("set_lengths", self.programs.set_lengths)(state.lengths, mask, new)
    return state._replace(lengths=lengths, host_lengths=new)

  def share_prefix(self, state: DecodeState, slot: int, tokens) -> DecodeState:
    """Empty slot `slot` starts with the pages other slots hold of the
    longest page-aligned prefix of `tokens` (`register_prefix`; paging.py,
    "Shared prefixes"): its length is theirs, read from the state's
    `host_lengths`. A dense engine, or a model with recurrent layers, shares
    nothing (length 0)."""
    if int(state.host_lengths[slot]):
      raise ValueError(
        f"slot {slot} holds {int(state.host_lengths[slot])} positions; "
        "share_prefix is for an empty slot"
      )
    shared = self.kv_cache.share(state, slot, tokens)
    return self._set_length(state, slot, shared) if shared else state

  def register_prefix(self, state: DecodeState, slot: int, tokens) -> None:
    """Offers slot `slot`'s cached entries, those of `tokens` (what its cache
    holds from position 0), to `share_prefix` (host-side only)."""
    self.kv_cache.register(state, slot, tokens)

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
    params, version = self.snapshot()
    return self.step_with(params, state, tokens, valid, self.next_key())[:3] + (version,)

  def serve_step(
    self,
    state: DecodeState,
    tokens: np.ndarray,
    valid: np.ndarray,
    slots: SlotSampling,
    *,
    top_n: int = 0,
  ):
    """`step` with each slot's own sampling (sampling.py, "per-slot sampling").

    `slots`: a `SlotSampling` of numpy arrays (each slot's temperature,
    top_p, request key stream and draws taken; its stop ids are `decode`'s
    business). Returns (new state, sampled tokens `[slots]`, their
    log-probs under each slot's behaviour distribution, top, version): top
    is None for `top_n` 0, else (ids, log-probs) `[slots, top_n]`.
    """
    params, version = self.snapshot()
    state, tok, logp, top = self.step_with(params, state, tokens, valid, slots, top_n)
    return state, tok, logp, top, version

  def step_with(self, params, state, tokens, valid, rng, top_n: int | None = None):
    """`step` with the params and the key given (a lane, batch_sampler.py, passes its
    own), no version; also returns the served top (None without `top_n`)."""
    width = _bucket(tokens.shape[1], self.prefill_buckets)
    pad = width - tokens.shape[1]
    tokens = np.asarray(tokens, np.int32)
    valid = np.asarray(valid, bool)
    if pad:
      tokens = np.pad(tokens, ((0, 0), (0, pad)))
      valid = np.pad(valid, ((0, 0), (0, pad)))
    fed = valid.sum(1).astype(np.int32)
    host = (state.host_lengths + fed).astype(np.int32)
    kv = self._kv_bucket(int(host[fed > 0].max()) if fed.any() else 1)
    state = self.kv_cache.prepare(state, host, fed > 0, self.shardings)
    cache, lengths, tok, logp, *rest = self._step(params, state, tokens, valid, rng, kv, top_n)
    tok, logp, rest = jax.device_get((tok, logp, rest))  # the step's one transfer
    top, chosen = (tuple(rest[:2]), rest[2:]) if top_n else (None, rest)
    return (
      state._replace(
        cache=cache, lengths=lengths, host_lengths=host, routing=chosen[0] if chosen else None
      ),
      tok,
      logp,
      top,
    )

  # --- the multi-token decode loop ------------------------------------------

  def decode(
    self, state: DecodeState, tokens, budgets, *, steps: int, stop_token: int | None = None
  ) -> tuple[DecodeState, DecodeChunk]:
    """Up to `steps` decode steps of every budgeted slot in one jitted loop.

    Slot b (with `budgets[b] > 0`) feeds `tokens[b]`, its pending token (the
    last one sampled, not yet in the cache), samples the next, feeds that,
    and so on, until it has sampled `budgets[b]` tokens or sampled
    `stop_token`; the loop ends after `steps` iterations or when every slot
    has stopped. Slots with budget 0 sit out untouched. The caller expresses
    its stop rules as budgets (the driver: the turn's remaining tokens and
    the room left before `max_len`).

    The call is asynchronous: it dispatches the loop and returns at once
    with device arrays; `collect` fetches the chunk in one transfer, so the
    caller can do host work (admissions, environment results) while the
    device decodes. Until then `state.host_lengths` is an upper bound
    (each slot's length plus its budget), which only widens the kv bucket
    of a step dispatched in between; `collect` makes it exact again.

    RNG contract: iteration k draws with the engine's k-th next key
    (`KeyStream`: `fold_in(base, draws + k)`), exactly the key the k-th of
    as many one-token `step` calls would draw with, so the loop samples the
    same tokens with the same log-probs as `step` fed the same slots one
    token at a time (tests/rollout/test_rollout.py); the stream advances by the
    iterations actually run. The loop draws all `steps` iterations'
    uniforms in one batched call before it starts.

    Args:
      state: the decode state.
      tokens: int `[slots]`, each budgeted slot's pending token.
      budgets: int `[slots]`, the most tokens to sample per slot (0: none).
      steps: the loop's static length (one compile per value).
      stop_token: a token that ends a slot's run once sampled (kept in the
        chunk, left pending); None: budgets only.

    Returns:
      (new state, `DecodeChunk` of device arrays). `state.next_tokens`
      holds each slot's new pending token.
    """
    params, version = self.snapshot()
    state, chunk, self._rng = self.decode_with(
      params, version, state, tokens, budgets, steps, stop_token, self._rng
    )
    return state, chunk

  def serve_decode(
    self,
    state: DecodeState,
    tokens,
    budgets,
    slots: SlotSampling,
    *,
    steps: int,
    stop_token: int | None = None,
    top_n: int = 0,
  ) -> tuple[DecodeState, DecodeChunk]:
    """`decode` with each slot's own sampling (`serve_step`): a slot also
    stops at any of its `slots.stops`; with `top_n` > 0 the chunk carries
    `top_ids` / `top_logprobs` `[slots, steps, top_n]`. The engine's key
    stream is not used (each slot draws from its request's)."""
    params, version = self.snapshot()
    state, chunk, _ = self.decode_with(
      params, version, state, tokens, budgets, steps, stop_token, slots, top_n
    )
    return state, chunk

  def decode_with(
    self, params, version, state, tokens, budgets, steps, stop_token, rng, top_n: int | None = None
  ):
    """`decode` with the params and key stream given (a lane, batch_sampler.py, passes
    its own); also returns the advanced stream (`top_n` an int: `serve_decode`'s
    program, `rng` a `SlotSampling`)."""
    budgets = np.minimum(np.asarray(budgets, np.int32), steps).astype(np.int32)
    tokens = np.asarray(tokens, np.int32)
    host = (state.host_lengths + budgets).astype(np.int32)
    fed = budgets > 0
    kv = self._kv_bucket(int(host[fed].max()) if fed.any() else 1)
    state = self.kv_cache.prepare(state, host, fed, self.shardings)
    stop = -1 if stop_token is None else int(stop_token)
    fn = self._jit(
      ("decode", kv, int(steps), stop, top_n),
      lambda: self.programs.decode(kv, int(steps), stop, top_n),
    )
    table = self.kv_cache.call_args(state)
    with self._context():
      cache, lengths, nxt, toks, logp, counts, rng, *rest = fn(
        params, state.cache, state.lengths, *table, tokens, budgets, rng
      )
    top, chosen = (rest[:2], rest[2:]) if top_n else ((None, None), rest)
    state = state._replace(cache=cache, lengths=lengths, next_tokens=nxt, host_lengths=host)
    return (
      state,
      DecodeChunk(toks, logp, counts, version, budgets, chosen[0] if chosen else None, *top),
      rng,
    )

  def collect(self, state: DecodeState, chunk: DecodeChunk) -> tuple[DecodeState, DecodeChunk]:
    """Fetches a `decode` chunk to the host (one transfer, blocks until done).

    Returns the state with exact `host_lengths` (the unused budgets taken
    off) and the chunk as numpy arrays.
    """
    toks, logp, counts, chosen, top_ids, top_lp = jax.device_get(
      (chunk.tokens, chunk.logprobs, chunk.counts, chunk.routing, chunk.top_ids, chunk.top_logprobs)
    )
    counts = np.asarray(counts, np.int32)
    host = np.maximum(state.host_lengths - (chunk.budgets - counts), 0).astype(np.int32)
    numpy = lambda x: None if x is None else np.asarray(x)
    return (
      state._replace(host_lengths=host),
      chunk._replace(
        tokens=np.asarray(toks),
        logprobs=np.asarray(logp),
        counts=counts,
        routing=numpy(chosen),
        top_ids=numpy(top_ids),
        top_logprobs=numpy(top_lp),
      ),
    )


def _place(tree, shardings):
  """`tree` on `shardings`, moved only if some leaf is not already there.

  Checking costs about a microsecond a leaf, where a no-op `jax.device_put`
  of the tree costs tens (milliseconds for an unscanned 48-layer model's
  params).
  """
  leaves, targets = jax.tree.leaves(tree), jax.tree.leaves(shardings)
  if len(leaves) == len(targets) and all(
    isinstance(x, jax.Array) and x.sharding == sh for x, sh in zip(leaves, targets)
  ):
    return tree
  return jax.device_put(tree, shardings)  # also the error for a tree of the wrong shape
