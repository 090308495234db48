"""The paged KV cache's device side: the pool, writes into pages, attention over them.

The host side (the allocator, the page table) is sao_jax/rollout/paging.py.

Layout
------
A pool leaf is `[KVH, P, page, hd]`: kv heads, then P pages of `page`
positions each, then the head dim (stacked over scanned layers:
`[n, KVH, P, page, hd]`; the tree mirrors `init_cache`'s). This is the
layout of JAX's Pallas TPU kernel
(`jax.experimental.pallas.ops.tpu.paged_attention`: k_pages
`[kv_heads, total_pages, page_size, head_dim]`), so on TPU a decode step
hands the pool to the kernel as it is stored, with no copy of the cache per
step; kv heads lead, so they shard over "tensor" as the dense cache's do,
and the page axis shards over the batch axes (each device's slots page
into their own part of the pool; `PagePool` groups). A slot's page table
row `[M]` names the page of each of its `page`-position blocks.

Writes and attention
--------------------
`write` scatters the new tokens' keys / values `[B, L, KVH, hd]` to
`(page_table[b, p // page], p % page)` for each valid token at position p;
padding tokens (and positions past the table) are never written. `gather`
assembles each slot's pages into the dense view `[B, M * page, KVH, hd]`
(`view` / `write_view` for a whole decode loop), on which the dense path's
attention runs unchanged, so a paged step computes what the dense step
computes. Compiling for TPU (`attention.compile_platform`), a decode step
calls the Pallas kernel on the pool in place instead (`kernel_usable`).
With a mesh of more than one device, writes and attention run under
`shard_map`, the table holding page ids local to each device's part of the
pool. Why each choice: docs/design/kv_cache.md.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from sao_jax.models import attention as attn_lib
from sao_jax.models import kv_layout
from sao_jax.models.config import ModelConfig

Array = jax.Array


def init_pages(cfg: ModelConfig, num_pages: int, page_size: int, slots: int = 0, dtype=None):
  """An empty pool of `num_pages` pages of `page_size` positions, per layer.

  The tree is `init_cache`'s (a list per layer, or "layer_i" plus stacked
  "layers" with `cfg.scan_layers`); every key / value leaf is
  `[..., KVH, P, page, hd]`. A linear (Gated DeltaNet) layer holds its
  recurrent state for `slots` slots instead (kv_layout.py), outside the pages.
  """
  return kv_layout.kv_tree(
    cfg, (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim), slots, dtype
  )


def pool_spec(ndim: int, batch_axes, kv_axes) -> PartitionSpec:
  """PartitionSpec of a pool leaf `[..., KVH, P, page, hd]`: kv heads over
  `kv_axes`, pages over `batch_axes`, leading (layer) dims whole."""
  if ndim < 4:
    raise ValueError(f"a page-pool leaf has dims [..., KVH, P, page, hd], got ndim {ndim}")
  return PartitionSpec(*([None] * (ndim - 4)), kv_axes, batch_axes, None, None)


def _by_rows() -> bool:
  """Writes and gathers index rows of the pool with its kv heads and pages
  flattened (`write` / `gather`): compiling for TPU, where a scatter or
  gather whose window spans the kv-head dim (major in the pool) made the
  compiler lay a loop-carried pool out kv heads minor, and copy the whole
  pool in and out of the driver's decode loop and the chunked prefill
  (benchmarks/RESULTS.md#pods-compile-and-fit). Elsewhere one index a
  token, its kv heads in the window: XLA:CPU runs a scatter as a loop over
  its indices."""
  return attn_lib.compile_platform() == "tpu"


def write(
  leaf: Array,
  new: Array,
  page_table: Array,
  positions: Array,
  valid: Array,
  layer=None,
  by_rows: bool | None = None,
) -> Array:
  """`leaf` with the valid new entries written into their pages.

  Args:
    leaf: `[KVH, P, page, hd]`, or `[n, KVH, P, page, hd]` with `layer`.
    new: `[B, L, KVH, hd]`, the new tokens' keys or values.
    page_table: int `[B, M]`, page ids into `leaf`'s P axis.
    positions: int `[B, L]`, each new token's position in its slot.
    valid: bool `[B, L]`; invalid tokens are not written.
    layer: index into a stacked leaf's first axis, or None.
    by_rows: index the leaf as rows `[KVH * P * page, hd]`, one index a kv
      head and token (default `_by_rows()`: when compiling for TPU); the
      result is the same.
  """
  kvh, p, page, hd = leaf.shape[-4:]
  m = page_table.shape[1]
  block = positions // page
  ok = valid & (positions >= 0) & (block < m)
  ids = jnp.take_along_axis(page_table, jnp.clip(block, 0, m - 1), axis=1)
  if by_rows is None:
    by_rows = _by_rows()
  if by_rows:
    # Row of (kv head h, token) in the leaf as [KVH * P * page, hd]: only the
    # head dim in the window, the minor one in the pool's own layout.
    rows = (jnp.arange(kvh, dtype=ids.dtype)[:, None, None] * p + ids[None]) * page + (
      positions % page
    )[None]  # [KVH, B, L]
    rows = jnp.where(ok[None], rows, kvh * p * page).reshape(-1)  # out of range: dropped
    upd = jnp.moveaxis(new, 2, 0).reshape(-1, hd).astype(leaf.dtype)  # [KVH * B * L, hd]
    if layer is None:
      return leaf.reshape(-1, hd).at[rows].set(upd, mode="drop").reshape(leaf.shape)
    flat = leaf.reshape(leaf.shape[0], -1, hd)
    return flat.at[layer, rows].set(upd, mode="drop").reshape(leaf.shape)
  ids = jnp.where(ok, ids, p)  # out of range: dropped
  # One scatter index a token, its kv heads in the update window (XLA:CPU
  # runs a scatter as a loop over its indices).
  if layer is None:  # [KVH, B, L, hd] at [:, ids, offsets]
    return leaf.at[:, ids, positions % page].set(
      jnp.moveaxis(new, 2, 0).astype(leaf.dtype), mode="drop"
    )
  # A scalar layer index and the token indices are split by the kv-head
  # slice: the indexed dims lead, so the update is [B, L, KVH, hd].
  return leaf.at[layer, :, ids, positions % page].set(new.astype(leaf.dtype), mode="drop")


def gather(leaf: Array, page_table: Array, layer=None, by_rows: bool | None = None) -> Array:
  """Each slot's pages as a dense cache view `[B, M * page, KVH, hd]`
  (`by_rows`: from the leaf as `[KVH * P, page, hd]`, as `write`)."""
  if layer is not None:
    leaf = jax.lax.dynamic_index_in_dim(leaf, layer, 0, keepdims=False)
  kvh, p, page, hd = leaf.shape
  if _by_rows() if by_rows is None else by_rows:
    ids = (
      jnp.arange(kvh, dtype=page_table.dtype)[:, None, None] * p
      + jnp.clip(page_table, 0, p - 1)[None]
    )  # [KVH, B, M]
    # [KVH, B, M, page, hd]
    pages = jnp.take(leaf.reshape(kvh * p, page, hd), ids, axis=0, mode="clip")
  else:
    pages = jnp.take(leaf, page_table, axis=1, mode="clip")  # [KVH, B, M, page, hd]
  _, b, m, _, _ = pages.shape
  return jnp.transpose(pages, (1, 2, 3, 0, 4)).reshape(b, m * page, kvh, hd)


def view(leaf: Array, page_table: Array) -> Array:
  """Every slot's pages of a leaf with any leading (layer) dims as the dense
  cache leaf `[..., B, M * page, KVH, hd]` (`init_cache`'s layout)."""
  pages = jnp.take(leaf, page_table, axis=leaf.ndim - 3, mode="clip")  # [..., KVH, B, M, page, hd]
  pages = jnp.moveaxis(pages, -5, -2)  # [..., B, M, page, KVH, hd]
  return pages.reshape(pages.shape[:-5] + (pages.shape[-5], -1) + pages.shape[-2:])


def write_view(leaf: Array, dense: Array, page_table: Array, lengths: Array, fed: Array) -> Array:
  """`leaf` with the entries a dense view (`view`) gained written back into their pages.

  dense `[..., B, S, KVH, hd]`; slot b gained `fed[b, :]` (a prefix, `[B, F]`)
  entries from position `lengths[b]` on.
  """
  positions = lengths[:, None] + jnp.arange(fed.shape[1], dtype=lengths.dtype)[None]  # [B, F]
  ax = dense.ndim - 3
  src = jnp.minimum(positions, dense.shape[ax] - 1).reshape(
    (1,) * (ax - 1) + positions.shape + (1, 1)
  )
  new = jnp.take_along_axis(dense, src, axis=ax)  # [..., B, F, KVH, hd]
  one = functools.partial(write, page_table=page_table, positions=positions, valid=fed)
  for _ in range(leaf.ndim - 4):  # leading (layer) dims, written alike
    one = jax.vmap(one)
  return one(leaf, new)


def kernel_usable(cfg: ModelConfig, new_tokens: int, page_size: int) -> bool:
  """The Pallas TPU paged-attention kernel runs this step: compiling for TPU,
  one new token a slot, TPU-tileable head dim and page size."""
  return (
    attn_lib.compile_platform() == "tpu"
    and new_tokens == 1
    and cfg.head_dim % 128 == 0
    and page_size % 8 == 0
  )


def decode_kernel(
  q: Array, k_leaf: Array, v_leaf: Array, page_table: Array, positions: Array
) -> Array:
  """One query a slot over its pages with the Pallas TPU kernel.

  q `[B, 1, H, hd]`, leaves `[KVH, P, page, hd]`, positions `[B, 1]` (the
  query at p sees positions 0 .. p) -> `[B, 1, H, hd]`. The kernel does not
  scale q; every row gets at least one position (a slot that is not fed
  reads its own first page, and its output is discarded).
  """
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as kernel

  hd = q.shape[-1]
  m, page = page_table.shape[1], k_leaf.shape[2]
  lengths = jnp.clip(positions[:, 0] + 1, 1, m * page).astype(jnp.int32)
  block = math.gcd(m, 8)  # pages per compute block: must divide the table's width
  qs = (q[:, 0] / jnp.sqrt(jnp.asarray(hd, q.dtype))).astype(q.dtype)
  out = kernel(
    qs, k_leaf, v_leaf, lengths, page_table.astype(jnp.int32), pages_per_compute_block=block
  )
  return out[:, None].astype(q.dtype)


def _local_attend(
  q, k, v, pool, page_table, positions, valid, layer, *, impl: str, block: int, use_kernel: bool
):
  """`attend` on one device's slots and its part of the pool."""
  pool = {
    "k": write(pool["k"], k, page_table, positions, valid, layer),
    "v": write(pool["v"], v, page_table, positions, valid, layer),
  }
  if use_kernel:
    leaves = [
      pool[n] if layer is None else jax.lax.dynamic_index_in_dim(pool[n], layer, 0, keepdims=False)
      for n in ("k", "v")
    ]
    return decode_kernel(q, *leaves, page_table, positions), pool
  k_all = gather(pool["k"], page_table, layer).astype(q.dtype)
  v_all = gather(pool["v"], page_table, layer).astype(q.dtype)
  return attn_lib.cache_attention(q, k_all, v_all, positions, impl, block), pool


def _mesh_axes(name: str):
  rules = nn.get_logical_axis_rules()
  return nn.logical_to_mesh_axes((name,), rules)[0] if rules else None


def attend(
  cfg: ModelConfig,
  q: Array,
  k: Array,
  v: Array,
  pool,
  page_table: Array,
  positions: Array,
  valid: Array,
  layer=None,
):
  """Writes the new keys / values into their pages and attends over each slot's pages.

  Args:
    q: `[B, L, H, hd]` (rotary applied); k, v: `[B, L, KVH, hd]`.
    pool: this layer's {"k", "v"} leaves `[KVH, P, page, hd]`, or with
      `layer` the stacked `[n, KVH, P, page, hd]` leaves of all scanned
      layers (only this layer's entries are written).
    page_table: int `[B, M]`; positions `[B, L]`; valid bool `[B, L]`.

  Returns:
    (attention output `[B, L, H, hd]`, the new pool).
  """
  use_kernel = kernel_usable(cfg, q.shape[1], pool["k"].shape[-2])
  fn = functools.partial(
    _local_attend, impl=cfg.attention_impl, block=cfg.attention_block, use_kernel=use_kernel
  )
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return fn(q, k, v, pool, page_table, positions, valid, layer)
  batch, heads, kv_heads = _mesh_axes("batch"), _mesh_axes("heads"), _mesh_axes("kv_heads")
  q_spec = PartitionSpec(batch, None, heads, None)
  kv_spec = PartitionSpec(batch, None, kv_heads, None)
  row = PartitionSpec(batch, None)
  # Only this layer's pages enter the manual region: a stacked pool passed
  # whole is copied at the boundary (the TPU compiler's temporaries: the
  # whole pool, against one layer's slice this way), and written back into
  # the stacked pool in place.
  stacked = pool if layer is not None else None
  if layer is not None:
    pool = {n: jax.lax.dynamic_index_in_dim(pool[n], layer, 0, keepdims=False) for n in ("k", "v")}
  specs = {n: pool_spec(4, batch, kv_heads) for n in ("k", "v")}
  local = lambda q, k, v, pool, t, p, ok: fn(q, k, v, pool, t, p, ok, None)
  out, pool = jax.shard_map(
    local,
    in_specs=(q_spec, kv_spec, kv_spec, specs, row, row, row),
    out_specs=(q_spec, specs),
    check_vma=False,
  )(q, k, v, pool, page_table, positions, valid)
  if layer is not None:
    pool = {
      n: jax.lax.dynamic_update_index_in_dim(stacked[n], pool[n], layer, 0) for n in ("k", "v")
    }
  return out, pool
