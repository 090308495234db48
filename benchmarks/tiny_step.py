"""The CPU default's train steps now vs an earlier commit, side by side.

    python benchmarks/tiny_step.py [--ref 7adb88f] [--rounds 3] [--policy_loss dis] \
        [--out benchmarks/RESULTS.md]

The model and the trainer carry pod-scale paths (scanned layers, splash /
chunked attention, chunked log-probs, expert-parallel MoE) behind config
switches, and the tiny CPU default's train step must be no slower for
them. This times the RL step (K critic updates + actor update) and
the value-pretraining step that `configs/sao_tiny.py` builds
(`factories.build_programs`, the trainer's own construction) on one fixed
packed batch, in this tree and in `--ref` (a `git archive` of it), each in
its own process, the processes alternating ref, head, ref, head, ... so load
on this shared box hits both alike. Read the ratio (head / ref time; below
1: head faster).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run inside the tree being timed (cwd and sys.path): only the API both trees
# share (build_programs, Programs.init_state, the steps) is used.
CHILD = r"""
import json, sys, time
import jax, numpy as np
from flax import linen as nn
from configs import sao_tiny  # the tree's own (cwd): a package, or a ref tree's plain folder
from sao_jax.envs import registry
try:  # the programs' factories, or a ref tree whose trainer built them
  from sao_jax.train import factories as build
  from sao_jax.models import sharding
except ImportError:
  try:
    from sao_jax.train import trainer as build
    from sao_jax.models import sharding
  except ImportError:
    from sao_jax import sharding, trainer as build

steps = int(sys.argv[1])
config = sao_tiny.get_config()
if sys.argv[3]:  # --policy_loss: the same loss in both trees
  config.rl.policy_loss = sys.argv[3]
tok = registry.make_tokenizer(config.env)
model_cfg = build.build_model_config(config, tok)
mesh = sharding.make_mesh(dict(config.sharding.mesh))
p = build.build_programs(config, model_cfg, build.step_config(config), mesh)
with jax.set_mesh(mesh):
  state = jax.jit(lambda: p.init_state(nn.unbox(p.policy_init()), nn.unbox(p.critic_init())),
                  out_shardings=p.state_shardings)()
  batch = {k: jax.device_put(v, p.batch_sharding) for k, v in np.load(sys.argv[2]).items()}
  out = {}
  for name in ("rl_step", "value_step"):
    fn = getattr(p, name)
    for _ in range(3):  # compile and warm up
      state, m = fn(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(steps):
      t = time.perf_counter()
      state, m = fn(state, batch)
      jax.block_until_ready((state, m))
      times.append(time.perf_counter() - t)
    out[name] = float(np.median(times))
print("RESULT " + json.dumps(out))
"""


def make_batch(path: str, seed: int = 0) -> None:
  """One packed RL batch of sao_tiny's shape: 16 multi-turn trajectories."""
  sys.path.insert(0, ROOT)
  from configs import sao_tiny
  from sao_jax.data import packing
  from sao_jax.envs import registry

  config = sao_tiny.get_config()
  vocab = registry.make_tokenizer(config.env).vocab_size
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from timing import random_trajectory

  rng = np.random.default_rng(seed)
  trajs = [
    random_trajectory(
      rng,
      int(rng.integers(120, config.rollout.max_len)),
      vocab,
      int(rng.integers(10, 30)),
      (10, 40),
      (5, 30),
      i,
    )
    for i in range(config.rl.batch_size)
  ]
  batch = packing.pack(trajs, config.rl.batch_size, config.data.buckets)
  np.savez(path, **batch)


def run_child(tree: str, batch: str, steps: int, policy_loss: str = "") -> dict:
  proc = subprocess.run(
    [sys.executable, "-c", CHILD, str(steps), batch, policy_loss],
    cwd=tree,
    env=dict(os.environ, PYTHONPATH=tree),
    capture_output=True,
    text=True,
    check=False,
  )
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[7:])
  raise RuntimeError(f"timing in {tree} failed:\n{proc.stderr[-3000:]}")


def main():
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from timing import report

  parser = argparse.ArgumentParser()
  parser.add_argument(
    "--ref",
    default="7adb88f",
    help="the commit to compare with (default: before the pod-scale paths)",
  )
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=20, help="timed steps per program per run")
  parser.add_argument("--out", default=None, help="append the table to this file")
  parser.add_argument(
    "--policy_loss",
    default="",
    help="rl.policy_loss in both trees (default: each tree's sao_tiny's; "
    "the CPU default moved from dis to ppo_clip in edcd23b)",
  )
  args = parser.parse_args()
  head = subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
  ).stdout.strip()
  with tempfile.TemporaryDirectory() as tmp:
    ref_tree = os.path.join(tmp, "ref")
    os.makedirs(ref_tree)
    archive = subprocess.run(
      ["git", "archive", args.ref], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", ref_tree], input=archive, check=True)
    batch = os.path.join(tmp, "batch.npz")
    make_batch(batch)
    runs = {"ref": [], "head": []}
    for r in range(args.rounds):
      for name, tree in (("ref", ref_tree), ("head", ROOT)):
        runs[name].append(run_child(tree, batch, args.steps, args.policy_loss))
        print(
          f"round {r + 1} {name}: "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in runs[name][-1].items()),
          flush=True,
        )
  shape = "sao_tiny, 16 rows" + (f", {args.policy_loss}" if args.policy_loss else "")
  lines = [
    f"| program ({shape}) | {args.ref} (ms) | {head} (ms) | {head} / {args.ref} |",
    "|---|---|---|---|",
  ]
  for prog in ("rl_step", "value_step"):
    ref = np.median([x[prog] for x in runs["ref"]])
    new = np.median([x[prog] for x in runs["head"]])
    lines.append(f"| {prog} | {ref * 1e3:.1f} | {new * 1e3:.1f} | {new / ref:.2f} |")
  report(lines, args.out)


if __name__ == "__main__":
  main()
