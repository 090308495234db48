"""Bytes per policy version with LoRA: the merged params against the adapters alone.

    python benchmarks/lora_versions.py [--configs=sao_moe,sao_qwen3_8b] [--tiny_steps=6]

A LoRA run's fleet sends each version as the adapter tree (float32: A and
B per adapted matrix, and any leaf trained whole), which each rollout
merges onto the base it built (fleet_worker.AdapterVersions); without
LoRA, or as sent before, a version is the merged params in the engines'
compute dtype. Per config:

  full bytes      the served params (`precision.serving_bytes` of the
                  policy: what a version crossed as before)
  adapter bytes   the adapter tree the trainer's state holds
                  (`Programs.abstract_state.policy`)

For the pod configs both are from shapes alone (`factories.build_programs`
on one CPU device: eval_shape, nothing allocated or compiled); the
configs' own `lora` section with `lora.enabled` (rank 16, the default
targets, `rl.actor_frozen` left out). For sao_tiny (`lora.rank = 4`, the
fleet test's config) the bytes are those of the arrays a real run
publishes, and `--tiny_steps` real SFT steps of the adapters at sao_moe's
actor learning rate and schedule (1e-6, warmup 10 of 400, as
benchmarks/delta_versions.py uses) give the fraction of adapter elements
whose float32 bits change from one version to the next: what a delta
version (weight_delta.py) could leave out.
"""

import argparse
import os
import sys

import jax
import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sao_jax.config import sections
from sao_jax.models import lora, policy, precision, sharding
from sao_jax.train import factories

GB = 1e9


def _config(name: str, **fields):
  """configs/<name>.py with LoRA on, placed on one device (shapes only)."""
  import importlib

  c = importlib.import_module(f"configs.{name}").get_config()
  c.lora.enabled = True
  c.sharding = sections.Sharding.defaults()
  c.rollout.mesh = ""
  for field, value in fields.items():
    section, key = field.split(".")
    c[section][key] = value
  return sections.load(c)


def _programs(config):
  model_cfg = factories.build_model_config(config)
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  return model_cfg, factories.build_programs(config, model_cfg, factories.step_config(config), mesh)


def from_shapes(name: str) -> dict:
  """Full and adapter bytes of one version of configs/<name>.py with LoRA."""
  model_cfg, p = _programs(_config(name))
  params = jax.eval_shape(lambda: policy.init_params(model_cfg, jax.random.key(0)))
  adapters = p.abstract_state.policy
  return {
    "config": name,
    "params": lora.count(params),
    "adapters": lora.count(adapters),
    "full_bytes": precision.serving_bytes(model_cfg, params),
    "adapter_bytes": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(adapters)),
  }


def _bits(tree) -> list[np.ndarray]:
  return [
    np.asarray(x).view(np.uint32 if x.dtype.itemsize == 4 else np.uint16).ravel()
    for x in jax.tree.leaves(tree)
  ]


def tiny(steps: int) -> dict:
  """sao_tiny with LoRA rank 4: the published trees' bytes, and the changed
  fraction over `steps` SFT steps of the adapters at sao_moe's actor lr."""
  import flax.linen as nn

  from sao_jax.envs import base as env_base
  from sao_jax.envs.demonstrations import demonstration_trajectory
  from sao_jax.train import run as run_lib

  def demos(step):
    """SFT's own draw of demonstrations for `step` (stages.sft's)."""
    idx = np.random.default_rng([c.seed, 2, step]).integers(
      0, c.data.num_train_tasks, c.sft.batch_size
    )
    tasks = [env_base.demonstration_task(run.env, int(i)) for i in idx]
    return [demonstration_trajectory(run.env, t, run.tok, run.format) for t in tasks]

  c = __import__("configs.sao_tiny", fromlist=["get_config"]).get_config()
  c.lora.enabled, c.lora.rank = True, 4
  c.sft.lr, c.sft.warmup, c.sft.steps = 1e-6, 10, 400
  run = run_lib.build(c)
  cast = jax.jit(lambda t: precision.cast_for_serving(run.model_cfg, t))
  out = {
    "config": "sao_tiny (lora.rank 4)",
    "params": lora.count(run.policy_params()),
    "adapters": lora.count(run.state.policy),
    "full_bytes": sum(x.nbytes for x in jax.tree.leaves(cast(run.policy_params()))),
    "adapter_bytes": sum(x.nbytes for x in jax.tree.leaves(run.state.policy)),
  }
  opt = jax.jit(run.programs.sft_tx.init)(run.state.policy)
  ad, fractions, served = run.state.policy, [], []
  before, before_served = _bits(ad), _bits(cast(run.policy_params()))
  for step in range(steps):
    batch = run.pack(demos(step), c.sft.batch_size)
    with jax.set_mesh(run.mesh), nn.logical_axis_rules(run.rules):
      ad, opt, _ = run.sft_step(ad, opt, batch)
    merged = cast(factories.full_params(run.programs, run.bases, ad))
    now, now_served = _bits(ad), _bits(merged)
    fractions.append(float(np.mean(np.concatenate(before) != np.concatenate(now))))
    served.append(float(np.mean(np.concatenate(before_served) != np.concatenate(now_served))))
    before, before_served = now, now_served
  out["changed"], out["served_changed"] = fractions, served
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--configs", default="sao_moe,sao_qwen3_8b")
  parser.add_argument("--tiny_steps", type=int, default=6)
  args = parser.parse_args()
  rows = [tiny(args.tiny_steps)] + [from_shapes(n) for n in args.configs.split(",") if n]
  print("| config | params | adapter params | full version bytes | adapter version bytes | ratio |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['config']} | {r['params']:,} | {r['adapters']:,} | {r['full_bytes']:,} "
      f"({r['full_bytes'] / GB:.3f} GB) | {r['adapter_bytes']:,} ({r['adapter_bytes'] / GB:.3f} GB) "
      f"| {r['adapter_bytes'] / r['full_bytes']:.2%} |"
    )
  t = rows[0]
  print("\nsao_tiny, per SFT step at lr 1e-6 (warmup 10): fraction of elements whose bits changed")
  print("adapters (fp32):  " + " ".join(f"{x:.4f}" for x in t["changed"]))
  print("served (merged):  " + " ".join(f"{x:.4f}" for x in t["served_changed"]))


if __name__ == "__main__":
  main()
