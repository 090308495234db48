"""Policy and value views of the transformer, aligned to docs/DESIGN.md section 2.

Both return per-token arrays indexed like the tokens: entry t is computed
from the prefix x_<t. `token_logprobs[t] = log pi(x_t | x_<t)` and
`token_values[t] = V(x_<t)`, the value of emitting x_t onward. Entry 0 of a
row, and the first token of every packed segment, have no prefix and are 0;
they are prompt tokens, never actions.

With `cfg.logits_chunk > 0` the log-probs never hold full-vocabulary logits
for the whole batch: the trunk returns final hidden states and the LM head
and log-softmax run over `logits_chunk` tokens at a time (a `lax.map` whose
body is rematerialised, so the backward pass recomputes each chunk's
[B, chunk, V] logits instead of storing [B, L, V]).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models import head_vocab
from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import Transformer, lm_head_weight, lm_logits, lora_variables

Array = jax.Array


def init_params(cfg: ModelConfig, rng, head: str = "lm", *, boxed: bool = False):
  """Fresh parameters; `boxed=True` keeps flax's logical-axis metadata."""
  tokens = jnp.zeros((1, 8), jnp.int32)
  variables = Transformer(cfg, head).init(rng, tokens, tokens, jnp.ones_like(tokens))
  params = variables["params"]
  return params if boxed else nn.unbox(params)


def _variables(params, adapters: tuple | None) -> tuple[dict, object]:
  """(the forward's variables, its LoRA config or None): `params` alone, or
  with `adapters` = (tree, config) LoRA's (`transformer.lora_variables`)."""
  if adapters is None:
    return {"params": params}, None
  tree, lora_cfg = adapters
  return lora_variables(params, tree, lora_cfg), lora_cfg


def _shift_right(x: Array, segment_ids: Array) -> Array:
  """out[t] = x[t-1] within a segment, 0 at a segment's first token."""
  shifted = jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
  prev_seg = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)))
  same = (prev_seg == segment_ids) & (segment_ids != 0)
  return jnp.where(same.reshape(same.shape + (1,) * (x.ndim - 2)), shifted, 0)


