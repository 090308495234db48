"""The tree every KV cache shares, dense or paged: one {"k", "v"} pair per layer.

A dense cache (`transformer.init_cache`) and a page pool (`paged.init_pages`)
differ only in their leaves' shapes; both lay those leaves out the way the
parameters are named, so a layer finds its cache where it finds its weights.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from sao_jax.models.config import ModelConfig

# A pytree of {"k", "v"} arrays, one pair per layer: see kv_tree.
Cache = Any


def kv_tree(cfg: ModelConfig, shape: tuple[int, ...], dtype=None) -> Cache:
  """Zero {"k", "v"} leaves of `shape` per layer: a list entry per layer, or,
  with `cfg.scan_layers`, "layer_i" for each unrolled layer before the scanned run and
  "layers" for the scanned ones, stacked on a leading axis."""
  dtype = dtype or cfg.dtype
  zeros = lambda *lead: {"k": jnp.zeros(lead + shape, dtype),
                         "v": jnp.zeros(lead + shape, dtype)}
  if not cfg.scan_layers:
    return [zeros() for _ in range(cfg.num_layers)]
  tree = {f"layer_{i}": zeros() for i in range(cfg.scan_prefix)}
  tree["layers"] = zeros(cfg.num_scanned_layers)
  return tree
