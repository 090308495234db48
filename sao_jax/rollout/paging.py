"""The paged KV cache's host side: a page allocator over a fixed pool.

A paged engine keeps its KV cache as a pool of `num_pages` pages of
`page_size` positions shared by all slots (the device side:
sao_jax/models/paged.py), and each slot a row of a page table: entry j of
slot b is the page holding positions `[j * page_size, (j + 1) * page_size)`.
This module is that table and the free list behind it, host-side numpy
only:

  * `ensure(slot, tokens)` gives a slot pages until they cover its first
    `tokens` positions, or returns False and changes nothing when the pool
    has too few: exhaustion is reported, never raised, so a caller can wait;
  * `release(slot)` returns all of a slot's pages;
  * `can_admit(tokens)` says whether the free pages would cover `tokens`
    more positions;
  * `device_table()` is the `[slots, pages_per_slot]` int32 table the
    jitted programs take, unallocated entries pointing at page 0 (never
    read or written);
  * `register` / `share` / `cut`: slots whose tokens begin alike hold the
    same full pages, counted (`refs`); no slot ever writes into a shared
    page.

Groups (sharded engines): with the slots split over `groups` devices, each
group allocates from its own `num_pages / groups` pages, the table holds
page ids local to the group, and every count is per group. Why it is built
so: docs/design/kv_cache.md.
"""

from __future__ import annotations

import numpy as np


