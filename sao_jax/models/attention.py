"""Causal self-attention over packed rows: a reference, a chunked and a TPU kernel.

All three compute the same function of

    q [B, L, H, hd]   (rotary applied)      k, v [B, L, KVH, hd]
    segment_ids [B, L]  (1, 2, ... per packed sequence, 0 = padding)

namely softmax(q k^T / sqrt(hd)) v over the keys a query may see: keys at
or before it (index order), in its own segment, not padding. Query heads
share key heads in groups of H / KVH (grouped-query attention). A padding
query sees no key; its output is finite garbage that no real token reads.

* `reference_attention` materialises [B, KVH, H/KVH, Lq, Lk] fp32 logits.
  It is the oracle, and it serves the KV-cache path for a decode step.
* `chunked_attention` walks query blocks and, inside each, key blocks with
  an online softmax (running max m, normaliser l, accumulator acc):

      m' = max(m, rowmax(s_j))    l' = l e^(m - m') + rowsum(e^(s_j - m'))
      acc' = acc e^(m - m') + e^(s_j - m') v_j          out = acc / l

  Key blocks entirely after a query block are skipped (`lax.cond`). Its
  backward is the flash-attention one (a `custom_vjp`): the forward keeps
  only out and the log-sum-exp per query, and the backward recomputes each
  block's probabilities. Memory O(B H L hd + B H block^2), never L x L.
* `cached_attention` is the same online softmax for new tokens over a KV
  cache (a chunked prefill): queries at absolute positions, key blocks of
  the cache, forward only.
* `splash_attention` is the Pallas TPU kernel
  (jax.experimental.pallas.ops.tpu.splash_attention) under `shard_map`,
  batch and heads split as the logical-axis rules say.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from sao_jax.models import sharding

Array = jax.Array

# Logit of a key a query may not see. Finite, so a row with no visible key
# (padding) stays finite; exp(_MASKED - m) underflows to 0 for any real m.
_MASKED = -1e30


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------


def reference_attention(q: Array, k: Array, v: Array, allowed: Array) -> Array:
  """Dense attention; `allowed` [B, Lq, Lk] says which keys each query sees.

  q [B, Lq, H, hd], k and v [B, Lk, KVH, hd] -> [B, Lq, H, hd].
  """
  hd, kvh = q.shape[-1], k.shape[2]
  groups = q.shape[2] // kvh
  qg = q.reshape(q.shape[:2] + (kvh, groups, hd))  # [B, Lq, KVH, G, hd]
  logits = jnp.einsum("bqngh,bknh->bngqk", qg, k).astype(jnp.float32)
  logits = logits / jnp.sqrt(jnp.float32(hd))
  logits = jnp.where(allowed[:, None, None], logits, _MASKED)  # [B, KVH, G, Lq, Lk]
  probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
  return jnp.einsum("bngqk,bknh->bqngh", probs, v).reshape(q.shape)


def decode_attention(q: Array, k: Array, v: Array, visible: Array) -> Array:
  """One query per row against a KV cache, the cache read as stored.

  q [B, 1, H, hd], k and v [B, S, KVH, hd], visible [B, S] -> [B, 1, H, hd];
  the same result as `reference_attention` with `allowed = visible[:, None]`.

  `reference_attention`'s matmuls are batched over (B, KVH), which on
  XLA:CPU makes every decode step transpose the whole cache into
  [B, KVH, S, hd] and [B, KVH, hd, S] (as costly as the matmuls). Here both
  matmuls are batched over B alone, on the cache's [B, S, KVH * hd] view:
  queries go in as a block-diagonal [B, KVH * hd, H] matrix (each head's
  query in its kv head's rows, zeros elsewhere), so the logits come out as
  [B, S, H] directly; the values come out for every (head, kv head) pair,
  [B, H, KVH * hd], and each head keeps its own kv head's block. KVH times
  the multiply-adds of the GQA form, and no copy of the cache, which costs
  less on CPU (benchmarks/RESULTS.md#rollout-engine).
  The model uses it for decode steps on CPU only: with the cache sharded
  over kv heads (pods) the contraction over KVH * hd would need a reduction
  across shards, which the GQA form does not.
  """
  b, _, h, hd = q.shape
  s, kvh = k.shape[1], k.shape[2]
  g = h // kvh
  own = jnp.arange(h) // g == jnp.arange(kvh)[:, None]  # [KVH, H]: head n reads kv head n // g
  q_bd = jnp.where(
    own[None, :, None, :], jnp.swapaxes(q[:, 0], 1, 2)[:, None], 0
  )  # [B, KVH, hd, H]
  logits = jnp.einsum(
    "bsc,bch->bsh", k.reshape(b, s, kvh * hd), q_bd.reshape(b, kvh * hd, h)
  ).astype(jnp.float32)
  logits = logits / jnp.sqrt(jnp.float32(hd))
  logits = jnp.where(visible[:, :, None], logits, _MASKED)  # [B, S, H]
  probs = jax.nn.softmax(logits, axis=1).astype(q.dtype)
  out = jnp.einsum("bsh,bsc->bhc", probs, v.reshape(b, s, kvh * hd))  # [B, H, KVH * hd]
  out = out.reshape(b, h, kvh, hd)
  out = jnp.sum(jnp.where(own.T[None, :, :, None], out, 0), axis=2)  # [B, H, hd]
  return out[:, None]


def cache_attention(q: Array, k: Array, v: Array, positions: Array, impl: str, block: int) -> Array:
  """New tokens' attention over a KV cache view, as the model's decoding picks it.

  q [B, Lq, H, hd] at cache positions `positions` [B, Lq]; k, v [B, S, KVH,
  hd] hold the new tokens' keys and values already; the query at p sees
  entries 0 .. p. A decode step (Lq = 1) is `decode_attention` on XLA:CPU
  (the cache read as stored) and the reference (GQA form) elsewhere: on
  TPU / GPU it keeps each kv head's work on its own shard of a
  kv-head-sharded cache. Several new tokens (a prefill chunk) are the
  reference when `impl` is "reference", else `cached_attention` in key
  blocks of `block` (no [Lq, S] logits). The dense cache (transformer.py)
  and the paged cache's view of a slot's pages (paged.py) both attend here.
  """
  if q.shape[1] == 1 and compile_platform() == "cpu":
    visible = jnp.arange(k.shape[1])[None, :] <= positions  # [B, S]
    return decode_attention(q, k, v, visible)
  if impl == "reference" or q.shape[1] == 1:
    key_pos = jnp.arange(k.shape[1])
    allowed = key_pos[None, None, :] <= positions[:, :, None]  # [B, Lq, S]
    # Logits [B, KVH, H/KVH, Lq, S]: the oracle, and decode steps off CPU.
    return reference_attention(q, k, v, allowed)
  return cached_attention(q, k, v, positions, block)


def packed_causal_mask(segment_ids: Array) -> Array:
  """[B, L, L]: query i sees key j <= i of its own (non-padding) segment."""
  idx = jnp.arange(segment_ids.shape[1])
  return (
    (segment_ids[:, :, None] == segment_ids[:, None, :])
    & (segment_ids[:, None, :] != 0)
    & (idx[None, :, None] >= idx[None, None, :])
  )


# --------------------------------------------------------------------------
# Chunked (pure JAX, flash-style backward)
# --------------------------------------------------------------------------


def _to_blocks(x: Array, block: int) -> Array:
  """[B, L, ...] -> [L / block, B, block, ...] (block axis first, for scan)."""
  b, length = x.shape[:2]
  x = x.reshape((b, length // block, block) + x.shape[2:])
  return jnp.moveaxis(x, 1, 0)


def _from_blocks(x: Array) -> Array:
  """[n, B, block, ...] -> [B, n * block, ...]."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


def _block_mask(i, j, block_q, block_k, seg_q, seg_k):
  """[B, bq, bk] visibility of key block j from query block i."""
  q_idx = i * block_q + jnp.arange(block_q)
  k_idx = j * block_k + jnp.arange(block_k)
  return (
    (seg_q[:, :, None] == seg_k[:, None, :])
    & (seg_k[:, None, :] != 0)
    & (q_idx[None, :, None] >= k_idx[None, None, :])
  )


def _block_needed(i, j, block_q, block_k):
  """Key block j holds a key at or before the last query of block i."""
  return j * block_k <= i * block_q + block_q - 1


def _scores(qi, kj, hd):
  """[B, KVH, G, bq, bk] fp32 logits of one block pair."""
  s = jnp.einsum("bqngh,bknh->bngqk", qi, kj, preferred_element_type=jnp.float32)
  return s / jnp.sqrt(jnp.float32(hd))


def _online_init(b, n, g, lq, hd):
  """The empty online-softmax state (m, l, acc) for grouped queries [B, lq, n, g, hd]."""
  return (
    jnp.full((b, n, g, lq), _MASKED, jnp.float32),
    jnp.zeros((b, n, g, lq), jnp.float32),
    jnp.zeros((b, n, g, lq, hd), jnp.float32),
  )


def _online_update(carry, qi, kj, vj, visible):
  """Folds one key block into the online softmax (the module docstring's m, l, acc).

  qi [B, lq, KVH, G, hd], kj / vj [B, bk, KVH, hd], visible [B, lq, bk].
  """
  m, l, acc = carry  # [B, KVH, G, lq], same, [B, KVH, G, lq, hd]
  s = _scores(qi, kj, qi.shape[-1])
  s = jnp.where(visible[:, None, None], s, _MASKED)
  m_new = jnp.maximum(m, s.max(-1))
  p = jnp.exp(s - m_new[..., None])
  correction = jnp.exp(m - m_new)
  l = l * correction + p.sum(-1)
  pv = jnp.einsum("bngqk,bknh->bngqh", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
  return m_new, l, acc * correction[..., None] + pv


def _online_result(carry, dtype):
  """(out [B, lq, KVH, G, hd], lse [B, lq, KVH, G] fp32) of a finished online softmax.

  Needs l > 0: every query saw at least one block with a visible (or, for a
  padding query, a masked but finite) key.
  """
  m, l, acc = carry
  out = acc / l[..., None]
  lse = m + jnp.log(l)
  return jnp.moveaxis(out, 3, 1).astype(dtype), jnp.moveaxis(lse, 3, 1)


def _chunked_forward(q, k, v, segment_ids, block_q, block_k):
  """(out [B, L, KVH, G, hd], lse [B, L, KVH, G] fp32) for grouped q."""
  b, _, n, g, hd = q.shape
  qb, segq = _to_blocks(q, block_q), _to_blocks(segment_ids, block_q)
  kb, vb, segk = (_to_blocks(x, block_k) for x in (k, v, segment_ids))
  nk = kb.shape[0]

  def query_block(args):
    i, qi, sq = args  # qi [B, bq, KVH, G, hd]

    def key_block(carry, xs):
      j, kj, vj, sk = xs
      update = lambda c: _online_update(c, qi, kj, vj, _block_mask(i, j, block_q, block_k, sq, sk))
      carry = jax.lax.cond(_block_needed(i, j, block_q, block_k), update, lambda c: c, carry)
      return carry, None

    carry, _ = jax.lax.scan(
      key_block, _online_init(b, n, g, block_q, hd), (jnp.arange(nk), kb, vb, segk)
    )
    return _online_result(carry, q.dtype)  # block 0 is never skipped: l >= 1

  out, lse = jax.lax.map(query_block, (jnp.arange(qb.shape[0]), qb, segq))
  return _from_blocks(out), _from_blocks(lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _chunked(q, k, v, segment_ids, block_q, block_k):
  return _chunked_forward(q, k, v, segment_ids, block_q, block_k)[0]


def _chunked_fwd(q, k, v, segment_ids, block_q, block_k):
  out, lse = _chunked_forward(q, k, v, segment_ids, block_q, block_k)
  return out, (q, k, v, segment_ids, out, lse)


def _chunked_bwd(block_q, block_k, residuals, d_out):
  """Flash-attention backward: per block pair, with P recomputed from lse.

  P = exp(S - lse)     dV = P^T dO     dP = dO V^T
  dS = P * (dP - rowsum(dO * O))     dQ = dS K / sqrt(hd)   dK = dS^T Q / sqrt(hd)
  """
  q, k, v, segment_ids, out, lse = residuals
  hd = q.shape[-1]
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1)  # [B, L, KVH, G]
  qb, dob, deltab, lseb, segq = (
    _to_blocks(x, block_q) for x in (q, d_out, delta, lse, segment_ids)
  )
  kb, vb, segk = (_to_blocks(x, block_k) for x in (k, v, segment_ids))
  nq, nk = qb.shape[0], kb.shape[0]
  scale = 1.0 / jnp.sqrt(jnp.float32(hd))

  def key_block(dq, xs):
    j, kj, vj, sk = xs

    def query_block(carry, ys):
      i, qi, doi, di, lsei, sq = ys

      def grads(_):
        s = _scores(qi, kj, hd)  # [B, KVH, G, bq, bk]
        visible = _block_mask(i, j, block_q, block_k, sq, sk)[:, None, None]
        p = jnp.where(visible, jnp.exp(s - jnp.moveaxis(lsei, 1, 3)[..., None]), 0.0)
        dv = jnp.einsum("bngqk,bqngh->bknh", p, doi.astype(jnp.float32))
        dp = jnp.einsum("bqngh,bknh->bngqk", doi, vj, preferred_element_type=jnp.float32)
        ds = p * (dp - jnp.moveaxis(di, 1, 3)[..., None]) * scale
        dk = jnp.einsum("bngqk,bqngh->bknh", ds, qi.astype(jnp.float32))
        dqi = jnp.einsum("bngqk,bknh->bqngh", ds, kj.astype(jnp.float32))
        return dk, dv, dqi

      def skip(_):
        return (
          jnp.zeros(kj.shape, jnp.float32),
          jnp.zeros(vj.shape, jnp.float32),
          jnp.zeros(qi.shape, jnp.float32),
        )

      dk, dv, dqi = jax.lax.cond(_block_needed(i, j, block_q, block_k), grads, skip, None)
      return (carry[0] + dk, carry[1] + dv), dqi

    zeros = (jnp.zeros(kj.shape, jnp.float32), jnp.zeros(vj.shape, jnp.float32))
    (dk, dv), dq_parts = jax.lax.scan(
      query_block, zeros, (jnp.arange(nq), qb, dob, deltab, lseb, segq)
    )
    return dq + dq_parts, (dk, dv)

  dq, (dk, dv) = jax.lax.scan(
    key_block, jnp.zeros(qb.shape, jnp.float32), (jnp.arange(nk), kb, vb, segk)
  )
  return (
    _from_blocks(dq).astype(q.dtype),
    _from_blocks(dk).astype(k.dtype),
    _from_blocks(dv).astype(v.dtype),
    None,
  )


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_attention(q: Array, k: Array, v: Array, segment_ids: Array, block: int) -> Array:
  """Packed causal attention in blocks of `block` tokens; no L x L array.

  q [B, L, H, hd], k and v [B, L, KVH, hd], segment_ids [B, L] -> [B, L, H, hd].
  L is padded up to a multiple of the block with padding tokens (segment 0,
  seen by no query) and the padded queries are dropped.
  """
  b, length, h, hd = q.shape
  kvh = k.shape[2]
  block = min(block, length)
  pad = -length % block
  if pad:
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
    segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
  qg = q.reshape(q.shape[:2] + (kvh, h // kvh, hd))  # [B, L', KVH, G, hd]
  out = _chunked(qg, k, v, segment_ids, block, block)
  return out.reshape(b, length + pad, h, hd)[:, :length]


def cached_attention(q: Array, k: Array, v: Array, positions: Array, block: int) -> Array:
  """Attention of new tokens over a KV cache, key block by key block; no [Lq, S] array.

  q [B, Lq, H, hd] at absolute cache positions `positions` [B, Lq]; k, v
  [B, S, KVH, hd] the whole cache, the new tokens' keys already written. The
  query at position p sees cache entries 0 .. p (the KV-cache rule of
  sao_jax/models/transformer.py), as `reference_attention` with
  `allowed[b, i, j] = j <= positions[b, i]` does, but with the online
  softmax over key blocks of `block` entries: memory O(B H Lq block), not
  O(B H Lq S). Key blocks after every query's position are skipped. Forward
  only (decoding never differentiates). A chunked prefill
  (sao_jax/models/decoding.py) attends this way.
  """
  b, lq, h, hd = q.shape
  kvh = k.shape[2]
  block = min(block, k.shape[1])
  pad = -k.shape[1] % block
  if pad:  # never visible: every real query's position is < S
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    k, v = jnp.pad(k, widths), jnp.pad(v, widths)
  qg = q.reshape(b, lq, kvh, h // kvh, hd)
  last = positions.max()

  def key_block(carry, j):
    start = j * block

    def update(carry):
      kj = jax.lax.dynamic_slice_in_dim(k, start, block, 1)
      vj = jax.lax.dynamic_slice_in_dim(v, start, block, 1)
      visible = (start + jnp.arange(block))[None, None, :] <= positions[:, :, None]
      return _online_update(carry, qg, kj, vj, visible)

    # Block 0 always runs, so l > 0 for every query.
    return jax.lax.cond(start <= last, update, lambda c: c, carry), None

  carry, _ = jax.lax.scan(
    key_block, _online_init(b, kvh, h // kvh, lq, hd), jnp.arange(k.shape[1] // block)
  )
  return _online_result(carry, q.dtype)[0].reshape(q.shape)


# --------------------------------------------------------------------------
# Splash (Pallas, TPU)
# --------------------------------------------------------------------------


_PLATFORM = contextvars.ContextVar("sao_jax_compile_platform", default=None)


@contextlib.contextmanager
def compiling_for(platform: str):
  """Traces inside say `compile_platform() == platform`, mesh or not.

  For ahead-of-time compiles of a program on one device, where no mesh
  names the target (launch/compile.py's one-chip engine).
  """
  token = _PLATFORM.set(platform)
  try:
    yield
  finally:
    _PLATFORM.reset(token)


def compile_platform() -> str:
  """The platform being compiled for: `compiling_for`'s, the set mesh's devices', else the default.

  Ahead-of-time compilation for a TPU topology on a CPU host sets a mesh of
  TPU devices (jax.set_mesh), while jax.default_backend() says "cpu".
  """
  chosen = _PLATFORM.get()
  if chosen is not None:
    return chosen
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else getattr(mesh, "abstract_device", None)
  platform = getattr(device, "platform", None)
  return platform or jax.default_backend()


def splash_usable(length: int, block: int) -> bool:
  """Splash runs here: compiling for TPU, and L tiles into 128-multiples."""
  return compile_platform() == "tpu" and length % 128 == 0 and math.gcd(block, length) % 128 == 0


def _mesh_axes(name: str):
  """The mesh axes the active logical-axis rules give `name` (None if none)."""
  rules = nn.get_logical_axis_rules()
  return nn.logical_to_mesh_axes((name,), rules)[0] if rules else None


def splash_attention(
  q: Array, k: Array, v: Array, segment_ids: Array, block: int, *, interpret: bool = False
) -> Array:
  """The Pallas TPU splash kernel, causal with segment ids; see `chunked_attention`.

  `interpret=True` runs the kernel in Pallas' interpreter (any backend, slow):
  how the CPU tests check this wrapper's layout, scaling and masking.

  Pallas kernels are opaque to GSPMD (it would gather their operands), so
  with a mesh set the kernel runs under `shard_map`: batch split as the
  "batch" rule says, query heads as "heads", key heads as "kv_heads". Each
  shard must keep the global heads-per-key-head ratio.

  Context parallelism: where the "length" rule splits rows over a mesh
  axis of c devices (configs/sao_moe_128k.py: "context"), each device
  keeps its L / c queries and all-gathers the row's keys, values and
  segment ids over that axis inside the shard_map; the kernel is built
  with `q_seq_shards=c` and its mask info split the same way, so each
  device computes attention for its own queries only (no duplicate work)
  and the backward's all-gather transpose sums the key and value
  gradients over the axis. The split is contiguous, so causal work is
  unbalanced: with c = 2 the later half's queries see 3/4 of the row's
  (query, key) pairs, the busier device doing 3/4 of the unsplit work, not
  1/2 (a zigzag order of the row's chunks would balance it; not done).
  Needs L / c to tile into the kernel's blocks; otherwise the length stays
  whole in the kernel (XLA gathers it and every device of the axis
  computes the whole row).
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

  b, length, h, hd = q.shape
  kvh = k.shape[2]
  blk = math.gcd(block, length)
  sizes = sk.BlockSizes(
    block_q=blk,
    block_kv=blk,
    block_kv_compute=blk,
    block_q_dkv=blk,
    block_kv_dkv=blk,
    block_kv_dkv_compute=blk,
    block_q_dq=blk,
    block_kv_dq=blk,
  )
  # The kernel takes [heads, L, hd] per example and does not scale q.
  qt = jnp.swapaxes(q / jnp.sqrt(jnp.asarray(hd, q.dtype)), 1, 2)  # [B, H, L, hd]
  kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, KVH, L, hd]

  def kernel(q, k, v, seg):
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads * kvh != kv_heads * h:
      raise ValueError(
        f"splash attention: a shard holds {heads} query heads and {kv_heads} key heads; "
        f"shard 'heads' and 'kv_heads' alike to keep the ratio {h // kvh}."
      )
    mask = sm.MultiHeadMask([sm.CausalMask((length, length))] * heads)
    splash = sk.make_splash_mha(
      mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )
    return jax.vmap(splash)(q, k, v, segment_ids=sk.SegmentIds(seg, seg))

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    out = kernel(qt, kt, vt, segment_ids)
  else:
    batch = _mesh_axes("batch")
    context = _mesh_axes("length")
    shards = sharding.axes_size(mesh, context)
    if shards > 1 and length % (shards * blk) == 0:
      out = _context_split_splash(
        qt, kt, vt, segment_ids, mesh, batch, context, shards, h, sizes, interpret
      )
    else:
      q_spec = PartitionSpec(batch, _mesh_axes("heads"), None, None)
      kv_spec = PartitionSpec(batch, _mesh_axes("kv_heads"), None, None)
      out = jax.shard_map(
        kernel,
        in_specs=(q_spec, kv_spec, kv_spec, PartitionSpec(batch, None)),
        out_specs=q_spec,
        check_vma=False,
      )(qt, kt, vt, segment_ids)
  return jnp.swapaxes(out, 1, 2).astype(q.dtype)  # [B, L, H, hd]


def _context_split_splash(
  qt, kt, vt, segment_ids, mesh, batch, context, shards, h, sizes, interpret
):
  """`splash_attention` with the queries split over the `context` mesh axes
  (its docstring): qt [B, H, L, hd], kt / vt [B, KVH, L, hd], all split
  over `context` along L on the way in; the output [B, H, L, hd] stays so."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

  length, kvh = qt.shape[2], kt.shape[1]
  heads_axes, kv_axes = _mesh_axes("heads"), _mesh_axes("kv_heads")
  local_heads = h // sharding.axes_size(mesh, heads_axes)
  if local_heads * sharding.axes_size(mesh, heads_axes) != h or (
    local_heads * kvh != (kvh // sharding.axes_size(mesh, kv_axes)) * h
  ):
    raise ValueError(
      f"splash attention: {h} query heads over {heads_axes} and {kvh} key heads over "
      f"{kv_axes} do not keep the ratio {h // kvh} in every shard"
    )
  mask = sm.MultiHeadMask([sm.CausalMask((length, length))] * local_heads)
  splash = sk.make_splash_mha(
    mask, block_sizes=sizes, head_shards=1, q_seq_shards=shards, interpret=interpret
  )
  # The kernel's mask info splits over the queries like the queries do.
  splash_spec = splash.manual_sharding_spec(
    jax.sharding.NamedSharding(mesh, PartitionSpec(None, context))
  )
  q_spec = PartitionSpec(batch, heads_axes, context, None)
  kv_spec = PartitionSpec(batch, kv_axes, context, None)
  seg_spec = PartitionSpec(batch, context)

  def kernel(q, k, v, seg, splash):
    # The row's keys, values and segment ids, gathered over the context axes.
    k, v = (jax.lax.all_gather(x, context, axis=2, tiled=True) for x in (k, v))
    seg_kv = jax.lax.all_gather(seg, context, axis=1, tiled=True)
    return jax.vmap(lambda q, k, v, sq, skv: splash(q, k, v, segment_ids=sk.SegmentIds(sq, skv)))(
      q, k, v, seg, seg_kv
    )

  return jax.shard_map(
    kernel,
    in_specs=(q_spec, kv_spec, kv_spec, seg_spec, splash_spec),
    out_specs=q_spec,
    check_vma=False,
  )(qt, kt, vt, segment_ids, splash)
