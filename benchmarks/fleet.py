"""The fleet's transport: trajectory-store throughput and weight-publish latency.

    nice -n 10 python benchmarks/fleet.py [--dir /tmp/fleet_bench] [--repeats 3]

Everything through the classes the trainer and rollout processes use
(sao_jax/transport/fleet.py), on one local disk, one process at a time:

store: a rollout's `ShardWriter` (serialise, ArrayRecord write, fsync,
  rename) writes N synthetic trajectories of length T into shards of 16, then
  the trainer's `ShardFeed` reads them back (grain ArrayRecordDataSource,
  hostile-input deserialise, validation) in completion order. MB/s are of
  the serialised records (what a trainer must move); "MB on disk" is the
  shard files' size (ArrayRecord compresses, and pads small shards).

weights: `WeightPublisher.publish` then `close` (the version complete on
  disk: orbax's device-to-host copy, write and commit rename), then a
  `WeightFollower.poll` on a fresh follower (find the newest complete
  version, restore it onto a device). Models: tiny and small (fp32 params,
  random init), and a synthetic 1 GiB tree of random bf16 [4096, 4096] leaves,
  where per-file overheads are amortised and bytes/s is the disk's and
  tensorstore's rate; the 30B row divides Qwen3-30B-A3B's bf16 param bytes
  by that rate (what that extrapolation ignores:
  benchmarks/RESULTS.md#fleet-and-weight-sync).

Prints markdown tables (medians of `--repeats`).

    nice -n 10 python benchmarks/fleet.py --gcs_emulator [--repeats 3]

runs every row twice, side by side: on the local disk and on a gs:// root
served by a local GCS emulator (tests/gcs_emulator.py: gcp-storage-emulator,
a single-threaded Python server on 127.0.0.1, in memory). The emulator is
not GCS: its figures are the clients' and the emulator's costs on this
machine, no forecast of a bucket's throughput or latency.
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.data import files, store
from sao_jax.data.trajectory import Trajectory
from sao_jax.models import config as mcfg
from sao_jax.models import policy
from sao_jax.transport import fleet

VOCAB = 64


def synthetic_trajectory(i: int, length: int) -> Trajectory:
  """A valid record of `length` tokens: 4 turns of actions and observations."""
  rng = np.random.default_rng(i)
  action_mask = np.zeros(length, bool)
  turn = length // 4
  starts = [8 + k * turn for k in range(4)]
  for s in starts:
    action_mask[s : s + turn // 2] = True
  logp = np.where(action_mask, -rng.uniform(0.01, 3.0, length), 0).astype(np.float32)
  rewards = np.zeros(length, np.float32)
  rewards[np.flatnonzero(action_mask)[-1]] = 1.0
  return Trajectory(
    tokens=rng.integers(0, VOCAB, length).astype(np.int32),
    action_mask=action_mask,
    rollout_logprobs=logp,
    policy_version=np.where(action_mask, 3, -1).astype(np.int32),
    rewards=rewards,
    turn_starts=np.asarray(starts, np.int32),
    prompt_id=i,
    group_id=i,
    finish_reason="done",
    start_time=0.0,
    end_time=1.0,
  )


def store_row(d: str, n: int, length: int, repeats: int, label: str = "") -> list[str]:
  trajs = [synthetic_trajectory(i, length) for i in range(n)]
  record_mb = sum(len(store.serialize(t)) for t in trajs) / 2**20
  writes, reads, sizes = [], [], []
  for r in range(repeats):
    root = files.join(d, f"store_{length}_{r}")
    files.rmtree(root)
    writer = fleet.ShardWriter(root, "bench", max_trajectories=16, max_seconds=1e9)
    t0 = time.perf_counter()
    for t in trajs:
      writer.write(t)
    writer.close()
    writes.append(time.perf_counter() - t0)
    tdir = fleet.trajectories_dir(root)
    if not files.is_url(tdir):  # (object sizes are not this benchmark's business)
      sizes.append(sum(os.path.getsize(os.path.join(tdir, f)) for f in os.listdir(tdir)))
    feed = fleet.ShardFeed(root, VOCAB, length, current_version=lambda: 10, log=lambda _: None)
    t0 = time.perf_counter()
    got = feed.take(n)
    reads.append(time.perf_counter() - t0)
    assert len(got) == n and not feed.rejected, feed.rejected
    files.rmtree(root)
  w, rd = float(np.median(writes)), float(np.median(reads))
  disk = f"{sizes[0] / 2**20:.1f}" if sizes else "-"
  return [
    f"| {label}{length} | {n} | {record_mb:.1f} | {disk} | {n / w:,.0f} "
    f"| {record_mb / w:.1f} | {n / rd:,.0f} | {record_mb / rd:.1f} |"
  ]


def tree_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def weights_row(d: str, name: str, params, repeats: int, label: str = "") -> tuple[str, float]:
  publish, pickup = [], []
  abstract = jax.eval_shape(lambda: params)
  for r in range(repeats):
    root = files.join(d, f"weights_{name.split()[0]}_{r}")
    files.rmtree(root)
    pub = fleet.WeightPublisher(root, keep=2, version=0)
    t0 = time.perf_counter()
    pub.publish(params, 1)
    pub.close()
    publish.append(time.perf_counter() - t0)
    follower = fleet.WeightFollower(root, abstract)
    t0 = time.perf_counter()
    got = follower.poll()
    jax.block_until_ready(got[0])
    pickup.append(time.perf_counter() - t0)
    assert got[1] == 1
    follower.close()
    files.rmtree(root)
  nbytes = tree_bytes(params)
  p, q = float(np.median(publish)), float(np.median(pickup))
  mb = nbytes / 2**20
  row = f"| {label}{name} | {mb:,.1f} | {p:.3f} | {mb / p:,.1f} | {q:.3f} | {mb / q:,.1f} |"
  return row, nbytes / (p + q)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--dir", default="/tmp/fleet_bench")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument(
    "--gcs_emulator",
    action="store_true",
    help="also on a gs:// root of a local GCS emulator, side by side",
  )
  parser.add_argument(
    "--big_mib",
    type=int,
    default=1024,
    help="size of the synthetic bf16 tree (MiB, a multiple of 32)",
  )
  args = parser.parse_args()
  os.makedirs(args.dir, exist_ok=True)
  places = [("", args.dir)]
  if args.gcs_emulator:
    sys.path.insert(
      0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    )
    import gcs_emulator

    emu = gcs_emulator.start(os.path.join(args.dir, "emulator.log"))
    emu.apply_here()
    places = [("disk: ", args.dir), ("gs:// emulator: ", emu.url("fleet_bench"))]

  out = [
    "### Trajectory store (ShardWriter -> ShardFeed)",
    "",
    "| tokens / trajectory | trajectories | record MB | MB on disk | write traj/s "
    "| write MB/s | read+validate traj/s | read MB/s |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for length, n in ((256, 512), (4096, 128)):
    for label, d in places:
      out += store_row(d, n, length, args.repeats, label)
      print(out[-1], flush=True)

  out += [
    "",
    "### Weight publish and pick-up (WeightPublisher -> WeightFollower)",
    "",
    "| params | MB | publish s | publish MB/s | pick-up s | pick-up MB/s |",
    "|---|---|---|---|---|---|",
  ]
  key = jax.random.key(0)
  trees = {
    "tiny (fp32)": policy.init_params(mcfg.tiny(VOCAB), key),
    "small (fp32)": policy.init_params(mcfg.small(VOCAB), key),
    # Random values: constant leaves would compress to nothing on disk.
    f"synthetic {args.big_mib} MiB (bf16)": {
      f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (args.big_mib * 4, 4096), jnp.bfloat16)
      for i in range(32)
    },
  }
  rate = None
  for name, params in trees.items():
    for label, d in places:
      row, place_rate = weights_row(d, name, params, args.repeats, label)
      rate = place_rate if not label.startswith("gs") else rate
      out.append(row)
      print(row, flush=True)
  qwen = jax.eval_shape(lambda: policy.init_params(mcfg.qwen3_30b_a3b(), key))
  qbytes = tree_bytes(qwen)
  out += [
    "",
    f"Qwen3-30B-A3B policy params: {qbytes / 2**30:.1f} GiB in bf16; at the "
    f"synthetic row's (disk) publish + pick-up rate ({rate / 2**20:,.0f} MB/s) one weight "
    f"sync would take {qbytes / rate:,.0f} s on this disk from one process.",
  ]
  print("\n".join(out))
  if args.gcs_emulator:
    emu.stop()


if __name__ == "__main__":
  main()
