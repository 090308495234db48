"""Do the weights move? N AdamW steps at a pod learning rate, three precisions side by side.

    python benchmarks/precision.py [--steps=20] [--lr=1e-6] [--preset=small]

Same init, same batches, same optimizer (optim.make_optimizer: global-norm
clip 1.0, b2 0.95, the configs' AdamW), three ways of holding the weights:

  bf16 params   param_dtype = dtype = bfloat16 (bf16 storage, no master copy)
  fp32 master   param_dtype float32, dtype bfloat16 (the qwen3_30b_a3b preset's)
  fp32          float32 throughout (the reference)

For each: the fraction of weights that changed after N steps, the norm of
the total movement ||w_N - w_0|| against fp32's, and the cosine of the
movement with fp32's. Also the Adam numbers that decide the rest of the
update's numerics: the median |g| per coordinate after clipping against
Adam's eps (1e-8), and the bf16 half-ulp at the weights' median magnitude.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from sao_jax.algo import optim
from sao_jax.models import config as mcfg
from sao_jax.models import policy, precision

_STEPS = flags.DEFINE_integer("steps", 20, "AdamW steps.")
_LR = flags.DEFINE_float("lr", 1e-6, "Learning rate (sao_moe's rl.actor_lr).")
_PRESET = flags.DEFINE_string("preset", "tiny", "Model preset (sao_jax/models/config.py).")


def batches(cfg, n, rows=4, length=64, prompt=8):
  rng = np.random.default_rng(0)
  for _ in range(n):
    tokens = rng.integers(0, cfg.vocab_size, (rows, length)).astype(np.int32)
    yield (
      tokens,
      np.broadcast_to(np.arange(length), tokens.shape),
      np.ones_like(tokens),
      np.arange(length)[None, :] >= prompt,
    )


def run(cfg, init, steps, lr):
  params = jax.tree.map(lambda x: x.astype(cfg.param_dtype), init)
  tx = optim.make_optimizer(params, lr, clip_norm=1.0)

  def loss(p, tokens, positions, segs, mask):
    logp, _ = policy.token_logprobs(cfg, p, tokens, positions, segs)
    return -jnp.where(mask, logp, 0.0).sum() / mask.sum()

  @jax.jit
  def step(p, opt, *batch):
    g = jax.grad(loss)(p, *batch)
    gnorm = optax.global_norm(g)
    clipped = jax.tree.map(lambda x: x * jnp.minimum(1.0, 1.0 / (gnorm + 1e-12)), g)
    med_g = jnp.median(
      jnp.abs(jnp.concatenate([x.astype(jnp.float32).ravel() for x in jax.tree.leaves(clipped)]))
    )
    updates, opt = tx.update(g, opt, p)
    return optax.apply_updates(p, updates), opt, med_g

  opt = tx.init(params)
  start = params
  med = []
  for tokens, positions, segs, mask in batches(cfg, steps):
    params, opt, med_g = step(params, opt, tokens, positions, segs, mask)
    med.append(float(med_g))
  flat = lambda t: np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(t)])
  moved = flat(params) - flat(start)
  moment_dtypes = sorted(
    {x.dtype.name for x in jax.tree.leaves(opt) if jnp.issubdtype(x.dtype, jnp.floating)}
  )
  return moved, float(np.median(med)), moment_dtypes


def main(_):
  base = mcfg.PRESETS[_PRESET.value]()
  init = policy.init_params(dataclasses.replace(base, param_dtype=jnp.float32), jax.random.key(0))
  weights = np.concatenate([np.abs(np.asarray(x)).ravel() for x in jax.tree.leaves(init)])
  arms = {
    "bf16 params": dataclasses.replace(base, param_dtype="bfloat16", dtype="bfloat16"),
    "fp32 master": dataclasses.replace(base, param_dtype="float32", dtype="bfloat16"),
    "fp32": dataclasses.replace(base, param_dtype="float32", dtype="float32"),
  }
  results = {}
  for name, cfg in arms.items():
    t0 = time.time()
    results[name] = run(cfg, init, _STEPS.value, _LR.value)
    print(f"[precision] {name}: {time.time() - t0:.1f} s", flush=True)
  ref = results["fp32"][0]
  n = ref.size
  print(
    f"\n{_PRESET.value} preset, {n:,} weights, {_STEPS.value} AdamW steps at lr "
    f"{_LR.value:g} (clip 1.0, b2 0.95); median |w| {np.median(weights):.3g} "
    f"(bf16 half-ulp there {precision.half_ulp(jnp.bfloat16, float(np.median(weights))):.2g})"
  )
  print(
    "| weights held as | moment dtypes | changed | ||movement|| / fp32's | cosine with fp32's "
    "| median |g| after clip (Adam eps 1e-8) |"
  )
  print("|---|---|---|---|---|---|")
  for name, (moved, med_g, dtypes) in results.items():
    changed = np.count_nonzero(moved) / n
    ratio = np.linalg.norm(moved) / np.linalg.norm(ref)
    cos = moved @ ref / (np.linalg.norm(moved) * np.linalg.norm(ref) + 1e-30)
    print(
      f"| {name} | {', '.join(dtypes)} | {changed:.3f} | {ratio:.4f} | {cos:.4f} | {med_g:.2g} |"
    )


if __name__ == "__main__":
  app.run(main)
