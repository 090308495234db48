"""Rollout throughput: the engine's decode loop, continuous batching, weight swaps.

    python benchmarks/rollout.py [--out benchmarks/RESULTS.md] [--sections engine,batching,lanes,swap]

Tiny model (random init), one process, every comparison interleaved (A B A
B, median of `--repeats`) so that load on this shared machine hits each
side alike; the ratios are what to read.

engine: the engine alone, `slots` prompts of 64 tokens plus 64 new tokens,
  temperature 1. "one-step" feeds one token per host call (`step`, the
  driver's path before the decode loop); "decode K" runs K tokens per call
  (`decode`), and "generate_batch" is the plain sampler (one prefill, one
  loop for all the new tokens).

batching: the driver on 96 requests whose number of turns is long-tailed
  (1 + geometric, capped at 12; each turn up to 12 sampled tokens, then a
  short observation). "static" admits a new batch only when every slot of
  the previous one has finished; "continuous" refills a slot the moment it
  frees; each with `decode_steps` 1 and 8. Instant environment steps, and
  30 ms of simulated tool latency per step.

lanes: the engine's lanes (`LaneSampler(engine, 2)`: two programs of half
  the slots, run from two threads) on `generate_batch` (32 prompts of 64
  tokens, 64 new) against one program; and, for comparison, the driver's
  generated tokens/s on `--requests` long-tailed tasks (one driver of 32
  slots, the path evaluation and rollout take, which does not use lanes).

swap: the cost of a weight swap under each `rollout.swap_policy`: the driver
  gets new params every `--swap_every` finished trajectories (as from a
  trainer) and its generated tokens/s is compared with no swaps at all.
  Cost per swap = (seconds with swaps - seconds without) / swaps.
"""

import argparse
import time

import jax
import numpy as np

from sao_jax.config import sections
from sao_jax.envs.base import StepResult, Task
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import config as mcfg
from sao_jax.models import policy
from sao_jax.rollout.batch_sampler import LaneSampler, generate_batch
from sao_jax.rollout.driver import SWAP_POLICIES, RolloutDriver
from sao_jax.rollout.engine import PolicyEngine

SLOTS, MAX_LEN = 16, 512


class LongTailEnv:
  name, max_turns = "long_tail", 12

  def task(self, i):
    turns = min(1 + int(np.random.default_rng(i).geometric(0.3)), self.max_turns)
    return Task(i, f"task {i % 100}\n", None, {"turns": turns})

  def episode(self, task):
    left = [task.meta["turns"]]

    class Ep:
      def step(self, action):
        left[0] -= 1
        return StepResult("" if left[0] <= 0 else ">ok\n", float(left[0] <= 0), left[0] <= 0)

    return Ep()


def _engine(cfg, params, warm, seed, slots=SLOTS):
  engine = PolicyEngine(cfg, params, sections.Rollout(slots=slots, max_len=MAX_LEN), seed=seed)
  if warm is not None:  # reuse the compiled programs (same shapes, same config)
    engine._jits = warm._jits
  return engine


def _interleaved(fns: dict, repeats: int) -> dict:
  """Median of each fn's result (a rate) over interleaved repeats, after a warm-up."""
  for fn in fns.values():
    fn()
  out = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      out[name].append(fn())
  return {name: float(np.median(v)) for name, v in out.items()}


# --- engine alone --------------------------------------------------------------------


