"""The RL loop end to end: async SAO vs sync, and the rollout side vs the engine alone.

    nice -n 10 python benchmarks/loop.py [--steps 30] [--latency 0.1] [--out benchmarks/RESULTS.md]

One warm start (a short SFT and value pretraining of the tiny model on
python_tool, `configs/sao_tiny.py` otherwise) is made once in
`<workdir>/base`; every arm then runs the RL stage of the real trainer
(`sao_jax.train.trainer.train(..., until="done")`, no final evaluation) from a copy
of it, in this process, with the same config except `rl.mode` and
`env.tool_latency_s`, arms interleaved (async, sync, async, sync, ...).

Figures per arm, from the run's metrics.jsonl (rl stage):
  * RL wall: seconds from the first step's record to the last one's, i.e.
    steps 2..N (step 1 carries the train step's compile; async's rollout
    thread generates meanwhile, so the queue starts full: a head start of
    at most `rollout.queue_size` trajectories, stated beside the figure);
  * the wall-clock split of the last record: time/train_frac,
    time/wait_frac (trainer waiting for data), time/generate_frac
    (rollout thread in engine calls), time/env_frac (rollout thread
    blocked on environment steps with nothing to decode);
  * rollout/generated_tokens_per_s over the whole RL stage.

"engine alone": the same driver and engine (same slots, the warm-start
policy, same environment) with no trainer, tool latency 0: the generation
rate the loop is compared with.

All of it shares this machine's 2 cores: generation and training contend
for them, which is what the figures measure.
"""

import argparse
import json
import os
import shutil
import sys
import time

import jax
import numpy as np

from sao_jax.data import prompts as prompt_data
from sao_jax.train import factories, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from configs import common  # noqa: E402


def make_config(args, mode="async", latency=0.0):
  c = common.get_config()
  c.tensorboard = False
  c.log_every = 1
  c.sft.steps = args.sft_steps
  c.sft.batch_size = 16
  c.value_pretrain.steps = 5
  c.value_pretrain.num_trajectories = 32
  c.eval.num_tasks = 16
  c.eval.slots = 16
  c.rl.steps = args.steps
  c.rl.eval_every = 0
  c.checkpoint.every = 10_000
  c.rl.mode = mode
  c.env.tool_latency_s = latency
  c.rollout.swap_policy = args.swap_policy
  return c


def rl_figures(workdir: str) -> dict:
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    recs = [r for r in map(json.loads, f) if r["stage"] == "rl"]
  last = recs[-1]
  keys = (
    "time/train_frac",
    "time/wait_frac",
    "time/generate_frac",
    "time/env_frac",
    "rollout/generated_tokens_per_s",
    "trainer/idle_fraction",
  )
  return {
    "wall": last["time"] - recs[0]["time"],
    "steps": len(recs) - 1,
    **{k: last.get(k, float("nan")) for k in keys},
  }


def engine_alone(config, base: str, trajectories: int) -> float:
  """Generated tokens/s of the driver alone on the warm-start policy."""
  run = trainer.load_run(config, base)
  try:

    def once(n):
      engine = factories.make_engine(config, run.model_cfg, run.state.policy, int(run.state.step))
      prompts = prompt_data.train_prompts(config.data.num_train_tasks, config.seed + 1)
      driver = factories.make_driver(config, engine, run.env, run.tok, prompts, lambda t: None)
      start = time.perf_counter()
      driver.run(max_trajectories=n)
      seconds = time.perf_counter() - start
      driver.stop()
      return driver.stats.generated_tokens / seconds

    once(16)  # compile
    return float(np.median([once(trajectories) for _ in range(2)]))
  finally:
    run.close()


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--workdir", default=os.path.join(ROOT, "workdirs", "loop"))
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--sft_steps", type=int, default=60)
  parser.add_argument("--latency", type=float, default=0.1)
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--out", default=None)
  parser.add_argument("--swap_policy", default=common.get_config().rollout.swap_policy)
  args = parser.parse_args()
  jax.config.update("jax_compilation_cache_dir", os.path.join(args.workdir, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  base = os.path.join(args.workdir, "base")
  if not os.path.exists(os.path.join(base, "summary_base.json")):
    shutil.rmtree(base, ignore_errors=True)
    evals = trainer.train(make_config(args), base, until="rl")
    with open(os.path.join(base, "summary_base.json"), "w", encoding="utf-8") as f:
      json.dump(evals, f)

  alone = engine_alone(make_config(args), base, 48)
  print(f"engine alone: {alone:,.0f} generated tokens/s", flush=True)
  arms = [("async", 0.0), ("sync", 0.0), ("async", args.latency), ("sync", args.latency)]
  results = {arm: [] for arm in arms}
  for rep in range(args.repeats):
    for mode, latency in arms:
      workdir = os.path.join(args.workdir, f"{mode}_{latency}_{rep}")
      shutil.rmtree(workdir, ignore_errors=True)
      shutil.copytree(base, workdir)
      os.remove(os.path.join(workdir, "metrics.jsonl"))
      trainer.train(make_config(args, mode, latency), workdir, until="done")
      results[(mode, latency)].append(rl_figures(workdir))
      print(mode, latency, results[(mode, latency)][-1], flush=True)

  def med(arm, key):
    return float(np.median([r[key] for r in results[arm]]))

  lines = [
    "| tool latency | mode | RL wall, steps 2..N (s) | train | wait | generate | env "
    "| generated tokens/s | vs engine alone |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for mode, latency in arms:
    arm = (mode, latency)
    tps = med(arm, "rollout/generated_tokens_per_s")
    lines.append(
      f"| {latency * 1000:.0f} ms | {mode} | {med(arm, 'wall'):.1f} "
      f"| {med(arm, 'time/train_frac'):.2f} | {med(arm, 'time/wait_frac'):.2f} "
      f"| {med(arm, 'time/generate_frac'):.2f} | {med(arm, 'time/env_frac'):.2f} "
      f"| {tps:,.0f} | {tps / alone:.2f} |"
    )
  for latency in (0.0, args.latency):
    ratio = med(("sync", latency), "wall") / med(("async", latency), "wall")
    lines.append(f"\nsync / async RL wall at {latency * 1000:.0f} ms tool latency: {ratio:.2f}x")
  lines.append(
    f"\nengine alone (same driver and slots, no trainer, no latency): "
    f"{alone:,.0f} generated tokens/s"
  )
  print("\n".join(lines), flush=True)
  if args.out:
    with open(args.out, "a", encoding="utf-8") as f:
      f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
