"""A Qwen3-style decoder in flax linen (the layers `cfg.layer_specs` lists:
softmax or Gated DeltaNet attention, dense or MoE MLPs), with an optional
decoding cache.

The forward pass is a pure function of (params, tokens, positions,
segment_ids[, cache]):

    Transformer(cfg, head="lm").apply({"params": p}, tokens, positions,
                                      segment_ids, cache=None)
      -> (logits [B, L, V] or values [B, L], aux)

(V is `cfg.head_size`: the vocabulary, or a subset of it with
`cfg.vocab_ids`, sao_jax/models/head_vocab.py; tokens are always the
tokenizer's ids.)

`aux["load_balance_loss"]` is the MoE auxiliary loss averaged over MoE layers
(0 for a dense model);
with a cache, `aux["cache"]` is the updated cache. `head="hidden"` returns the
final (normed) hidden states [B, L, D] instead, for heads applied in chunks
(policy.token_logprobs with `logits_chunk`; `lm_head_weight` and `lm_logits`
give the same LM head).

Two attention modes:

* Packed training rows (no cache): a row may hold several sequences,
  `segment_ids` 1, 2, ... tell them apart and 0 marks padding. A token
  attends to earlier tokens of its own segment. `positions` restart at 0 in
  each segment (they drive the rotary embedding only).
* Incremental decoding (cache given): one sequence per row ("slot").
  `positions` are absolute indices into the cache; the new keys and values
  are written there, and a token at position p attends to cache entries
  0 .. p. Entries past p may hold stale or padding keys; they are never read
  before being overwritten, because position p is always written before it
  is attended to. `segment_ids` 0 marks padding query tokens. With a
  `page_table` [B, M] the cache is a pool of fixed-size pages shared by the
  slots, row b naming slot b's pages (sao_jax/models/paged.py); padding
  tokens are then not written.

Layers. Layer i is `cfg.layer_spec(i)`: its attention kind ("attn":
`Attention`, gated or not, or `LinearAttention`, Gated DeltaNet) and its
MLP ("mlp" params for a dense SwiGLU, "moe" for routed experts, with a
"moe/shared" expert in Qwen3.5-MoE). With `cfg.scan_layers` the run of
repeating layers that ends the stack runs as one `nn.scan`: with period 1
(identical layers) their parameters are stacked under "layers" with a
leading axis named "layers" (so "layers/attn/q" is [n, D, H, hd]); with a
longer period (Qwen3.5's [linear x3, full] block) each step is a `Group`
and layer r of the block is stacked under "layers/sub_r". The layers before
the run (`cfg.scan_prefix`: Qwen3-MoE's dense prefix, none otherwise) stay
unrolled as "layer_0" ... (`ModelConfig.layer_location` says where layer i
lives). Each layer (each group) is rematerialised as `cfg.remat` says.
Training attention is `cfg.attention_impl` (sao_jax/models/attention.py).

LoRA (sao_jax/models/lora.py). `Transformer(cfg, head, lora=lora_cfg)`
takes the frozen base as "params" and the adapters of its layers as a
second collection "lora" (`lora_variables` builds both): each layer (each
scanned step, each prefix layer) merges its own weights, `lora.merge` on
that layer's slice, inside its rematerialised block. Only one layer's
merged weights and their gradient are live at a time, and under remat the
backward recomputes them instead of saving them (a policy that saves dots,
`cfg.remat = "dots_saveable"`, saves each layer's A @ B like any other
dot). The leaves outside the layers (embedding, final norm, heads) are
merged whole by `lora_variables`.

A linear layer's cache is its recurrent state per slot (`LinearAttention`,
sao_jax/models/kv_layout.py), not positions: packed training rows restart
it at each segment, a decode row at position 0 starts it from zeros.

Every parameter and the main activations carry logical axis names
(`sao_jax/models/sharding.py` maps them onto a Mesh with rules from the config):
the residual stream, q / k / v and the attention output, and the MLP / MoE
hidden activations are constrained so GSPMD does not replicate them.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models import attention as attn_lib
from sao_jax.models import deltanet, head_vocab, kv_layout, moe, paged
from sao_jax.models import lora as lora_lib
from sao_jax.models.config import LayerSpec, ModelConfig

Array = jax.Array
# A pytree of {"k", "v"} arrays whose shapes end in [B, S, KVH, hd]: see init_cache.
Cache = kv_layout.Cache

_init = nn.initializers.normal(stddev=0.02)


def _param(module, name, shape, axes, dtype, init=_init):
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def _constrain(x, axes):
  return nn.with_logical_constraint(x, axes)


class RMSNorm(nn.Module):
  """y = w * x_hat (Qwen3), or with `zero_centered` y = (1 + w) * x_hat in
  fp32 with w initialised at 0 (Qwen3.5), x_hat = x / rms(x)."""

  eps: float
  param_dtype: Any
  axis_name: str = "embed"
  zero_centered: bool = False

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.zeros if self.zero_centered else nn.initializers.ones
    scale = _param(self, "scale", (x.shape[-1],), (self.axis_name,), self.param_dtype, init)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + self.eps)
    if self.zero_centered:  # the scale as the compute dtype holds it (precision.py rule 2)
      return (x32 * (1.0 + scale.astype(x.dtype).astype(jnp.float32))).astype(x.dtype)
    return scale.astype(x.dtype) * x32.astype(x.dtype)


def _norm(cfg: ModelConfig, name: str, axis_name: str = "embed") -> RMSNorm:
  return RMSNorm(cfg.rms_eps, cfg.param_dtype, axis_name, cfg.zero_centered_norm, name=name)


def rotary(x: Array, positions: Array, theta: float, dims: int | None = None) -> Array:
  """Rotary embedding, rotate-half convention, on the first `dims` of each
  head (None: all; the rest pass through). x [B, L, N, hd], positions [B, L]."""
  hd = x.shape[-1]
  dims = dims or hd
  if dims < hd:
    return jnp.concatenate([rotary(x[..., :dims], positions, theta), x[..., dims:]], -1)
  inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, L, hd/2]
  emb = jnp.concatenate([freqs, freqs], -1)[:, :, None, :]  # [B, L, 1, hd]
  x1, x2 = jnp.split(x, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], -1)
  out = x.astype(jnp.float32) * jnp.cos(emb) + rotated.astype(jnp.float32) * jnp.sin(emb)
  return out.astype(x.dtype)


class Attention(nn.Module):
  """Softmax attention; with `gated` (a "gated_full" layer) its output is
  multiplied by sigmoid(x W_gate) per head and dim before the output
  projection, W_gate stored with W_q as "q" [D, H, 2 hd], [query | gate]
  per head (transformers' q_proj)."""

  cfg: ModelConfig
  gated: bool = False

  @nn.compact
  def __call__(self, x, positions, segment_ids, cache, layer=None, page_table=None):
    """x [B, L, D] -> ([B, L, D], new cache or None).

    `cache` is this layer's {"k", "v"} [B, S, KVH, hd], or with `layer` (an
    int32 scalar, scanned layers) the stacked [n, B, S, KVH, hd] cache of all
    scanned layers: only this layer's new entries are written into it, so
    the scan carries one cache and never copies it per layer. With
    `page_table` [B, M] the cache is a page pool instead (leaves
    [KVH, P, page, hd], stacked [n, KVH, P, page, hd]; models/paged.py).
    """
    cfg = self.cfg
    d, h, kvh, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    # Gated: "q" is [query | gate] per head, as transformers' q_proj.
    wq = _param(
      self,
      "q",
      (d, h, 2 * hd if self.gated else hd),
      ("embed", "heads", "head_dim"),
      cfg.param_dtype,
    )
    wk = _param(self, "k", (d, kvh, hd), ("embed", "kv_heads", "head_dim"), cfg.param_dtype)
    wv = _param(self, "v", (d, kvh, hd), ("embed", "kv_heads", "head_dim"), cfg.param_dtype)
    wo = _param(self, "o", (h, hd, d), ("heads", "head_dim", "embed"), cfg.param_dtype)
    dt = cfg.dtype
    q = jnp.einsum("bld,dnh->blnh", x, wq.astype(dt))
    if self.gated:
      q, gate = q[..., :hd], q[..., hd:]
    k = jnp.einsum("bld,dnh->blnh", x, wk.astype(dt))
    v = jnp.einsum("bld,dnh->blnh", x, wv.astype(dt))
    q = _norm(cfg, "q_norm", "head_dim")(q)
    k = _norm(cfg, "k_norm", "head_dim")(k)
    q = rotary(q, positions, cfg.rope_theta, cfg.rotary_dims)
    k = rotary(k, positions, cfg.rope_theta, cfg.rotary_dims)
    q = _constrain(q, ("batch", "length", "heads", "head_dim"))
    k = _constrain(k, ("batch", "length", "kv_heads", "head_dim"))
    v = _constrain(v, ("batch", "length", "kv_heads", "head_dim"))

    if cache is None:
      out = self._packed_attention(q, k, v, segment_ids)
      new_cache = None
    elif page_table is not None:  # a paged cache: this layer's pool (models/paged.py)
      out, new_cache = paged.attend(
        cfg, q, k, v, cache, page_table, positions, segment_ids != 0, layer
      )
    else:
      b_idx = jnp.arange(x.shape[0])[:, None]
      new_k, new_v = k.astype(cache["k"].dtype), v.astype(cache["v"].dtype)
      if layer is None:
        k_all = cache["k"].at[b_idx, positions].set(new_k, mode="drop")
        v_all = cache["v"].at[b_idx, positions].set(new_v, mode="drop")
        new_cache = {"k": k_all, "v": v_all}
      else:
        new_cache = {
          "k": cache["k"].at[layer, b_idx, positions].set(new_k, mode="drop"),
          "v": cache["v"].at[layer, b_idx, positions].set(new_v, mode="drop"),
        }
        k_all, v_all = new_cache["k"][layer], new_cache["v"][layer]  # [B, S, KVH, hd]
      k, v = k_all.astype(dt), v_all.astype(dt)
      # A decode step on CPU reads the cache as stored; a prefill chunk
      # attends in key blocks (attention.cache_attention says which when).
      out = attn_lib.cache_attention(q, k, v, positions, cfg.attention_impl, cfg.attention_block)

    out = _constrain(out, ("batch", "length", "heads", "head_dim"))
    if self.gated:
      out = out * jax.nn.sigmoid(gate)
    out = jnp.einsum("blnh,nhd->bld", out, wo.astype(dt))
    return out, new_cache

  def _packed_attention(self, q, k, v, segment_ids):
    """Training attention over packed rows, by `cfg.attention_impl`."""
    cfg = self.cfg
    impl = cfg.attention_impl
    if impl == "splash" and attn_lib.splash_usable(q.shape[1], cfg.attention_block):
      return attn_lib.splash_attention(q, k, v, segment_ids, cfg.attention_block)
    if impl in ("chunked", "splash"):
      return attn_lib.chunked_attention(q, k, v, segment_ids, cfg.attention_block)
    return attn_lib.reference_attention(q, k, v, attn_lib.packed_causal_mask(segment_ids))


# A Gated DeltaNet layer's cache entries: the conv inputs of q, k and v
# before the next token, and the delta-rule state (LinearAttention).
LINEAR_CACHE = ("conv_q", "conv_k", "conv_v", "state")


class LinearAttention(nn.Module):
  """Gated DeltaNet (a "linear" layer; the math is sao_jax/models/deltanet.py).

  q, k and v have projections and conv weights of their own (transformers
  fuses them as in_proj_qkv / conv1d, channels [q | k | v]), so each splits
  by its own heads on a mesh. Training rows reset the recurrence at packed
  segment starts. With a cache (this layer's LINEAR_CACHE entries, per slot:
  conv [B, K-1, heads, dim], state [B, H, Dk, Dv] fp32; stacked [n, ...]
  with `layer`), a row whose first token is at position 0 starts from zeros
  and every other row continues its slot's state; a row of padding leaves it
  as it was. Pages play no part: the state has one size per slot.
  """

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, positions, segment_ids, cache, layer=None):
    cfg = self.cfg
    d, hk, h = cfg.d_model, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, taps, dt, pd = (
      cfg.linear_key_head_dim,
      cfg.linear_value_head_dim,
      cfg.linear_conv_kernel,
      cfg.dtype,
      cfg.param_dtype,
    )
    shapes = {"q": (hk, dk, "kv_heads"), "k": (hk, dk, "kv_heads"), "v": (h, dv, "heads")}
    mixed, conv_states = {}, {}
    fresh = None if cache is None else (positions[:, 0] == 0)
    for name, (n, dim, axis) in shapes.items():
      w = _param(self, name, (d, n, dim), ("embed", axis, "head_dim"), pd)
      cw = _param(self, f"conv_{name}", (taps, n, dim), (None, axis, "head_dim"), pd)
      y = jnp.einsum("bld,dnh->blnh", x, w.astype(dt))
      b, length = y.shape[:2]
      state = None if cache is None else self._read(cache, f"conv_{name}", layer, fresh)
      out, state = deltanet.causal_conv(
        y.reshape(b, length, n * dim),
        cw.astype(dt).reshape(taps, n * dim),
        None if state is None else state.reshape(b, taps - 1, n * dim).astype(dt),
        segment_ids,
      )
      mixed[name] = _constrain(
        out.reshape(b, length, n, dim), ("batch", "length", axis, "head_dim")
      )
      conv_states[f"conv_{name}"] = state.reshape(b, taps - 1, n, dim)
    wa, wb = (_param(self, name, (d, h), ("embed", "heads"), pd) for name in ("a", "b"))
    a_log = _param(self, "a_log", (h,), ("heads",), pd, nn.initializers.zeros)
    dt_bias = _param(self, "dt_bias", (h,), ("heads",), pd, nn.initializers.ones)
    # Every weight in the compute dtype first, as the engine holds it
    # (precision.py, rule 2); decay_and_beta then works in fp32.
    g, beta = deltanet.decay_and_beta(
      x @ wa.astype(dt), x @ wb.astype(dt), a_log.astype(dt), dt_bias.astype(dt)
    )
    rule_args = dict(
      initial_state=None if cache is None else self._read(cache, "state", layer, fresh),
      segment_ids=segment_ids,
      use_qk_l2norm_in_kernel=True,
    )
    if cache is not None and x.shape[1] == 1:
      out, state = deltanet.recurrent_gated_delta_rule(
        mixed["q"], mixed["k"], mixed["v"], g, beta, **rule_args
      )
    else:
      out, state = deltanet.chunked_gated_delta_rule(
        mixed["q"], mixed["k"], mixed["v"], g, beta, chunk=cfg.deltanet_chunk, **rule_args
      )
    wz = _param(self, "z", (d, h, dv), ("embed", "heads", "head_dim"), pd)
    norm = _param(self, "norm", (dv,), ("head_dim",), pd, nn.initializers.ones)
    out = deltanet.gated_rms_norm(
      out.astype(dt), jnp.einsum("bld,dnh->blnh", x, wz.astype(dt)), norm.astype(dt), cfg.rms_eps
    )
    out = _constrain(out, ("batch", "length", "heads", "head_dim"))
    wo = _param(self, "o", (h, dv, d), ("heads", "head_dim", "embed"), pd)
    out = jnp.einsum("blnh,nhd->bld", out, wo.astype(dt))
    if cache is None:
      return out, None
    new = dict(conv_states, state=state)
    if layer is None:
      return out, {n: new[n].astype(cache[n].dtype) for n in LINEAR_CACHE}
    return out, {n: cache[n].at[layer].set(new[n].astype(cache[n].dtype)) for n in LINEAR_CACHE}

  @staticmethod
  def _read(cache, name, layer, fresh):
    """This layer's slot states of `name`, zeroed where a row starts afresh."""
    x = cache[name] if layer is None else cache[name][layer]
    return jnp.where(fresh.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.zeros_like(x), x)


