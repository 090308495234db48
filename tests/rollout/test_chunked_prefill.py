"""Chunked prefill (decoding.extend_last) and cache attention against the references.

A chunked prefill writes the KV cache C tokens at a time, attends over the
cache with `attention.cached_attention` (key blocks, no [Lq, S] logits) and
returns only each row's last logits. It must compute what one pass of
`decoding.extend` with the reference attention computes: the same last
logits, the same cache on every written position, the same next decode
step, to 1e-5 in fp32, for unscanned and scanned layers, with ragged rows
(different cache lengths, an empty row, widths that chunks and key blocks
do not divide). The rollout engine built on such a model samples the same
tokens with the same log-probs as the reference engine.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fakes import random_params

from sao_jax.config import sections
from sao_jax.models import attention, decoding, policy
from sao_jax.models import config as mcfg
from sao_jax.rollout import engine as engine_lib

# One dense layer, then two MoE layers (the scanned run), as in test_model_scale.
REF = dataclasses.replace(
  mcfg.tiny(),
  d_model=32,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  moe_d_ff=32,
  num_layers=3,
  dense_layers=(0,),
  dense_d_ff=48,
)
# Chunks of 4 new tokens, cache key blocks of 3: neither divides the widths.
CHUNKED = dataclasses.replace(REF, attention_impl="chunked", attention_block=3, prefill_chunk=4)
SCAN_CHUNKED = dataclasses.replace(CHUNKED, scan_layers=True, remat="full")
TOL = dict(atol=1e-5, rtol=1e-5)
S = 20  # cache positions per slot

extend = jax.jit(decoding.extend, static_argnums=0)
extend_last = jax.jit(decoding.extend_last, static_argnums=0)


@pytest.fixture(scope="module")
def params():
  return random_params(REF, 0.3)


def test_cached_attention_equals_reference():
  b, lq, h, kvh, hd = 3, 5, 4, 2, 8
  keys = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(keys[0], (b, lq, h, hd))
  k = jax.random.normal(keys[1], (b, S, kvh, hd))
  v = jax.random.normal(keys[2], (b, S, kvh, hd))
  # Rows at different cache lengths; row 2 ends at the cache's last entry.
  positions = jnp.array([0, 7, S - lq])[:, None] + jnp.arange(lq)[None]
  allowed = jnp.arange(S)[None, None, :] <= positions[:, :, None]
  want = attention.reference_attention(q, k, v, allowed)
  for block in (1, 3, 8, S, 64):  # dividing S or not, one block or several
    got = jax.jit(attention.cached_attention, static_argnums=4)(q, k, v, positions, block)
    np.testing.assert_allclose(got, want, **TOL, err_msg=f"block {block}")


def _ragged_feed(seed, widths):
  """Token rows of the given valid widths, padded to a common width."""
  w = max(max(widths), 1)
  tokens = np.zeros((len(widths), w), np.int32)
  valid = np.zeros((len(widths), w), bool)
  rng = np.random.default_rng(seed)
  for i, n in enumerate(widths):
    tokens[i, :n] = rng.integers(0, REF.vocab_size, n)
    valid[i, :n] = True
  return tokens, valid


def _cache_leaves(cfg, cache):
  """Per-layer [B, S, KVH, hd] k / v arrays, whatever the layout."""
  if not cfg.scan_layers:
    return [(c["k"], c["v"]) for c in cache]
  out = [(cache[f"layer_{i}"]["k"], cache[f"layer_{i}"]["v"]) for i in range(len(cfg.dense_layers))]
  return out + [
    (cache["layers"]["k"][i], cache["layers"]["v"][i]) for i in range(cfg.num_scanned_layers)
  ]


@pytest.mark.parametrize("cfg", [CHUNKED, SCAN_CHUNKED], ids=["unscanned", "scanned"])
def test_chunked_prefill_equals_one_pass(params, cfg):
  p = policy.scan_params(cfg, params) if cfg.scan_layers else params
  ref_cache = decoding.init_cache(REF, 4, S)
  cache = decoding.init_cache(cfg, 4, S)
  lengths = jnp.zeros((4,), jnp.int32)
  # A first feed (prefill of 11 / 3 / 0 / 9 tokens: several chunks, one, none),
  # then an append to non-empty caches, then a decode step.
  for step, widths in enumerate(([11, 3, 0, 9], [2, 7, 5, 0], [1, 1, 1, 1])):
    tokens, valid = _ragged_feed(step, widths)
    ref_logits, ref_cache, ref_len = extend(REF, params, ref_cache, tokens, lengths, valid)
    logits, cache, new_len = extend_last(cfg, p, cache, tokens, lengths, valid)
    np.testing.assert_array_equal(new_len, ref_len)
    fed = np.asarray(widths) > 0
    last = np.maximum(valid.sum(1) - 1, 0)
    want = np.asarray(ref_logits)[np.arange(4), last]
    assert logits.shape == (4, REF.vocab_size)
    np.testing.assert_allclose(np.asarray(logits)[fed], want[fed], **TOL, err_msg=f"step {step}")
    # Every written position holds the same keys and values.
    written = np.arange(S)[None, :] < np.asarray(new_len)[:, None]  # [B, S]
    for (k, v), (rk, rv) in zip(_cache_leaves(cfg, cache), _cache_leaves(REF, ref_cache)):
      np.testing.assert_allclose(np.asarray(k)[written], np.asarray(rk)[written], **TOL)
      np.testing.assert_allclose(np.asarray(v)[written], np.asarray(rv)[written], **TOL)
    lengths = new_len


def test_prefill_chunk_zero_is_extend_bit_for_bit(params):
  tokens, valid = _ragged_feed(5, [6, 2, 0])
  cache = decoding.init_cache(REF, 3, S)
  lengths = jnp.array([0, 4, 1], jnp.int32)
  logits, ref_cache, _ = extend(REF, params, cache, tokens, lengths, valid)
  last, new_cache, _ = extend_last(REF, params, cache, tokens, lengths, valid)
  rows = np.maximum(valid.sum(1) - 1, 0)
  np.testing.assert_array_equal(last, np.asarray(logits)[np.arange(3), rows])
  for a, b in zip(jax.tree.leaves(new_cache), jax.tree.leaves(ref_cache)):
    np.testing.assert_array_equal(a, b)


def test_engine_with_chunked_prefill_samples_as_the_reference(params):
  rollout = sections.Rollout(slots=3, max_len=32, temperature=1.0)
  out = {}
  for name, cfg in (("ref", REF), ("chunked", CHUNKED)):
    eng = engine_lib.PolicyEngine(cfg, params, rollout, seed=3)
    state = eng.init_decode_state()
    tokens, valid = _ragged_feed(7, [13, 5, 9])
    state, tok, logp, _ = eng.step(state, tokens, valid)
    toks, logps = [tok], [logp]
    for _ in range(4):  # decode steps feed back the sampled tokens
      state, tok, logp, _ = eng.step(state, tok[:, None], np.ones((3, 1), bool))
      toks.append(tok)
      logps.append(logp)
    out[name] = (np.stack(toks), np.stack(logps))
  np.testing.assert_array_equal(out["chunked"][0], out["ref"][0])
  np.testing.assert_allclose(out["chunked"][1], out["ref"][1], **TOL)
