"""The rollout engine's KV cache as one strategy per kind: dense or paged.

`rollout.kv_cache` (sections.KV_CACHES) names the engine's cache and
`KV_CACHES` maps each name to its class here. Everything the engine
(engine.py), its programs (programs.py) and the driver's admission
(admission.py) do differently for the two kinds, they ask the strategy,
built once with the programs (`EnginePrograms`) from the serving model
config, the slots, max_len, the layout's slot groups and, for a paged
cache, page_size and the pool's pages. A strategy answers:

  * the device side: the empty cache (`init`, traced in a jitted program),
    its ShapeDtypeStructs (`abstract`) and the engine's shardings with it
    (`shardings`), the live tokens it holds (`live_tokens`) and what
    `EnginePrograms.capacity` adds of it (`describe`);
  * the programs' arguments: the static arg a step or decode program gets
    for its kv bucket (`static_kv`) and the arguments it takes after the
    lengths (`abstract_table`, `table_shardings`: the page table, or none);
    each kind's program bodies are programs.py's, in its `BODIES`;
  * the host side, on a decode state: what a new state holds besides its
    arrays (`attach`), pages for a call's fed slots before it is dispatched
    (`prepare`), the call's arguments after the lengths (`call_args`),
    pages reserved ahead and given back (`reserve`, `release`, `trim`), and
    the engine options it rules out (`check_engine`);
  * the server's prefix reuse (serving/batcher.py): a slot's cache cut back
    (`cut`), and a prefix's entries offered to other slots and taken by an
    empty one (`register`, `share`; paged only: shared pages);
  * admission (admission.py): the slot group a slot draws pages from
    (`group_of`), whether a group's free pages take a new slot's first
    tokens (`can_admit`), the pages a slot holds (`held`).

`KVCache` is that protocol, with the answers of a cache without pages:
every slot holds its max_len positions, so a reservation always succeeds,
every slot may be admitted and there is nothing to do before a call.
`DenseCache` keeps them; `PagedCache` overrides them. A new kind is a
class here, its name in `KV_CACHES` and sections.KV_CACHES, and its step
and decode bodies in programs.py's `BODIES`.

Dense (`kv_cache="dense"`)
--------------------------
Each slot owns `max_len` positions, leaves `[..., slots, max_len, KVH, hd]`;
the programs take (params, cache, lengths, ...) and attend over the cache
prefix of the kv bucket (engine.py, "Cache sizing").

Paged (`kv_cache="paged"`)
--------------------------
The cache is a pool of `num_pages` pages of `page_size` positions that all
slots share (leaves `[..., KVH, pages, page_size, hd]`; device side
sao_jax/models/paged.py), and each slot a row of a page table naming its
pages in position order (host side: rollout/paging.py's `PagePool`, in
`DecodeState.pages`). `kv_pages=0` is the dense cache's size. The programs
take the table `[slots, pages_per_slot]` after the lengths, and a kv bucket
names the table's first ceil(kv / page_size) columns.

A slot gets pages as it grows: `prepare` allocates what a call's fed slots
need before it is dispatched and raises `PagePoolExhausted` when the pool
has too few; a caller that may fill the pool reserves ahead with
`PolicyEngine.reserve(state, slot, tokens)`, which only reports failure,
and waits. `reset_slots` (and `release_pages`) give a slot's pages back.
Samples and log-probs equal the dense engine's (same seed). With a sharded
engine each device of the batch axes holds its slots' part of the pool
(every group must hold one max_len trajectory: `check_engine`). Why it is
built so: docs/design/kv_cache.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.models import decoding, paged
from sao_jax.models.config import ModelConfig
from sao_jax.rollout import layout
from sao_jax.rollout.paging import PagePool


class PagePoolExhausted(RuntimeError):
  """A paged engine's step needed pages its pool did not have.

  The engine allocates pages as slots grow; a caller that may fill the pool
  (the rollout driver) reserves them ahead (`PolicyEngine.reserve`) and
  waits when that fails, so this is a caller's bug, not a state to handle.
  """


class KVCache:
  """What every KV cache answers (module docstring), as a cache without pages does.

  The device side (`abstract`, `init`, `shardings`, `live_tokens`) is each
  kind's own. Everything else defaults to the answers of a cache whose
  slots hold all their max_len positions: no table, nothing to allocate,
  every reservation and admission granted. An instance of this class alone
  is that host side (admission.py's stand-in for an engine without a
  strategy, a test's double).
  """

  kind = ""
  paged = False  # whether the slots share a pool of pages
  page_size: int | None = None  # positions a page holds (None: no pages)
  num_pages = 0  # pages in the pool, all slot groups together
  pages_per_slot = 0  # page-table columns

  # --- the device side ------------------------------------------------------

  def abstract(self):
    """ShapeDtypeStructs of the empty cache (nothing allocated)."""
    raise NotImplementedError

  def init(self, batch: int):
    """The empty cache of `batch` slots, traced in a jitted program."""
    raise NotImplementedError

  def shardings(self, mesh, rules) -> layout.EngineShardings:
    """The engine's shardings on `mesh` by `rules`, the cache's included."""
    raise NotImplementedError

  @property
  def live_tokens(self) -> int:
    """Positions the cache holds, all slots together."""
    raise NotImplementedError

  def describe(self) -> dict:
    """What `EnginePrograms.capacity` adds of this cache besides its kind."""
    return {}

  # --- the programs' arguments ---------------------------------------------

  def static_kv(self, kv: int | None) -> int | None:
    """A program's static arg for the kv bucket `kv` (None: the whole cache)."""
    return kv

  def abstract_table(self) -> tuple:
    """ShapeDtypeStructs of the arguments a program takes after the lengths."""
    return ()

  def table_shardings(self, shardings: layout.EngineShardings) -> tuple:
    """The shardings of those arguments."""
    del shardings
    return ()

  # --- the host side, on a decode state --------------------------------------

  def check_engine(self, lanes: int) -> None:
    """Raises ValueError for an engine this cache cannot serve (`lanes`)."""
    del lanes

  def attach(self, state, shardings: layout.EngineShardings):
    """A new decode state with what it holds besides its arrays."""
    del shardings
    return state

  def prepare(self, state, need: np.ndarray, fed: np.ndarray, shardings: layout.EngineShardings):
    """`state` ready for a call that writes the first `need[b]` positions of
    every `fed` slot b (or raises `PagePoolExhausted`)."""
    del need, fed, shardings
    return state

  def call_args(self, state) -> tuple:
    """A call's arguments after the lengths, from `state`."""
    del state
    return ()

  def reserve(self, state, slot: int, tokens: int) -> bool:
    """Holds what slot `slot`'s first `tokens` positions need; False (and
    nothing held) when there is too little free. Host-side only."""
    del state, slot, tokens
    return True

  def release(self, state, slots_mask: np.ndarray) -> None:
    """The masked slots give back what they hold (host-side only)."""
    del state, slots_mask

  def trim(self, state, slot: int, tokens: int) -> None:
    """Slot `slot` gives back what it holds past its first `tokens` positions
    (host-side only)."""
    del state, slot, tokens

  def cut(self, state, slot: int, length: int) -> int:
    """Slot `slot`'s cache cut back to at most `length` positions, to be
    written again after (host-side only); the positions kept."""
    del state, slot
    return int(length)

  def share(self, state, slot: int, tokens) -> int:
    """Gives empty slot `slot` the cached entries other slots hold of a prefix
    of `tokens` (host-side only); how many positions (0: none)."""
    del state, slot, tokens
    return 0

  def register(self, state, slot: int, tokens) -> None:
    """Offers slot `slot`'s cached entries of `tokens` to `share`."""
    del state, slot, tokens

  # --- admission --------------------------------------------------------------

  def group_of(self, state, slot: int) -> int:
    """The slot group whose free pages slot `slot` draws on."""
    del state, slot
    return 0

  def can_admit(self, state, tokens: int, group: int) -> bool:
    """Whether `group`'s free pages cover a new slot's first `tokens` positions."""
    del state, tokens, group
    return True

  def held(self, state, slot: int) -> int:
    """Pages slot `slot` holds."""
    del state, slot
    return 0


class DenseCache(KVCache):
  """Every slot owns `max_len` positions (module docstring, "Dense").

  Args:
    cfg, slots, max_len: the serving model config and the engine's size.
    groups, page_size, num_pages: a paged cache's; unused.
  """

  kind = "dense"

  def __init__(
    self,
    cfg: ModelConfig,
    slots: int,
    max_len: int,
    groups: int = 1,
    *,
    page_size: int | None = None,
    num_pages: int = 0,
  ):
    del groups, page_size, num_pages
    self.cfg, self.slots, self.max_len = cfg, slots, max_len

  def abstract(self):
    return layout.abstract_cache(self.cfg, self.slots, self.max_len)

  def init(self, batch: int):
    return decoding.init_cache(self.cfg, batch, self.max_len)

  def shardings(self, mesh, rules) -> layout.EngineShardings:
    return layout.engine_shardings(self.cfg, self.slots, self.max_len, mesh, rules)

  @property
  def live_tokens(self) -> int:
    return self.slots * self.max_len


class PagedCache(KVCache):
  """A pool of pages the slots share (module docstring, "Paged").

  Args:
    cfg, slots, max_len: the serving model config and the engine's size.
    groups: slot groups (`layout.batch_groups`); each has its own part of
      the pool.
    page_size: positions a page holds.
    num_pages: pages in the pool (0: the dense cache's size), rounded up to
      whole pages a group.
  """

  kind = "paged"
  paged = True

  def __init__(
    self,
    cfg: ModelConfig,
    slots: int,
    max_len: int,
    groups: int = 1,
    *,
    page_size: int | None = None,
    num_pages: int = 0,
  ):
    if page_size is None or page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {page_size}")
    self.cfg, self.slots, self.max_len, self.groups = cfg, slots, max_len, groups
    self.page_size = page_size
    self.pages_per_slot = -(-max_len // page_size)
    pages = num_pages or layout.default_pages(slots, max_len, page_size)
    self.num_pages = -(-pages // groups) * groups

  # --- the device side ------------------------------------------------------

  def abstract(self):
    return layout.abstract_pool(self.cfg, self.num_pages, self.page_size, self.slots)

  def init(self, batch: int):
    # The pool's size is its pages', whatever the slots; a linear layer's
    # state is per slot.
    return paged.init_pages(self.cfg, self.num_pages, self.page_size, batch)

  def shardings(self, mesh, rules) -> layout.EngineShardings:
    return layout.engine_shardings(
      self.cfg, self.slots, self.max_len, mesh, rules, pages=(self.num_pages, self.page_size)
    )

  @property
  def live_tokens(self) -> int:
    return self.num_pages * self.page_size

  def describe(self) -> dict:
    return dict(
      page_size=self.page_size, pages=self.num_pages, pages_per_group=self.num_pages // self.groups
    )

  # --- the programs' arguments ---------------------------------------------

  def static_kv(self, kv: int | None) -> int | None:
    """The page-table columns that cover the cache prefix `kv` (None: all)."""
    if kv is None:
      return None
    cols = -(-kv // self.page_size)
    return None if cols >= self.pages_per_slot else cols

  def abstract_table(self) -> tuple:
    return (jax.ShapeDtypeStruct((self.slots, self.pages_per_slot), jnp.int32),)

  def table_shardings(self, shardings: layout.EngineShardings) -> tuple:
    return (shardings.tokens,)  # slots over the batch axes, like a step's tokens

  # --- the host side, on a decode state --------------------------------------

  def check_engine(self, lanes: int) -> None:
    if lanes > 1:
      raise ValueError("lanes > 1 is for the dense cache (a paged engine's slots share one pool)")
    if self.num_pages // self.groups < self.pages_per_slot:
      raise ValueError(
        f"kv_pages {self.num_pages} over {self.groups} slot groups leaves "
        f"{self.num_pages // self.groups} pages a group, fewer than one max_len "
        f"trajectory's {self.pages_per_slot} (max_len {self.max_len} / page_size "
        f"{self.page_size})"
      )

  def attach(self, state, shardings: layout.EngineShardings):
    """`state` with a fresh `PagePool` (one object the states of one run
    share) and its table's device copy."""
    pages = PagePool(
      self.num_pages, self.page_size, len(state.host_lengths), self.pages_per_slot, self.groups
    )
    return _synced(state._replace(pages=pages), shardings)

  def prepare(self, state, need: np.ndarray, fed: np.ndarray, shardings: layout.EngineShardings):
    """Allocates the pages every fed slot's first `need[b]` positions lack,
    or raises `PagePoolExhausted`; syncs the table."""
    pages = state.pages
    for b in np.flatnonzero(fed):
      if not pages.ensure(int(b), int(need[b])):
        raise PagePoolExhausted(
          f"slot {b} needs pages for {int(need[b])} positions, holds "
          f"{pages.held(int(b))}, and its group has "
          f"{pages.free_pages(pages.group_of(int(b)))} free of "
          f"{self.num_pages}; reserve pages ahead (PolicyEngine.reserve) and wait when "
          "that fails"
        )
    return _synced(state, shardings)

  def call_args(self, state) -> tuple:
    return (state.page_table,)

  def reserve(self, state, slot: int, tokens: int) -> bool:
    return state.pages.ensure(slot, tokens)

  def release(self, state, slots_mask: np.ndarray) -> None:
    for b in np.flatnonzero(np.asarray(slots_mask, bool)):
      state.pages.release(int(b))

  def trim(self, state, slot: int, tokens: int) -> None:
    state.pages.shrink(slot, tokens)

  def cut(self, state, slot: int, length: int) -> int:
    return state.pages.cut(slot, length)

  def share(self, state, slot: int, tokens) -> int:
    # A recurrent layer's state is per slot, not in pages: nothing to share.
    return 0 if "linear" in self.cfg.attention_kinds else state.pages.share(slot, tokens)

  def register(self, state, slot: int, tokens) -> None:
    state.pages.register(slot, tokens)

  # --- admission --------------------------------------------------------------

  def group_of(self, state, slot: int) -> int:
    return state.pages.group_of(slot)

  def can_admit(self, state, tokens: int, group: int) -> bool:
    return state.pages.can_admit(tokens, group)

  def held(self, state, slot: int) -> int:
    return state.pages.held(slot)


def _synced(state, shardings: layout.EngineShardings):
  """`state` with the device copy of its page table current."""
  if not state.pages.dirty:
    return state
  table = jax.device_put(state.pages.device_table(), shardings.tokens)
  state.pages.dirty = False
  return state._replace(page_table=table)


# The extension point: `rollout.kv_cache` names one of these.
KV_CACHES: dict[str, type[DenseCache] | type[PagedCache]] = {
  "dense": DenseCache,
  "paged": PagedCache,
}


def build(
  kind: str | None,
  cfg: ModelConfig,
  slots: int,
  max_len: int,
  groups: int = 1,
  *,
  page_size: int | None = None,
  num_pages: int = 0,
) -> KVCache:
  """The `KV_CACHES[kind]` strategy of an engine (the class's Args).

  `kind` None: "paged" when a `page_size` is given, else "dense" (how
  `EnginePrograms` is told without naming the kind).
  """
  if kind is None:
    kind = "dense" if page_size is None else "paged"
  if kind not in KV_CACHES:
    raise ValueError(f"unknown kv_cache {kind!r}; known: {', '.join(KV_CACHES)}")
  return KV_CACHES[kind](cfg, slots, max_len, groups, page_size=page_size, num_pages=num_pages)
