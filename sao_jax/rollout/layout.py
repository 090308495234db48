"""Where the rollout engine's arrays live, and how many bytes that is per device.

The engine has one layout: a Mesh and logical sharding rules. A single-device
engine is the same layout over a mesh of one device (`one_device_mesh`),
where every sharding below is trivially whole. With more devices:

  * params are laid out by the rules: the logical axes of every parameter
    come from `nn.get_partition_spec` of the boxed initialiser, shapes only
    (`jax.eval_shape`), as in `sharding.sharded_init`;
  * every KV-cache leaf, `[..., B, S, KVH, head_dim]` (per-layer leaves or
    stacked with a leading layer axis: the spec is derived from each leaf's
    ndim), is sharded with slots B over the mesh axes of the "batch" rule and
    kv heads over those of the "kv_heads" rule (`rollout_rules` maps it to
    "tensor"); S and head_dim stay whole, so appending a token and reading
    a prefix are local to each device;
  * per-slot vectors (lengths, pending tokens, samples) and a step's
    `[B, L]` tokens / valid mask are sharded over slots like the cache, so
    positions and cache writes never leave the device that holds the slot;
    the sampling key is replicated (threefry is partitionable, so the
    sampled bits do not depend on the layout).

`slots` must divide by the size of the batch axes and `num_kv_heads` by the
kv-head axes. `cache_bytes_per_device` / `param_bytes_per_device` size any
mesh, an `AbstractMesh` or an abstract TPU topology's included (shapes only,
nothing allocated); engine.py's module docstring has the figures for
Qwen3-30B-A3B.

A paged engine's cache is a pool of pages (sao_jax/models/paged.py), leaves
`[..., KVH, P, page, hd]`: pages over the batch axes (each device's slots
page into their own part, `paging.PagePool` groups), kv heads over the
"kv_heads" rule's; `pool_bytes_per_device` sizes it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from sao_jax.models import decoding, kv_layout, paged, policy
from sao_jax.models import sharding as shd
from sao_jax.models.config import ModelConfig


def one_device_mesh(device=None) -> Mesh:
  """The single-device engine's mesh: `device` (default: the first local one) on "data"."""
  return Mesh(np.asarray([device or jax.local_devices()[0]]), ("data",))


def rollout_rules(mesh) -> tuple[tuple[str, Any], ...]:
  """Decode-friendly sharding rules for an engine on `mesh`.

  Slots (and with them the KV cache, the dominant memory) go over every mesh
  axis except "tensor"; heads, kv heads, MLP and vocabulary over "tensor";
  experts over "expert". No parameter is sharded over the data / fsdp axes:
  a decode step reads every weight for a handful of tokens per slot, so
  gathering fsdp-sharded weights each step would cost more than the step.
  Every sharded dimension must divide by its axes' size (a 61-token toy
  vocabulary over tensor=2 does not: map "vocab" to None there).
  """
  names = tuple(mesh.axis_names)
  tensor = "tensor" if "tensor" in names else None
  placed = {
    "batch": tuple(a for a in names if a != "tensor") or None,
    "vocab": tensor,
    "heads": tensor,
    "kv_heads": tensor,
    "mlp": tensor,
    "expert": "expert" if "expert" in names else None,
  }
  # Every other logical axis (length, embed, head_dim, a scanned "layers"
  # axis, ...) stays whole.
  return tuple((a, placed.get(a)) for a in dict.fromkeys(shd.LOGICAL_AXES + tuple(placed)))


def _mesh_axes(rules, logical: str):
  """The mesh axes (None, a name or a tuple) that `rules` map `logical` to."""
  return nn.logical_to_mesh_axes((logical,), rules)[0]


def cache_spec(ndim: int, batch_axes, kv_axes) -> PartitionSpec:
  """PartitionSpec of a cache leaf `[..., B, S, KVH, hd]` of `ndim` dims.

  Leading dims (a stacked layer axis) stay whole: every device holds its
  slots' cache for every layer.
  """
  if ndim < 4:
    raise ValueError(f"a KV-cache leaf has dims [..., B, S, KVH, head_dim], got ndim {ndim}")
  return PartitionSpec(*([None] * (ndim - 4)), batch_axes, None, kv_axes, None)


def abstract_cache(cfg: ModelConfig, batch: int, cache_len: int, dtype=None):
  """ShapeDtypeStructs of a `batch` x `cache_len` KV cache (nothing allocated)."""
  args = () if dtype is None else (dtype,)
  return jax.eval_shape(lambda: decoding.init_cache(cfg, batch, cache_len, *args))