def engine_section(cfg, params, repeats, slots, prompt_len=64, new=64):
  rng = np.random.default_rng(0)
  prompts = rng.integers(4, cfg.vocab_size, (slots, prompt_len)).astype(np.int32)
  warm = _engine(cfg, params, None, 0, slots)

  def one_step():
    engine = _engine(cfg, params, warm, 1, slots)
    start = time.perf_counter()
    state, tok, _, _ = engine.step(
      engine.init_decode_state(), prompts, np.ones(prompts.shape, bool)
    )
    alive = np.ones((slots, 1), bool)
    for _ in range(new - 1):
      state, tok, _, _ = engine.step(state, tok[:, None], alive)
    return slots * new / (time.perf_counter() - start)

  def chunked(k):
    def fn():
      engine = _engine(cfg, params, warm, 1, slots)
      start = time.perf_counter()
      state, tok, _, _ = engine.step(
        engine.init_decode_state(), prompts, np.ones(prompts.shape, bool)
      )
      budgets = np.full((slots,), new - 1, np.int32)
      while budgets.any():
        state, chunk = engine.decode(state, tok, budgets, steps=k)
        state, chunk = engine.collect(state, chunk)
        tok = chunk.tokens[np.arange(slots), chunk.counts - 1]
        budgets = budgets - chunk.counts
      return slots * new / (time.perf_counter() - start)

    return fn

  def batch():
    engine = _engine(cfg, params, warm, 1, slots)
    start = time.perf_counter()
    generate_batch(engine, list(prompts), new)
    return slots * new / (time.perf_counter() - start)

  fns = {
    "one-step": one_step,
    "decode 8": chunked(8),
    "decode 16": chunked(16),
    "generate_batch": batch,
  }
  res = _interleaved(fns, repeats)
  lines = [
    f"| {slots} | {name} | {tps:,.0f} | {tps / res['one-step']:.2f} |" for name, tps in res.items()
  ]
  return res, lines


# --- the driver ------------------------------------------------------------------


def drive(engine, tok, n, *, static=False, decode_steps=8, latency=0.0, swap=None, swap_every=4):
  """Runs n requests; (generated tokens/s, seconds, swaps, engine calls)."""
  out = []
  rollout = engine.rollout.replace(
    max_turn_tokens=12, env_workers=16, decode_steps=decode_steps, swap_policy=swap or "keep"
  )
  driver = RolloutDriver(
    engine,
    LongTailEnv(),
    tok,
    iter(range(n)),
    None,
    rollout,
    static_batching=static,
    tool_latency_s=latency,
  )

  def emit(t):
    out.append(t)
    if swap is not None and len(out) % swap_every == 0:
      driver.update_params(engine.params, engine.version + 1)

  driver._emit = emit
  start = time.perf_counter()
  driver.run()
  seconds = time.perf_counter() - start
  driver.stop()
  st = driver.stats
  return st.generated_tokens / seconds, seconds, st.param_swaps, st.steps


def batching_section(cfg, params, tok, repeats, n):
  lines = []
  for latency in (0.0, 0.03):
    warm = _engine(cfg, params, None, 0)
    for k in (1, 8):
      drive(warm, tok, 16, decode_steps=k, latency=latency)  # compile every bucket once
    fns, steps = {}, {}
    for static in (False, True):
      for k in (1, 8):

        def fn(static=static, k=k, warm=warm, latency=latency, steps=steps):
          tps, _, _, calls = drive(
            _engine(cfg, params, warm, 1), tok, n, static=static, decode_steps=k, latency=latency
          )
          steps[(static, k)] = calls
          return tps

        fns[(static, k)] = fn
    res = _interleaved(fns, repeats)
    base = res[(True, 1)]
    for (static, k), tps in res.items():
      lines.append(
        f"| {latency * 1000:.0f} ms | {'static' if static else 'continuous'} | {k} "
        f"| {tps:,.0f} | {tps / base:.2f} | {steps[(static, k)]} |"
      )
      print(lines[-1], flush=True)
  return lines