class PagePool:
  """A free list over `num_pages` pages and the per-slot page table.

  Args:
    num_pages: pages in the pool (all groups together).
    page_size: positions a page holds.
    slots: the engine's decode slots.
    pages_per_slot: table columns: a slot's most pages
      (ceil(max_len / page_size)).
    groups: slot / pool partitions (module docstring); must divide
      `slots` and `num_pages`.
  """

  def __init__(
    self, num_pages: int, page_size: int, slots: int, pages_per_slot: int, groups: int = 1
  ):
    if page_size < 1 or slots < 1 or pages_per_slot < 1 or groups < 1:
      raise ValueError(
        f"page_size, slots, pages_per_slot and groups must be >= 1, got "
        f"{page_size}, {slots}, {pages_per_slot}, {groups}"
      )
    if slots % groups or num_pages % groups:
      raise ValueError(
        f"{groups} groups must divide the slots ({slots}) and the pages ({num_pages})"
      )
    if num_pages // groups < 1:
      raise ValueError(f"a pool of {num_pages} pages has none for each of {groups} groups")
    self.num_pages, self.page_size, self.slots = num_pages, page_size, slots
    self.pages_per_slot, self.groups = pages_per_slot, groups
    self.group_pages = num_pages // groups
    self._group_slots = slots // groups
    self.table = np.full((slots, pages_per_slot), -1, np.int32)
    self._held = np.zeros((slots,), np.int32)  # pages each slot holds
    # Each group's free pages as a stack; popping gives the lowest id first.
    self._free = [list(range(self.group_pages - 1, -1, -1)) for _ in range(groups)]
    # Holders of each page, [groups, group_pages]; 0: free.
    self.refs = np.zeros((groups, self.group_pages), np.int32)
    # The prefix index: (group, page before or -1, page's tokens) -> page, and back.
    self._index: dict[tuple, int] = {}
    self._key_of: dict[tuple[int, int], tuple] = {}
    # Set on every change of the table; the engine clears it once it has
    # copied the table to the device.
    self.dirty = True

  # --- sizes ------------------------------------------------------------------

  def pages_for(self, tokens: int) -> int:
    """Pages that hold `tokens` positions."""
    return -(-max(int(tokens), 0) // self.page_size)

  @property
  def capacity(self) -> int:
    """Positions a slot's table can address (pages_per_slot x page_size)."""
    return self.pages_per_slot * self.page_size

  def group_of(self, slot: int) -> int:
    return int(slot) // self._group_slots

  def free_pages(self, group: int = 0) -> int:
    """Free pages of `group`."""
    return len(self._free[group])

  @property
  def total_free(self) -> int:
    return sum(len(f) for f in self._free)

  @property
  def used_pages(self) -> int:
    return self.num_pages - self.total_free

  def held(self, slot: int) -> int:
    """Pages slot `slot` holds."""
    return int(self._held[slot])

  def covered(self, slot: int) -> int:
    """Positions slot `slot`'s pages cover."""
    return int(self._held[slot]) * self.page_size

  # --- allocation -------------------------------------------------------------

  def can_admit(self, tokens: int, group: int = 0) -> bool:
    """Whether `group`'s free pages cover a new slot's first `tokens` positions."""
    need = self.pages_for(min(int(tokens), self.capacity))
    return need <= self.free_pages(group)

  def ensure(self, slot: int, tokens: int) -> bool:
    """Pages for slot `slot`'s first `tokens` positions (capped at `capacity`).

    Allocates only the missing pages. Returns False, allocating nothing,
    when its group has too few free pages: the caller waits or frees.
    """
    need = self.pages_for(min(int(tokens), self.capacity))
    have = int(self._held[slot])
    if need <= have:
      return True
    free = self._free[self.group_of(slot)]
    if need - have > len(free):
      return False
    for j in range(have, need):
      self.table[slot, j] = free.pop()
      self.refs[self.group_of(slot), self.table[slot, j]] = 1
    self._held[slot] = need
    self.dirty = True
    return True

  def release(self, slot: int) -> int:
    """Returns all of slot `slot`'s pages to the free list; how many."""
    return self.shrink(slot, 0)

  def shrink(self, slot: int, tokens: int) -> int:
    """Returns the pages of slot `slot` past its first `tokens` positions to
    the free list (a parked cache keeps only its tokens' pages); how many."""
    have, keep = int(self._held[slot]), self.pages_for(min(int(tokens), self.capacity))
    if have <= keep:
      return 0
    group = self.group_of(slot)
    for p in (int(p) for p in self.table[slot, keep:have][::-1]):  # lowest page on top
      self.refs[group, p] -= 1
      if not self.refs[group, p]:
        self._free[group].append(p)
        self._index.pop(self._key_of.pop((group, p), None), None)
    self.table[slot, keep:have] = -1
    self._held[slot] = keep
    self.dirty = True
    return have - keep

  # --- shared prefixes ----------------------------------------------------------

  def register(self, slot: int, tokens) -> None:
    """Enters slot `slot`'s full pages into the prefix index; `tokens`: what
    its cache holds from position 0 (its computed entries). A page already
    indexed under the same key keeps its place."""
    group, prev, size = self.group_of(slot), -1, self.page_size
    for j in range(min(len(tokens) // size, int(self._held[slot]))):
      key = (group, prev, tuple(tokens[j * size : (j + 1) * size]))
      page = int(self.table[slot, j])
      if key not in self._index and (group, page) not in self._key_of:
        self._index[key], self._key_of[(group, page)] = page, key
      if self._index.get(key) != page:
        return  # this slot's later pages follow another page: not on the index's chain
      prev = page

  def share(self, slot: int, tokens) -> int:
    """Maps into slot `slot` (holding no pages) the indexed full pages that
    begin `tokens`, at most its first `len(tokens)` positions; returns the
    positions they hold (a multiple of page_size; 0: none)."""
    if self._held[slot]:
      raise ValueError(f"slot {slot} holds pages already; share is for an empty slot")
    group, prev, size, pages = self.group_of(slot), -1, self.page_size, []
    while (len(pages) + 1) * size <= len(tokens) and len(pages) < self.pages_per_slot:
      j = len(pages)
      page = self._index.get((group, prev, tuple(tokens[j * size : (j + 1) * size])))
      if page is None:
        break
      pages.append(page)
      prev = page
    for j, page in enumerate(pages):
      self.table[slot, j] = page
      self.refs[group, page] += 1
    self._held[slot] = len(pages)
    self.dirty = self.dirty or bool(pages)
    return len(pages) * size

  def cut(self, slot: int, length: int) -> int:
    """Slot `slot`'s cache cut back to at most its first `length` positions,
    to be written again after: its pages past them go back, and the page
    the next write lands in leaves the index -- or, when another slot holds
    it too, goes back as well and the cut falls to its start. Returns the
    positions kept."""
    group, j = self.group_of(slot), int(length) // self.page_size
    if int(length) % self.page_size and j < self._held[slot]:
      page = int(self.table[slot, j])
      if self.refs[group, page] > 1:
        length = j * self.page_size
      else:
        self._index.pop(self._key_of.pop((group, page), None), None)
    self.shrink(slot, length)
    return int(length)

  def release_all(self) -> None:
    for slot in range(self.slots):
      self.release(slot)

  def device_table(self) -> np.ndarray:
    """The int32 `[slots, pages_per_slot]` table the programs take (no page: 0)."""
    return np.maximum(self.table, 0)

  def check(self) -> None:
    """Raises AssertionError unless every page is free or held, by as many
    slots as its `refs` say (each group's pages within its own range), and
    only held pages are indexed."""
    for g in range(self.groups):
      rows = self.table[g * self._group_slots : (g + 1) * self._group_slots]
      held = rows[rows >= 0]
      free = self._free[g]
      counts = np.bincount(held, minlength=self.group_pages)
      assert (counts == self.refs[g]).all(), f"group {g}: holders disagree with refs"
      assert len(set(free)) == len(free), f"group {g}: a page is free twice"
      assert not set(held.tolist()) & set(free), f"group {g}: a page is both free and held"
      assert sorted(set(held.tolist()) | set(free)) == list(range(self.group_pages)), (
        f"group {g}: pages leaked"
      )
      assert all(self.refs[g, p] for gg, p in self._key_of if gg == g), (
        f"group {g}: a free page is indexed"
      )
    counts = (self.table >= 0).sum(1)
    assert (counts == self._held).all(), "held counts disagree with the table"
    for b in range(self.slots):  # allocated entries are a prefix of each row
      assert (self.table[b, : self._held[b]] >= 0).all() and (
        self.table[b, self._held[b] :] < 0
      ).all(), f"slot {b}: table row is not a prefix"
