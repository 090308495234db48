"""Incremental decoding over a KV cache with per-slot lengths.

`extend` appends up to L new tokens to every slot (L = prompt bucket for
prefill, L = 1 for a decode step), at positions `lengths[b], lengths[b] + 1,
...`, and returns the next-token logits of every new token. A slot whose row
is all padding (`valid` False) is left as it was, so slots advance
independently: that is what continuous batching needs.

`extend_last` is what a sampler needs: the same cache update, but only the
logits after each row's last valid token, `[B, V]`. With
`cfg.prefill_chunk = C > 0` it is a chunked prefill:

    tokens [B, W]  ->  chunks [B, C] x ceil(W / C), in order:
      run the trunk on the chunk against the cache (writes its keys/values)
      keep each row's hidden state at its last valid token so far
    logits = LM head (final hidden [B, D])          # [B, V], never [B, W, V]

Chunk c's queries attend to the cache, which already holds chunks 0 .. c-1,
so the result is the one-pass result: the KV-cache rule (a token at
position p sees entries 0 .. p, written before they are read) does not care
how the new tokens are grouped. Peak activations are those of one [B, C]
chunk; attention over the cache is `attention.cached_attention` (key blocks,
no [B, H, C, S] logits) unless `cfg.attention_impl` is "reference". A
decode step (one new token) uses `attention.decode_attention` on CPU
(the cache read in its stored layout) and the reference attention
([B, H, 1, S]) elsewhere.
`cfg.prefill_chunk = 0` is `extend` followed by a gather of the last valid
position: the reference, bit for bit what the engine computed before.

The cache layout follows `cfg.scan_layers` (see `init_cache`). Given a
`page_table`, the cache is a paged pool instead (`paged.init_pages`,
sao_jax/models/paged.py): the same results, the slot's entries in pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sao_jax.models import routing
from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import Cache, Transformer, init_cache, lm_head_weight, lm_logits

Array = jax.Array

__all__ = ["extend", "extend_last", "init_cache"]


def extend(
  cfg: ModelConfig,
  params,
  cache: Cache,
  tokens: Array,
  lengths: Array,
  valid: Array,
  page_table: Array | None = None,
  *,
  record_routing: bool = False,
):
  """Appends tokens to the cache and returns their next-token logits.

  Args:
    cfg: model shape.
    params: policy parameters.
    cache: from `init_cache` (per layer or stacked over scanned layers; every
      leaf ends in `[B, S, KVH, hd]`).
    tokens: int32 `[B, L]`; row b's valid tokens must be a prefix of the row.
    lengths: int32 `[B]`, tokens already in each slot's cache.
    valid: bool `[B, L]`, True on real tokens.
    page_table: int `[B, M]` when `cache` is a page pool
      (`paged.init_pages`): slot b's pages, in position order.

  Returns:
    (logits `[B, L, V]` predicting the token after each input token,
     new cache, new lengths `[B]`), and with `record_routing` the MoE
    layers' expert choices for each input token, int32 `[B, L, M * k]`
    (`routing.collect(..., flat=True)`; meaningless at padding).
  """
  positions = lengths[:, None] + jnp.arange(tokens.shape[1])[None, :]
  (logits, aux), chosen = _apply(
    cfg, Transformer(cfg, "lm"), params, tokens, positions, valid, cache, page_table, record_routing
  )
  out = (logits, aux["cache"], lengths + valid.sum(1).astype(lengths.dtype))
  return out + (chosen,) if record_routing else out


def _apply(cfg, model, params, tokens, positions, valid, cache, page_table, record_routing):
  """model.apply on the cache, and the routing it used `[B, L, M * k]` (or None)."""
  args = ({"params": params}, tokens, positions, valid.astype(jnp.int32))
  if not record_routing:
    return model.apply(*args, cache=cache, page_table=page_table), None
  out, state = model.apply(*args, cache=cache, page_table=page_table, mutable=["intermediates"])
  return out, routing.collect(cfg, state["intermediates"], *tokens.shape, flat=True)


def _last_valid(x: Array, valid: Array) -> Array:
  """x [B, L, ...] at each row's last valid index (index 0 for an empty row)."""
  last = jnp.maximum(valid.sum(1) - 1, 0)
  index = last.reshape((-1,) + (1,) * (x.ndim - 1))
  return jnp.take_along_axis(x, index, 1)[:, 0]


def extend_last(
  cfg: ModelConfig,
  params,
  cache: Cache,
  tokens: Array,
  lengths: Array,
  valid: Array,
  page_table: Array | None = None,
  *,
  record_routing: bool = False,
):
  """`extend`, returning only the logits after each row's last valid token.

  Arguments as `extend`. Returns (logits `[B, V]` fp32, new cache, new
  lengths `[B]`). A row with no valid token gets meaningless logits and an
  unchanged length. With `cfg.prefill_chunk` > 0 the tokens go through in
  chunks of that many (module docstring); the width is padded up to a
  whole number of chunks with padding tokens. With `record_routing` a
  fourth output: every input token's expert choices `[B, W, M * k]`
  (`extend`'s).
  """
  width = tokens.shape[1]
  if not cfg.prefill_chunk:
    out = extend(
      cfg, params, cache, tokens, lengths, valid, page_table, record_routing=record_routing
    )
    return (_last_valid(out[0], valid),) + out[1:]

  chunk = min(cfg.prefill_chunk, width)
  pad = -width % chunk
  if pad:
    tokens = jnp.pad(tokens, ((0, 0), (0, pad)))
    valid = jnp.pad(valid, ((0, 0), (0, pad)))
  trunk = Transformer(cfg, "hidden")

  def one_chunk(carry, xs):
    cache, lens, last = carry
    tok, ok = xs  # [B, C]
    positions = lens[:, None] + jnp.arange(chunk, dtype=lens.dtype)[None, :]
    (hidden, aux), chosen = _apply(
      cfg, trunk, params, tok, positions, ok, cache, page_table, record_routing
    )  # [B, C, D]
    last = jnp.where(ok.any(1)[:, None], _last_valid(hidden, ok), last)
    return (aux["cache"], lens + ok.sum(1).astype(lens.dtype), last), chosen

  last = jnp.zeros((tokens.shape[0], cfg.d_model), cfg.dtype)
  carry = (cache, lengths, last)
  n = tokens.shape[1] // chunk
  if n == 1:
    carry, chosen = one_chunk(carry, (tokens, valid))
  else:  # [B, n*C] -> [n, B, C]: one chunk per iteration, the cache carried
    split = lambda x: jnp.moveaxis(x.reshape(x.shape[0], n, chunk), 1, 0)
    carry, chosen = jax.lax.scan(one_chunk, carry, (split(tokens), split(valid)))
    if record_routing:  # [n, B, C, M*k] -> [B, n*C, M*k]
      chosen = jnp.moveaxis(chosen, 0, 1).reshape(chosen.shape[1], n * chunk, -1)
  cache, new_lengths, last = carry
  out = (lm_logits(cfg, last, lm_head_weight(cfg, params)), cache, new_lengths)
  return out + (chosen[:, :width],) if record_routing else out
