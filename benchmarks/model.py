"""Model throughput on CPU: train step and KV-cache decoding, side by side.

    python benchmarks/model.py [--out benchmarks/RESULTS.md]

1. Forward + backward tokens/s of the tiny and small presets (loss = mean
   teacher-forced log-prob, jitted value_and_grad).
2. Decoding: B slots generate N tokens greedily after a P-token prompt, with
   the KV cache (`decoding.extend`, one token per step) against recomputing
   the whole fixed-size sequence every step (one compile, no cache). Both run
   in the same process, interleaved; the ratio is what to read.
"""

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from timing import time_fns

from sao_jax.models import config as mcfg
from sao_jax.models import decoding, policy
from sao_jax.models.transformer import Transformer


def train_throughput(cfg, batch, length, repeats):
  params = policy.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (batch, length), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(length), (batch, length))
  seg = jnp.ones((batch, length), jnp.int32)

  @jax.jit
  def step(p):
    return jax.value_and_grad(lambda p: -policy.token_logprobs(cfg, p, tokens, pos, seg)[0].mean())(
      p
    )

  sec = time_fns({"s": step}, {"s": (params,)}, repeats)["s"]
  n = sum(x.size for x in jax.tree.leaves(params))
  return n, batch * length / sec


def decode_compare(cfg, batch, prompt, new, repeats):
  params = policy.init_params(cfg, jax.random.key(0))
  total = prompt + new
  prompts = jax.random.randint(jax.random.key(2), (batch, prompt), 0, cfg.vocab_size)
  extend = jax.jit(functools.partial(decoding.extend, cfg))

  def with_cache():
    cache = decoding.init_cache(cfg, batch, total)
    lengths = jnp.zeros((batch,), jnp.int32)
    logits, cache, lengths = extend(params, cache, prompts, lengths, jnp.ones_like(prompts, bool))
    tok = jnp.argmax(logits[:, -1], -1)
    out = [tok]
    ones = jnp.ones((batch, 1), bool)
    for _ in range(new - 1):
      logits, cache, lengths = extend(params, cache, tok[:, None], lengths, ones)
      tok = jnp.argmax(logits[:, -1], -1)
      out.append(tok)
    return jnp.stack(out, 1)

  @jax.jit
  def full_step(seq, length):
    pos = jnp.broadcast_to(jnp.arange(total), seq.shape)
    seg = (pos < length).astype(jnp.int32)
    logits, _ = Transformer(cfg).apply({"params": params}, seq, pos, seg)
    return jnp.argmax(logits[:, length - 1], -1)

  def recompute():
    seq = jnp.zeros((batch, total), jnp.int32).at[:, :prompt].set(prompts)
    out = []
    for i in range(new):
      tok = full_step(seq, prompt + i)
      seq = seq.at[:, prompt + i].set(tok)
      out.append(tok)
    return jnp.stack(out, 1)

  np.testing.assert_array_equal(with_cache(), recompute())  # same tokens
  sec = time_fns({"cache": with_cache, "full": recompute}, {"cache": (), "full": ()}, repeats)
  return batch * new / sec["cache"], batch * new / sec["full"]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=None)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  lines = ["| model | params | fwd+bwd tokens/s (B x L) |", "|---|---|---|"]
  for name, b, l in (("tiny", 16, 256), ("small", 8, 256)):
    n, tps = train_throughput(mcfg.PRESETS[name](), b, l, args.repeats)
    lines.append(f"| {name} | {n / 1e6:.2f}M | {tps:,.0f} ({b} x {l}) |")
    print(lines[-1], flush=True)
  lines += [
    "",
    "| model | B slots, prompt, new | KV cache tokens/s | recompute tokens/s | cache / recompute |",
    "|---|---|---|---|---|",
  ]
  for name, b, p, n in (("tiny", 8, 64, 192), ("small", 8, 64, 192)):
    c, f = decode_compare(mcfg.PRESETS[name](), b, p, n, args.repeats)
    lines.append(f"| {name} | {b}, {p}, {n} | {c:,.0f} | {f:,.0f} | {c / f:.2f} |")
    print(lines[-1], flush=True)
  if args.out:
    with open(args.out, "a", encoding="utf-8") as fh:
      fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
