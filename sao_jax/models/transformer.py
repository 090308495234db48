"""A Qwen3-MoE-style decoder in flax linen, with an optional KV cache.

The forward pass is a pure function of (params, tokens, positions,
segment_ids[, cache]):

    Transformer(cfg, head="lm").apply({"params": p}, tokens, positions,
                                      segment_ids, cache=None)
      -> (logits [B, L, V] or values [B, L], aux)

`aux["load_balance_loss"]` is the MoE auxiliary loss averaged over MoE layers;
with a cache, `aux["cache"]` is the updated cache.

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
  is attended to. `segment_ids` 0 marks padding query tokens.

Every parameter and the main activations carry logical axis names
(`sao_jax/sharding.py` maps them onto a Mesh with rules from the config).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig

Array = jax.Array
Cache = list  # per layer: {"k": [B, S, KVH, hd], "v": [B, S, KVH, hd]}

_init = nn.initializers.normal(stddev=0.02)


def _param(module, name, shape, axes, dtype, init=_init):
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def _constrain(x, axes):
  return nn.with_logical_constraint(x, axes)


class RMSNorm(nn.Module):
  eps: float
  param_dtype: Any
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x):
    scale = _param(self, "scale", (x.shape[-1],), (self.axis_name,),
                   self.param_dtype, nn.initializers.ones)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + self.eps)
    return scale.astype(x.dtype) * x32.astype(x.dtype)


def rotary(x: Array, positions: Array, theta: float) -> Array:
  """Rotary embedding, rotate-half convention. x [B, L, N, hd], positions [B, L]."""
  hd = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, L, hd/2]
  emb = jnp.concatenate([freqs, freqs], -1)[:, :, None, :]  # [B, L, 1, hd]
  x1, x2 = jnp.split(x, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], -1)
  out = x.astype(jnp.float32) * jnp.cos(emb) + rotated.astype(jnp.float32) * jnp.sin(emb)
  return out.astype(x.dtype)


class Attention(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, positions, segment_ids, cache):
    cfg = self.cfg
    d, h, kvh, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    wq = _param(self, "q", (d, h, hd), ("embed", "heads", "head_dim"), cfg.param_dtype)
    wk = _param(self, "k", (d, kvh, hd), ("embed", "kv_heads", "head_dim"), cfg.param_dtype)
    wv = _param(self, "v", (d, kvh, hd), ("embed", "kv_heads", "head_dim"), cfg.param_dtype)
    wo = _param(self, "o", (h, hd, d), ("heads", "head_dim", "embed"), cfg.param_dtype)
    dt = cfg.dtype
    q = jnp.einsum("bld,dnh->blnh", x, wq.astype(dt))
    k = jnp.einsum("bld,dnh->blnh", x, wk.astype(dt))
    v = jnp.einsum("bld,dnh->blnh", x, wv.astype(dt))
    q = RMSNorm(cfg.rms_eps, cfg.param_dtype, "head_dim", name="q_norm")(q)
    k = RMSNorm(cfg.rms_eps, cfg.param_dtype, "head_dim", name="k_norm")(k)
    q = rotary(q, positions, cfg.rope_theta)
    k = rotary(k, positions, cfg.rope_theta)
    q = _constrain(q, ("batch", "length", "heads", "head_dim"))

    if cache is None:
      idx = jnp.arange(x.shape[1])
      allowed = ((segment_ids[:, :, None] == segment_ids[:, None, :])
                 & (segment_ids[:, None, :] != 0)
                 & (idx[None, :, None] >= idx[None, None, :]))  # [B, Lq, Lk]
      new_cache = None
    else:
      b_idx = jnp.arange(x.shape[0])[:, None]
      k_all = cache["k"].at[b_idx, positions].set(k.astype(cache["k"].dtype), mode="drop")
      v_all = cache["v"].at[b_idx, positions].set(v.astype(cache["v"].dtype), mode="drop")
      new_cache = {"k": k_all, "v": v_all}
      k, v = k_all.astype(dt), v_all.astype(dt)
      key_pos = jnp.arange(k.shape[1])
      allowed = key_pos[None, None, :] <= positions[:, :, None]  # [B, Lq, S]

    groups = h // kvh
    qg = q.reshape(q.shape[:2] + (kvh, groups, hd))
    logits = jnp.einsum("bqngh,bknh->bngqk", qg, k).astype(jnp.float32)
    logits = logits / jnp.sqrt(jnp.float32(hd))
    logits = jnp.where(allowed[:, None, None], logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1).astype(dt)
    out = jnp.einsum("bngqk,bknh->bqngh", probs, v).reshape(q.shape)
    out = jnp.einsum("blnh,nhd->bld", out, wo.astype(dt))
    return out, new_cache


def _swiglu(x, w_gate, w_up, w_down):
  return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


class DenseMLP(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    d, f = cfg.d_model, cfg.dense_d_ff
    wg = _param(self, "wi_gate", (d, f), ("embed", "mlp"), cfg.param_dtype)
    wu = _param(self, "wi_up", (d, f), ("embed", "mlp"), cfg.param_dtype)
    wd = _param(self, "wo", (f, d), ("mlp", "embed"), cfg.param_dtype)
    dt = cfg.dtype
    return _swiglu(x, wg.astype(dt), wu.astype(dt), wd.astype(dt))


class MoE(nn.Module):
  """Top-k routed SwiGLU experts (Qwen3-MoE's sparse block)."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, token_mask):
    cfg = self.cfg
    d, f, e, top_k = cfg.d_model, cfg.moe_d_ff, cfg.num_experts, cfg.experts_per_token
    router = _param(self, "router", (d, e), ("embed", None), cfg.param_dtype)
    wg = _param(self, "wi_gate", (e, d, f), ("expert", "embed", "mlp"), cfg.param_dtype)
    wu = _param(self, "wi_up", (e, d, f), ("expert", "embed", "mlp"), cfg.param_dtype)
    wd = _param(self, "wo", (e, f, d), ("expert", "mlp", "embed"), cfg.param_dtype)
    dt = cfg.dtype
    shape = x.shape
    xf = x.reshape(-1, d)  # [N, D]
    router_logits = (xf @ router.astype(dt)).astype(jnp.float32)  # [N, E]
    probs = jax.nn.softmax(router_logits, -1)
    top_p, top_i = jax.lax.top_k(probs, top_k)  # [N, k]
    if cfg.norm_topk_prob:
      top_p = top_p / top_p.sum(-1, keepdims=True)
    top_p = top_p.astype(dt)

    if cfg.moe_impl == "dense":
      gates = jnp.zeros_like(probs, dtype=dt).at[
          jnp.arange(xf.shape[0])[:, None], top_i].set(top_p)  # [N, E]
      hidden = jax.nn.silu(jnp.einsum("nd,edf->nef", xf, wg.astype(dt))) * jnp.einsum(
          "nd,edf->nef", xf, wu.astype(dt))
      out = jnp.einsum("nef,efd,ne->nd", hidden, wd.astype(dt), gates)
    else:
      flat_e = top_i.reshape(-1)  # [N*k]
      order = jnp.argsort(flat_e)
      xs = xf[order // top_k]  # [N*k, D], grouped by expert
      sizes = jnp.bincount(flat_e, length=e).astype(jnp.int32)
      hidden = jax.nn.silu(jax.lax.ragged_dot(xs, wg.astype(dt), sizes)) * jax.lax.ragged_dot(
          xs, wu.astype(dt), sizes)
      ys = jax.lax.ragged_dot(hidden, wd.astype(dt), sizes)  # [N*k, D]
      ys = jnp.zeros_like(ys).at[order].set(ys).reshape(-1, top_k, d)
      out = jnp.einsum("nkd,nk->nd", ys, top_p)

    # Load balancing (Switch / Qwen3-MoE form): E * sum_e f_e * P_e over the
    # real tokens, f_e = top-k assignments to e per token, P_e = mean prob.
    w = token_mask.reshape(-1).astype(jnp.float32)
    n = jnp.maximum(w.sum(), 1.0)
    assign = jax.nn.one_hot(top_i, e, dtype=jnp.float32).sum(1)  # [N, E]
    f_e = (assign * w[:, None]).sum(0) / n
    p_e = (probs * w[:, None]).sum(0) / n
    aux = e * jnp.sum(f_e * p_e)
    return out.reshape(shape), aux


class Block(nn.Module):
  cfg: ModelConfig
  dense: bool

  @nn.compact
  def __call__(self, x, positions, segment_ids, cache):
    cfg = self.cfg
    h, new_cache = Attention(cfg, name="attn")(
        RMSNorm(cfg.rms_eps, cfg.param_dtype, name="attn_norm")(x),
        positions, segment_ids, cache)
    x = x + h
    y = RMSNorm(cfg.rms_eps, cfg.param_dtype, name="mlp_norm")(x)
    if self.dense:
      y, aux = DenseMLP(cfg, name="mlp")(y), None
    else:
      y, aux = MoE(cfg, name="moe")(y, segment_ids != 0)
    x = _constrain(x + y, ("batch", "length", "embed"))
    return x, new_cache, aux


class Transformer(nn.Module):
  """The trunk with an LM head ("lm": logits) or a scalar head ("value")."""
  cfg: ModelConfig
  head: str = "lm"

  @nn.compact
  def __call__(self, tokens, positions, segment_ids, cache: Cache | None = None):
    cfg = self.cfg
    if self.head not in ("lm", "value"):
      raise ValueError(f"head must be 'lm' or 'value', got {self.head!r}")
    embedding = _param(self, "embed", (cfg.vocab_size, cfg.d_model),
                       ("vocab", "embed"), cfg.param_dtype)
    x = jnp.take(embedding, tokens, axis=0).astype(cfg.dtype)
    x = _constrain(x, ("batch", "length", "embed"))
    new_cache, aux_losses = [], []
    for i in range(cfg.num_layers):
      x, layer_cache, aux = Block(cfg, dense=i in cfg.dense_layers, name=f"layer_{i}")(
          x, positions, segment_ids, None if cache is None else cache[i])
      new_cache.append(layer_cache)
      if aux is not None:
        aux_losses.append(aux)
    x = RMSNorm(cfg.rms_eps, cfg.param_dtype, name="final_norm")(x)
    aux = {"load_balance_loss": (jnp.mean(jnp.stack(aux_losses)) if aux_losses
                                 else jnp.zeros((), jnp.float32))}
    if cache is not None:
      aux["cache"] = new_cache
    if self.head == "value":
      w = _param(self, "value_head", (cfg.d_model, 1), ("embed", None),
                 cfg.param_dtype, nn.initializers.zeros)
      b = _param(self, "value_bias", (1,), (None,), cfg.param_dtype, nn.initializers.zeros)
      values = (x.astype(jnp.float32) @ w.astype(jnp.float32) + b.astype(jnp.float32))[..., 0]
      return values, aux
    if cfg.tie_embeddings:
      logits = x @ embedding.astype(cfg.dtype).T
    else:
      w = _param(self, "lm_head", (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                 cfg.param_dtype)
      logits = x @ w.astype(cfg.dtype)
    logits = _constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))
    return logits, aux


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> Cache:
  """An empty KV cache of `batch` slots, `max_len` positions each."""
  shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  dtype = dtype or cfg.dtype
  return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
          for _ in range(cfg.num_layers)]
