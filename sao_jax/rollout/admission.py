"""Page admission: which episodes may start, and which slots may be fed, by free pages.

With a paged engine (`kv_cache="paged"`, rollout/paging.py) admission is
bounded by free pages, not by free slots. The rule is to reserve a turn
ahead: before a slot is fed (its prompt, an observation, or its turn's
decoding) it holds pages for everything it can write until its turn ends,
`min(len(record) + max_turn_tokens - turn_tokens, max_len)` positions
(`PolicyEngine.reserve`). That need stays constant while a turn decodes
(each sampled token adds one to both terms), so a decode call never needs
a page it was not given, and grows only when an observation arrives and a
new turn starts. In-flight slots reserve first, oldest first; a slot whose
reservation fails waits with its input pending ("blocked"), and no prompt
is admitted into its group of slots while one waits. A prompt is admitted
only if its first turn's pages can be reserved, else it waits, queued.
When every slot of a group is blocked (none decoding, none at an
environment, so no pages will come back), the youngest slot holding pages
is preempted: its pages go back and its record is re-fed from the start
once pages allow (as a "recompute" swap re-feeds; its recorded tokens,
log-probs and versions stand). The oldest then always proceeds, since a
group's pages hold one max_len trajectory (the engine checks), so every
trajectory finishes. A finished trajectory's pages go back at once.
`DriverStats.page_waits` counts passes that deferred an admission or
blocked a slot, `preemptions` the preempted slots.

This is a module of its own because it is a policy over pages alone: it
reads the slots' lengths and admission order, asks the engine's KV cache
strategy (`engine.kv_cache`, rollout/kv_cache.py: reservations, slot
groups, free pages), and answers ready, wait or preempt; the episode loop
(rollout/driver.py) does what it answers and never looks at pages itself.
A cache without pages (a dense one, or `Engine`'s default `kv_cache.KVCache()`
for an engine without a strategy) grants every reservation and admission:
every slot with input is ready and every free slot admits.
"""

from __future__ import annotations

import numpy as np

from sao_jax.rollout import kv_cache
from sao_jax.rollout.stats import DriverStats


class PageAdmission:
  """The driver's page reservations over `engine`'s pool (module docstring).

  The slots it is handed are the driver's: None for a free slot, else a
  record with `tokens`, `fed`, `waiting`, `turn_tokens`, `admitted` (its
  admission order) and `refeed()`. `state` is the engine's decode state,
  which the engine's KV cache strategy reads its pages from. `blocked`
  holds the slots that waited for pages at the last reservation.
  """

  def __init__(self, engine, max_turn_tokens: int, max_len: int, stats: DriverStats):
    self.engine = engine
    # Engines without a strategy (test doubles) have every slot's positions.
    self.cache: kv_cache.KVCache = engine.kv_cache
    self.max_turn_tokens = max_turn_tokens
    self.max_len = max_len
    self.stats = stats
    self.blocked: set[int] = set()

  def need(self, s) -> int:
    """Positions slot `s` can write before its turn ends: what it reserves."""
    return min(len(s.tokens) + self.max_turn_tokens - s.turn_tokens, self.max_len)

  def reserve(self, slots: list, state, count: bool = True) -> list[int]:
    """The slots with pending input that hold their pages: in-flight slots
    reserve, oldest first; the rest wait (a pass with one counts in
    `page_waits`, if `count`)."""
    pending = [
      i for i, s in enumerate(slots) if s is not None and not s.waiting and len(s.tokens) > s.fed
    ]
    ready, blocked = [], set()
    for i in sorted(pending, key=lambda i: slots[i].admitted):
      if self.cache.reserve(state, i, self.need(slots[i])):
        ready.append(i)
      else:
        blocked.add(i)
    if blocked and count:
      self.stats.page_waits += 1
    self.blocked = blocked
    return sorted(ready)

  def full_groups(self, slots: list, state) -> set[int]:
    """The slot groups closed to admission in this pass: in-flight slots take
    their pages first, and a group where one of them waits admits nothing."""
    self.reserve(slots, state, count=False)
    return self._blocked_groups(state)

  def closed(self, state, i: int, full: set[int]) -> bool:
    """Whether free slot `i` is in one of the `full` groups."""
    return self.cache.group_of(state, i) in full

  def admits(self, state, i: int, prompt_tokens: int, full: set[int]) -> bool:
    """Whether a prompt of `prompt_tokens` may start in free slot `i`: its
    first turn's pages are free. If not, its group joins `full` and the pass
    counts in `page_waits`."""
    group = self.cache.group_of(state, i)
    if self.cache.can_admit(state, self._first_turn(prompt_tokens), group):
      return True
    full.add(group)
    self.stats.page_waits += 1
    return False

  def take(self, state, i: int, prompt_tokens: int) -> None:
    """Reserves the first turn's pages of the prompt `admits` let into slot `i`."""
    if not self.cache.reserve(state, i, self._first_turn(prompt_tokens)):
      raise AssertionError(f"slot {i}: pages that can_admit promised were not there")

  def release(self, slots: list, state, i: int) -> None:
    """Slot `i` gives its pages back (host-side: no device call)."""
    self.cache.release(state, np.arange(len(slots)) == i)
    self.blocked.discard(i)

  def preempt(self, slots: list, state):
    """Frees pages in each group where every slot waits for pages: its
    youngest slot holding pages gives them back and will re-feed its record.
    Returns the decode state with the preempted slots' caches emptied."""
    cache = self.cache
    for g in sorted(self._blocked_groups(state)):
      members = [i for i, s in enumerate(slots) if s is not None and cache.group_of(state, i) == g]
      if any(i not in self.blocked for i in members):
        continue  # a slot decodes or is at its environment: pages will come back
      oldest = min(members, key=lambda i: slots[i].admitted)
      holders = [i for i in members if i != oldest and cache.held(state, i) > 0]
      if not holders:
        raise AssertionError(f"slot group {g} is blocked with no pages to preempt")
      victim = max(holders, key=lambda i: slots[i].admitted)
      slots[victim].refeed()
      state = self.engine.reset_slots(state, np.arange(len(slots)) == victim)
      self.stats.preemptions += 1
    return state

  def _first_turn(self, prompt_tokens: int) -> int:
    """Positions a new episode's first turn can write: its prompt and a turn."""
    return min(prompt_tokens + self.max_turn_tokens, self.max_len)

  def _blocked_groups(self, state) -> set[int]:
    return {self.cache.group_of(state, i) for i in self.blocked}
