"""The tree every decoding cache shares, dense or paged: one entry per layer.

A full-attention layer's entry is {"k", "v"}; a Gated DeltaNet ("linear")
layer's is its recurrent state per slot, {"conv_q", "conv_k", "conv_v",
"state"} (transformer.LINEAR_CACHE). A dense cache (`transformer.init_cache`)
and a page pool (`paged.init_pages`) differ only in their key / value
leaves' shapes; the recurrent leaves are the same in both (one fixed-size
state a slot, batch at axis -4 like a dense cache's). Both lay the entries
out the way the parameters are named (`ModelConfig.layer_location`), so a
layer finds its cache where it finds its weights.

Code that works on positions (a kv bucket's prefix, writing back new
entries, gathering pages) maps over the key / value leaves only: `map_kv`
hands the recurrent leaves through as the model last wrote them.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig

# A pytree with one entry per layer: see kv_tree.
Cache = Any

RECURRENT_LEAVES = ("conv_q", "conv_k", "conv_v", "state")


def recurrent_shapes(cfg: ModelConfig, slots: int) -> dict[str, tuple[int, ...]]:
  """A linear layer's cache leaves: conv inputs [slots, K-1, heads, dim] of
  q, k and v, and the delta-rule state [slots, H, Dk, Dv]."""
  hk, h = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  dk, dv, k = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel
  return {
    "conv_q": (slots, k - 1, hk, dk),
    "conv_k": (slots, k - 1, hk, dk),
    "conv_v": (slots, k - 1, h, dv),
    "state": (slots, h, dk, dv),
  }


def _layer_entry(cfg: ModelConfig, i: int, kv_shape, slots: int, dtype, lead=()):
  if cfg.layer_spec(i).attention == "linear":
    return {
      name: jnp.zeros(lead + shape, jnp.float32 if name == "state" else dtype)
      for name, shape in recurrent_shapes(cfg, slots).items()
    }
  return {"k": jnp.zeros(lead + kv_shape, dtype), "v": jnp.zeros(lead + kv_shape, dtype)}


def kv_tree(cfg: ModelConfig, shape: tuple[int, ...], slots: int, dtype=None) -> Cache:
  """Zero entries per layer, key / value leaves of `shape` and recurrent ones
  for `slots` slots: a list entry per layer, or, with `cfg.scan_layers`,
  "layer_i" for each unrolled layer and "layers" for the scanned ones,
  stacked on a leading axis ("layers/sub_r" for a period's layer r)."""
  dtype = dtype or cfg.dtype
  if not cfg.scan_layers:
    return [_layer_entry(cfg, i, shape, slots, dtype) for i in range(cfg.num_layers)]
  tree: dict = {
    f"layer_{i}": _layer_entry(cfg, i, shape, slots, dtype) for i in range(cfg.scan_prefix)
  }
  steps, period = cfg.scan_steps, cfg.scan_period
  subs = [
    _layer_entry(cfg, cfg.scan_prefix + r, shape, slots, dtype, (steps,)) for r in range(period)
  ]
  tree["layers"] = subs[0] if period == 1 else {f"sub_{r}": e for r, e in enumerate(subs)}
  return tree


def is_recurrent(path) -> bool:
  """Whether a cache leaf's key path ends in a recurrent-state name."""
  last = path[-1] if path else None
  return getattr(last, "key", None) in RECURRENT_LEAVES


def map_kv(fn: Callable, *trees) -> Cache:
  """`fn` over the key / value leaves of caches of one structure; a
  recurrent leaf is taken from the last tree (the model's latest state)."""
  return jax.tree_util.tree_map_with_path(
    lambda path, *leaves: leaves[-1] if is_recurrent(path) else fn(*leaves), *trees
  )


def kv_leaves(tree) -> list:
  """The key / value leaves of a cache (its recurrent ones left out)."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [leaf for path, leaf in flat if not is_recurrent(path)]
