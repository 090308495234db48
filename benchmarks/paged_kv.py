"""The paged KV cache against the dense one: memory per live token, tokens/s at equal memory.

    python benchmarks/paged_kv.py [--repeats 5] [--requests 256] [--decode_steps 1,8] \
        [--sections memory,throughput] [--out benchmarks/RESULTS.md]

memory: cache bytes per live token on a long-tailed length mix, no model
  run. Trajectory lengths are lognormal (median max_len / 16, sigma 1),
  capped at max_len; `slots` of them run at once with continuous refill,
  each growing in turns of `max_turn_tokens` decoded tokens plus a
  16-token observation. Dense holds slots x max_len positions whatever
  the lengths; paged holds, per live trajectory, the pages of its length
  plus its turn's reservation (the driver's rule: rollout/admission.py,
  module docstring), and its pool must hold the peak of that over the run
  (the pool that never makes a trajectory wait). Bytes per live token =
  the cache's bytes / the mean live tokens. Shapes: sao_tiny's (tiny
  model, 16 slots x 256, pages of 16) and Qwen3-30B-A3B's in bf16 (256
  slots x 32,768 and x 131,072, pages of 128). A sharded engine pages each
  device's slots into that device's part of the pool, which must hold one
  max_len trajectory and the peak of its own slots' mix, so with G slot
  groups (devices over the batch axes) the pool is G x the larger of the
  two (the last column: sao_moe's colocated engine, 128 groups of 2 slots;
  a 64-chip rollout slice {data 16, tensor 4}, 16 groups of 16).

throughput: generated tokens/s of the rollout driver on this CPU, tiny
  model (random init), max_len 256, pages of 16, `--requests` tasks whose
  number of turns is long-tailed (1 + lognormal(0, 1), capped at 10; each
  turn up to 24 sampled tokens, then a 4-token observation), decode_steps
  1 (sao_tiny's) and 8, one table each. Arms, all in one process,
  interleaved (A B C ..., median of --repeats, after a warm-up), the
  ratios against dense-16 (median of the per-repeat ratios) being what to
  read:
    dense-16        16 slots, the dense cache (sao_tiny's engine): 4,096 positions;
    paged-16        16 slots, a pool of the dense size (256 pages of 16): the
                    cost of paging itself at equal slots and memory;
    paged-16-small  16 slots, 96 pages (3/8 of the memory);
    paged-64        64 slots sharing the dense-16 memory (256 pages): more
                    trajectories at once, admission bounded by free pages;
    dense-64        64 slots, the dense cache (4x the memory), for reference.
  Each arm also reports its mean live tokens and the bytes per live token
  of its cache.
"""

import argparse
import math
import time

import jax
import numpy as np

from sao_jax.config import sections
from sao_jax.envs.base import StepResult, Task
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import config as mcfg
from sao_jax.models import policy
from sao_jax.rollout import layout
from sao_jax.rollout.driver import RolloutDriver
from sao_jax.rollout.engine import PolicyEngine

MAX_LEN, PAGE, TURN = 256, 16, 24
# paged-16-small's pool: 96 pages of 16, 3/8 of the dense cache (the
# memory section's peak for this shape is 87).
SMALL_POOL = 96


# --- memory: a simulated long-tailed mix ------------------------------------------------


