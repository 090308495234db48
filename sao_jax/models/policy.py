"""Policy and value views of the transformer, aligned to DESIGN.md section 2.

Both return per-token arrays indexed like the tokens: entry t is computed
from the prefix x_<t. `token_logprobs[t] = log pi(x_t | x_<t)` and
`token_values[t] = V(x_<t)`, the value of emitting x_t onward. Entry 0 of a
row, and the first token of every packed segment, have no prefix and are 0;
they are prompt tokens, never actions.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import Transformer

Array = jax.Array


def init_params(cfg: ModelConfig, rng, head: str = "lm", *, boxed: bool = False):
  """Fresh parameters; `boxed=True` keeps flax's logical-axis metadata."""
  tokens = jnp.zeros((1, 8), jnp.int32)
  variables = Transformer(cfg, head).init(rng, tokens, tokens, jnp.ones_like(tokens))
  params = variables["params"]
  return params if boxed else nn.unbox(params)


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


def token_logprobs(cfg: ModelConfig, params, tokens: Array, positions: Array,
                   segment_ids: Array, temperature: float = 1.0):
  """Teacher-forced log pi(x_t | x_<t) `[B, L]` and the model's aux losses."""
  logits, aux = Transformer(cfg, "lm").apply({"params": params}, tokens, positions,
                                             segment_ids)
  prev_logits = _shift_right(logits, segment_ids)  # predicts x_t
  logp = logprobs_from_logits(prev_logits, tokens, temperature)
  starts = _shift_right(jnp.ones_like(tokens), segment_ids) == 0
  return jnp.where(starts, 0.0, logp), aux


def token_values(cfg: ModelConfig, params, tokens: Array, positions: Array,
                 segment_ids: Array):
  """V(x_<t) `[B, L]` from the value head, and the model's aux losses."""
  values, aux = Transformer(cfg, "value").apply({"params": params}, tokens, positions,
                                                segment_ids)
  return _shift_right(values, segment_ids), aux


def value_params_from_policy(policy_params, value_params):
  """The value model initialised from a policy: trunk copied, head kept fresh.

  `value_params` supplies the value head (from `init_params(..., "value")`);
  every other leaf comes from the policy (whose LM head is dropped).
  """
  out = {k: v for k, v in policy_params.items() if k != "lm_head"}
  for key in ("value_head", "value_bias"):
    out[key] = value_params[key]
  missing = set(value_params) - set(out)
  if missing:
    raise ValueError(f"Policy params lack trunk entries {sorted(missing)}.")
  return out