def logprobs_from_logits(logits: Array, tokens: Array, temperature: float = 1.0) -> Array:
  """log softmax(logits / T)[token]; logits [..., V], tokens [...]."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
  return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def _head_logprobs(
  cfg: ModelConfig, hidden: Array, w: Array, tokens: Array, temperature: float
) -> Array:
  """log softmax(hidden @ w / T)[token] `[B, L]` for hidden `[B, L, D]`, the head
  as one [B * L, D] x [D, V] matmul.

  On XLA:CPU the backward of the [B, L, D] product (its weight gradient
  contracts two dimensions, B and L) runs slower than the same matmul in
  two dimensions (benchmarks/RESULTS.md#models-and-the-train-step); the
  reshapes are free.
  """
  b, length, d = hidden.shape
  logits = lm_logits(cfg, hidden.reshape(b * length, d), w).reshape(b, length, -1)
  logits = nn.with_logical_constraint(logits, ("batch", "length", "vocab"))
  return logprobs_from_logits(logits, tokens, temperature)


def chunked_logprobs(
  cfg: ModelConfig, hidden: Array, w: Array, tokens: Array, temperature: float = 1.0
) -> Array:
  """log softmax(hidden @ w / T)[token] `[B, L]`, `cfg.logits_chunk` tokens at a time.

  hidden [B, L, D], w [D, V] (the LM head), tokens [B, L]. Equal to
  `logprobs_from_logits(lm_logits(cfg, hidden, w), tokens, temperature)`;
  peak logits [B, chunk, V] fp32 in the forward and the backward pass.
  """
  b, length, d = hidden.shape
  chunk = min(cfg.logits_chunk, length)
  pad = -length % chunk
  hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
  tokens = jnp.pad(tokens, ((0, 0), (0, pad)))
  n = (length + pad) // chunk
  h_chunks = hidden.reshape(b, n, chunk, d).swapaxes(0, 1)  # [n, B, c, D]
  t_chunks = tokens.reshape(b, n, chunk).swapaxes(0, 1)  # [n, B, c]

  @jax.checkpoint
  def one_chunk(h, t, w):
    logits = nn.with_logical_constraint(lm_logits(cfg, h, w), ("batch", "length", "vocab"))
    return logprobs_from_logits(logits, t, temperature)  # [B, c]

  # The head enters the loop in fp32 (lm_logits casts it to cfg.dtype, so
  # the forward is unchanged): the backward sums its gradient over chunks in
  # fp32, not in a bf16 param dtype.
  w32 = w.astype(jnp.float32)
  logp = jax.lax.map(lambda ht: one_chunk(ht[0], ht[1], w32), (h_chunks, t_chunks))
  return logp.swapaxes(0, 1).reshape(b, n * chunk)[:, :length]


def _logprobs_at(
  cfg: ModelConfig, params, hidden: Array, tokens: Array, index: Array, temperature: float
) -> Array:
  """log pi(x_t | x_<t) at the positions `index` `[B, A]` (-1: none) of each row, `[B, L]`.

  The head meets only the A gathered hidden states, so its cost is A / L
  of the full head's; every other position's log-prob is 0.
  """
  valid = index >= 0
  safe = jnp.where(valid, index, 0)
  h = jnp.take_along_axis(hidden, safe[..., None], axis=1)  # [B, A, D]
  t = jnp.take_along_axis(tokens, safe, axis=1)  # [B, A]
  w = lm_head_weight(cfg, params)
  if cfg.logits_chunk:
    logp = chunked_logprobs(cfg, h, w, t, temperature)
  else:
    logp = _head_logprobs(cfg, h, w, t, temperature)
  rows = jnp.arange(index.shape[0])[:, None]
  return jnp.zeros(tokens.shape, logp.dtype).at[rows, safe].add(jnp.where(valid, logp, 0.0))


def token_logprobs(
  cfg: ModelConfig,
  params,
  tokens: Array,
  positions: Array,
  segment_ids: Array,
  temperature: float = 1.0,
  action_index: Array | None = None,
  routing: Array | None = None,
  adapters: tuple | None = None,
):
  """Teacher-forced log pi(x_t | x_<t) `[B, L]` and the model's aux losses.

  With `action_index` `[B, A]` (`packing.pack(..., action_index=True)`),
  only those positions' log-probs are computed (the rest are 0): the
  vocabulary-wide head runs on A positions a row instead of L. `routing`
  `[M, B, L, k]` replays MoE expert choices (`models/routing.py`).
  `adapters` (LoRA): (adapter tree, `lora.LoraConfig`) over `params`, the
  frozen base; the forward is that of `lora.merge(params, tree, cfg)`, each
  layer merging its own weights (`transformer.lora_variables`).

  With a head subset (`cfg.vocab_ids`) the log-probs are those of the
  distribution over the subset, and a target outside it (never an action)
  gets 0, as a segment's first token does.
  """
  starts = _shift_right(jnp.ones_like(tokens), segment_ids) == 0
  if cfg.vocab_ids:
    starts = starts | ~head_vocab.covered(cfg, tokens)
  # The trunk embeds tokenizer ids; the head's targets are its columns.
  targets = jnp.where(starts, 0, head_vocab.index(cfg, tokens))
  variables, lora_cfg = _variables(params, adapters)
  params = variables["params"]
  hidden, aux = Transformer(cfg, "hidden", lora_cfg).apply(
    variables, tokens, positions, segment_ids, routing=routing
  )
  # Shifting the hidden state shifts its logits (the head is per token), at
  # D numbers a token instead of V: shifting [B, L, V] logits cost the step
  # passes over its largest array, forward and backward.
  prev_hidden = _shift_right(hidden, segment_ids)  # predicts x_t
  w = lm_head_weight(cfg, params)
  if action_index is not None:
    logp = _logprobs_at(cfg, params, prev_hidden, targets, action_index, temperature)
  elif cfg.logits_chunk:
    logp = chunked_logprobs(cfg, prev_hidden, w, targets, temperature)
  else:
    logp = _head_logprobs(cfg, prev_hidden, w, targets, temperature)
  return jnp.where(starts, 0.0, logp), aux


def token_values(
  cfg: ModelConfig,
  params,
  tokens: Array,
  positions: Array,
  segment_ids: Array,
  adapters: tuple | None = None,
):
  """V(x_<t) `[B, L]` from the value head, and the model's aux losses.

  The value head is [D, 1]: its output is [B, L] at any length, so unlike
  the log-probs it needs no chunking. `adapters`: as `token_logprobs`'.
  """
  variables, lora_cfg = _variables(params, adapters)
  values, aux = Transformer(cfg, "value", lora_cfg).apply(variables, tokens, positions, segment_ids)
  return _shift_right(values, segment_ids), aux


def value_params_from_policy(policy_params, value_params):
  """The value model initialised from a policy: trunk copied, head kept fresh.

  `value_params` supplies the value head (from `init_params(..., "value")`);
  every other leaf comes from the policy (whose LM head is dropped). Works
  for either layer layout (top-level keys "layer_i" and / or "layers").
  """
  out = {k: v for k, v in policy_params.items() if k != "lm_head"}
  for key in ("value_head", "value_bias"):
    out[key] = value_params[key]
  missing = set(value_params) - set(out)
  if missing:
    raise ValueError(f"Policy params lack trunk entries {sorted(missing)}.")
  return out


def scan_params(cfg: ModelConfig, params):
  """Unscanned params ("layer_i" for every layer) -> the `cfg.scan_layers` layout.

  The layers before the scanned run (`cfg.scan_prefix`) keep their "layer_i"
  entries; the rest are stacked along a new leading axis under "layers"
  ("layers/sub_r" for layer r of each step of a longer `cfg.scan_period`).
  `cfg` is the scanned config.
  """
  k, period = cfg.scan_prefix, cfg.scan_period
  out = {
    n: v for n, v in params.items() if not (n.startswith("layer_") and int(n[len("layer_") :]) >= k)
  }
  stacks = [
    jax.tree.map(
      lambda *xs: jnp.stack(xs),
      *[params[f"layer_{i}"] for i in range(k + r, cfg.num_layers, period)],
    )
    for r in range(period)
  ]
  out["layers"] = stacks[0] if period == 1 else {f"sub_{r}": t for r, t in enumerate(stacks)}
  return out


def unscan_params(cfg: ModelConfig, params):
  """The inverse of `scan_params`: "layers" split back into "layer_i" entries."""
  out = {n: v for n, v in params.items() if n != "layers"}
  for i in range(cfg.scan_prefix, cfg.num_layers):
    where, g = cfg.layer_location(i)
    tree = params
    for key in where.split("/"):
      tree = tree[key]
    out[f"layer_{i}"] = jax.tree.map(lambda x, g=g: x[g], tree)
  return out
