"""Rollout throughput: continuous batching vs one static batch at a time.

    python benchmarks/rollout.py [--out benchmarks/RESULTS.md]

The same engine (tiny model, 16 slots) and the same 96 requests, whose
number of turns is long-tailed (1 + geometric, capped at 12; each turn up to
12 sampled tokens, then a short observation). "Static" admits a new batch
only when every slot of the previous one has finished, so each batch waits
for its longest episode; "continuous" refills a slot the moment it frees.
Run twice: with instant environment steps, and with 30 ms of simulated tool
latency per step (sleep in the environment worker), where continuous
batching can also overlap one slot's tool call with the others' decoding.
Both modes run in one process, alternating; generated tokens/s is the
figure, the ratio is what to read.
"""

import argparse
import time

import jax
import numpy as np

from sao_jax.envs.base import StepResult, Task
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import config as mcfg
from sao_jax.models import policy
from sao_jax.rollout.driver import RolloutDriver
from sao_jax.rollout.engine import PolicyEngine


class LongTailEnv:
  name, max_turns = "long_tail", 12

  def __init__(self, latency_s):
    self.latency_s = latency_s

  def task(self, i):
    turns = min(1 + int(np.random.default_rng(i).geometric(0.3)), self.max_turns)
    return Task(i, f"task {i % 100}\n", None, {"turns": turns})

  def episode(self, task):
    env, left = self, [task.meta["turns"]]

    class Ep:
      def step(self, action):
        if env.latency_s:
          time.sleep(env.latency_s)
        left[0] -= 1
        return StepResult("" if left[0] <= 0 else ">ok\n", float(left[0] <= 0), left[0] <= 0)

    return Ep()


def run(engine, env, tok, static, n):
  out = []
  driver = RolloutDriver(engine, env, tok, iter(range(n)), out.append, max_turn_tokens=12,
                         env_workers=16, static_batching=static)
  start = time.perf_counter()
  driver.run()
  seconds = time.perf_counter() - start
  driver.stop()
  return driver.stats.generated_tokens / seconds, driver.stats.steps


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=None)
  parser.add_argument("--requests", type=int, default=96)
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  tok = CharTokenizer()
  cfg = mcfg.tiny(vocab_size=tok.vocab_size)
  params = policy.init_params(cfg, jax.random.key(0))
  lines = ["| tool latency | continuous tokens/s | static tokens/s | continuous / static "
           "| engine steps (cont. / static) |", "|---|---|---|---|---|"]
  for latency in (0.0, 0.03):
    env = LongTailEnv(latency)
    warm = PolicyEngine(cfg, params, slots=16, max_len=512, seed=0)
    run(warm, env, tok, False, 16)  # compile every bucket once
    results = {True: [], False: []}
    steps = {}
    for rep in range(args.repeats):
      for static in (False, True):
        engine = PolicyEngine(cfg, params, slots=16, max_len=512, seed=rep)
        engine._step = warm._step  # pylint: disable=protected-access  (reuse compiled step)
        tps, steps[static] = run(engine, env, tok, static, args.requests)
        results[static].append(tps)
    cont, stat = np.median(results[False]), np.median(results[True])
    lines.append(f"| {latency * 1000:.0f} ms | {cont:,.0f} | {stat:,.0f} | {cont / stat:.2f} "
                 f"| {steps[False]} / {steps[True]} |")
    print(lines[-1], flush=True)
  if args.out:
    with open(args.out, "a", encoding="utf-8") as f:
      f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
