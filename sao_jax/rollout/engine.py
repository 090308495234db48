"""PolicyEngine: the policy as a sampler with log-probs and versions.

The engine owns a batched KV cache of `max_concurrent_decodes` slots and the
current params with their version. Each sampled token comes with its
log-prob under the exact sampling distribution (temperature, top-k, top-p
applied, renormalised) and the version of the params whose logits produced
it. Its API is the rollout driver's:

  * `init_decode_state()`, an empty decode state of every slot;
  * `step(state, tokens, valid)`: append any number of pending tokens to
    chosen slots and sample each slot's next token, in one jitted call, so
    continuous batching can mix prompt and observation appends with
    decoding. Widths are bucketed so each compiles once;
  * `decode(state, tokens, budgets, steps=K)`: a jitted loop of up to K
    one-token steps with per-slot stops (a stop token, a per-slot budget),
    which returns every sampled token, log-prob and count in one transfer,
    dispatched asynchronously (`collect` fetches it) so the host can work
    meanwhile;
  * `reset_slots`, `update_params` / `load_params`, `abstract_params`;

the server's (rollout/serving.py), where each slot is its own request:

  * `serve_step` / `serve_decode`: `step` / `decode` with per-slot sampling
    arrays (`SlotSampling`: temperature, 0 greedy; top_p; each request's
    key stream; stop ids) and optionally each token's `top_n` likeliest
    alternatives; one compile for any mix of values (sampling.py,
    "per-slot sampling"). The driver's programs are untouched by them;
  * prefix reuse: `rewind` (a slot's cache cut back to a shared prefix;
    refused for recurrent layers, `can_rewind`), `trim_pages`, and
    `register_prefix` / `share_prefix` (a paged engine's slots share the
    full pages of a common prefix; paging.py, "Shared prefixes");

and `generate_batch(prompts, max_new_tokens)`, the engine as a plain
sampler (one prefill step, one decode loop).

`sao_jax/rollout/jetstream_bridge.py` (the `jetstream` extra) puts JetStream's
Engine API (prefill / insert / generate) on top of `step` and `decode`;
nothing here imports jetstream. Sampling and the key stream are
`sampling.py`'s; the layout (shardings and sizing) is `layout.py`'s; every
program the engine jits (its function, static args, shardings and donation)
is defined once in `programs.py`, which `launch/compile.py` lowers for a TPU
topology.

Lanes (`lanes`)
---------------
On XLA:CPU one program mostly keeps one core busy: a decode step's ops are
too small for the intra-op threads (benchmarks/RESULTS.md, "Session 11:
engine lanes on both cores"), and separate programs overlap only when they
are launched from separate threads (async dispatch from one thread runs
them one after the other). `lanes=L` splits `generate_batch`'s slots into L
groups of `ceil(slots / L)`; each lane has its own decode state and key and
runs its prefill and decode loop from its own thread, so the L programs
execute at once. Each lane samples exactly as a one-lane engine of its
size would (its log-probs are teacher-forced exact, tests/rollout/test_rollout.py);
the tokens differ from `lanes=1` only through the keys. Throughput on 2
cores: benchmarks/RESULTS.md. Only `generate_batch` uses lanes, and only on
one device; the driver's `step` / `decode` work on one decode state of all
the slots.

Layout (`mesh`, `rules`)
------------------------
One layout: the engine's params, cache and per-slot state live on a Mesh by
logical sharding rules (layout.py; `rollout_rules(mesh)` is the default,
decode-friendly). Without a mesh the engine builds one over one device
(`device`, default the first local one: `layout.one_device_mesh`), where
every sharding is whole; the code path is the same. With a mesh of many
devices, slots (and the cache with them) go over the batch axes and kv
heads over "tensor"; the step is jitted with the layout's in / out
shardings and the decode state (cache, lengths) donated; sampled tokens and
log-probs come back to the host in one `device_get` per step, the version
is host-side. Sharded and single-device engines sample the same tokens with
the same log-probs (up to float reassociation across devices:
tests/rollout/test_engine_sharded.py).

Weight sync
-----------
Colocated (the engine's mesh over the trainer's devices, the in-process
path): `load_params` reshards the trainer's params, which live in the
trainer's state shardings, into `engine.param_shardings` on device, no host
round trip, into buffers of the engine's own (a jitted copy with the
engine's shardings as out_shardings; params on other devices go through
`jax.device_put(params, engine.param_shardings)` first: `load_params` says
why device_put alone is not a private copy). It blocks until the copy
exists, so the trainer may donate its buffers to its next step as soon as
`driver.update_params` returns (the driver copies in the trainer's thread
and swaps between steps with `copied=True`).

Separate rollout slice (docs/DESIGN.md section 5): the engine is built on its
own mesh over its own devices,

    mesh = sharding.make_mesh({"data": -1, "tensor": 4}, devices=rollout_devices)
    rollout = sections.Rollout(slots=256, max_len=32768, temperature=1.0)
    engine = PolicyEngine(cfg, params, rollout, mesh=mesh, rules=rollout_rules(mesh))

(`factories.make_engine(config, ...)` builds exactly this from a config's
rollout section and `rollout.mesh`)
and new weights arrive as versioned checkpoints: restore each version
straight into `engine.param_shardings` (`engine.abstract_params()` gives the
restore target: shapes, dtypes and shardings) and hand it over with
`engine.update_params(restored, version, copied=True)`. The transport (which
version, when) is not this module's.

Cache sizing: a dense cache, attention over the live-length bucket
------------------------------------------------------------------
Of the two ways to fit long agentic contexts, bucketed lengths and paging,
this is the first, for the attention only. Each slot owns `max_len` cache
positions (no paging): memory is `slots x max_len` per layer, and it is made
to fit by sharding (slots over the data axes, kv heads over "tensor").
`cache_bytes_per_device(cfg, slots, max_len, mesh, rules)` is the size per
device for any mesh, an `AbstractMesh` or an abstract TPU topology's
included; `param_bytes_per_device` is the same for the params
(launch/compile.py reports both beside the compiler's memory figures for
the pod configs; benchmarks/RESULTS.md, "Pod scale: AOT compile for TPU", has them).

What is bucketed is the attention. Each step runs the model on the cache
prefix `[0, kv)`, `kv` the smallest of `kv_buckets` that holds every fed
slot's new length (the host mirrors the lengths in
`DecodeState.host_lengths`, so choosing it costs no transfer), then writes
only the valid new entries back into the full cache. A decode step thus
reads and attends over the live bucket, not `max_len`, with one compile per
(width bucket, kv bucket). The bucket is the maximum over the fed slots, so
with many slots of long-tailed lengths it follows the longest live one
(the paged cache below sizes memory per live token instead). A bucketed step copies
the live prefix once (the model's attention takes a whole cache leaf and
writes into it), so it moves about twice the bytes of reading that prefix
in place; the last bucket, `max_len`, runs on the whole cache without the
copy.

Paged cache (`kv_cache="paged"`)
--------------------------------
The cache is a pool of `kv_pages` pages of `page_size` positions that all
slots share, each slot a row of a page table. The engine never branches on
the kind: its strategy (`engine.kv_cache`, rollout/kv_cache.py, whose
module docstring, "Paged", describes the pool, the table and when pages
are allocated) builds the cache, readies a decode state before each call
(a paged one allocates the pages the fed slots' new lengths need, or
raises `PagePoolExhausted`) and gives the programs their page table.
`reserve(state, slot, tokens)` takes pages ahead and only reports failure
(the driver waits: rollout/admission.py); `reset_slots` (and
`release_pages`, host-side only) give a slot's pages back. Samples and
log-probs equal the dense engine's (tests/rollout/test_rollout.py, same
seed).
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
from sao_jax.rollout import engine_protocol
from sao_jax.rollout import kv_cache as kv_cache_lib
from sao_jax.rollout import layout
# The strategy's exception stays importable from here (tests, callers).
from sao_jax.rollout.kv_cache import PagePoolExhausted  # pylint: disable=unused-import
# The layout's names stay importable from here (launch/compile.py, tests).
from sao_jax.rollout.layout import (  # pylint: disable=unused-import
    EngineShardings, cache_bytes_per_device, cache_shardings, cache_spec, engine_shardings,
    param_bytes_per_device, rollout_rules)
from sao_jax.rollout.paging import PagePool
from sao_jax.rollout.programs import EnginePrograms
# Sampling and the key stream live in sampling.py; these names stay importable from here.
from sao_jax.rollout.sampling import (  # pylint: disable=unused-import
    KeyStream, SamplingConfig, SlotSampling, inverse_cdf, sample, sampling_logprobs, take)

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
  """The policy model as the rollout driver's sampler (see module docstring).

  Args:
    cfg, params: the model and its params (copied into the engine's layout).
    rollout: the config's rollout section (sao_jax/config/sections.py), of which
      the engine reads: slots (concurrent decode slots,
      `max_concurrent_decodes`); max_len (cache positions per slot,
      `max_prefill_length`); temperature, top_k, top_p (sampling);
      kv_cache, "dense" (each slot owns max_len positions) or "paged" (a
      shared pool of pages; module docstring, "Paged cache"); page_size
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
    mesh, rules: the engine's layout (module docstring); `rules` default to
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

  def __init__(self, cfg: ModelConfig, params, rollout: sections.Rollout, *, seed: int = 0,
               version: int = 0, device=None, mesh: Mesh | None = None, rules=None,
               kv_buckets: tuple[int, ...] | None = None, record_routing: bool = False):
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
    self.programs = EnginePrograms.for_rollout(cfg, rollout, mesh=mesh, rules=rules,
                                               device=device, record_routing=record_routing)
    self.record_routing = record_routing
    sampling = self.programs.sampling
    # The KV cache's strategy (kv_cache.py): what differs between dense and paged.
    self.kv_cache: kv_cache_lib.KVCache = self.programs.kv_cache
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
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        nn.unbox(layout.abstract_params(self.cfg)), self.shardings.params)

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
    if not all(isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
               and tuple(x.sharding.mesh.devices.flat) == devices
               for x in jax.tree.leaves(params)):
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

  def _step(self, params, state, tokens, valid, rng, kv: int | None = None,
            top_n: int | None = None):
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
      raise ValueError("a model with recurrent (linear) layers cannot cut a cache back: its "
                       "state is that of every cached token")
    if not 0 <= length <= int(state.host_lengths[slot]):
      raise ValueError(f"slot {slot} holds {int(state.host_lengths[slot])} positions, "
                       f"cannot keep {length}")
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
      raise ValueError(f"slot {slot} holds {int(state.host_lengths[slot])} positions; "
                       "share_prefix is for an empty slot")
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

  def serve_step(self, state: DecodeState, tokens: np.ndarray, valid: np.ndarray,
                 slots: SlotSampling, *, top_n: int = 0):
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
    return state._replace(cache=cache, lengths=lengths, host_lengths=host,
                          routing=chosen[0] if chosen else None), tok, logp, top

  # --- the multi-token decode loop ------------------------------------------

  def decode(self, state: DecodeState, tokens, budgets, *, steps: int,
             stop_token: int | None = None) -> tuple[DecodeState, DecodeChunk]:
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
    state, chunk, self._rng = self.decode_with(params, version, state, tokens, budgets, steps,
                                               stop_token, self._rng)
    return state, chunk

  def serve_decode(self, state: DecodeState, tokens, budgets, slots: SlotSampling, *, steps: int,
                   stop_token: int | None = None, top_n: int = 0
                   ) -> tuple[DecodeState, DecodeChunk]:
    """`decode` with each slot's own sampling (`serve_step`): a slot also
    stops at any of its `slots.stops`; with `top_n` > 0 the chunk carries
    `top_ids` / `top_logprobs` `[slots, steps, top_n]`. The engine's key
    stream is not used (each slot draws from its request's)."""
    params, version = self.snapshot()
    state, chunk, _ = self.decode_with(params, version, state, tokens, budgets, steps,
                                       stop_token, slots, top_n)
    return state, chunk

  def decode_with(self, params, version, state, tokens, budgets, steps, stop_token, rng,
                  top_n: int | None = None):
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
    fn = self._jit(("decode", kv, int(steps), stop, top_n),
                   lambda: self.programs.decode(kv, int(steps), stop, top_n))
    table = self.kv_cache.call_args(state)
    with self._context():
      cache, lengths, nxt, toks, logp, counts, rng, *rest = fn(
          params, state.cache, state.lengths, *table, tokens, budgets, rng)
    top, chosen = (rest[:2], rest[2:]) if top_n else ((None, None), rest)
    state = state._replace(cache=cache, lengths=lengths, next_tokens=nxt, host_lengths=host)
    return state, DecodeChunk(toks, logp, counts, version, budgets,
                              chosen[0] if chosen else None, *top), rng

  def collect(self, state: DecodeState, chunk: DecodeChunk) -> tuple[DecodeState, DecodeChunk]:
    """Fetches a `decode` chunk to the host (one transfer, blocks until done).

    Returns the state with exact `host_lengths` (the unused budgets taken
    off) and the chunk as numpy arrays.
    """
    toks, logp, counts, chosen, top_ids, top_lp = jax.device_get(
        (chunk.tokens, chunk.logprobs, chunk.counts, chunk.routing, chunk.top_ids,
         chunk.top_logprobs))
    counts = np.asarray(counts, np.int32)
    host = np.maximum(state.host_lengths - (chunk.budgets - counts), 0).astype(np.int32)
    numpy = lambda x: None if x is None else np.asarray(x)
    return (state._replace(host_lengths=host),
            chunk._replace(tokens=np.asarray(toks), logprobs=np.asarray(logp), counts=counts,
                           routing=numpy(chosen), top_ids=numpy(top_ids),
                           top_logprobs=numpy(top_lp)))


def _place(tree, shardings):
  """`tree` on `shardings`, moved only if some leaf is not already there.

  Checking costs about a microsecond a leaf, where a no-op `jax.device_put`
  of the tree costs tens (milliseconds for an unscanned 48-layer model's
  params).
  """
  leaves, targets = jax.tree.leaves(tree), jax.tree.leaves(shardings)
  if len(leaves) == len(targets) and all(
      isinstance(x, jax.Array) and x.sharding == sh for x, sh in zip(leaves, targets)):
    return tree
  return jax.device_put(tree, shardings)  # also the error for a tree of the wrong shape