def _kv_axes(cfg: ModelConfig, mesh, rules, count: int, what: str):
  """The mesh axes of the "batch" and "kv_heads" rules, checked to divide
  `count` (slots or pages, `what`) and the kv heads."""
  shd.check_rules(rules, mesh)
  batch_axes = _mesh_axes(rules, "batch")
  kv_axes = _mesh_axes(rules, "kv_heads")
  if count % shd.axes_size(mesh, batch_axes):
    raise ValueError(
      f"{count} {what} do not divide over the batch axes {batch_axes} "
      f"(size {shd.axes_size(mesh, batch_axes)}) of mesh {dict(mesh.shape)}"
    )
  if cfg.num_kv_heads % shd.axes_size(mesh, kv_axes):
    raise ValueError(
      f"num_kv_heads {cfg.num_kv_heads} does not divide over the kv_heads "
      f"axes {kv_axes} (size {shd.axes_size(mesh, kv_axes)})"
    )
  return batch_axes, kv_axes


def recurrent_spec(path, ndim: int, batch_axes, head_axes) -> PartitionSpec:
  """PartitionSpec of a linear layer's state leaf (kv_layout.RECURRENT_LEAVES):
  slots by the batch axes; heads by `head_axes` (conv inputs
  `[..., B, K-1, heads, dim]`, the delta-rule state `[..., B, H, Dk, Dv]`)."""
  lead = [None] * (ndim - 4)
  if path[-1].key == "state":
    return PartitionSpec(*lead, batch_axes, head_axes, None, None)
  return PartitionSpec(*lead, batch_axes, None, head_axes, None)


def _linear_head_axes(cfg: ModelConfig, mesh, kv_axes):
  """The axes a linear layer's state heads split over: the kv heads' where
  its key heads divide by their size, else none (the state is replicated
  over them)."""
  if cfg.linear_num_key_heads and cfg.linear_num_key_heads % shd.axes_size(mesh, kv_axes):
    return None
  return kv_axes


def _state_shardings(cfg: ModelConfig, abstract, mesh, batch_axes, kv_axes, kv_spec):
  """NamedShardings of a cache tree: key / value leaves by `kv_spec(ndim)`,
  recurrent ones by `recurrent_spec`."""
  head_axes = _linear_head_axes(cfg, mesh, kv_axes)

  def spec(path, a):
    if kv_layout.is_recurrent(path):
      return NamedSharding(mesh, recurrent_spec(path, a.ndim, batch_axes, head_axes))
    return NamedSharding(mesh, kv_spec(a.ndim))

  return jax.tree_util.tree_map_with_path(spec, abstract)


def cache_shardings(cfg: ModelConfig, batch: int, cache_len: int, mesh, rules, *, abstract=None):
  """NamedShardings of a `batch`-slot cache: slots by the "batch" rule, kv heads
  by the "kv_heads" rule."""
  batch_axes, kv_axes = _kv_axes(cfg, mesh, rules, batch, "slots")
  if abstract is None:
    abstract = abstract_cache(cfg, batch, cache_len)
  return _state_shardings(
    cfg, abstract, mesh, batch_axes, kv_axes, lambda ndim: cache_spec(ndim, batch_axes, kv_axes)
  )


def _sized_mesh(mesh):
  """`mesh`, or a one-device abstract mesh for None (the whole array on one device)."""
  return AbstractMesh((1,), ("data",)) if mesh is None else mesh


def cache_bytes_per_device(
  cfg: ModelConfig, slots: int, cache_len: int, mesh=None, rules=None, dtype=None
) -> int:
  """KV-cache bytes on each device for `slots` x `cache_len` positions.

  Shapes only (nothing is allocated); `mesh` may be an abstract TPU
  topology's mesh. `mesh=None`: one device, the whole cache. `rules`
  default to `rollout_rules(mesh)`.
  """
  mesh = _sized_mesh(mesh)
  rules = rollout_rules(mesh) if rules is None else rules
  abstract = abstract_cache(cfg, slots, cache_len, dtype)
  return shd.shard_bytes(
    abstract, cache_shardings(cfg, slots, cache_len, mesh, rules, abstract=abstract)
  )


def abstract_params(cfg: ModelConfig):
  """Boxed (logical-axis annotated) abstract policy params: shapes only."""
  return jax.eval_shape(lambda: policy.init_params(cfg, jax.random.key(0), boxed=True))


