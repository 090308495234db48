"""Delta weight versions (sao_jax/transport/weight_delta.py) against whole ones,
side by side in one run, on a model trained at sao_moe's learning rate.

    nice -n 10 python benchmarks/delta_versions.py [--preset small] [--steps 40] \\
        [--grads lm|random]

Train: the preset's params in float32 (the precision policy's masters),
AdamW as the trainer builds it for the actor (`optim.make_optimizer`:
global-norm clip 1.0, b1 0.9, b2 0.95) on sao_moe's schedule
(`configs/sao_moe.py`: rl.actor_lr 1e-6, rl.warmup 10, rl.steps 400,
`optim.warmup_cosine`). Gradients (--grads): "lm", the next-token loss of
the model itself on one fixed batch of random tokens (real gradients of
the model, correlated from step to step as an RL batch's are not quite);
"random", fresh N(0, 1) gradients each step (no correlation: Adam's steps
partly cancel). Not RL steps: at this lr both are updates of about lr a
step, which is what sets how many bf16 elements move.

Each step's params are published as a version (their bf16 cast, as
FleetSource does) through the real `WeightServer` (this process, one CPU
device, loopback) and pulled by two `NetFollower`s in turn: one whole
versions only (`delta=False`), one deltas (`delta=True`); both checked bit
for bit against the host's cast. Per step: the fraction of bf16 elements
that changed, bytes and seconds per version both ways, and the bytes other
block sizes (and a bitmask encoding) would have moved.

Then the pod, modeled from the measured byte ratio: `--version_gb` (the
plan's bytes of a sao_moe version into one rollout host:
benchmarks/RESULTS.md#fleet-and-weight-sync) at `--gbps` rates; with LoRA a version is the adapters
(`--lora_gb`, benchmarks/lora_sizes.py).
"""

import argparse
import dataclasses
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.algo import optim
from sao_jax.models import config as model_config
from sao_jax.models import policy
from sao_jax.transport import weight_delta, weight_transfer

# configs/sao_moe.py's actor schedule.
LR, WARMUP, TOTAL = 1e-6, 10, 400


def train_steps(args):
  """(model config, params, a jitted step(params, opt_state, i) -> both)."""
  cfg = model_config.PRESETS[args.preset]()
  cfg = dataclasses.replace(cfg, param_dtype=jnp.float32, dtype=jnp.bfloat16)
  params = policy.init_params(cfg, jax.random.key(0))
  tx = optim.make_optimizer(params, optim.warmup_cosine(LR, WARMUP, TOTAL), clip_norm=1.0)
  tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, cfg.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(args.seq), tokens.shape)
  segments = jnp.ones_like(tokens)

  def loss(p):
    logp, _ = policy.token_logprobs(cfg, p, tokens, positions, segments)
    return -logp.mean()

  @jax.jit
  def step(p, state, i):
    if args.grads == "lm":
      grads = jax.grad(loss)(p)
    else:
      leaves, tree = jax.tree.flatten(p)
      keys = jax.random.split(jax.random.fold_in(jax.random.key(2), i), len(leaves))
      grads = jax.tree.unflatten(
        tree, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
      )
    updates, state = tx.update(grads, state, p)
    return jax.tree.map(lambda a, u: a + u, p, updates), state

  return cfg, params, tx.init(params), step


def cast(params):
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, params)


def block_bytes(old, new, blocks):
  """Bytes a delta from `old` to `new` (host leaves, one piece each) moves
  per block size (each piece whole where that is no more), and a bitmask
  encoding's (a bit per element, then the changed values)."""
  out = dict.fromkeys(blocks, 0)
  out["bitmask"] = 0
  for a, b in zip(old, new):
    wa, wb = a.reshape(-1).view(np.uint16), b.reshape(-1).view(np.uint16)
    differ = wa != wb
    full = a.nbytes
    for block in blocks:
      pad = -differ.size % block
      changed = int(np.pad(differ, (0, pad)).reshape(-1, block).any(axis=1).sum())
      out[block] += min(
        full, weight_delta.delta_nbytes(weight_delta.bucket(changed), block, a.dtype)
      )
    out["bitmask"] += min(full, -(-differ.size // 8) + 2 * int(differ.sum()))
  return out


def pull(server, net, offer):
  """Seconds until `net` holds `offer` (this process serves the requests)."""
  t0 = time.time()
  net.start(offer)
  while True:
    server.serve_requests()
    got = net.advance()
    if got is not None:
      return got, time.time() - t0
    time.sleep(0.001)


def measure(args, root):
  cfg, params, state, step = train_steps(args)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  served = jax.eval_shape(cast, params)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), served)
  server = weight_transfer.WeightServer(root, "bench", host="127.0.0.1", sockets=2, thread=False)
  nets = {
    kind: weight_transfer.NetFollower(
      root, kind, abstract, host="127.0.0.1", sockets=2, delta=kind == "delta"
    )
    for kind in ("full", "delta")
  }
  blocks = [int(b) for b in args.blocks.split(",")]
  cast_jit = jax.jit(cast)
  rows, prev = [], None
  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(f"{args.preset}: {n_params:,} params, {args.grads} gradients, lr {LR} warmup {WARMUP}")
  for v in range(args.steps + 1):
    if v:
      params, state = step(params, state, v)
    host = [np.asarray(x) for x in jax.tree.leaves(cast_jit(params))]
    t0 = time.time()
    server.publish(params, v, cast_jit)
    publish_s = time.time() - t0
    offer = weight_transfer.newest_offer(root)
    assert offer.version == v
    row = dict(version=v, publish_s=publish_s, delta_s=server.last_delta.get("seconds", 0.0))
    for kind, net in nets.items():
      before = net.pulled_bytes
      got, row[f"{kind}_pull_s"] = pull(server, net, offer)
      row[f"{kind}_bytes"] = net.pulled_bytes - before
      for a, b in zip(jax.tree.leaves(got), host):
        assert np.asarray(a).tobytes() == b.tobytes(), (kind, v)
    if prev is not None:
      changed = sum(
        int((a.view(np.uint16) != b.view(np.uint16)).sum())
        for a, b in zip(prev, host)
        if a.dtype.itemsize == 2
      )
      row["changed_fraction"] = changed / sum(a.size for a in host if a.dtype.itemsize == 2)
      row["blocks"] = block_bytes(prev, host, blocks)
    prev = host
    rows.append(row)
    print(_line(row), flush=True)
  server.close()
  return rows, sum(a.nbytes for a in prev)


