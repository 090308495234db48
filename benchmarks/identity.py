"""What a version's params fingerprint costs (sao_jax/data/identity.py).

    nice -n 10 python benchmarks/identity.py [--mib 256] [--repeats 5]

On this machine's CPU as 8 simulated devices (XLA_FLAGS is set here):

shapes: Qwen3.5-35B-A3B's param tree (models/config.py qwen3_5_35b_a3b, as
  `jax.eval_shape` gives it: nothing allocated), in bf16 as the trainer
  serves it, each leaf sharded over the 8 devices along its largest
  dimension. The fingerprint's sampling program is compiled for it (never
  run): its leaves, the bytes it reads and returns, the collectives in the
  compiled program (all-gathers: none expected) and XLA's temporary bytes
  per device, against one device's shard of the params.

timing: a synthetic tree of `--mib` MiB of random bf16 [8, 1024, 512]
  leaves sharded the same way; interleaved rounds of (a) `fingerprint`,
  warm, (b) `fingerprint` of as many leaves of [8, 64, 64] (1/128 of the
  bytes: the cost is per leaf, not per byte) and (c) a jitted sum of every
  element's bits (every byte read once, on the devices: the least a digest
  of every byte costs). Medians of `--repeats` rounds, each as a multiple
  of (a); and, before the rounds, (a) alone `--repeats` times.
"""

import argparse
import os
import re
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sao_jax.data import identity
from sao_jax.models import config as model_config
from sao_jax.models import policy

MESH = Mesh(np.array(jax.devices()), ("model",))


def _spec(shape) -> P:
  """The leaf split over the 8 devices along its largest dimension divisible by 8."""
  dims = [d for d in np.argsort(shape)[::-1] if shape[d] % len(MESH.devices) == 0]
  if not dims:
    return P()
  spec = [None] * len(shape)
  spec[dims[0]] = "model"
  return P(*spec)


def shapes_row() -> dict:
  cfg = model_config.qwen3_5_35b_a3b()
  tree = jax.eval_shape(lambda: policy.init_params(cfg, jax.random.key(0)))
  leaves = [
    jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=NamedSharding(MESH, _spec(x.shape)))
    for x in jax.tree.leaves(tree)
  ]
  sampler = identity._sampler(tuple(x.shape for x in leaves), NamedSharding(MESH, P()))
  t0 = time.time()
  compiled = sampler.lower(leaves).compile()
  compile_s = time.time() - t0
  hlo = compiled.as_text()
  mem = compiled.memory_analysis()
  total = sum(int(np.prod(x.shape)) * 2 for x in leaves)
  sampled = sum(min(identity.SAMPLES, int(np.prod(x.shape))) for x in leaves)
  return {
    "leaves": len(leaves),
    "param_gib": total / 2**30,
    "shard_gib_per_device": mem.argument_size_in_bytes / 2**30,
    "sampled_bytes": sampled * 2,
    "output_bytes": mem.output_size_in_bytes,
    "temp_bytes_per_device": mem.temp_size_in_bytes,
    "all_gathers": len(re.findall(r" all-gather(?:-start)?\(", hlo)),
    "all_reduces": len(re.findall(r" all-reduce(?:-start)?\(", hlo)),
    "compile_s": compile_s,
  }


def _sum_bits(leaves):
  return [jnp.sum(jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)) for x in leaves]


def timing_rows(mib: int, repeats: int) -> dict:
  shape = (8, 1024, 512)
  n = max(1, mib * 2**20 // (int(np.prod(shape)) * 2))
  sharding = NamedSharding(MESH, _spec(shape))
  tree = {
    f"w{i:03d}": jax.device_put(jax.random.normal(jax.random.key(i), shape, jnp.bfloat16), sharding)
    for i in range(n)
  }
  small = {k: jax.device_put(v[:, :64, :64], sharding) for k, v in tree.items()}
  total = jax.jit(_sum_bits)
  runs = {
    "fingerprint": lambda: identity.fingerprint(tree),
    "fingerprint_small_leaves": lambda: identity.fingerprint(small),
    "sum_every_byte": lambda: jax.block_until_ready(total(list(tree.values()))),
  }
  for f in runs.values():  # compile, warm
    f()
  alone = []  # before the interleaved rounds: nothing else ran just before
  for _ in range(repeats):
    t0 = time.perf_counter()
    runs["fingerprint"]()
    alone.append(time.perf_counter() - t0)
  times = {k: [] for k in runs}
  for _ in range(repeats):
    for k, f in runs.items():
      t0 = time.perf_counter()
      f()
      times[k].append(time.perf_counter() - t0)
  med = {k: statistics.median(v) for k, v in times.items()}
  return {
    "leaves": n,
    "mib": n * int(np.prod(shape)) * 2 / 2**20,
    "median_s": med,
    "alone_s": statistics.median(alone),
    "ratio_to_fingerprint": {k: v / med["fingerprint"] for k, v in med.items()},
  }


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--mib", type=int, default=256)
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args()
  s = shapes_row()
  print(
    "| Qwen3.5-35B-A3B (bf16, 8-way) | leaves | param GiB | shard GiB/device | sampled B "
    "| output B | temp B/device | all-gathers | all-reduces | compile s |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|")
  print(
    f"| sampling program | {s['leaves']} | {s['param_gib']:.1f} | "
    f"{s['shard_gib_per_device']:.2f} | {s['sampled_bytes']} | {s['output_bytes']} | "
    f"{s['temp_bytes_per_device']} | {s['all_gathers']} | {s['all_reduces']} | "
    f"{s['compile_s']:.1f} |"
  )
  t = timing_rows(args.mib, args.repeats)
  print(
    f"\n{t['leaves']} leaves, {t['mib']:.0f} MiB bf16 over 8 CPU devices, "
    f"median of {args.repeats} interleaved rounds:\n"
  )
  print("| | median ms | x fingerprint |")
  print("|---|---|---|")
  for k, v in t["median_s"].items():
    print(f"| {k} | {v * 1e3:.1f} | {t['ratio_to_fingerprint'][k]:.1f} |")
  print(
    f"\nfingerprint alone (warm, {args.repeats} calls before the rounds): median "
    f"{t['alone_s'] * 1e3:.1f} ms"
  )


if __name__ == "__main__":
  main()