def param_bytes_per_device(cfg: ModelConfig, mesh=None, rules=None) -> int:
  """Policy parameter bytes on each device under `rules` (default `rollout_rules`)."""
  mesh = _sized_mesh(mesh)
  rules = rollout_rules(mesh) if rules is None else rules
  boxed = abstract_params(cfg)
  return shd.shard_bytes(nn.unbox(boxed), shd.logical_shardings(boxed, mesh, rules))


def batch_groups(mesh, rules) -> int:
  """How many ways slots split over the mesh (the "batch" rule's axes): a
  paged engine's pool splits alike (`paging.PagePool` groups)."""
  return shd.axes_size(mesh, _mesh_axes(rules, "batch"))


def default_pages(slots: int, max_len: int, page_size: int) -> int:
  """The pool of the dense cache's size: every slot's max_len positions in pages."""
  return slots * -(-max_len // page_size)


def abstract_pool(cfg: ModelConfig, num_pages: int, page_size: int, slots: int = 0, dtype=None):
  """ShapeDtypeStructs of a paged cache's pool (models/paged.py; nothing
  allocated), with the recurrent state of `slots` slots."""
  return jax.eval_shape(lambda: paged.init_pages(cfg, num_pages, page_size, slots, dtype))


def pool_shardings(
  cfg: ModelConfig, num_pages: int, page_size: int, mesh, rules, *, slots: int = 0, abstract=None
):
  """NamedShardings of a page pool: pages over the "batch" rule's axes (each
  device holds its slots' pages), kv heads by the "kv_heads" rule; a linear
  layer's per-slot state as a dense cache's (`recurrent_spec`)."""
  batch_axes, kv_axes = _kv_axes(cfg, mesh, rules, num_pages, "pages")
  if abstract is None:
    abstract = abstract_pool(cfg, num_pages, page_size, slots)
  return _state_shardings(
    cfg,
    abstract,
    mesh,
    batch_axes,
    kv_axes,
    lambda ndim: paged.pool_spec(ndim, batch_axes, kv_axes),
  )


def pool_bytes_per_device(
  cfg: ModelConfig,
  num_pages: int,
  page_size: int,
  mesh=None,
  rules=None,
  dtype=None,
  slots: int = 0,
) -> int:
  """A paged cache's pool bytes on each device (as `cache_bytes_per_device`),
  with `slots` slots' recurrent state."""
  mesh = _sized_mesh(mesh)
  rules = rollout_rules(mesh) if rules is None else rules
  abstract = abstract_pool(cfg, num_pages, page_size, slots, dtype)
  return shd.shard_bytes(
    abstract, pool_shardings(cfg, num_pages, page_size, mesh, rules, abstract=abstract)
  )


class EngineShardings(NamedTuple):
  """Where each piece of an engine's state lives."""

  params: Any  # pytree of NamedSharding, like the params
  cache: Any  # like init_cache(cfg, slots, max_len), or a paged engine's pool
  slots: NamedSharding  # [slots] vectors: lengths, pending tokens, samples
  tokens: NamedSharding  # [slots, L] step inputs
  replicated: NamedSharding  # the sampling key stream


def engine_shardings(
  cfg: ModelConfig, slots: int, max_len: int, mesh, rules, *, pages: tuple[int, int] | None = None
) -> EngineShardings:
  """The shardings a `PolicyEngine(cfg, ..., mesh=mesh, rules=rules)` uses;
  `pages` (num_pages, page_size): a paged engine's, the cache a page pool."""
  batch_axes = _mesh_axes(rules, "batch")
  if pages is None:
    cache = cache_shardings(cfg, slots, max_len, mesh, rules)
  else:
    cache = pool_shardings(cfg, *pages, mesh, rules, slots=slots)
    if slots % shd.axes_size(mesh, batch_axes):
      raise ValueError(
        f"{slots} slots do not divide over the batch axes {batch_axes} "
        f"(size {shd.axes_size(mesh, batch_axes)}) of mesh {dict(mesh.shape)}"
      )
  return EngineShardings(
    params=shd.logical_shardings(abstract_params(cfg), mesh, rules),
    cache=cache,
    slots=NamedSharding(mesh, PartitionSpec(batch_axes)),
    tokens=NamedSharding(mesh, PartitionSpec(batch_axes, None)),
    replicated=NamedSharding(mesh, PartitionSpec()),
  )
