"""Incremental decoding over a KV cache with per-slot lengths.

One function serves prefill and decode: `extend` appends up to L new tokens
to every slot (L = prompt bucket for prefill, L = 1 for a decode step), at
positions `lengths[b], lengths[b] + 1, ...`. A slot whose row is all padding
(`valid` False) is left as it was, so slots advance independently: that is
what continuous batching needs.

Attention here is always the reference math over the whole cache (logits
[B, H, L, S]), whatever `cfg.attention_impl` says: a decode step has L = 1.
The cache layout follows `cfg.scan_layers` (see `init_cache`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import Cache, Transformer, init_cache

Array = jax.Array

__all__ = ["extend", "init_cache"]


def extend(cfg: ModelConfig, params, cache: Cache, tokens: Array, lengths: Array,
           valid: Array) -> tuple[Array, Cache, Array]:
  """Appends tokens to the cache and returns their next-token logits.

  Args:
    cfg: model shape.
    params: policy parameters.
    cache: from `init_cache` (per layer or stacked over scanned layers; every
      leaf ends in `[B, S, KVH, hd]`).
    tokens: int32 `[B, L]`; row b's valid tokens must be a prefix of the row.
    lengths: int32 `[B]`, tokens already in each slot's cache.
    valid: bool `[B, L]`, True on real tokens.

  Returns:
    (logits `[B, L, V]` predicting the token after each input token,
     new cache, new lengths `[B]`).
  """
  positions = lengths[:, None] + jnp.arange(tokens.shape[1])[None, :]
  logits, aux = Transformer(cfg, "lm").apply(
      {"params": params}, tokens, positions, valid.astype(jnp.int32), cache=cache)
  return logits, aux["cache"], lengths + valid.sum(1).astype(lengths.dtype)
