"""Timing and synthetic-data helpers shared by the benchmark scripts.

(Not named common.py: configs/common.py is the config files' `common`.)
"""

import time

import jax
import numpy as np


def time_fns(fns: dict, args_for: dict, repeats: int = 7) -> dict:
  """Median seconds per call of each fn, interleaved so load noise is shared.

  Every function is compiled and run once before timing. Calls of different
  functions alternate within each repeat, so a burst of load on this shared
  machine hits all of them alike and ratios stay meaningful.
  """
  for name, fn in fns.items():
    jax.block_until_ready(fn(*args_for[name]))
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args_for[name]))
      times[name].append(time.perf_counter() - start)
  return {name: float(np.median(t)) for name, t in times.items()}


def random_trajectory(
  rng,
  n: int,
  vocab: int,
  first: int,
  turn: tuple[int, int],
  gap: tuple[int, int],
  prompt_id: int = 0,
):
  """A trajectory of `n` random tokens shaped like a multi-turn episode.

  A prompt of `first` tokens, then action turns of lengths drawn from
  `turn` and observations from `gap` (half-open ranges) to the end; sampled-
  looking log-probs on the actions, a 0 or 1 reward on the last one.
  """
  from sao_jax.data.trajectory import Trajectory

  mask = np.zeros(n, bool)
  starts, pos = [], first
  while pos < n:
    k = min(int(rng.integers(*turn)), n - pos)
    mask[pos : pos + k] = True
    starts.append(pos)
    pos += k + int(rng.integers(*gap))
  rewards = np.zeros(n, np.float32)
  rewards[np.flatnonzero(mask)[-1]] = float(rng.integers(0, 2))
  return Trajectory(
    tokens=rng.integers(0, vocab, n).astype(np.int32),
    action_mask=mask,
    rollout_logprobs=np.where(mask, -rng.uniform(0.1, 3.0, n), 0.0).astype(np.float32),
    policy_version=np.zeros(n, np.int32),
    rewards=rewards,
    turn_starts=np.asarray(starts, np.int32),
    prompt_id=prompt_id,
  )


def report(lines: list[str], out: str | None = None) -> None:
  """Prints a result table and, with `out`, appends it to that file (RESULTS.md)."""
  print("\n".join(lines))
  if out:
    with open(out, "a", encoding="utf-8") as f:
      f.write("\n".join(lines) + "\n")