def simulate(
  slots: int,
  max_len: int,
  page: int,
  turn: int,
  obs: int = 16,
  trajectories: int = 4000,
  seed: int = 0,
) -> dict:
  """Continuous batching of lognormal-length trajectories, one turn a tick.

  Returns mean live tokens, and the mean and peak pages a paged cache holds
  under the driver's reservation (length plus the turn's remaining tokens).
  """
  rng = np.random.default_rng(seed)
  median = max_len / 16
  final = np.minimum(
    max_len, np.maximum(2, rng.lognormal(math.log(median), 1.0, trajectories))
  ).astype(int)
  length = np.zeros(slots, int)
  target = np.zeros(slots, int)
  nxt, live, held = 0, [], []
  pages = lambda n: -(-n // page)
  while nxt < trajectories or target.any():
    for b in range(slots):
      if target[b] == 0 and nxt < trajectories:
        target[b], length[b] = final[nxt], min(final[nxt], 64)  # a prompt of up to 64
        nxt += 1
    # Each tick: every live trajectory decodes one turn (or what is left of
    # it), the cache reserved for the whole turn; sampled once mid-turn.
    grow = np.minimum(turn, target - length)
    mid = length + grow // 2
    live.append(int(mid[target > 0].sum()))
    held.append(int(sum(pages(min(l + turn, max_len)) for l, t in zip(mid, target) if t)))
    length = np.minimum(target, length + grow + obs)
    done = (target > 0) & (length >= target)
    target[done], length[done] = 0, 0
  steady = slice(len(live) // 10, -len(live) // 10)  # without the fill and the drain
  return {
    "live": float(np.mean(live[steady])),
    "pages_mean": float(np.mean(held[steady])),
    "pages_peak": int(np.max(held[steady])),
    "mean_length": float(final.mean()),
    "p99_length": float(np.percentile(final, 99)),
  }


def memory_section(shapes) -> list[str]:
  lines = [
    "| shape | slots x max_len | page | mean / p99 length | mean live tokens | "
    "dense bytes / live token | paged (pool = peak) bytes / live token | "
    "paged / dense | pool, pages of the dense size | slot groups: pool floor, "
    "paged / dense |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for name, cfg, slots, max_len, page, turn, groups in shapes:
    per_position = layout.cache_bytes_per_device(cfg, 1, page) / page
    sim = simulate(slots, max_len, page, turn)
    dense = slots * max_len * per_position
    pool = sim["pages_peak"] * page * per_position
    dense_pages = slots * max_len // page
    # A sharded engine pages each device's slots into its own part of the
    # pool, which must hold one max_len trajectory (engine.py) and the peak
    # of its own slots.
    group = (
      sim
      if groups == 1
      else simulate(slots // groups, max_len, page, turn, trajectories=4000 // groups * 4)
    )
    floor = groups * max(group["pages_peak"], max_len // page)
    lines.append(
      f"| {name} | {slots} x {max_len:,} | {page} | {sim['mean_length']:,.0f} / "
      f"{sim['p99_length']:,.0f} | {sim['live']:,.0f} | {_bytes(dense / sim['live'])} | "
      f"{_bytes(pool / sim['live'])} | {pool / dense:.3f} | "
      f"{sim['pages_peak']:,} / {dense_pages:,} ({_bytes(pool)} vs {_bytes(dense)}) | "
      f"{groups}: {floor:,}, {floor / dense_pages:.3f} |"
    )
  return lines


def _bytes(n: float) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:,.1f} {unit}"
  return f"{n:,.0f} B"


# --- throughput: the driver on this CPU ----------------------------------------------


class LongTailEnv:
  """Long-tailed episodes: 1 + lognormal(0, 1) turns, capped at 10."""

  name, max_turns = "long_tail", 10

  def task(self, i):
    turns = min(1 + int(np.random.default_rng(i).lognormal(0.0, 1.0)), self.max_turns)
    return Task(i, f"task {i % 100}\n", None, {"turns": turns})

  def episode(self, task):
    left = [task.meta["turns"]]

    class Ep:
      def step(self, action):
        left[0] -= 1
        return StepResult("" if left[0] <= 0 else ">ok\n", float(left[0] <= 0), left[0] <= 0)

    return Ep()


def throughput_section(repeats: int, requests: int, decode_steps: int) -> tuple[dict, list[str]]:
  tok = CharTokenizer()
  cfg = mcfg.tiny(vocab_size=tok.vocab_size)
  params = policy.init_params(cfg, jax.random.key(0))
  dense_pages = 16 * MAX_LEN // PAGE
  arms = {
    "dense-16": dict(slots=16),
    "paged-16": dict(slots=16, kv_cache="paged"),
    "paged-16-small": dict(slots=16, kv_cache="paged", kv_pages=SMALL_POOL),
    "paged-64": dict(slots=64, kv_cache="paged", kv_pages=dense_pages),
    "dense-64": dict(slots=64),
  }
  warm = {}

  def run(name):
    # The arm's engine; the driver's turns of TURN tokens, `decode_steps`, and
    # fixed settings otherwise (swap policy keep, 4 env workers, 60 s timeout).
    rollout = sections.Rollout(
      max_len=MAX_LEN,
      page_size=PAGE,
      max_turn_tokens=TURN,
      decode_steps=decode_steps,
      swap_policy="keep",
      env_workers=4,
      env_timeout=60.0,
      **arms[name],
    )
    engine = PolicyEngine(cfg, params, rollout, seed=1)
    if name in warm:  # the compiled programs of the same shapes
      engine._jits = warm[name]
    warm[name] = engine._jits
    live, samples = [], []
    step, decode = engine.step, engine.decode

    def sample(state):
      live.append(int(state.host_lengths.sum()))
      samples.append(state.pages.used_pages if state.pages is not None else 0)

    def step_(state, *a, **k):
      sample(state)
      return step(state, *a, **k)

    def decode_(state, *a, **k):
      sample(state)
      return decode(state, *a, **k)

    engine.step, engine.decode = step_, decode_
    driver = RolloutDriver(engine, LongTailEnv(), tok, iter(range(requests)), lambda t: None)
    start = time.perf_counter()
    driver.run()
    seconds = time.perf_counter() - start
    assert driver.stats.finished == requests
    if engine.paged:
      assert driver._state.pages.used_pages == 0
    return {
      "tps": driver.stats.generated_tokens / seconds,
      "live": float(np.mean(live)),
      "used_pages": float(np.mean(samples)),
      "waits": driver.stats.page_waits,
      "preemptions": driver.stats.preemptions,
      "positions": (
        engine.kv_pages * PAGE if engine.paged else engine.max_concurrent_decodes * MAX_LEN
      ),
    }

  for name in arms:  # warm-up: compiles
    run(name)
  results = {name: [] for name in arms}
  for _ in range(repeats):
    for name in arms:
      results[name].append(run(name))
  per_position = layout.cache_bytes_per_device(cfg, 1, PAGE) / PAGE
  base = [r["tps"] for r in results["dense-16"]]
  lines = [
    "| arm | cache positions (bytes) | generated tokens/s (median) | vs dense-16 "
    "(median of pairs) | mean live tokens | bytes / live token | page waits / "
    "preemptions a run |",
    "|---|---|---|---|---|---|---|",
  ]
  summary = {}
  for name, runs in results.items():
    tps = float(np.median([r["tps"] for r in runs]))
    ratio = float(np.median([r["tps"] / b for r, b in zip(runs, base)]))
    live = float(np.median([r["live"] for r in runs]))
    positions = runs[0]["positions"]
    waits = float(np.median([r["waits"] for r in runs]))
    pre = float(np.median([r["preemptions"] for r in runs]))
    summary[name] = dict(tps=tps, ratio=ratio, live=live)
    lines.append(
      f"| {name} | {positions:,} ({_bytes(positions * per_position)}) | {tps:,.0f} | "
      f"{ratio:.2f} | {live:,.0f} | {_bytes(positions * per_position / live)} | "
      f"{waits:.0f} / {pre:.0f} |"
    )
  return summary, lines


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--requests", type=int, default=256)
  parser.add_argument("--sections", default="memory,throughput")
  parser.add_argument(
    "--decode_steps", default="1,8", help="the driver's decode_steps, one throughput table each"
  )
  parser.add_argument("--out", default=None, help="append the tables to this file")
  args = parser.parse_args()
  out = []
  if "memory" in args.sections:
    tok = CharTokenizer()
    qwen = mcfg.PRESETS["qwen3_30b_a3b"]()
    # Slot groups: sao_moe's colocated engine splits its 256 slots over all
    # 128 chips (2 a chip); a rollout slice {data 16, tensor 4} over 16.
    shapes = [
      ("sao_tiny (tiny, fp32)", mcfg.tiny(vocab_size=tok.vocab_size), 16, MAX_LEN, PAGE, TURN, 1)
    ]
    for max_len in (32768, 131072):
      for groups in (128, 16):
        shapes.append(("Qwen3-30B-A3B, bf16", qwen, 256, max_len, 128, 8192, groups))
    out += (
      ["memory: cache bytes per live token, lognormal lengths (median max_len / 16, sigma 1)", ""]
      + memory_section(shapes)
      + [""]
    )
  if "throughput" in args.sections:
    for k in (int(x) for x in args.decode_steps.split(",")):
      _, lines = throughput_section(args.repeats, args.requests, k)
      out += (
        [
          f"throughput: the driver on {args.requests} long-tailed tasks, decode_steps {k}, "
          f"this CPU, median of {args.repeats}",
          "",
        ]
        + lines
        + [""]
      )
  text = "\n".join(out)
  print(text)
  if args.out:
    with open(args.out, "a", encoding="utf-8") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()
