"""The paged KV cache: the host allocator (sao_jax/rollout/paging.py)."""

import numpy as np
import pytest

from sao_jax.rollout.paging import PagePool


def test_pages_grow_with_the_length_and_return_on_release():
  pool = PagePool(num_pages=10, page_size=4, slots=3, pages_per_slot=4)
  assert pool.ensure(0, 1) and pool.held(0) == 1
  assert pool.ensure(0, 4) and pool.held(0) == 1  # still one page
  assert pool.ensure(0, 5) and pool.held(0) == 2
  assert pool.ensure(1, 9) and pool.held(1) == 3
  assert pool.free_pages() == 5 and pool.used_pages == 5
  np.testing.assert_array_equal(pool.table[0], [0, 1, -1, -1])
  np.testing.assert_array_equal(pool.table[1], [2, 3, 4, -1])
  np.testing.assert_array_equal(pool.device_table()[0], [0, 1, 0, 0])
  pool.check()
  assert pool.release(0) == 2 and pool.held(0) == 0 and pool.free_pages() == 7
  assert pool.release(0) == 0
  # Freed pages are reused, lowest first.
  assert pool.ensure(2, 8)
  np.testing.assert_array_equal(pool.table[2], [0, 1, -1, -1])
  pool.check()


def test_ensure_caps_at_the_table_and_reports_exhaustion_without_raising():
  pool = PagePool(num_pages=5, page_size=4, slots=2, pages_per_slot=4)
  assert pool.ensure(0, 1000) and pool.held(0) == 4  # capped at max_len's pages
  assert not pool.can_admit(8) and pool.can_admit(4)
  pool.dirty = False
  assert not pool.ensure(1, 8)  # 2 pages wanted, 1 free: nothing allocated
  assert pool.held(1) == 0 and pool.free_pages() == 1 and not pool.dirty
  assert pool.ensure(1, 3) and pool.dirty
  assert not pool.ensure(1, 5) and pool.held(1) == 1
  pool.check()


def test_no_leak_over_thousands_of_mixed_length_trajectories():
  # Lognormal trajectory lengths capped at max_len, grown in turns of up to
  # 24 tokens. As in the driver: in-flight trajectories get pages first,
  # oldest first; admission waits while one of them waits or the pool lacks
  # a first turn's pages; when every trajectory waits, the youngest holding
  # pages gives them back and starts over (preemption).
  rng = np.random.default_rng(0)
  page, max_len, slots = 16, 512, 8
  pool = PagePool(num_pages=80, page_size=page, slots=slots, pages_per_slot=max_len // page)
  target = np.zeros(slots, int)  # each slot's final length, 0: free
  length = np.zeros(slots, int)
  admitted = np.zeros(slots, int)  # admission order
  finished = waits = restarts = clock = 0
  while finished < 3000:
    progress, blocked = False, False
    for b in np.argsort(admitted):
      if target[b] == 0:
        continue
      grow = min(int(rng.integers(1, 25)), target[b] - length[b])
      if pool.ensure(b, length[b] + grow):
        length[b] += grow
        progress = True
      else:
        waits += 1
        blocked = True
      if length[b] >= target[b]:
        assert pool.release(b) == pool.pages_for(length[b])
        target[b] = length[b] = 0
        finished += 1
    for b in np.flatnonzero(target == 0):
      want = int(min(max_len, max(2, rng.lognormal(4.5, 1.0))))
      if blocked or not pool.can_admit(min(want, 24)):
        waits += 1
        break
      assert pool.ensure(b, min(want, 24))
      target[b], length[b], admitted[b], progress = want, min(want, 24), clock, True
      clock += 1
    if not progress:
      holding = np.flatnonzero(length > 0)
      b = holding[np.argmax(admitted[holding])]
      pool.release(b)
      length[b] = 0
      restarts += 1
    for b in range(slots):
      assert pool.held(b) == pool.pages_for(length[b])
  pool.check()
  assert waits > 0 and restarts > 0  # the pool was the limit at times
  pool.release_all()
  pool.check()
  assert pool.total_free == 80 and (pool.table == -1).all()


def test_groups_allocate_from_their_own_pages_with_local_ids():
  pool = PagePool(num_pages=8, page_size=2, slots=4, pages_per_slot=4, groups=2)
  assert pool.group_of(1) == 0 and pool.group_of(2) == 1
  assert pool.ensure(0, 8) and pool.free_pages(0) == 0 and pool.free_pages(1) == 4
  assert not pool.ensure(1, 1) and not pool.can_admit(1, group=0)
  assert pool.ensure(2, 6) and pool.ensure(3, 2)
  np.testing.assert_array_equal(pool.table[2], [0, 1, 2, -1])  # local ids in group 1
  np.testing.assert_array_equal(pool.table[3], [3, -1, -1, -1])
  pool.check()
  pool.release(0)
  assert pool.ensure(1, 3) and pool.free_pages(0) == 2
  pool.check()


def test_bad_pools_are_refused():
  with pytest.raises(ValueError, match="groups must divide"):
    PagePool(num_pages=7, page_size=4, slots=4, pages_per_slot=2, groups=2)
  with pytest.raises(ValueError, match=">= 1"):
    PagePool(num_pages=4, page_size=0, slots=4, pages_per_slot=2)
