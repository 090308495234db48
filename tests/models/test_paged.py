"""The paged KV cache's device side (sao_jax/models/paged.py) against the dense cache."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.models import config as mcfg
from sao_jax.models import decoding, paged, policy
from sao_jax.rollout import layout
from sao_jax.rollout.paging import PagePool

CFG = mcfg.tiny(vocab_size=61)
MAX_LEN, PAGE, SLOTS = 32, 4, 3  # SLOTS: the write / gather test's


def test_write_then_gather_is_the_dense_cache_below_each_length():
  rng = np.random.default_rng(0)
  kvh, hd, pages = 2, 8, 20
  leaf = jnp.asarray(rng.normal(size=(kvh, pages, PAGE, hd)), jnp.float32)  # stale data
  table = rng.permutation(pages)[: SLOTS * 6].reshape(SLOTS, 6).astype(np.int32)
  lengths = np.array([3, 0, 9])
  width = 7
  new = jnp.asarray(rng.normal(size=(SLOTS, width, kvh, hd)), jnp.float32)
  fed = np.array([5, 2, 7])
  valid = np.arange(width)[None] < fed[:, None]
  positions = lengths[:, None] + np.arange(width)[None]
  out = paged.write(leaf, new, table, positions, valid)
  view = np.asarray(paged.gather(out, table))  # [B, 24, KVH, hd]
  dense = np.array(paged.gather(leaf, table))
  for b in range(SLOTS):
    dense[b, lengths[b] : lengths[b] + fed[b]] = np.asarray(new)[b, : fed[b]]
  np.testing.assert_array_equal(view, dense)  # padding (past `fed`) was not written
  # Pages no slot names are untouched.
  unused = np.setdiff1d(np.arange(pages), table)
  np.testing.assert_array_equal(np.asarray(out)[:, unused], np.asarray(leaf)[:, unused])
  # A stacked leaf: only the given layer's pages change.
  stacked = jnp.stack([leaf, leaf + 1.0])
  out1 = paged.write(stacked, new, table, positions, valid, layer=jnp.int32(1))
  np.testing.assert_array_equal(np.asarray(out1[0]), np.asarray(leaf))
  np.testing.assert_array_equal(
    np.asarray(paged.gather(out1, table, jnp.int32(1))),
    np.asarray(paged.gather(paged.write(leaf + 1.0, new, table, positions, valid), table)),
  )


def _steps(slots):
  """Ragged appends: a prefill of ragged prompts (slot 1 empty), a ragged
  chunk, then two one-token decode steps with slot 0 sitting one out."""
  rng = np.random.default_rng(1)
  fed = [
    np.array([5, 0, 9, 2]),
    np.array([6, 3, 1, 7]),
    np.array([1, 1, 1, 1]),
    np.array([0, 1, 1, 1]),
  ]
  for n in fed:
    n = n[:slots]
    width = max(int(n.max()), 1)
    tokens = rng.integers(0, CFG.vocab_size, size=(slots, width)).astype(np.int32)
    yield tokens, np.arange(width)[None] < n[:, None]


def _run(cfg, params, pool_pages=None, slots=3, groups=1):
  """Logits of every valid token over the steps, dense (pool_pages None) or paged."""
  if pool_pages is None:
    cache = decoding.init_cache(cfg, slots, MAX_LEN)
    host = None
  else:
    cache = paged.init_pages(cfg, pool_pages, PAGE)
    host = PagePool(pool_pages, PAGE, slots, MAX_LEN // PAGE, groups=groups)
    # Scatter the slots' pages over the pool: take some pages first.
    for b in range(slots):
      host.ensure(b, 2 * PAGE)
    host.release(0)
  fn = jax.jit(lambda c, t, l, v, table: decoding.extend(cfg, params, c, t, l, v, table))
  lengths = jnp.zeros((slots,), jnp.int32)
  out, host_len = [], np.zeros(slots, int)
  for tokens, valid in _steps(slots):
    table = None
    if host is not None:
      host_len = host_len + valid.sum(1)
      for b in range(slots):
        assert host.ensure(b, host_len[b])
      table = jnp.asarray(host.device_table())
    logits, cache, lengths = fn(cache, tokens, lengths, valid, table)
    out.append(np.where(valid[..., None], np.asarray(logits), 0.0))
  return out, np.asarray(lengths)


@pytest.mark.parametrize("variant", ["unscanned", "scanned", "chunked_prefill"])
def test_paged_decoding_equals_dense_decoding(variant):
  cfg = {
    "unscanned": CFG,
    "scanned": dataclasses.replace(
      CFG, scan_layers=True, num_layers=3, dense_layers=(0,), dense_d_ff=32
    ),
    "chunked_prefill": dataclasses.replace(
      CFG, prefill_chunk=4, attention_impl="chunked", attention_block=8
    ),
  }[variant]
  params = policy.init_params(cfg, jax.random.key(0))
  dense, dense_len = _run(cfg, params)
  paged_out, paged_len = _run(cfg, params, pool_pages=20)
  np.testing.assert_array_equal(dense_len, paged_len)
  assert sum(int((d != 0).any(-1).sum()) for d in dense) == 5 + 9 + 6 + 3 + 1 + 3 + 2
  for d, p in zip(dense, paged_out):
    np.testing.assert_allclose(p, d, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scanned", [False, True])
def test_paged_decoding_under_a_mesh_equals_dense_on_one_device(scanned):
  # Four slots and the pool's pages over "data" (2 groups, local page ids),
  # kv heads and query heads over "tensor": the write and the attention run
  # under shard_map (scanned: on the layer's slice of the stacked pool).
  cfg = (
    dataclasses.replace(CFG, scan_layers=True, num_layers=3, dense_layers=(0,), dense_d_ff=32)
    if scanned
    else CFG
  )
  params = policy.init_params(cfg, jax.random.key(0))
  ref, _ = _run(cfg, params, slots=4)  # dense, one device
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
  rules = tuple((a, None if a == "vocab" else r) for a, r in layout.rollout_rules(mesh))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    out, _ = _run(cfg, params, pool_pages=20, slots=4, groups=2)
  for r, o in zip(ref, out):
    np.testing.assert_allclose(o, r, atol=1e-5, rtol=0)