def lanes_section(cfg, params, tok, repeats, n, slots=32, prompt_len=64, new=64):
  prompts = list(np.random.default_rng(0).integers(2, cfg.vocab_size, (slots, prompt_len)))
  rollout = sections.Rollout(slots=slots, max_len=MAX_LEN)
  engines = {lanes: LaneSampler(PolicyEngine(cfg, params, rollout), lanes) for lanes in (1, 2)}

  def sample(lanes):
    def fn():
      start = time.perf_counter()
      engines[lanes].generate_batch(prompts, new)
      return slots * new / (time.perf_counter() - start)

    return fn

  warm = _engine(cfg, params, None, 0, slots)

  def drive_all():  # compiled programs shared through `warm` after the first call
    return drive(_engine(cfg, params, warm, 1, slots), tok, n)[0]

  res = _interleaved(
    {("generate_batch", 1): sample(1), ("generate_batch", 2): sample(2), ("driver", 1): drive_all},
    repeats,
  )
  lines = [
    f"| {what} | {lanes} | {tps:,.0f} | {tps / res[('generate_batch', 1)]:.2f} |"
    for (what, lanes), tps in res.items()
  ]
  print("\n".join(lines), flush=True)
  return lines


def swap_section(cfg, params, tok, repeats, n, swap_every):
  warm = _engine(cfg, params, None, 0)
  drive(warm, tok, 16)
  drive(warm, tok, 16, swap="recompute", swap_every=2)
  runs = {}

  def make(policy_name):
    def fn():
      tps, seconds, swaps, _ = drive(
        _engine(cfg, params, warm, 1), tok, n, swap=policy_name, swap_every=swap_every
      )
      runs.setdefault(policy_name or "none", []).append((seconds, swaps))
      return tps

    return fn

  fns = {"none": make(None), **{p: make(p) for p in SWAP_POLICIES}}
  res = _interleaved(fns, repeats)
  base_seconds = np.median([s for s, _ in runs["none"]])
  lines = []
  for name, tps in res.items():
    seconds = np.median([s for s, _ in runs[name]])
    swaps = int(np.median([w for _, w in runs[name]]))
    per = (seconds - base_seconds) / swaps * 1000 if swaps else 0.0
    lines.append(
      f"| {name} | {tps:,.0f} | {tps / res['none']:.2f} | {swaps} | {per:+.0f} |"
      if swaps
      else f"| {name} | {tps:,.0f} | 1.00 | 0 | - |"
    )
    print(lines[-1], flush=True)
  return lines


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=None)
  parser.add_argument("--requests", type=int, default=96)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--swap_every", type=int, default=4)
  parser.add_argument("--sections", default="engine,batching,lanes,swap")
  args = parser.parse_args()
  wanted = args.sections.split(",")
  tok = CharTokenizer()
  cfg = mcfg.tiny(vocab_size=tok.vocab_size)
  params = policy.init_params(cfg, jax.random.key(0))
  out = []
  if "engine" in wanted:
    out += ["", "| slots | engine loop | tokens/s | vs one-step |", "|---|---|---|---|"]
    for slots in (16, 32):
      _, lines = engine_section(cfg, params, args.repeats, slots)
      out += lines
      print("\n".join(lines), flush=True)
  if "batching" in wanted:
    out += [
      "",
      "| tool latency | batching | decode_steps | tokens/s | vs static, 1 step | engine calls |",
      "|---|---|---|---|---|---|",
    ]
    out += batching_section(cfg, params, tok, args.repeats, args.requests)
  if "lanes" in wanted:
    out += [
      "",
      "| call (32 slots) | lanes | generated tokens/s | vs generate_batch, 1 lane |",
      "|---|---|---|---|",
    ]
    out += lanes_section(cfg, params, tok, args.repeats, args.requests)
  if "swap" in wanted:
    out += [
      "",
      f"| swap policy (every {args.swap_every} trajectories) | tokens/s | vs no swaps "
      "| swaps | cost per swap (ms) |",
      "|---|---|---|---|---|",
    ]
    out += swap_section(cfg, params, tok, args.repeats, args.requests, args.swap_every)
  if args.out:
    with open(args.out, "a", encoding="utf-8") as f:
      f.write("\n".join(out) + "\n")


if __name__ == "__main__":
  main()
