"""Serving LoRA: merge once per version, or apply the adapters in every forward.

    python benchmarks/lora_serving.py [--d=2048] [--f=6144] [--rank=16] [--rows=16]

One projection at a time, the choice the engine faces per version: the
merged weight W' = W + s A B costs one pass over W when a version arrives
(`lora.merge`'s arithmetic on one [d, f] matrix), then each decode step is
x W'; applied in the forward, each step is x W + s (x A) B and no merge is
ever done. Both in float32 on this host, jitted, rows = the decode batch
(the engine's slots). The three programs run interleaved, `--repeats`
rounds, each timed by its median. The break-even is merge / (applied - merged
per step): a version serving more decode steps than that is cheaper merged.
"""

import argparse
import time

import jax
import numpy as np

from sao_jax.models import lora


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--d", type=int, default=2048)
  parser.add_argument("--f", type=int, default=6144)
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--rows", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=30)
  args = parser.parse_args()
  keys = jax.random.split(jax.random.key(0), 4)
  w = jax.random.normal(keys[0], (args.d, args.f)) * 0.02
  ad = {
    lora.A: jax.random.normal(keys[1], (args.d, args.rank)) * 0.02,
    lora.B: jax.random.normal(keys[2], (args.rank, args.f)) * 0.02,
  }
  x = jax.random.normal(keys[3], (args.rows, args.d))
  scale = 2.0
  merge = jax.jit(lambda w, ad: w + lora.delta(w.shape, ad, scale))
  merged_step = jax.jit(lambda x, w: x @ w)
  applied_step = jax.jit(lambda x, w, ad: x @ w + scale * ((x @ ad[lora.A]) @ ad[lora.B]))
  w2 = merge(w, ad)
  np.testing.assert_allclose(merged_step(x, w2), applied_step(x, w, ad), rtol=1e-4, atol=1e-4)
  runs = {
    "merge": lambda: merge(w, ad),
    "merged step": lambda: merged_step(x, w2),
    "applied step": lambda: applied_step(x, w, ad),
  }
  times = {k: [] for k in runs}
  for _ in range(args.repeats):
    for k, f in runs.items():
      t = time.perf_counter()
      jax.block_until_ready(f())
      times[k].append(time.perf_counter() - t)
  med = {k: float(np.median(v)) for k, v in times.items()}
  extra = med["applied step"] - med["merged step"]
  print(f"[{args.d}, {args.f}] rank {args.rank}, {args.rows} rows, {jax.devices()[0].platform}")
  for k, v in med.items():
    print(f"  {k}: {v * 1e3:.3f} ms")
  print(f"  applied / merged step: {med['applied step'] / med['merged step']:.2f}x")
  print(
    "  break-even decode steps per version: "
    + (f"{med['merge'] / extra:.1f}" if extra > 0 else "none (applied is not slower)")
  )


if __name__ == "__main__":
  main()
