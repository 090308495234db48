"""Gated DeltaNet, the linear attention of the Qwen3.5/3.6 hybrids, as pure functions.

Three of every four text layers of a Qwen3.5 model are Gated DeltaNet
(transformers' `Qwen3_5GatedDeltaNet`). A layer reads hidden states
x [B, L, E] and computes

    qkv = causal_conv(x W_qkv)                 K-tap depthwise conv, then SiLU
    q, k, v = split(qkv)                       [B, L, Hk, Dk] x2, [B, L, H, Dv]
    beta = sigmoid(x W_b)                      [B, L, H]  write strength
    g = -exp(A_log) softplus(x W_a + dt_bias)  [B, L, H]  log decay, <= 0
    o = gated_delta_rule(l2norm(q) / sqrt(Dk), l2norm(k), v, g, beta)
    y = (rmsnorm(o) * w_norm * silu(x W_z)) W_out

with every key head serving H / Hk consecutive value heads (as grouped-query
attention shares key heads). Per head, the gated delta rule keeps a matrix
state S [Dk, Dv] (a key -> value memory) and per token t does

    S' = exp(g_t) S_{t-1}                                  decay
    u_t = beta_t (v_t - S'^T k_t)                          the delta: what S' mispredicts
    S_t = S' + k_t u_t^T                                   write the correction
        = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T q_t

This module has the per-token pieces: `causal_conv` (with the state a decode
step continues from), `decay_and_beta`, `l2norm`, `gated_rms_norm`, and the
recurrence in two forms computing the same function:

* `recurrent_gated_delta_rule`, a `lax.scan` over tokens: the decode step
  ([B, 1, ...]) and the in-library oracle.
* `chunked_gated_delta_rule`, the chunked parallel (WY / UT-transform) form
  for training and prefill: inside a chunk of C tokens everything is a
  matmul and one unit-triangular solve, and a scan over L / C chunks carries
  S; see its docstring for the algebra.

Packed rows. `segment_ids` [B, L] numbers the sequences of a packed row
1, 2, ... and marks padding 0, as in `attention.py`. A new segment starts
from a zero delta-rule state and a zero conv window; padding neither reads
nor writes either state (its outputs are 0), so a row's final state is its
last real token's. A carried state (`initial_state`, `conv_state`) continues
the segment at position 0: position 0 of a decode step or of a prefill
chunk continues the slot's sequence. The tokens of a segment are contiguous
(padding sits between segments and at the end of a row, where packing puts
it); if position 0 is padding, the first real segment starts afresh.

Precision. The decay, beta, the state S and every product that builds it
are fp32 whatever the input dtype (the reference does the same); outputs
come back in the dtype of q (of x for the conv). On TPU an fp32 matmul runs
at the default precision unless the caller sets
`jax.default_matmul_precision`.

Sharding: everything here is independent per (row, head), so the layer
shards like attention (heads over "tensor", rows and engine slots over the
batch axes), with q, k and v kept as three arrays so each splits by its own
heads. In the engine a slot's state per DeltaNet layer (S and the three
conv windows) has a fixed size per slot; a row at position 0 starts from
zeros and a slot not fed in a call keeps its state. How the layer shards
and how the engine carries its state: docs/design/deltanet.md.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

# The reference's (and the FLA kernels') epsilon for l2norm: x / sqrt(|x|^2 + eps).
L2NORM_EPS = 1e-6


# --------------------------------------------------------------------------
# Per-token pieces
# --------------------------------------------------------------------------


def l2norm(x: Array, eps: float = L2NORM_EPS) -> Array:
  """x / sqrt(sum_d x_d^2 + eps) over the last axis, in fp32."""
  x = x.astype(jnp.float32)
  return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def decay_and_beta(a: Array, b: Array, a_log: Array, dt_bias: Array) -> tuple[Array, Array]:
  """The per-token log decay and write strength from the a and b projections.

      g_t = -exp(A_log) softplus(a_t + dt_bias)    (<= 0, so exp(g_t) in (0, 1])
      beta_t = sigmoid(b_t)

  a, b [B, L, H]; a_log, dt_bias [H] -> g, beta [B, L, H], both fp32.
  """
  chex.assert_rank([a, b, a_log, dt_bias], [3, 3, 1, 1])
  chex.assert_equal_shape([a, b])
  f32 = jnp.float32
  g = -jnp.exp(a_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + dt_bias.astype(f32))
  return g, jax.nn.sigmoid(b.astype(f32))


def gated_rms_norm(x: Array, gate: Array, weight: Array, eps: float = 1e-6) -> Array:
  """The output norm of a DeltaNet layer, norm first, then the gate.

      y = w * (x / sqrt(mean_d x_d^2 + eps)) * silu(z)

  x, gate [..., Dv] (gate is z, the x W_z projection per value head),
  weight [Dv] -> [..., Dv] in x's dtype. The normalised x is cast to x's
  dtype before the weight multiplies it, as the reference does.
  """
  chex.assert_equal_shape([x, gate])
  chex.assert_shape(weight, (x.shape[-1],))
  xf = x.astype(jnp.float32)
  normed = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
  return (weight * normed * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def causal_conv(
  x: Array, weight: Array, conv_state: Array | None = None, segment_ids: Array | None = None
) -> tuple[Array, Array]:
  """Depthwise causal conv1d over time, then SiLU, continuing from a state.

  With the K-1 inputs before position 0 taken from `conv_state`
  (x_{-K+1}, ..., x_{-1}; zeros when None), per channel c

      y_t = silu( sum_{j=0}^{K-1} weight[j, c] x_{t-K+1+j, c} )

  so weight[K-1] multiplies the current token. With `segment_ids`, a term
  x_s counts only if s is in t's segment (the state counts as position 0's
  segment), and padding outputs are 0.

  Args:
    x: inputs at times [0, L), [B, L, C] (C = 2 Hk Dk + H Dv for q, k, v).
    weight: [K, C]; transformers' `conv1d.weight` [C, 1, K] is
      `weight[:, 0, :].T`. No bias (Qwen3.5 has none).
    conv_state: inputs at times [-K+1, 0), [B, K-1, C], or None for zeros.
    segment_ids: [B, L] int, 1, 2, ... per packed sequence and 0 for padding,
      or None for one sequence per row.

  Returns:
    y [B, L, C] in x's dtype, and the state a next call continues from:
    the K-1 inputs up to the last real token, [B, K-1, C], with positions
    outside that token's segment zeroed (a row of padding only returns
    `conv_state` unchanged).
  """
  chex.assert_rank([x, weight], [3, 2])
  batch, length, channels = x.shape
  taps = weight.shape[0]
  chex.assert_shape(weight, (taps, channels))
  if conv_state is None:
    conv_state = jnp.zeros((batch, taps - 1, channels), x.dtype)
  chex.assert_shape(conv_state, (batch, taps - 1, channels))
  xs = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, L+K-1, C]
  w = weight.astype(jnp.float32)

  if segment_ids is None:
    pre = sum(w[j] * xs[:, j : j + length].astype(jnp.float32) for j in range(taps))
    return jax.nn.silu(pre).astype(x.dtype), xs[:, length:]

  chex.assert_shape(segment_ids, (batch, length))
  # The state's positions belong to position 0's segment.
  seg_ext = jnp.concatenate([jnp.repeat(segment_ids[:, :1], taps - 1, axis=1), segment_ids], axis=1)
  pre = sum(
    w[j]
    * jnp.where(
      (seg_ext[:, j : j + length] == segment_ids)[..., None],
      xs[:, j : j + length].astype(jnp.float32),
      0.0,
    )
    for j in range(taps)
  )
  y = jnp.where((segment_ids != 0)[..., None], jax.nn.silu(pre), 0.0).astype(x.dtype)

  # The window ending at the last real token t* is ext positions t*+1 .. t*+K-1.
  real = segment_ids != 0
  last = jnp.max(jnp.where(real, jnp.arange(length), -1), axis=1)  # [B], -1: no real token
  idx = jnp.maximum(last, 0)[:, None] + 1 + jnp.arange(taps - 1)  # [B, K-1]
  window = jnp.take_along_axis(xs, idx[..., None], axis=1)
  last_seg = jnp.take_along_axis(segment_ids, jnp.maximum(last, 0)[:, None], axis=1)  # [B, 1]
  keep = jnp.take_along_axis(seg_ext, idx, axis=1) == last_seg
  new_state = jnp.where(keep[..., None], window, 0).astype(x.dtype)
  new_state = jnp.where((last >= 0)[:, None, None], new_state, conv_state.astype(x.dtype))
  return y, new_state


# --------------------------------------------------------------------------
# The gated delta rule
# --------------------------------------------------------------------------


def _segment_resets(segment_ids: Array) -> Array:
  """[B, L] True where a token starts a new segment (its state begins at 0).

  Padding joins the segment before it (forward fill of the nonzero ids), so
  it never starts one: t > 0 starts a segment iff fill_t != fill_{t-1}.
  """
  length = segment_ids.shape[1]
  pos = jnp.where(segment_ids != 0, jnp.arange(length), -1)
  last_real = lax.cummax(pos, axis=1)
  filled = jnp.where(
    last_real >= 0, jnp.take_along_axis(segment_ids, jnp.maximum(last_real, 0), axis=1), 0
  )
  return jnp.concatenate(
    [jnp.zeros_like(filled[:, :1], bool), filled[:, 1:] != filled[:, :-1]], axis=1
  )


def _prepare(q, k, v, g, beta, initial_state, segment_ids, use_qk_l2norm_in_kernel, scale):
  """Checks shapes; returns per-head fp32 inputs [B, H, L, ...] and masks [B, L]."""
  chex.assert_rank([q, k, v, g, beta], [4, 4, 4, 3, 3])
  chex.assert_equal_shape([q, k])
  batch, length, key_heads, dk = k.shape
  heads, dv = v.shape[2:]
  chex.assert_shape(v, (batch, length, heads, dv))
  chex.assert_shape([g, beta], (batch, length, heads))
  if heads % key_heads:
    raise ValueError(f"{heads} value heads do not divide by {key_heads} key heads")
  if initial_state is None:
    initial_state = jnp.zeros((batch, heads, dk, dv), jnp.float32)
  chex.assert_shape(initial_state, (batch, heads, dk, dv))
  if segment_ids is None:
    segment_ids = jnp.ones((batch, length), jnp.int32)
  chex.assert_shape(segment_ids, (batch, length))

  f32 = jnp.float32
  q, k = q.astype(f32), k.astype(f32)
  if use_qk_l2norm_in_kernel:
    q, k = l2norm(q), l2norm(k)
  q = q * (dk**-0.5 if scale is None else scale)
  # Key head i serves value heads i * H/Hk .. (i+1) * H/Hk - 1.
  q, k = (jnp.repeat(x, heads // key_heads, axis=2) for x in (q, k))
  real = segment_ids != 0
  # Padding reads nothing and writes nothing: zero inputs, g = 0, beta = 0.
  q, k, v, g, beta = (
    jnp.where(real.reshape(real.shape + (1,) * (x.ndim - 2)), x.astype(f32), 0.0)
    for x in (q, k, v, g, beta)
  )
  heads_first = lambda x: jnp.moveaxis(x, 2, 1)  # [B, L, H, ...] -> [B, H, L, ...]
  return (
    (heads_first(x) for x in (q, k, v, g, beta)),
    initial_state.astype(f32),
    _segment_resets(segment_ids),
    real,
  )


def _recurrent_one(q, k, v, g, beta, state, resets):
  """One head of one row: q, k [L, Dk], v [L, Dv], g, beta, resets [L], state [Dk, Dv]."""

  def step(s, x):
    q_t, k_t, v_t, g_t, beta_t, reset_t = x
    s = jnp.where(reset_t, 0.0, s) * jnp.exp(g_t)  # S' = exp(g_t) S_{t-1}
    u = beta_t * (v_t - k_t @ s)  # [Dv]
    s = s + jnp.outer(k_t, u)
    return s, q_t @ s

  state, out = lax.scan(step, state, (q, k, v, g, beta, resets))
  return out, state


def recurrent_gated_delta_rule(
  q: Array,
  k: Array,
  v: Array,
  g: Array,
  beta: Array,
  initial_state: Array | None = None,
  segment_ids: Array | None = None,
  use_qk_l2norm_in_kernel: bool = False,
  scale: float | None = None,
) -> tuple[Array, Array]:
  """The gated delta rule token by token (a `lax.scan`): decode step and oracle.

  Per row and value head h, from S_{-1} = initial_state,

      S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - (exp(g_t) S_{t-1})^T k_t)
      o_t = S_t^T q_t

  where q_t is scaled by `scale` (1/sqrt(Dk) by default, as the reference
  always does), after l2norm of q and k if `use_qk_l2norm_in_kernel`
  (Qwen3.5 sets it; the reference's flag of that name). S_{t-1} is read as
  0 at a segment's first token; padding tokens leave S unchanged and output
  0 (see the module docstring).

  Args:
    q, k: times [0, L), [B, L, Hk, Dk]; key head i serves value heads
      i H/Hk .. (i+1) H/Hk - 1.
    v: times [0, L), [B, L, H, Dv].
    g: log decay at times [0, L), [B, L, H], <= 0.
    beta: write strength at times [0, L), [B, L, H], in [0, 1].
    initial_state: S_{-1} [B, H, Dk, Dv] (a slot's state from an earlier
      call), or None for zeros.
    segment_ids: [B, L], 1, 2, ... per packed sequence, 0 for padding; None
      for one sequence per row.
    use_qk_l2norm_in_kernel: l2-normalise q and k (in fp32) first.
    scale: the query scale; None for Dk^-1/2.

  Returns:
    out [B, L, H, Dv] in q's dtype, and the state after the last real token,
    [B, H, Dk, Dv] fp32.
  """
  (qh, kh, vh, gh, bh), state, resets, real = _prepare(
    q, k, v, g, beta, initial_state, segment_ids, use_qk_l2norm_in_kernel, scale
  )
  per_head = jax.vmap(_recurrent_one, in_axes=(0, 0, 0, 0, 0, 0, None))
  out, state = jax.vmap(per_head)(qh, kh, vh, gh, bh, state, resets)  # [B, H, L, Dv]
  out = jnp.where(real[:, :, None, None], jnp.moveaxis(out, 1, 2), 0.0)
  return out.astype(q.dtype), state


@jax.custom_vjp
def unit_lower_inverse(a: Array) -> Array:
  """(I + A)^-1 for A [..., C, C] strictly lower triangular.

  Forward substitution, one row a step: row i of T = (I + A)^-1 is
  e_i - A_i T (A_i is zero from column i on, so only the rows already
  found count): C steps of a [C] x [C, C] product, exact for any A (no
  power series, whose terms can grow like binomial coefficients). It
  replaces `jax.scipy.linalg.solve_triangular`, which XLA:CPU runs far
  slower for some batched shapes (benchmarks/RESULTS.md#kernels). The
  gradient is the closed form dT = -T dA T (`custom_vjp`), so the backward
  pass keeps no per-step residuals.
  """
  c = a.shape[-1]
  eye = jnp.eye(c, dtype=a.dtype)

  def row(i, t):
    new = eye[i] - jnp.einsum("...j,...jk->...k", a[..., i, :], t)
    return t.at[..., i, :].set(new)

  return lax.fori_loop(0, c, row, jnp.zeros_like(a))


def _unit_lower_inverse_fwd(a):
  t = unit_lower_inverse(a)
  return t, t


def _unit_lower_inverse_bwd(t, g):
  # d<g, T> = <g, -T dA T> = <-T^T g T^T, dA>, kept strictly lower (A's support).
  ga = -jnp.einsum("...ji,...jk,...lk->...il", t, g, t)
  return (jnp.tril(ga, -1),)


unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def _chunked_one(q, k, v, g, beta, state, resets, chunk):
  """One head of one row, L a multiple of `chunk`; shapes as `_recurrent_one`."""
  length, dk = k.shape
  n = length // chunk
  to_chunks = lambda x: x.reshape((n, chunk) + x.shape[1:])
  q, k, v, g, beta = (to_chunks(x) for x in (q, k, v, g, beta))
  seg = to_chunks(jnp.cumsum(resets))  # [N, C] segment counter along the row
  seg_in = jnp.concatenate([jnp.zeros((1,), seg.dtype), seg[:-1, -1]])  # [N] at each chunk's start
  cum_g = jnp.cumsum(g, axis=1)  # [N, C]: G_i

  idx = jnp.arange(chunk)
  # D_ij = exp(G_i - G_j) for j <= i in i's segment, else 0. The inner where
  # keeps exp finite (and its gradient free of inf * 0) where it is masked.
  visible = (idx[:, None] >= idx[None, :]) & (seg[:, :, None] == seg[:, None, :])  # [N, C, C]
  log_d = cum_g[:, :, None] - cum_g[:, None, :]
  decay = jnp.where(visible, jnp.exp(jnp.where(visible, log_d, 0.0)), 0.0)
  # exp(G_i) while i still sees the incoming state, 0 after a reset.
  from_start = jnp.where(seg == seg_in[:, None], jnp.exp(cum_g), 0.0)  # [N, C]

  strictly_lower = idx[:, None] > idx[None, :]
  a = jnp.where(strictly_lower, beta[:, :, None] * jnp.einsum("nid,njd->nij", k, k) * decay, 0.0)
  # U_v and W share one solve: (I + A) [U_v, W] = [diag(beta) V, diag(beta exp(G)) K].
  rhs = jnp.concatenate([beta[..., None] * v, (beta * from_start)[..., None] * k], axis=-1)
  u_both = unit_lower_inverse(a) @ rhs
  u_values, u_state = u_both[..., :-dk], u_both[..., -dk:]  # [N, C, Dv], [N, C, Dk]
  attn = jnp.einsum("nid,njd->nij", q, k) * decay  # [N, C, C], diagonal included
  q_state = from_start[..., None] * q  # [N, C, Dk]
  k_end = decay[:, -1, :, None] * k  # [N, C, Dk]: exp(G_C - G_j) k_j
  carry_end = from_start[:, -1]  # [N]

  def step(s, x):
    u_values, u_state, attn, q_state, k_end, carry_end = x
    u = u_values - u_state @ s  # [C, Dv]
    out = q_state @ s + attn @ u
    return carry_end * s + k_end.T @ u, out

  state, out = lax.scan(step, state, (u_values, u_state, attn, q_state, k_end, carry_end))
  return out.reshape(length, -1), state


def chunked_gated_delta_rule(
  q: Array,
  k: Array,
  v: Array,
  g: Array,
  beta: Array,
  chunk: int = 64,
  initial_state: Array | None = None,
  segment_ids: Array | None = None,
  use_qk_l2norm_in_kernel: bool = False,
  scale: float | None = None,
) -> tuple[Array, Array]:
  """The gated delta rule in chunks of `chunk` tokens: training and prefill.

  The same function as `recurrent_gated_delta_rule` (same arguments and
  returns; `chunk` is static, and L need not be a multiple of it: the row
  is padded internally with padding tokens). Inside a chunk with incoming
  state S_0, positions i = 1..C, G_i = g_1 + ... + g_i, unrolling the
  recurrence gives

      S_i = exp(G_i) S_0 + sum_{j<=i} exp(G_i - G_j) k_j u_j^T
      u_i = beta_i v_i - beta_i exp(G_i) S_0^T k_i
            - sum_{j<i} beta_i exp(G_i - G_j) (k_i . k_j) u_j

  that is (I + A) U = diag(beta) V - diag(beta exp(G)) K S_0 with A strictly
  lower triangular, A_ij = beta_i exp(G_i - G_j) k_i . k_j. One unit-lower
  triangular solve per chunk gives U_v = (I + A)^-1 diag(beta) V and
  W = (I + A)^-1 diag(beta exp(G)) K, and then, in a scan over chunks,

      U = U_v - W S_0
      O = diag(exp(G)) Q S_0 + (Q K^T * D) U        D_ij = exp(G_i - G_j), j <= i
      S_C = exp(G_C) S_0 + (diag(D_Cj) K)^T U

  Segment starts inside a chunk zero D_ij across the boundary and exp(G_i)
  for tokens after it, which is the recurrence with S read as 0 there.
  Memory per head O(L (Dk + Dv) + L C), fp32.
  """
  (qh, kh, vh, gh, bh), state, resets, real = _prepare(
    q, k, v, g, beta, initial_state, segment_ids, use_qk_l2norm_in_kernel, scale
  )
  length = q.shape[1]
  pad = -length % chunk
  if pad:
    # Padding tokens: zero inputs (so g = beta = 0) and no reset.
    qh, kh, vh, gh, bh = (
      jnp.pad(x, ((0, 0), (0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 3))
      for x in (qh, kh, vh, gh, bh)
    )
    resets = jnp.pad(resets, ((0, 0), (0, pad)))
  per_head = jax.vmap(lambda *x: _chunked_one(*x, chunk=chunk), in_axes=(0, 0, 0, 0, 0, 0, None))
  out, state = jax.vmap(per_head)(qh, kh, vh, gh, bh, state, resets)  # [B, H, Lp, Dv]
  out = jnp.where(real[:, :, None, None], jnp.moveaxis(out, 1, 2)[:, :length], 0.0)
  return out.astype(q.dtype), state
