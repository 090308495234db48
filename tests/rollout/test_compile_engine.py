"""The rollout engine as launch/compile.py compiles it, checked on CPU without the TPU compiler.

Its KV capacity (`EnginePrograms.capacity`): a paged pool holds pages x
page_size live tokens, split into one part per slot group (the devices of
the mesh's batch axes), a dense cache slots x max_len. Shapes only: nothing
is compiled or allocated (tests/test_compile.py checks the same figures in
the script's report).

The page pool's TPU form of writes and gathers (`paged.write` /
`paged.gather` with `by_rows`, what compiling for TPU takes): the same
result as the form CPU runs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.config import sections
from sao_jax.models import config as mcfg
from sao_jax.models import paged, sharding
from sao_jax.rollout import kv_cache, layout
from sao_jax.rollout import programs as programs_lib
from sao_jax.rollout import sampling as sampling_lib

CFG = mcfg.tiny()  # 2 layers, 2 kv heads of 16, fp32: 2 * 2 * 2 * 16 * 4 = 512 bytes a token
SAMPLING = sampling_lib.SamplingConfig(1.0, 0, 1.0)
TOKEN_BYTES = CFG.num_layers * 2 * CFG.num_kv_heads * CFG.head_dim * 4


def programs(slots=8, max_len=64, **kw):
  return programs_lib.EnginePrograms(CFG, SAMPLING, slots, max_len, **kw)


def test_dense_cache_holds_every_slot_at_max_len():
  cap = programs().capacity()
  assert cap["kind"] == "dense" and "pages" not in cap
  assert cap["live_tokens"] == cap["dense_tokens"] == 8 * 64
  assert cap["fraction_of_dense"] == 1.0 and cap["groups"] == 1
  assert cap["max_len_trajectories_per_group"] == 8.0
  assert cap["bytes"] == cap["bytes_per_device"] == 8 * 64 * TOKEN_BYTES
  assert cap["bytes_per_token"] == TOKEN_BYTES


def test_a_paged_pool_holds_its_pages_on_one_device():
  # 12 pages of 16 = 192 live tokens: 3 max_len trajectories, 3/8 of the dense cache.
  cap = programs(page_size=16, num_pages=12).capacity()
  assert cap["kind"] == "paged" and (cap["pages"], cap["page_size"]) == (12, 16)
  assert cap["live_tokens"] == cap["live_tokens_per_group"] == 192
  assert cap["dense_tokens"] == 512 and cap["fraction_of_dense"] == pytest.approx(0.375)
  assert cap["max_len_trajectories_per_group"] == 3.0
  assert cap["bytes"] == cap["bytes_per_device"] == 192 * TOKEN_BYTES
  # num_pages 0: the dense cache's size in pages.
  full = programs(page_size=16).capacity()
  assert full["pages"] == 32 and full["fraction_of_dense"] == 1.0


def test_every_configurable_kv_cache_has_a_strategy_and_program_bodies():
  # rollout.kv_cache names a strategy (kv_cache.KV_CACHES) with step and decode bodies.
  assert tuple(kv_cache.KV_CACHES) == sections.KV_CACHES
  assert set(programs_lib.BODIES) == set(kv_cache.KV_CACHES)
  for kind in sections.KV_CACHES:
    progs = programs(kv_cache=kind, page_size=16)
    assert progs.kv_cache.kind == progs.capacity()["kind"] == kind
    assert progs.paged == (kind == "paged")
  # Without a name, a page_size given means a paged cache.
  assert programs(page_size=16).kv_cache.kind == "paged" and not programs().paged
  with pytest.raises(ValueError, match="unknown kv_cache 'ring'; known: dense, paged"):
    programs(kv_cache="ring")


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
def test_a_sharded_pool_splits_into_slot_groups():
  # data 4 x tensor 2: slots and pages over 4 groups, kv heads over 2 chips.
  mesh = sharding.make_mesh({"data": 4, "tensor": 2})
  progs = programs(page_size=16, num_pages=30, mesh=mesh)
  cap = progs.capacity()
  assert progs.num_pages == 32  # rounded up to whole pages a group
  assert (cap["groups"], cap["slots_per_group"], cap["pages_per_group"]) == (4, 2, 8)
  assert cap["live_tokens"] == 512 and cap["live_tokens_per_group"] == 128
  assert cap["max_len_trajectories_per_group"] == 2.0
  # A device holds its group's pages for its kv heads: 1/8 of the pool.
  assert cap["bytes_per_device"] == cap["bytes"] // 8
  assert cap["bytes_per_device"] == layout.pool_bytes_per_device(CFG, 32, 16, mesh)


def test_the_tpu_form_of_page_writes_and_gathers_is_the_cpu_form():
  # Ragged appends (one slot empty, padding past each valid prefix), into a
  # pool with stale data, per layer and into one layer of a stacked pool.
  rng = np.random.default_rng(0)
  kvh, hd, pages, page, slots, width = 2, 8, 20, 4, 3, 7
  leaf = jnp.asarray(rng.normal(size=(kvh, pages, page, hd)), jnp.float32)
  table = rng.permutation(pages)[: slots * 6].reshape(slots, 6).astype(np.int32)
  new = jnp.asarray(rng.normal(size=(slots, width, kvh, hd)), jnp.float32)
  positions = np.array([3, 0, 9])[:, None] + np.arange(width)[None]
  valid = np.arange(width)[None] < np.array([5, 0, 7])[:, None]
  stacked = jnp.stack([leaf, leaf + 1.0, leaf - 1.0])
  for pool, layer in ((leaf, None), (stacked, jnp.int32(1))):
    cpu, tpu = (
      paged.write(pool, new, table, positions, valid, layer, by_rows=f) for f in (False, True)
    )
    np.testing.assert_array_equal(np.asarray(tpu), np.asarray(cpu))
    assert not np.array_equal(np.asarray(cpu), np.asarray(pool))  # something was written
    views = [np.asarray(paged.gather(cpu, table, layer, by_rows=f)) for f in (False, True)]
    np.testing.assert_array_equal(views[1], views[0])
