"""Prefix reuse in the serving batcher: a long agent session and many concurrent ones.

    python benchmarks/prefix_reuse.py [--turns 50] [--sessions 64] [--session_turns 4] \
        [--repeats 3] [--sections session,concurrent] [--out benchmarks/RESULTS.md]

An agent harness sends each turn's whole history again: the system prompt,
every earlier reply and tool result, then the new tool result. Without
prefix reuse the batcher prefills all of it every turn (quadratic in the
turns); with it (`Batcher.submit(..., prefix_key=session)`) the session's
parked cache is kept and only the new tool result is prefilled
(serving/batcher.py, "Prefix reuse").

Model: the `small` preset (~3M params, random init, 512-token vocabulary,
max_seq_len raised to 4096) on this CPU, dense KV cache, one engine and
one batcher for both arms, seeded sampling (the two arms get the same
prompts: the "after" arm's conversation, sent to both).

session: one session of `--turns` turns; each turn appends a 24-token tool
  result to the history and samples a reply of up to 16 tokens (64-token
  system prompt first). The arms alternate turn by turn ("before": no
  prefix_key; "after": the session's key) after an untimed warm-up session
  of both (every program compiled). Per turn: prompt tokens prefilled and
  seconds from submit to the reply.

concurrent: `--sessions` sessions at once (one client thread each, 64
  slots, max_len 512, prefill widths 64 / 128 / 256 / 512), each
  `--session_turns` turns as above; generated
  tokens/s and prefill tokens over the whole run, the arms alternating
  (before, after, ...) `--repeats` times after a warm-up of each; the
  ratio is the median of the per-repeat ratios.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from fakes import random_params

from sao_jax.config import sections
from sao_jax.models import config as mcfg
from sao_jax.rollout.engine import PolicyEngine
from sao_jax.serving import batcher as batcher_lib

VOCAB, STOP = 512, 511  # STOP is never fed as a prompt token
SYSTEM, TOOL, REPLY = 64, 24, 16


def make_batcher(slots: int, max_len: int, buckets=(64, 256, 1024)) -> batcher_lib.Batcher:
  cfg = dataclasses.replace(mcfg.small(VOCAB), max_seq_len=4096)
  engine = PolicyEngine(
    cfg,
    random_params(cfg, 0.05),
    sections.Rollout(slots=slots, max_len=max_len, prefill_buckets=buckets),
    seed=0,
  )
  return batcher_lib.Batcher(engine, STOP, decode_steps=8)


def tool_result(rng) -> list[int]:
  return rng.integers(0, STOP, TOOL).tolist()


def turn(batcher, prompt, key, sampling):
  """(reply, prompt tokens prefilled, seconds) of one request."""
  computed = batcher.prefill_computed
  start = time.perf_counter()
  reply = batcher.submit(prompt, REPLY, sampling=sampling, prefix_key=key).result()
  return reply, batcher.prefill_computed - computed, time.perf_counter() - start


def session(batcher, turns: int, seed: int, timed: bool):
  """The two arms over one conversation, turn by turn; per turn (before, after) rows."""
  rng = np.random.default_rng(seed)
  sampling = batcher_lib.RequestSampling(seed=seed)
  history = rng.integers(0, STOP, SYSTEM).tolist()
  rows = []
  for k in range(turns):
    prompt = history + tool_result(rng)
    _, before_tokens, before_s = turn(batcher, prompt, None, sampling)
    reply, after_tokens, after_s = turn(batcher, prompt, f"s{seed}", sampling)
    history = prompt + list(reply.tokens)
    if timed:
      rows.append((k + 1, len(prompt), before_tokens, before_s, after_tokens, after_s))
  return rows


def run_session(turns: int) -> list[str]:
  batcher = make_batcher(slots=2, max_len=4096)
  try:
    session(batcher, turns, seed=1, timed=False)  # compiles every program both arms use
    rows = session(batcher, turns, seed=2, timed=True)
  finally:
    batcher.close()
  out = [
    "| turn | prompt tokens | prefilled before | s before | prefilled after | s after |",
    "|---|---|---|---|---|---|",
  ]
  for k, n, bt, bs, at, a_s in rows:
    if k in (1, 2, 10, 25, 40, 50) or k == len(rows):
      out.append(f"| {k} | {n} | {bt} | {bs:.3f} | {at} | {a_s:.3f} |")
  total = lambda i: sum(r[i] for r in rows)
  last = rows[-10:]
  out += [
    "",
    f"All {len(rows)} turns: {total(2)} prompt tokens prefilled before, {total(4)} "
    f"after ({total(2) / total(4):.1f}x fewer); {total(3):.2f} s before, {total(5):.2f} s "
    f"after ({total(3) / total(5):.2f}x). Last 10 turns: "
    f"{statistics.mean(r[3] for r in last):.3f} s a turn before, "
    f"{statistics.mean(r[5] for r in last):.3f} s after "
    f"(median ratio {statistics.median(r[3] / r[5] for r in last):.2f}x).",
  ]
  return out


def concurrent_run(batcher, sessions: int, turns: int, reuse: bool, seed: int):
  """(generated tokens / s, prompt tokens prefilled, seconds) of `sessions`
  clients at once, each `turns` turns."""

  def client(c):
    rng = np.random.default_rng(seed * 1000 + c)
    sampling = batcher_lib.RequestSampling(seed=c)
    history = rng.integers(0, STOP, SYSTEM).tolist()
    for _ in range(turns):
      prompt = history + tool_result(rng)
      reply = batcher.submit(
        prompt, REPLY, sampling=sampling, prefix_key=f"c{seed}-{c}" if reuse else None
      ).result()
      history = prompt + list(reply.tokens)

  generated, computed = batcher.generated_tokens, batcher.prefill_computed
  start = time.perf_counter()
  with cf.ThreadPoolExecutor(sessions) as pool:
    list(pool.map(client, range(sessions)))
  seconds = time.perf_counter() - start
  return (
    (batcher.generated_tokens - generated) / seconds,
    batcher.prefill_computed - computed,
    seconds,
  )


def run_concurrent(sessions: int, turns: int, repeats: int) -> list[str]:
  batcher = make_batcher(slots=64, max_len=512, buckets=(64, 128, 256))
  try:
    for reuse in (False, True):  # warm-up: every program
      concurrent_run(batcher, sessions, turns, reuse, seed=99)
    arms = {False: [], True: []}
    for rep in range(repeats):
      for reuse in (False, True):
        arms[reuse].append(concurrent_run(batcher, sessions, turns, reuse, seed=rep))
  finally:
    batcher.close()
  ratios = [a[0] / b[0] for a, b in zip(arms[True], arms[False])]
  out = [
    "| arm | generated tok/s (median) | prompt tokens prefilled | s (median) |",
    "|---|---|---|---|",
  ]
  for reuse, name in ((False, "before (no prefix_key)"), (True, "after (prefix_key)")):
    runs = arms[reuse]
    out.append(
      f"| {name} | {statistics.median(r[0] for r in runs):.1f} | {runs[0][1]} | "
      f"{statistics.median(r[2] for r in runs):.2f} |"
    )
  out += [
    "",
    f"Throughput after / before: {statistics.median(ratios):.2f}x (median of "
    f"{repeats} interleaved repeats: {', '.join(f'{r:.2f}' for r in ratios)}).",
  ]
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--turns", type=int, default=50)
  p.add_argument("--sessions", type=int, default=64)
  p.add_argument("--session_turns", type=int, default=4)
  p.add_argument("--sections", default="session,concurrent")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--out", default="")
  args = p.parse_args()
  lines = []
  if "session" in args.sections.split(","):
    lines += [f"### One session of {args.turns} turns", ""] + run_session(args.turns)
    print("\n".join(lines), flush=True)
  if "concurrent" in args.sections.split(","):
    more = ["", f"### {args.sessions} concurrent sessions, {args.session_turns} turns each", ""]
    more += run_concurrent(args.sessions, args.session_turns, args.repeats)
    print("\n".join(more), flush=True)
    lines += more
  if args.out:
    with open(args.out, "a", encoding="utf-8") as f:
      f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
