"""Meshes and sharding rules: logical axis names -> mesh axes, as config data.

Every parameter and key activation of the model is annotated with logical
axis names ("embed", "heads", "expert", ...). A rule set maps each name to a
mesh axis, a tuple of mesh axes, or None (replicated):

    RULES = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("heads", "tensor"),
             ("expert", "expert"), ("vocab", "tensor"), ...)

The order of work follows big_vision: `jax.eval_shape` the initialiser, derive
shardings from the rules, then jit the initialiser with those out_shardings.

Activation constraints (`nn.with_logical_constraint` in the model) resolve
only where a mesh is set with `jax.set_mesh(mesh)` and rules with
`nn.logical_axis_rules(rules)` while the function is traced: flax reads the
abstract mesh, which the deprecated `with mesh:` no longer sets, so under it
every constraint is silently dropped.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sao_jax.algo.optim import param_path

Rules = Sequence[tuple[str, Any]]

# Logical axes the model uses (sao_jax/models/transformer.py). "layers" is
# the stacked axis of scanned layers' parameters (ModelConfig.scan_layers);
# rules map it to None: every device holds every layer's slice.
LOGICAL_AXES = (
  "batch",
  "length",
  "embed",
  "vocab",
  "heads",
  "kv_heads",
  "head_dim",
  "mlp",
  "expert",
  "layers",
)


def axes_size(mesh, axes) -> int:
  """Devices along `axes` of `mesh` (None, an axis name or a tuple of them)."""
  if axes is None:
    return 1
  axes = axes if isinstance(axes, (tuple, list)) else (axes,)
  return int(np.prod([mesh.shape[a] for a in axes]))


def make_mesh(axis_sizes: dict[str, int], devices=None) -> Mesh:
  """A Mesh with the named axes; one size may be -1 (all remaining devices)."""
  devices = list(devices if devices is not None else jax.devices())
  names = list(axis_sizes)
  sizes = [int(s) for s in axis_sizes.values()]
  if sizes.count(-1) > 1:
    raise ValueError(f"At most one mesh axis may be -1, got {axis_sizes}")
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f"{len(devices)} devices do not divide by {known} ({axis_sizes})")
    sizes[sizes.index(-1)] = len(devices) // known
  if int(np.prod(sizes)) != len(devices):
    raise ValueError(
      f"Mesh {dict(zip(names, sizes))} needs {int(np.prod(sizes))} devices, have {len(devices)}."
    )
  return Mesh(np.asarray(devices).reshape(sizes), names)


def check_rules(rules: Rules, mesh: Mesh) -> None:
  """Every logical axis has a rule, and every rule names real mesh axes."""
  names = {name for name, _ in rules}
  missing = [a for a in LOGICAL_AXES if a not in names]
  if missing:
    raise ValueError(
      f"Sharding rules lack logical axes {missing}; map them to a mesh axis or None."
    )
  for name, target in rules:
    targets = target if isinstance(target, (tuple, list)) else (target,)
    for t in targets:
      if t is not None and t not in mesh.axis_names:
        raise ValueError(f"Rule {name!r} -> {target!r}: mesh has axes {mesh.axis_names}")


def logical_shardings(boxed_tree, mesh: Mesh, rules: Rules):
  """NamedShardings for a (possibly abstract) pytree of flax-boxed leaves."""
  check_rules(rules, mesh)
  specs = nn.get_partition_spec(boxed_tree)

  def to_sharding(spec):
    if not isinstance(spec, PartitionSpec):
      spec = PartitionSpec()
    return NamedSharding(mesh, nn.logical_to_mesh_axes(spec, rules))

  return jax.tree.map(to_sharding, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def sharded_init(init_fn: Callable[[], Any], mesh: Mesh, rules: Rules):
  """Initialises boxed params straight into their shardings.

  Returns:
    (unboxed params placed on the mesh, their shardings).
  """
  abstract = jax.eval_shape(init_fn)
  shardings = logical_shardings(abstract, mesh, rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    params = jax.jit(lambda: nn.unbox(init_fn()), out_shardings=shardings)()
  return params, shardings


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int = 2) -> NamedSharding:
  """Sharding of a `[B, ...]` host batch: batch axis by the "batch" rule."""
  spec = nn.logical_to_mesh_axes(("batch",) + (None,) * (ndim - 1), rules)
  return NamedSharding(mesh, spec)


def shard_bytes(tree, shardings=None) -> int:
  """Bytes one device holds of `tree`: each leaf's shard at its dtype, shapes only.

  `shardings` is a tree of the same structure (a leaf each); by default each
  leaf's own `.sharding` (sharded `ShapeDtypeStruct`s or arrays). A shard is
  `sharding.shard_shape(shape)`, the largest any device holds.
  """
  leaves = jax.tree.leaves(tree)
  shds = [x.sharding for x in leaves] if shardings is None else jax.tree.leaves(shardings)
  return sum(
    math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
    for x, s in zip(leaves, shds, strict=True)
  )


def shardings_like_params(tree, params, param_shardings, mesh: Mesh):
  """Shardings for a pytree that mirrors params in places (e.g. Adam moments).

  A leaf whose path ends with a parameter's path and has its shape gets that
  parameter's sharding; every other leaf (counters, scalars) is replicated.
  """
  by_path = {}
  for (path, leaf), sh in zip(
    jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(param_shardings)
  ):
    by_path[param_path(path)] = (leaf.shape, sh)
  replicated = NamedSharding(mesh, PartitionSpec())

  def pick(path, leaf):
    p = param_path(path)
    for name, (shape, sh) in by_path.items():
      if (p == name or p.endswith("/" + name)) and tuple(leaf.shape) == tuple(shape):
        return sh
    return replicated

  return jax.tree_util.tree_map_with_path(pick, tree)
