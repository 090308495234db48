"""Timing helpers shared by the benchmark scripts."""

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