class DenseMLP(nn.Module):
  """A SwiGLU of width `d_ff` (0: `cfg.dense_d_ff`)."""

  cfg: ModelConfig
  d_ff: int = 0

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    d, f = cfg.d_model, self.d_ff or cfg.dense_d_ff
    wg = _param(self, "wi_gate", (d, f), ("embed", "mlp"), cfg.param_dtype)
    wu = _param(self, "wi_up", (d, f), ("embed", "mlp"), cfg.param_dtype)
    wd = _param(self, "wo", (f, d), ("mlp", "embed"), cfg.param_dtype)
    dt = cfg.dtype
    hidden = jax.nn.silu(x @ wg.astype(dt)) * (x @ wu.astype(dt))  # [B, L, F]
    hidden = _constrain(hidden, ("batch", "length", "mlp"))
    return hidden @ wd.astype(dt)


class MoE(nn.Module):
  """Top-k routed SwiGLU experts (Qwen3-MoE's sparse block), plus with
  `cfg.shared_expert_d_ff` a shared SwiGLU expert every token passes
  through, scaled by sigmoid(x W_sg) (Qwen3.5-MoE's shared_expert)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, token_mask, routing=None):
    """x [B, L, D], token_mask [B, L]; `routing` [B, L, k] int replays expert
    choices (routing replay: -1 at a token keeps the router's own top-k).

    The router's choices are sown as intermediates "moe_top_i", [k, B*L]
    (free unless the caller asks for intermediates; models/routing.py reads them). Replayed choices take
    their gate weights from this router's probabilities at those experts,
    renormalised as `norm_topk_prob` says, so the router still learns.
    """
    cfg = self.cfg
    d, f, e, top_k = cfg.d_model, cfg.moe_d_ff, cfg.num_experts, cfg.experts_per_token
    router = _param(self, "router", (d, e), ("embed", None), cfg.param_dtype)
    dt = cfg.dtype
    wg, wu, wd = (
      _param(self, name, shape, axes, cfg.param_dtype).astype(dt)
      for name, shape, axes in (
        ("wi_gate", (e, d, f), ("expert", "embed", "mlp")),
        ("wi_up", (e, d, f), ("expert", "embed", "mlp")),
        ("wo", (e, f, d), ("expert", "mlp", "embed")),
      )
    )
    xf = x.reshape(-1, d)  # [N, D]
    router_logits = (xf @ router.astype(dt)).astype(jnp.float32)  # [N, E]
    probs = jax.nn.softmax(router_logits, -1)
    top_p, top_i = jax.lax.top_k(probs, top_k)  # [N, k]
    # Sown as [k, N]: a minor dimension of k (8) would be padded to a TPU
    # tile's 128 lanes in every buffer that stacks it (16x the bytes).
    self.sow("intermediates", "moe_top_i", top_i.T)
    if routing is not None:
      forced = routing.reshape(-1, top_k).astype(top_i.dtype)
      replay = (forced >= 0).all(-1, keepdims=True)
      top_i = jnp.where(replay, forced, top_i)
      top_p = jnp.take_along_axis(probs, top_i, axis=-1)
    if cfg.norm_topk_prob:
      top_p = top_p / top_p.sum(-1, keepdims=True)
    top_p = top_p.astype(dt)
    dense = functools.partial(_dense_experts, wg=wg, wu=wu, wd=wd)

    # Blocked rows: N*k plus up to a block per expert; dense rows: N*E;
    # calls too small to block: E * small_capacity rows when no expert's
    # load exceeds it, else dense (capacity_or_dense: nothing is dropped).
    if cfg.moe_impl == "blocked" and xf.shape[0] * (e - top_k) > e * cfg.moe_block:
      out = moe.blocked_moe(xf, top_i, top_p, wg, wu, wd, block=cfg.moe_block)
    elif cfg.moe_impl == "blocked":
      out = moe.capacity_or_dense(xf, top_i, top_p, wg, wu, wd, dense)
    elif cfg.moe_impl == "dense":
      out = dense(xf, top_i, top_p)
    elif cfg.moe_impl == "expert_parallel":
      out, dropped = moe.expert_parallel_moe(
        xf,
        top_i,
        top_p,
        wg,
        wu,
        wd,
        token_mask=token_mask.reshape(-1),
        capacity_factor=cfg.moe_capacity_factor,
        dispatch_chunk=cfg.moe_dispatch_chunk,
      )
      self.sow("intermediates", "moe_dropped", dropped)
    else:
      out = _ragged_experts(xf, top_i, top_p, wg, wu, wd)
    out = out.reshape(x.shape)
    if cfg.shared_expert_d_ff:
      shared = DenseMLP(cfg, cfg.shared_expert_d_ff, name="shared")(x)
      w_sg = _param(self, "shared_gate", (d, 1), ("embed", None), cfg.param_dtype)
      out = out + jax.nn.sigmoid(x @ w_sg.astype(dt)) * shared
    return out, _load_balance(top_i, probs, token_mask)


def _dense_experts(xf, top_i, top_p, *, wg, wu, wd):
  """Every expert on every row [N, D], the top-k gates [N, k] applied before
  the down projection (N*E rows of work; nothing dropped)."""
  e = wg.shape[0]
  gates = (
    jnp.zeros((xf.shape[0], e), top_p.dtype).at[jnp.arange(xf.shape[0])[:, None], top_i].set(top_p)
  )  # [N, E]
  # Batched over experts, every weight in its stored [E, ...] layout (no
  # per-call transpose of the expert weights).
  xe = jnp.broadcast_to(xf, (e,) + xf.shape)  # [E, N, D]
  hidden = jax.nn.silu(jnp.einsum("end,edf->enf", xe, wg)) * jnp.einsum("end,edf->enf", xe, wu)
  hidden = hidden * gates.T[:, :, None]
  hidden = _constrain(hidden, ("expert", "batch", "mlp"))  # [E, N, F], N = B * L
  return jnp.einsum("enf,efd->end", hidden, wd).sum(0)


def _ragged_experts(xf, top_i, top_p, wg, wu, wd):
  """The N*k (row, expert) pairs sorted by expert and run as grouped matmuls
  (`jax.lax.ragged_dot`), then scattered back and summed under the gates."""
  top_k, e, d = top_i.shape[-1], wg.shape[0], xf.shape[-1]
  flat_e = top_i.reshape(-1)  # [N*k]
  order = jnp.argsort(flat_e)
  xs = xf[order // top_k]  # [N*k, D], grouped by expert
  sizes = jnp.bincount(flat_e, length=e).astype(jnp.int32)
  hidden = jax.nn.silu(jax.lax.ragged_dot(xs, wg, sizes)) * jax.lax.ragged_dot(xs, wu, sizes)
  ys = jax.lax.ragged_dot(hidden, wd, sizes)  # [N*k, D]
  ys = jnp.zeros_like(ys).at[order].set(ys).reshape(-1, top_k, d)
  return jnp.einsum("nkd,nk->nd", ys, top_p)


def _load_balance(top_i, probs, token_mask):
  """Load balancing (Switch / Qwen3-MoE form): E * sum_e f_e * P_e over the
  real tokens, f_e = top-k assignments to e per token, P_e = mean prob."""
  e = probs.shape[-1]
  w = token_mask.reshape(-1).astype(jnp.float32)
  n = jnp.maximum(w.sum(), 1.0)
  assign = jax.nn.one_hot(top_i, e, dtype=jnp.float32).sum(1)  # [N, E]
  f_e = (assign * w[:, None]).sum(0) / n
  p_e = (probs * w[:, None]).sum(0) / n
  return e * jnp.sum(f_e * p_e)


class Block(nn.Module):
  """One pre-norm layer, in the (carry, x) -> (carry, y) form `nn.scan` needs.

  carry = (residual stream [B, L, D], cache); returns ((x, new cache), aux)
  with aux the MoE load-balancing loss (None for a dense layer). `spec` is
  the layer's kinds (`ModelConfig.layer_spec`). `layer` is
  the index into a stacked cache (scanned layers), None otherwise;
  `page_table` [B, M] when the cache is a page pool (models/paged.py).
  """

  cfg: ModelConfig
  spec: LayerSpec

  @nn.compact
  def __call__(self, carry, positions, segment_ids, layer=None, page_table=None, routing=None):
    cfg = self.cfg
    x, cache = carry
    normed = _norm(cfg, "attn_norm")(x)
    if self.spec.attention == "linear":
      h, new_cache = LinearAttention(cfg, name="attn")(normed, positions, segment_ids, cache, layer)
    else:
      h, new_cache = Attention(cfg, self.spec.attention == "gated_full", name="attn")(
        normed, positions, segment_ids, cache, layer, page_table
      )
    x = x + h
    y = _norm(cfg, "mlp_norm")(x)
    if self.spec.mlp == "dense":
      y, aux = DenseMLP(cfg, name="mlp")(y), None
    else:
      y, aux = MoE(cfg, name="moe")(y, segment_ids != 0, routing)
    x = _constrain(x + y, ("batch", "length", "embed"))
    return (x, new_cache), aux


class Group(nn.Module):
  """`cfg.scan_period` layers in a row ("sub_0", ...): one step of the scan
  over a periodic stack (Qwen3.5's three linear layers and a full one).

  Same (carry, ...) -> (carry, aux) form as `Block`; the cache is a dict
  of the sub-layers' caches, `routing` [m, B, L, k] the group's m MoE
  layers' rows, aux [m] their load-balancing losses (None when m is 0).
  """

  cfg: ModelConfig
  specs: tuple[LayerSpec, ...]

  @nn.compact
  def __call__(self, carry, positions, segment_ids, layer=None, page_table=None, routing=None):
    x, cache = carry
    new_cache, aux, moe_index = {}, [], 0
    for r, spec in enumerate(self.specs):
      name = f"sub_{r}"
      sub_routing = None if routing is None or not spec.is_moe else routing[moe_index]
      moe_index += spec.is_moe
      (x, sub_cache), sub_aux = Block(self.cfg, spec, name=name)(
        (x, None if cache is None else cache[name]),
        positions,
        segment_ids,
        layer,
        page_table,
        sub_routing,
      )
      new_cache[name] = sub_cache
      if sub_aux is not None:
        aux.append(sub_aux)
    return (x, None if cache is None else new_cache), (jnp.stack(aux) if aux else None)


def _block_class(cfg: ModelConfig, scanned: bool, cls=Block, lora_cfg=None):
  """`cls` (a Block, or a scanned Group), rematerialised as `cfg.remat` says;
  with `lora_cfg` it first merges its "lora" adapters into its params
  (`_merge_layer`), inside the remat, so the merge is recomputed, not saved.

  Under a scan, common-subexpression elimination cannot merge the recomputed
  forward into the backward across loop iterations, so `prevent_cse` (extra
  barriers) is only needed for unrolled layers.
  """
  if lora_cfg is not None:
    cls = nn.map_variables(
      cls, ("params", LORA), trans_in_fn=functools.partial(_merge_layer, lora_cfg)
    )
  if cfg.remat == "none":
    return cls
  policy = (
    jax.checkpoint_policies.nothing_saveable
    if cfg.remat == "full"
    else getattr(jax.checkpoint_policies, cfg.remat)
  )
  return nn.remat(cls, policy=policy, prevent_cse=not scanned)


# The variable collection of a LoRA forward's layer adapters (`lora_variables`).
LORA = "lora"
# Top-level param keys of layers: the scanned stack and the unrolled ones.
_LAYER_KEY = re.compile(r"^(layers|layer_\d+)$")


def _merge_layer(lora_cfg: lora_lib.LoraConfig, variables: dict) -> dict:
  """One layer's (one scan step's) params with its adapters merged: `lora.merge`
  on the layer's slice of the base and of the adapters ({} if it has none)."""
  return {"params": lora_lib.merge(variables["params"], variables.get(LORA, {}), lora_cfg)}


def lora_variables(base, adapters, lora_cfg: lora_lib.LoraConfig) -> dict:
  """The variables of `Transformer(..., lora=lora_cfg)` for adapters over `base`.

  "params": `base` with the leaves outside the layers (embedding, final
  norm, heads) merged (`lora.merge`), the layers' as they are; LORA: the
  layers' adapters, which each layer merges into its own weights. The
  forward equals that of `lora.merge(base, adapters, lora_cfg)`.
  """
  outside = {k: v for k, v in base.items() if not _LAYER_KEY.match(k)}
  params = {**base, **lora_lib.merge(outside, adapters, lora_cfg)}
  return {"params": params, LORA: {k: v for k, v in adapters.items() if _LAYER_KEY.match(k)}}


def lm_head_weight(cfg: ModelConfig, params) -> Array:
  """The LM head [D, V] of policy params (the embedding's transpose when tied).

  V is `cfg.head_size`: the vocabulary, or the subset of `cfg.vocab_ids`.
  """
  if cfg.tie_embeddings:
    return params["embed"][: cfg.head_size].T
  return params["lm_head"]


def lm_logits(cfg: ModelConfig, x: Array, w: Array) -> Array:
  """fp32 logits [..., V] of final hidden states x [..., D] under head w [D, V]."""
  return (x @ w.astype(cfg.dtype)).astype(jnp.float32)


class Transformer(nn.Module):
  """The trunk with an LM head ("lm": logits), a scalar head ("value"), or
  none ("hidden": final hidden states, for a head applied in chunks).
  `lora`: the adapters' config when the variables carry LoRA adapters
  (`lora_variables`; module docstring)."""

  cfg: ModelConfig
  head: str = "lm"
  lora: lora_lib.LoraConfig | None = None

  @nn.compact
  def __call__(
    self, tokens, positions, segment_ids, cache: Cache | None = None, page_table=None, routing=None
  ):
    """`routing` [M, B, L, k] int: expert choices to replay in the M MoE
    layers, in layer order (`MoE`; -1 rows keep the router's choice)."""
    cfg = self.cfg
    if self.head not in ("lm", "value", "hidden"):
      raise ValueError(f"head must be 'lm', 'value' or 'hidden', got {self.head!r}")
    # Tokens are the tokenizer's ids; with a head subset (cfg.vocab_ids) the
    # table has a row per covered id and one shared by the rest.
    embedding = _param(
      self,
      "embed",
      (head_vocab.embedding_rows(cfg), cfg.d_model),
      ("vocab", "embed"),
      cfg.param_dtype,
    )
    x = jnp.take(embedding, head_vocab.index(cfg, tokens), axis=0).astype(cfg.dtype)
    x = _constrain(x, ("batch", "length", "embed"))
    block = _block_class(cfg, scanned=False, lora_cfg=self.lora)
    # Unrolled layers: all of them, or those before the scanned run.
    unrolled = cfg.unrolled_layers
    new_cache = {} if cfg.scan_layers else []
    aux_losses = []
    moe_index = 0  # the next MoE layer's row of `routing`
    for i in range(unrolled):
      name = f"layer_{i}"
      layer_cache = None if cache is None else cache[name if cfg.scan_layers else i]
      spec = cfg.layer_spec(i)
      layer_routing = None if routing is None or not spec.is_moe else routing[moe_index]
      moe_index += spec.is_moe
      (x, layer_cache), aux = block(cfg, spec=spec, name=name)(
        (x, layer_cache), positions, segment_ids, None, page_table, layer_routing
      )
      if cfg.scan_layers:
        new_cache[name] = layer_cache
      else:
        new_cache.append(layer_cache)
      if aux is not None:
        aux_losses.append(aux[None])
    if cfg.scan_layers:
      x, stacked, layer_aux = self._scanned(
        x,
        positions,
        segment_ids,
        cache,
        page_table,
        None if routing is None else routing[moe_index:],
      )
      new_cache["layers"] = stacked
      if layer_aux is not None:
        aux_losses.append(layer_aux.reshape(-1))  # [steps * MoE layers a step]
    x = _norm(cfg, "final_norm")(x)
    aux = {
      "load_balance_loss": (
        jnp.mean(jnp.concatenate(aux_losses)) if aux_losses else jnp.zeros((), jnp.float32)
      )
    }
    if cache is not None:
      aux["cache"] = new_cache
    if self.head == "hidden":
      return _constrain(x, ("batch", "length", "embed")), aux
    if self.head == "value":
      w = _param(
        self,
        "value_head",
        (cfg.d_model, 1),
        ("embed", None),
        cfg.param_dtype,
        nn.initializers.zeros,
      )
      b = _param(self, "value_bias", (1,), (None,), cfg.param_dtype, nn.initializers.zeros)
      values = (x.astype(jnp.float32) @ w.astype(jnp.float32) + b.astype(jnp.float32))[..., 0]
      return values, aux
    if cfg.tie_embeddings:
      w = embedding[: cfg.head_size].T
    else:
      w = _param(self, "lm_head", (cfg.d_model, cfg.head_size), ("embed", "vocab"), cfg.param_dtype)
    logits = _constrain(lm_logits(cfg, x, w), ("batch", "length", "vocab"))
    return logits, aux

  def _scanned(self, x, positions, segment_ids, cache, page_table, routing):
    """The scanned layers (after `cfg.scan_prefix`) as one `nn.scan` of
    `cfg.scan_steps` steps: a Block each (period 1) or a Group of
    `cfg.scan_period` layers. Returns (x, the stacked cache, aux [steps, ...]
    or None without MoE layers); `routing` [M', B, L, k] the scanned MoE
    layers' rows in layer order, or None."""
    cfg, period, steps = self.cfg, self.cfg.scan_period, self.cfg.scan_steps
    specs = cfg.layer_specs[cfg.scan_prefix : cfg.scan_prefix + period]
    moe_per_step = sum(s.is_moe for s in specs)
    if period == 1:
      module, kwargs = Block, {"spec": specs[0]}
    else:
      module, kwargs = Group, {"specs": specs}
      if routing is not None and moe_per_step:
        routing = routing.reshape((steps, moe_per_step) + routing.shape[1:])
    scanned = nn.scan(
      _block_class(cfg, scanned=True, cls=module, lora_cfg=self.lora),
      variable_axes={"params": 0, LORA: 0, "intermediates": 0},
      split_rngs={"params": True},
      in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast, 0),
      length=steps,
      metadata_params={nn.PARTITION_NAME: "layers"},
    )
    (x, stacked), aux = scanned(cfg, name="layers", **kwargs)(
      (x, None if cache is None else cache["layers"]),
      positions,
      segment_ids,
      jnp.arange(steps, dtype=jnp.int32),
      page_table,
      routing if moe_per_step else None,
    )
    return x, stacked, (aux if moe_per_step else None)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> Cache:
  """An empty KV cache of `batch` slots, `max_len` positions each.

  Layout (every leaf is a {"k" | "v"} array ending in [B, S, KVH, hd], batch
  at axis -4, so slot-wise code can index `[..., slot, :, :, :]`):

  * unscanned layers: a list, entry i = layer i's {"k", "v"} [B, S, KVH, hd];
  * `cfg.scan_layers`: a dict mirroring the parameter names, "layer_i" for
    each unrolled dense-prefix layer ([B, S, KVH, hd]) and "layers" for the
    scanned layers, stacked: {"k", "v"} [n, B, S, KVH, hd].
  """
  return kv_layout.kv_tree(cfg, (batch, max_len, cfg.num_kv_heads, cfg.head_dim), batch, dtype)