def _line(r):
  out = (
    f"v{r['version']:3d} publish {r['publish_s']:.3f}s (delta {r['delta_s']:.3f}s) "
    f"full {r['full_bytes']:,} B {r['full_pull_s']:.3f}s  "
    f"delta {r['delta_bytes']:,} B {r['delta_pull_s']:.3f}s"
  )
  if "changed_fraction" in r:
    out += f"  changed {100 * r['changed_fraction']:.3f}%"
  return out


def summary(args, rows, version_bytes):
  # Medians past the warmup: while the lr climbs, each version's changed
  # counts reach new buckets and compile new programs.
  later = [r for r in rows if r["version"] > WARMUP] or rows[2:]
  med = lambda key, rs=later: statistics.median(r[key] for r in rs)
  full_s = statistics.median(r["publish_s"] - r["delta_s"] + r["full_pull_s"] for r in later)
  delta_s = statistics.median(r["publish_s"] + r["delta_pull_s"] for r in later)
  warm = [r for r in rows if 1 <= r["version"] <= WARMUP]
  after = [r for r in rows if r["version"] > WARMUP]
  print(f"\nversion {version_bytes:,} B; medians over versions {later[0]['version']}..{args.steps}")
  print(
    f"changed fraction: warmup (v1-{WARMUP}) median {100 * med('changed_fraction', warm):.3f}%"
    + (
      f", after (v{WARMUP + 1}-{args.steps}) median "
      f"{100 * med('changed_fraction', after):.3f}% max "
      f"{100 * max(r['changed_fraction'] for r in after):.3f}%"
      if after
      else ""
    )
  )
  ratio = med("delta_bytes") / version_bytes
  print(
    f"per version: full {version_bytes:,} B {full_s:.3f} s (publish + pull); delta "
    f"{med('delta_bytes'):,.0f} B ({100 * ratio:.2f}%) {delta_s:.3f} s (publish with "
    f"encode {med('delta_s'):.3f} s + pull, apply and checksums)"
  )
  for key in list(later[0]["blocks"]):
    b = statistics.median(r["blocks"][key] for r in later)
    print(f"  block {key}: {b:,.0f} B ({100 * b / version_bytes:.2f}%)")
  print(
    f"programs compiled: encode {weight_delta.encode._cache_size()}, apply "
    f"{weight_delta.apply._cache_size()} (one per piece shape and bucket)"
  )
  print(
    f"\npod (modeled): a version {args.version_gb} GB, delta {100 * ratio:.2f}% of it = "
    f"{args.version_gb * ratio:.2f} GB; LoRA adapters {args.lora_gb} GB"
  )
  for gbps in (float(g) for g in args.gbps.split(",")):
    print(
      f"  at {gbps} GB/s: full {args.version_gb / gbps:.2f} s, delta "
      f"{args.version_gb * ratio / gbps:.3f} s, adapters {args.lora_gb / gbps:.3f} s"
    )


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="small", choices=sorted(model_config.PRESETS))
  ap.add_argument("--steps", type=int, default=40)
  ap.add_argument("--grads", default="lm", choices=["lm", "random"])
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=128)
  ap.add_argument("--blocks", default="1,16,64,256")
  ap.add_argument("--version_gb", type=float, default=61.06)
  ap.add_argument("--lora_gb", type=float, default=3.376)  # 843.8 M fp32 adapters
  ap.add_argument("--gbps", default="25,3.59")
  args = ap.parse_args()
  import tempfile

  with tempfile.TemporaryDirectory() as root:
    rows, version_bytes = measure(args, root)
  summary(args, rows, version_bytes)


if __name__ == "__main__":
  main()
