"""The precision policy: trained params keep their updates; engines serve the compute dtype.

Two rules (docs/DESIGN.md section 10, README "Precision"):

1. **An update must survive the add.** Adam's per-coordinate step is at
   most about the learning rate (|m_hat / sqrt(v_hat)| <= ~1; the first
   step is lr * sign(g)), and `w + u` in a float format rounds to the
   nearest representable value: an update below half the unit in the last
   place of `w` is lost. In bfloat16 (7 stored mantissa bits) half an ulp
   of a weight of magnitude 1 is 2^-8 = 0.0039, and of a typical 0.02
   matrix entry 2^-14 = 6.1e-5: at an RL learning rate of 1e-6 bf16 params
   do not train at all. `check_updates_kept` refuses a stage whose smallest
   learning rate (its schedule's floor) is below half an ulp at magnitude 1
   in the trained params' dtype. Magnitude 1 because RMSNorm scales start
   at 1 (and trained checkpoints keep them O(1)): below that floor some
   trained parameters cannot move at all. In float32 the floor is 2^-24 =
   6e-8, below every learning rate a shipped config uses. The fix is
   mixed precision: float32 master weights (`param_dtype`), bfloat16
   compute (`dtype`); the model casts every weight to the compute dtype
   where it is used, and its gradients come back float32.

2. **The engine serves the compute dtype.** Every use of a policy weight
   in the forward pass casts it to `cfg.dtype` first (sao_jax/models/
   transformer.py: matmuls, the embedding gather, RMSNorm scales, the LM
   head), so an engine holding `w.astype(cfg.dtype)` computes bit for bit
   what the trainer's forward computes from float32 `w`, with half the
   bytes. `serving_config(cfg)` is the engine's model config
   (param_dtype = dtype); `cast_for_serving` makes its copy, once per
   version (the engine's `copy_params`, and the fleet before it publishes).
   The value model never serves: its head computes in float32.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig


def half_ulp(dtype, magnitude: float = 1.0) -> float:
  """Half the spacing of `dtype`'s values at `magnitude`: the smallest update
  that `w + u` keeps for |w| in [2^e, 2^(e+1)) with 2^e <= magnitude (round
  to nearest; a tie rounds to even, so exactly half an ulp may still be lost)."""
  finfo = jnp.finfo(dtype)
  exponent = math.floor(math.log2(magnitude))
  return 2.0 ** (exponent - finfo.nmant - 1)


def schedule_floor(peak: float, decays: bool) -> float:
  """The smallest learning rate a stage applies after warmup: the cosine's
  end (optim.END_FRACTION of the peak) for a decaying schedule, else the peak."""
  from sao_jax.algo import optim

  return peak * optim.END_FRACTION if decays else peak


def updates_lost(param_dtype, lr: float) -> bool:
  """True when a step of `lr` rounds away on a weight of magnitude 1 in `param_dtype`."""
  return lr < half_ulp(param_dtype, 1.0)


def check_updates_kept(param_dtype, stages: dict[str, tuple[float, float]]) -> str | None:
  """One line naming the first stage whose learning rate `param_dtype` cannot
  represent as an update, or None. `stages`: lr field -> (its value, the
  smallest lr its schedule applies: `schedule_floor`)."""
  name = jnp.dtype(param_dtype).name
  for field, (lr, floor) in stages.items():
    if updates_lost(param_dtype, floor):
      low = "" if floor == lr else f" (down to {floor:g} as its schedule decays)"
      return (
        f"{field} = {lr:g}{low} with {name} params: {name} rounds away a step "
        f"below {half_ulp(param_dtype, 1.0):.2g} on a weight of magnitude 1 (below "
        f"{half_ulp(param_dtype, 0.02):.2g} on a typical 0.02 weight), so the model "
        "would not train; keep float32 master weights (model.overrides param_dtype = "
        '"float32") with bfloat16 compute (model.compute_dtype = "bfloat16")'
      )
  return None


def serving_config(cfg: ModelConfig) -> ModelConfig:
  """The engine's model config: params held in the compute dtype."""
  if cfg.param_dtype == cfg.dtype:
    return cfg
  return dataclasses.replace(cfg, param_dtype=cfg.dtype)


def cast_for_serving(cfg: ModelConfig, params):
  """`params` with every floating leaf in the compute dtype (traceable; the
  leaves already in it are returned as they are)."""
  dtype = jnp.dtype(cfg.dtype)
  return jax.tree.map(
    lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x,
    params,
  )


def serving_bytes(cfg: ModelConfig, params) -> int:
  """Bytes of the engine's copy of `params` (arrays or ShapeDtypeStructs)."""
  dtype = jnp.dtype(cfg.dtype)
  return sum(
    math.prod(x.shape)
    * (dtype.itemsize if jnp.issubdtype(x.dtype, jnp.floating) else jnp.dtype(x.dtype).itemsize)
    for x in jax.tree.leaves(params)
  )
