"""MoE routing: read the experts a forward pass chose, compare and replay them.

Why. The rollout engine and the trainer run the same router on the same
tokens but not the same program: the engine decodes one token at a time
against a KV cache in its serving dtype, the trainer runs the whole
sequence at once, with its own fusions and reduction orders. A top-k
choice between two near-tied experts can flip between the two, and then
the token's MLP output, every later hidden state and its log-prob differ
for a reason that is not the policy. For Qwen3-30B-A3B GRPO that has been
reported as a cause of collapse; "routing replay" feeds the engine's
choices to the trainer's forward so that the two agree.

The pieces, all pure:

* `Transformer(...).apply(..., mutable=["intermediates"])` sows every MoE
  layer's choices as "moe_top_i"; `collect` turns those into one array
  `[M, B, L, k]` (M MoE layers in layer order), the layout the model's
  `routing` argument takes back.
* `Transformer(..., routing=r)` uses `r`'s experts (rows of -1 keep the
  router's own choice) with gate weights from the router's probabilities at
  those experts (`transformer.MoE`).
* `differ` marks the tokens whose expert *sets* differ between two routings
  (order within the top-k does not matter to the output).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig

Array = jax.Array

__all__ = ["NONE", "collect", "differ"]

NONE = -1  # a routing row that replays nothing (the router's own top-k)


def collect(
  cfg: ModelConfig, intermediates, batch: int, length: int, *, flat: bool = False
) -> Array:
  """The sown "moe_top_i" of one forward, as int32 `[M, B, L, k]`, or with
  `flat` `[B, L, M * k]` (the engine's layout: a minor dimension of M x k,
  384 for Qwen3-30B-A3B, where k alone would be padded to a TPU tile).

  `intermediates` is the "intermediates" collection of a `Transformer`
  applied to `[batch, length]` tokens. Each MoE layer's entry is `[k, B*L]`
  (transformer.MoE), found where its parameters are
  (`ModelConfig.layer_location`: "layer_i", or a slice of a scanned stack).
  """
  k = cfg.experts_per_token
  rows = []
  for i, spec in enumerate(cfg.layer_specs):
    if not spec.is_moe:
      continue
    where, index = cfg.layer_location(i)
    entry = intermediates
    for key in where.split("/") + ["moe"]:
      entry = entry.get(key, {}) if isinstance(entry, dict) else {}
    if "moe_top_i" not in entry:
      raise ValueError(
        "no MoE layer sowed its routing: was the model applied with mutable=['intermediates']?"
      )
    (top_i,) = entry["moe_top_i"]  # [k, B*L], or [steps, k, B*L] for a scanned layer
    rows.append((top_i if index is None else top_i[index]).reshape(1, k, batch, length))
  out = jnp.concatenate(rows, 0).astype(jnp.int32)  # [M, k, B, L]
  if out.shape[0] != cfg.num_moe_layers:
    raise ValueError(f"collected {out.shape[0]} MoE layers, the config has {cfg.num_moe_layers}")
  if flat:
    return jnp.transpose(out, (2, 3, 0, 1)).reshape(batch, length, -1)
  return jnp.transpose(out, (0, 2, 3, 1))


def differ(a: Array, b: Array) -> Array:
  """bool `[..., ]`: True where the expert sets of `a` and `b` `[..., k]` differ."""
  a = jnp.sort(a, -1)
  b = jnp.sort(b, -1)
  return (a != b).any(-1)
