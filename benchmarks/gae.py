"""Skip-observation GAE vs rlax's unmasked truncated GAE, side by side.

    python benchmarks/gae.py [--out benchmarks/RESULTS.md]

rlax runs `truncated_generalized_advantage_estimation` vmapped over the batch
and jitted, on the same rewards and values with every token an action (it has
no notion of observation tokens). sao-jax runs skip-observation GAE with a
realistic mask (turns of action tokens with observations between). The ratio
is rlax time / our time: above 1 means faster than rlax.
"""

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import rlax

sys.path.insert(0, os.path.dirname(__file__))
from timing import time_fns

from sao_jax.algo import advantages

GAMMA, LAM = 1.0, 0.95
SIZES = [(64, 1024), (64, 4096), (256, 1024), (256, 4096), (256, 8192)]


def make_inputs(b, t, seed=0):
  rng = np.random.default_rng(seed)
  # Turns of 20-200 action tokens separated by 10-100 observation tokens.
  mask = np.zeros((b, t), bool)
  for row in range(b):
    pos = int(rng.integers(5, 50))
    while pos < t:
      n = int(rng.integers(20, 200))
      mask[row, pos : pos + n] = True
      pos += n + int(rng.integers(10, 100))
  rewards = np.where(mask, rng.normal(size=(b, t)) * 0.1, 0.0).astype(np.float32)
  values = rng.normal(size=(b, t)).astype(np.float32)
  return jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask)


@jax.jit
def rlax_gae(rewards, values):
  t = rewards.shape[1]
  discount = jnp.full((t,), GAMMA, rewards.dtype).at[-1].set(0.0)
  bootstrap = jnp.pad(values, ((0, 0), (0, 1)))
  return jax.vmap(rlax.truncated_generalized_advantage_estimation, in_axes=(0, None, None, 0))(
    rewards, discount, LAM, bootstrap
  )


ours = jax.jit(functools.partial(advantages.skip_observation_gae, gamma=GAMMA, lam=LAM))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=None, help="append the table to this file")
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args()

  fns = {"rlax": rlax_gae, "ours": ours}
  lines = [
    "| B x T | rlax, unmasked (ms) | skip-observation GAE (ms) | rlax / ours |",
    "|---|---|---|---|",
  ]
  for b, t in SIZES:
    r, v, m = make_inputs(b, t)
    sec = time_fns(fns, {"rlax": (r, v), "ours": (r, v, m)}, repeats=args.repeats)
    line = (
      f"| {b} x {t} | {sec['rlax'] * 1e3:.1f} | {sec['ours'] * 1e3:.1f} "
      f"| {sec['rlax'] / sec['ours']:.2f} |"
    )
    print(line, flush=True)
    lines.append(line)
  if args.out:
    with open(args.out, "a", encoding="utf-8") as f:
      f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
