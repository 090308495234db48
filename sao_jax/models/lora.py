"""LoRA: low-rank adapters over a frozen base, as pure functions of param trees.

A targeted matrix W (any of our layouts, viewed as [*batch, in, out]) is
served as

    W' = W + (alpha / r) A @ B,     A [*batch, in, r],  B [*batch, r, out]

with A drawn like peft's default (uniform in +-1/sqrt(in)) and B = 0, so a
fresh adapter leaves the model bit for bit the base. The trained tree (the
"adapters") mirrors the param tree's nesting but holds only

    {"lora_a": A, "lora_b": B}   at each targeted matrix, and
    the leaf itself              at each leaf trained whole (the critic's
                                 value head: new, it has no base to adapt)

Targets are regexes over parameter paths as `optim.param_path` spells them
("layer_0/attn/q", "layers/moe/wi_up"): the same rules style as the
freezing rules (`optim.freeze_rules`, `rl.actor_frozen`), and like those,
every rule must match a parameter. A path matching a `frozen` rule (the
actor's `rl.actor_frozen`) gets no adapter: frozen wins.

**How a weight is viewed as a matrix** (`LAYOUTS`, first match wins): its
leading axes are batch axes, one adapter each (the stacked layer axis of
scanned layers "layers/...", the experts axis of MoE matrices [E, in,
out]); the next `inputs` axes are what the projection contracts (1 for
[d, heads, head_dim] q/k/v and [in, out] matrices, 2 for attn/o's
[heads, head_dim, d]); the rest are its output. A DenseGeneral kernel
with heads as an axis is thus flattened in row-major order to
[d, heads * head_dim], which is also how hf_layout writes it to HF's
q_proj ([out, in] transposed), so the PEFT export is a transpose.

**Where the merge runs.** `merge` is the one definition of an adapted
weight, and it applies to any subtree or slice of the params with the
adapters' matching subtree or slice: `delta` reads the matrix view off A
and B's shapes, not off the path. Engines, evaluation and exports get the
whole-tree `merge` (a new tree the base's size, once per version). The
train steps never build that tree: the model merges each layer inside its
rematerialised block (`transformer.lora_variables`; for the scanned stack,
`merge` on one scan step's slice), so one layer's merged matrices and
their gradient dL/dW' are live at a time, and the backward recomputes
them instead of saving them. The leaves outside the layers (embedding,
final norm, heads) are merged whole. Both forwards use the same `merge`,
so they agree up to float32 summation order (tests/models/test_lora.py).

**Precision** (sao_jax/models/precision.py). Adapters are float32 and
trained; the base is never updated, so rule 1's worry (an update rounded
away by `w + u` in bf16) does not arise for it, and a bfloat16 base is
allowed. `merge` adds in float32 and casts to the base's dtype: with a
bf16 base the sum is rounded once to bf16, which is what a bf16-compute
forward does to a float32 weight anyway (rule 2: every weight is cast to
`cfg.dtype` where it is used), except that W itself was rounded first:
the served weight may differ from the fp32-base one by one bf16 ulp.
Small adapter deltas below half a bf16 ulp of W are invisible in a bf16
forward either way; they are not lost from training, since A and B are
float32 and their gradients do not depend on that rounding.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.algo import optim

A, B = "lora_a", "lora_b"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """One model's adapters (the actor's or the critic's).

  rank: r, the adapters' inner dimension.
  alpha: the scale's numerator: W' = W + (alpha / r) A @ B (peft's lora_alpha).
  targets: regexes; matrices whose path matches one get an adapter.
  whole: regexes; leaves trained whole (in float32) instead of adapted.
  frozen: regexes; paths never adapted nor trained (wins over both).
  """

  rank: int
  alpha: float
  targets: tuple[str, ...]
  whole: tuple[str, ...] = ()
  frozen: tuple[str, ...] = ()

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a weight is a matrix: `batch` leading axes (beyond a stacked
  layer axis) with an adapter each, then `inputs` contracted axes."""

  batch: int
  inputs: int


# First match wins; an extension point for new parameter kinds.
LAYOUTS: tuple[tuple[str, Layout], ...] = (
  (r"/moe/(wi_gate|wi_up|wo)$", Layout(batch=1, inputs=1)),  # [E, in, out]
  (r"/attn/o$", Layout(batch=0, inputs=2)),  # [heads, head_dim, d]
  (r".*", Layout(batch=0, inputs=1)),  # [in, out...]: q/k/v [d, heads, head_dim]
)
# Paths that are not projections (a gather), refused as targets.
NOT_PROJECTIONS = (r"^embed$",)
_STACKED = re.compile(r"^layers/")


def _matrix_axes(path: str, shape: tuple) -> tuple[int, int]:
  """(batch axes, input axes) of the weight at `path`; refuses non-matrices."""
  if any(re.search(rx, path) for rx in NOT_PROJECTIONS):
    raise ValueError(
      f"lora: {path!r} is not a projection (an embedding gather); leave it out of the targets"
    )
  layout = next(lay for rx, lay in LAYOUTS if re.search(rx, path))
  batch = layout.batch + (1 if _STACKED.search(path) else 0)
  if len(shape) < batch + layout.inputs + 1:
    raise ValueError(
      f"lora: {path!r} of shape {tuple(shape)} is not a matrix; a target "
      "must be a projection weight (not a norm scale or bias)"
    )
  return batch, layout.inputs


def matrix_shape(path: str, shape: tuple) -> tuple[tuple, int, int]:
  """(batch shape, in, out) of the weight at `path` viewed as a matrix."""
  batch, inputs = _matrix_axes(path, shape)
  return (
    tuple(shape[:batch]),
    math.prod(shape[batch : batch + inputs]),
    math.prod(shape[batch + inputs :]),
  )


def _names(params) -> list[tuple[str, tuple, object]]:
  """(path, key tuple, leaf) for every leaf."""
  return [
    (optim.param_path(p), tuple(getattr(k, "key", k) for k in p), x)
    for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
  ]


def plan(params, cfg: LoraConfig) -> dict[str, str]:
  """path -> "adapter" | "whole" for every trained leaf of `params`.

  Every target and whole rule must match a parameter (`optim.check_rules_match`);
  a path both adapted and whole is refused; `frozen` paths are left out.
  """
  if cfg.rank < 1:
    raise ValueError(f"lora.rank = {cfg.rank}: must be >= 1")
  optim.check_rules_match(params, [(rx, optim.TRAIN) for rx in cfg.targets], "lora targets")
  optim.check_rules_match(params, [(rx, optim.TRAIN) for rx in cfg.whole], "lora whole")
  hit = lambda rules, name: any(re.search(rx, name) for rx in rules)
  out = {}
  for name, _, x in _names(params):
    if hit(cfg.frozen, name):
      continue
    adapted, whole = hit(cfg.targets, name), hit(cfg.whole, name)
    if adapted and whole:
      raise ValueError(f"lora: {name!r} matches both a target and a whole rule")
    if adapted:
      _matrix_axes(name, x.shape)
      out[name] = "adapter"
    elif whole:
      out[name] = "whole"
  return out


def _insert(tree: dict, keys: tuple, value) -> None:
  for k in keys[:-1]:
    tree = tree.setdefault(k, {})
  tree[keys[-1]] = value


def init_adapters(params, cfg: LoraConfig, rng):
  """The adapter tree of `params` (arrays or ShapeDtypeStructs under eval_shape).

  A uniform in +-1/sqrt(in) (peft's default, kaiming-uniform with a = sqrt(5)),
  B zero, both float32; whole leaves are float32 copies of the base's.
  """
  kinds = plan(params, cfg)
  out: dict = {}
  for i, (name, keys, x) in enumerate(_names(params)):
    kind = kinds.get(name)
    if kind == "whole":
      _insert(out, keys, jnp.asarray(x, jnp.float32))
    elif kind == "adapter":
      batch, n_in, n_out = matrix_shape(name, x.shape)
      bound = 1.0 / math.sqrt(n_in)
      a = jax.random.uniform(
        jax.random.fold_in(rng, i), batch + (n_in, cfg.rank), jnp.float32, -bound, bound
      )
      _insert(out, keys, {A: a, B: jnp.zeros(batch + (cfg.rank, n_out), jnp.float32)})
  return out


def _merged_spec(specs: tuple):
  """The mesh axes of a run of axes flattened row-major into one: the first
  axis's when it alone is sharded (its blocks stay contiguous), else None."""
  if not specs or all(x is None for x in specs[1:]):
    return specs[0] if specs else None
  return None


def adapter_shardings(params, param_shardings, cfg: LoraConfig):
  """The adapter tree's shardings (`init_adapters`' structure): each adapter
  laid out like its weight, so that none is replicated on every chip.

  W viewed as [*batch, in, out] with spec (*b, i, o): A [*batch, in, r] gets
  (*b, i, None) and B [*batch, r, out] (*b, None, o), where an `in` or `out`
  that flattens several axes keeps the first one's mesh axes only when the
  others are unsharded (else it is replicated); whole leaves keep their
  weight's sharding. The merge's A @ B then comes out laid out as W is.
  """
  kinds = plan(params, cfg)
  out: dict = {}
  shardings = jax.tree.leaves(param_shardings)
  for (name, keys, x), sh in zip(_names(params), shardings):
    kind = kinds.get(name)
    if kind == "whole":
      _insert(out, keys, sh)
    elif kind == "adapter":
      batch, inputs = _matrix_axes(name, x.shape)
      spec = tuple(sh.spec) + (None,) * (len(x.shape) - len(sh.spec))
      b, i, o = (
        spec[:batch],
        _merged_spec(spec[batch : batch + inputs]),
        _merged_spec(spec[batch + inputs :]),
      )
      named = lambda *axes, sh=sh: jax.sharding.NamedSharding(
        sh.mesh, jax.sharding.PartitionSpec(*axes)
      )
      _insert(out, keys, {A: named(*b, i, None), B: named(*b, None, o)})
  return out


def _lookup(tree, keys: tuple):
  for k in keys:
    if not isinstance(tree, Mapping) or k not in tree:
      return None
    tree = tree[k]
  return tree


def delta(shape: tuple, adapter: dict, scale: float) -> jax.Array:
  """(alpha / r) A @ B in float32, in the weight's own shape."""
  a, b = adapter[A], adapter[B]
  ab = jnp.einsum("...ir,...ro->...io", a, b, precision=jax.lax.Precision.HIGHEST)
  return (scale * ab).reshape(shape)


def merge(base, adapters, cfg: LoraConfig):
  """The served params: W + (alpha / r) A @ B for each adapted matrix (summed in
  float32, cast to W's dtype), whole leaves from `adapters`, the rest `base`."""

  def one(path, w):
    keys = tuple(getattr(k, "key", k) for k in path)
    got = _lookup(adapters, keys)
    if got is None:
      return w
    if isinstance(got, dict):
      d = delta(w.shape, got, cfg.scale)
      return (w.astype(jnp.float32) + d).astype(w.dtype)
    return got

  return jax.tree_util.tree_map_with_path(one, base)


def carry_over(source, target):
  """`target` with each leaf that `source` holds at the same path and shape
  taken from `source` (the critic's adapters from the SFT policy's)."""

  def one(path, x):
    got = _lookup(source, tuple(getattr(k, "key", k) for k in path))
    return got if got is not None and getattr(got, "shape", None) == x.shape else x

  return jax.tree_util.tree_map_with_path(one, target)


def optimizer_rules(adapters, trained: Sequence[str]) -> tuple[tuple[str, str], ...]:
  """Freezing rules (optim's) over an adapter tree: the adapters of base paths
  matching no regex of `trained` are carried, not trained (the critic's
  copies of the SFT policy's attention adapters)."""
  rules = []
  for name, _, _ in _names(adapters):
    base = re.sub(f"/({A}|{B})$", "", name)
    if base != name and not any(re.search(rx, base) for rx in trained):
      rules.append((f"^{re.escape(name)}$", optim.FREEZE))
  return tuple(rules) + optim.TRAIN_ALL_RULES


def count(tree) -> int:
  """Elements of a tree (arrays or ShapeDtypeStructs)."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def _leaf_digest(x: jax.Array) -> jax.Array:
  """A uint32 of a leaf's bits, independent of how a sum is ordered or sharded:
  sum over elements of bits * (1 + sum_axis iota_axis * prime_axis), wrapping."""
  if jnp.issubdtype(x.dtype, jnp.floating):
    width = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    x = jax.lax.bitcast_convert_type(x.astype(jnp.float32) if width is jnp.uint32 else x, width)
  bits = x.astype(jnp.uint32)
  primes = (2654435761, 2246822519, 3266489917, 668265263, 374761393)
  weight = jnp.ones(x.shape, jnp.uint32)
  for axis in range(x.ndim):
    weight = weight + (
      jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * jnp.uint32(primes[axis % len(primes)])
    )
  return jnp.sum(bits * weight, dtype=jnp.uint32)


def fingerprint(params) -> str:
  """A short digest of a param tree's paths, shapes, dtypes and bits.

  Computed on device (a wrapping integer sum per leaf: the same on any mesh),
  then hashed on the host with the tree's structure: what an adapter-only
  checkpoint records of the base it was trained on.
  """
  sums = jax.jit(lambda t: jax.tree.map(_leaf_digest, t))(params)
  h = hashlib.sha256()
  for name, _, x in _names(sums):
    leaf = _lookup(params, tuple(name.split("/")))
    value = int(np.asarray(x.addressable_data(0)) if hasattr(x, "addressable_data") else x)
    h.update(f"{name}:{tuple(leaf.shape)}:{jnp.dtype(leaf.dtype).name}:{value};".encode())
  return h.hexdigest()[:16]
