"""Weight sync: the direct path (sao_jax/transport/weight_transfer.py) against the
checkpoint path (sao_jax/transport/fleet.py), side by side in one run, and the plan's
bytes for a pod.

    nice -n 10 python benchmarks/weight_sync.py --gib 1 --repeats 3
    nice -n 10 python benchmarks/weight_sync.py --plan_config configs/sao_moe.py \\
        --topology v5p:4x4x8 --rollout_topology v5p:2x2x1 --rollout_mesh expert:2,tensor:2

Measure: a trainer process (a child, 2 CPU devices, the tree sharded over
both) publishes each version both ways; this process is the rollout (2 CPU
devices, another layout). The trainer holds float32 params (the precision
policy's master weights; --master bfloat16 for bf16 ones) and publishes
their bf16 cast, as FleetSource does: direct = `WeightServer.publish` (the
cast and the snapshot copy in one jitted program, manifest) + the
rollout's pull until the assembled params are in its layout; checkpoint =
the jitted cast + `WeightPublisher.publish` + `close` (the orbax write) +
a fresh `WeightFollower.poll` (restore onto the rollout's devices). The
versions are random [4096, 4096] leaves (--gib of bf16); every pulled and restored version is
checked bit for bit. With --drop_caches (root) the checkpoint pick-up reads
the disk: right after the write it would otherwise read the trainer's
bytes back from this host's page cache, which a rollout host on another
machine does not share. Over 127.0.0.1 on this host: the loopback path is a
floor of the library's cost, not a prediction of DCN rates.

Manifest check (--cover N): `check_cover`, which a rollout runs on the
manifests before each pull, timed on a leaf of N row pieces and on a grid
of about N pieces, both exact tilings.

Plan (--plan_config): the transfer plan of a config's trainer layout on
--topology into one engine on --rollout_topology (abstract shapes only,
nothing compiled), and the modeled seconds per version from it at the
bandwidths given (--rollout_gbps / --trainer_gbps: bytes per second per
host in GB/s).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LEAF = (4096, 4096)
GIB = 1 << 30


def tree(version, n_leaves, sharding, dtype="bfloat16"):
  """Version `version`'s leaves in `dtype`: float32 values, rounded to bf16
  for "bfloat16" (so the bf16 tree is the float32 tree's serving cast)."""
  import jax
  import jax.numpy as jnp

  keys = jax.random.split(jax.random.key(version), n_leaves)
  make = jax.jit(
    lambda k: jax.random.normal(k, LEAF, jnp.float32).astype(dtype), out_shardings=sharding
  )
  return {f"w{i:03d}": make(k) for i, k in enumerate(keys)}


def trainer(root, n_leaves, repeats, sockets, master):
  """The child: publishes version v both ways when <root>/go-<v> appears,
  from `master` params cast to bf16 as the trainer's FleetSource does it:
  inside the server's snapshot on the direct path, by the jitted cast
  before the write on the checkpoint path."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from sao_jax.transport import fleet, weight_transfer

  sharding = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("fsdp",)), P("fsdp", None))
  server = weight_transfer.WeightServer(
    root, "bench", host="127.0.0.1", sockets=sockets, poll_seconds=0.01
  )
  # precision.cast_for_serving's work for a bf16 engine.
  cast = jax.jit(lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t))
  for v in range(1, repeats + 1):
    while not os.path.exists(os.path.join(root, f"go-{v}")):
      time.sleep(0.01)
    params = tree(v, n_leaves, sharding, master)
    jax.block_until_ready(params)
    t0 = time.time()
    server.publish(params, v, cast)
    serve_s = time.time() - t0
    # Wait until the rollout has pulled it (one pull per version) before
    # the checkpoint path runs: the two never share the cores.
    while server.served < v or not os.path.exists(os.path.join(root, f"pulled-{v}")):
      time.sleep(0.01)
    pub = fleet.WeightPublisher(root, keep=2, version=v)  # close() ends a publisher
    t0 = time.time()
    pub.publish(cast(params), v, {"nonce": "bench"})
    pub.close()
    publish_s = time.time() - t0
    with open(os.path.join(root, f"trainer-{v}.json"), "w", encoding="utf-8") as f:
      json.dump({"serve_s": serve_s, "publish_s": publish_s}, f)
    del params
  while not os.path.exists(os.path.join(root, "stop")):
    time.sleep(0.05)
  server.close()


def drop_page_cache():
  """Writes the dirty pages out and drops the clean ones (root only)."""
  os.sync()
  try:
    with open("/proc/sys/vm/drop_caches", "w", encoding="utf-8") as f:
      f.write("1\n")
  except OSError as e:
    raise SystemExit(f"--drop_caches needs root (writing /proc/sys/vm/drop_caches): {e}") from e


def measure(args):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from sao_jax.transport import fleet, weight_transfer

  n_leaves = max(1, round(args.gib * GIB / (LEAF[0] * LEAF[1] * 2)))
  nbytes = n_leaves * LEAF[0] * LEAF[1] * 2
  root = tempfile.mkdtemp(prefix="weight_sync_", dir=args.dir)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
  child = subprocess.Popen(
    [
      sys.executable,
      __file__,
      "--trainer",
      root,
      "--repeats",
      str(args.repeats),
      "--leaves",
      str(n_leaves),
      "--sockets",
      str(args.sockets),
      "--master",
      args.master,
    ],
    env=env,
  )
  # The rollout's layout: columns over its 2 devices (the trainer's: rows).
  sharding = NamedSharding(
    Mesh(np.array(jax.devices()[:2]), ("tensor",)),
    P(None, "tensor") if args.layout == "columns" else P("tensor", None),
  )
  abstract = {
    f"w{i:03d}": jax.ShapeDtypeStruct(LEAF, jnp.bfloat16, sharding=sharding)
    for i in range(n_leaves)
  }
  net = weight_transfer.NetFollower(root, "bench", abstract, host="127.0.0.1", sockets=args.sockets)
  rows = []
  try:
    for v in range(1, args.repeats + 1):
      open(os.path.join(root, f"go-{v}"), "w", encoding="utf-8").close()
      while (offer := weight_transfer.newest_offer(root)) is None or offer.version != v:
        time.sleep(0.005)
      t0 = time.time()
      net.start(offer)
      while (got := net.advance()) is None:
        time.sleep(0.002)
      jax.block_until_ready(got)
      pull_s = time.time() - t0
      want = tree(v, n_leaves, sharding)
      assert all(bool((got[k] == want[k]).all()) for k in want), "direct: not bit for bit"
      del got
      open(os.path.join(root, f"pulled-{v}"), "w", encoding="utf-8").close()
      while not os.path.exists(os.path.join(root, f"trainer-{v}.json")):
        time.sleep(0.01)
      with open(os.path.join(root, f"trainer-{v}.json"), encoding="utf-8") as f:
        t = json.load(f)
      if args.drop_caches:  # a rollout host elsewhere never saw the write in its page cache
        drop_page_cache()
      follower = fleet.WeightFollower(root, abstract)
      t0 = time.time()
      params, version, _ = follower.poll()
      jax.block_until_ready(params)
      restore_s = time.time() - t0
      follower.close()
      assert version == v and all(bool((params[k] == want[k]).all()) for k in want), (
        "checkpoint: not bit for bit"
      )
      del params, want
      rows.append(
        dict(
          t,
          pull_s=pull_s,
          restore_s=restore_s,
          transfer_s=net.last_transfer_s,
          assemble_s=net.last_assemble_s,
        )
      )
      print(
        f"version {v}: direct serve {t['serve_s']:.2f} s + pull {pull_s:.2f} s (transfer "
        f"{net.last_transfer_s:.2f}, assembly {net.last_assemble_s:.2f}); "
        f"checkpoint publish {t['publish_s']:.2f} s + pick-up {restore_s:.2f} s",
        flush=True,
      )
  finally:
    open(os.path.join(root, "stop"), "w", encoding="utf-8").close()
    child.wait(timeout=120)
  med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
  direct = med["serve_s"] + med["pull_s"]
  ckpt = med["publish_s"] + med["restore_s"]
  mb = nbytes / 1e6
  print(
    f"\n{nbytes / GIB:.2f} GiB of bf16 in {n_leaves} leaves (the trainer's params "
    f"{args.master}), medians of {len(rows)}, {args.sockets} bulk sockets, checkpoint "
    f"pick-up {'from disk (page cache dropped)' if args.drop_caches else 'as cached'}"
  )
  print("| path | publish s | pick-up s | total s | pick-up MB/s | end-to-end MB/s |")
  print("|---|---|---|---|---|---|")
  print(
    f"| direct (transfer server) | {med['serve_s']:.2f} | {med['pull_s']:.2f} | "
    f"{direct:.2f} | {mb / med['pull_s']:,.0f} | {mb / direct:,.0f} |"
  )
  print(
    f"| checkpoint (orbax) | {med['publish_s']:.2f} | {med['restore_s']:.2f} | "
    f"{ckpt:.2f} | {mb / med['restore_s']:,.0f} | {mb / ckpt:,.0f} |"
  )
  print(
    f"direct / checkpoint, end to end: {ckpt / direct:.1f}x; pick-up alone: "
    f"{med['restore_s'] / med['pull_s']:.1f}x"
  )


def plan(args):
  import functools
  import importlib.util

  import jax
  from jax.experimental import topologies

  from sao_jax.config import sections
  from sao_jax.models import precision, sharding
  from sao_jax.rollout import programs as programs_lib
  from sao_jax.train import factories
  from sao_jax.transport import weight_transfer

  spec = importlib.util.spec_from_file_location("cfg", args.plan_config)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
  rdevices = topologies.get_topology_desc(
    platform="tpu", topology_name=args.rollout_topology
  ).devices
  model_cfg = factories.build_model_config(config)
  mesh = sharding.make_mesh(dict(config.sharding.mesh), devices=devices)
  t0 = time.time()
  progs = factories.build_programs(config, model_cfg, factories.step_config(config), mesh)
  r = sections.rollout(config)
  if args.rollout_mesh:
    r = r.replace(mesh=args.rollout_mesh)
  emesh = factories.engine_mesh(r, rdevices)
  eng = programs_lib.EnginePrograms.for_rollout(model_cfg, r, mesh=emesh)
  policy = progs.abstract_state.policy
  serving = jax.eval_shape(functools.partial(precision.cast_for_serving, model_cfg), policy)
  src = [
    (x.shape, s.dtype, x.sharding)
    for x, s in zip(jax.tree.leaves(policy), jax.tree.leaves(serving))
  ]
  dst = [(x.shape, x.sharding) for x in jax.tree.leaves(eng.step_args(policy, 1)[0])]
  report = weight_transfer.report(src, dst, rollout_hosts=args.rollout_hosts)
  print(
    f"plan of {args.plan_config}: trainer {args.topology} mesh {dict(mesh.shape)}, engine "
    f"{args.rollout_topology} mesh {dict(emesh.shape)}, {args.rollout_hosts} rollout "
    f"hosts ({time.time() - t0:.0f} s)"
  )
  print(json.dumps(report, indent=1))
  v, per_trainer = report["version_bytes"], report["max_bytes_per_trainer_host"]
  for name, gbps in (("line rate", args.rollout_gbps), ("TCP as peers measured", args.tcp_gbps)):
    ingress = v / (gbps * 1e9)
    egress = per_trainer / (min(gbps, args.trainer_gbps) * 1e9)
    print(
      f"modeled at {name} ({gbps} GB/s per rollout host, {min(gbps, args.trainer_gbps)} "
      f"per trainer host): rollout ingress {ingress:.1f} s, busiest trainer host egress "
      f"{egress:.2f} s -> {max(ingress, egress):.1f} s per version"
    )


def cover(n: int):
  from sao_jax.transport import weight_transfer

  g = round(n**0.5)
  cases = {
    f"{n} rows": ([((4 * i, 4 * i + 4), (0, 8)) for i in range(n)], (4 * n, 8)),
    f"{g}x{g} grid": (
      [((4 * i, 4 * i + 4), (4 * j, 4 * j + 4)) for i in range(g) for j in range(g)],
      (4 * g, 4 * g),
    ),
  }
  for name, (indices, shape) in cases.items():
    pieces = [weight_transfer.Piece(0, ix, 0, 0, 1) for ix in indices]
    t0 = time.perf_counter()
    why = weight_transfer.check_cover(pieces, [shape])
    print(f"check_cover, {name}: {time.perf_counter() - t0:.3f} s ({why or 'a tiling'})")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--gib", type=float, default=1.0)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--sockets", type=int, default=4)
  p.add_argument(
    "--layout",
    default="columns",
    choices=("columns", "rows"),
    help="the rollout's split of each leaf (the trainer's: rows)",
  )
  p.add_argument(
    "--master",
    default="float32",
    choices=("float32", "bfloat16"),
    help="the trainer's params, cast to bf16 on publish (float32: the "
    "precision policy's master weights)",
  )
  p.add_argument(
    "--drop_caches",
    action="store_true",
    help="drop the page cache before each checkpoint pick-up (root only): the "
    "restore reads the disk, as a rollout host on another machine would",
  )
  p.add_argument("--dir", default=None, help="where the checkpoint path writes (default /tmp)")
  p.add_argument("--trainer", default=None, help=argparse.SUPPRESS)
  p.add_argument("--leaves", type=int, default=0, help=argparse.SUPPRESS)
  p.add_argument(
    "--cover", type=int, default=0, help="time check_cover on manifests of about this many pieces"
  )
  p.add_argument("--plan_config", default=None)
  p.add_argument("--topology", default="v5p:4x4x8")
  p.add_argument("--rollout_topology", default="v5p:2x2x1")
  p.add_argument("--rollout_mesh", default="")
  p.add_argument("--rollout_hosts", type=int, default=1)
  p.add_argument(
    "--rollout_gbps",
    type=float,
    default=25.0,
    help="GB/s into a rollout host (v5p: 4 chips x 50 Gbps DCN)",
  )
  p.add_argument("--trainer_gbps", type=float, default=25.0)
  p.add_argument(
    "--tcp_gbps",
    type=float,
    default=3.6,
    help="GB/s of host TCP peers measured (verl PR #7905: 3.59 on v6e)",
  )
  args = p.parse_args()
  if args.trainer:
    trainer(args.trainer, args.leaves, args.repeats, args.sockets, args.master)
  elif args.cover:
    cover(args.cover)
  elif args.plan_config:
    plan(args)
  else:
    measure(args)


if __name__ == "__main__":
  main()
