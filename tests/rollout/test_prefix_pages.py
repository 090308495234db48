"""Shared prefixes in the page allocator (rollout/paging.py): host-side only."""

import numpy as np
import pytest

from sao_jax.rollout.paging import PagePool


def pool(**kw):
  return PagePool(**{"num_pages": 12, "page_size": 4, "slots": 3, "pages_per_slot": 6, **kw})


def test_a_slot_takes_the_indexed_full_pages_that_begin_its_tokens():
  p = pool()
  system = list(range(10))  # two full pages and two tokens
  assert p.ensure(0, 10)
  p.register(0, system)
  assert p.share(1, system + [50, 51]) == 8  # the two full pages, not the partial third
  np.testing.assert_array_equal(p.table[1, :2], p.table[0, :2])
  assert p.refs[0, p.table[0, 0]] == 2 and p.refs[0, p.table[0, 2]] == 1
  assert p.share(2, [0, 1, 2, 9, 4]) == 0  # differs inside the first page
  p.check()
  with pytest.raises(ValueError, match="holds pages"):
    p.share(1, system)


def test_a_shared_page_goes_back_when_its_last_holder_releases_it():
  p = pool()
  p.ensure(0, 8)
  p.register(0, list(range(8)))
  p.share(1, list(range(8)) + [9])
  p.release(0)
  assert p.used_pages == 2 and p.share(2, list(range(8))) == 8  # still indexed: slot 1 holds them
  p.release(1)
  p.release(2)
  assert p.used_pages == 0 and p.share(0, list(range(8))) == 0  # freed pages leave the index
  p.check()


def test_a_cut_never_writes_into_a_shared_page_and_unindexes_a_rewritten_one():
  p = pool()
  p.ensure(0, 12)
  p.register(0, list(range(12)))
  p.share(1, list(range(12)) + [1])  # three pages
  assert p.cut(1, 6) == 4  # inside shared page 1: falls to its start
  assert p.held(1) == 1
  p.release(1)
  assert p.cut(0, 6) == 6  # page 1 is slot 0's alone: kept, but out of the index
  assert p.held(0) == 2 and p.share(2, list(range(12))) == 4
  p.check()


def test_pages_are_shared_only_within_a_slot_group():
  p = pool(num_pages=12, slots=4, groups=2)
  p.ensure(0, 8)
  p.register(0, list(range(8)))
  assert p.share(1, list(range(8))) == 8 and p.share(2, list(range(8))) == 0
  p.check()
