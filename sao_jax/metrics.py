"""Metrics: a JSON-lines file, TensorBoard event files, and a terminal line.

`MetricsWriter.write(step, metrics)` appends one JSON object per call to
`<workdir>/metrics.jsonl` (with `step`, `stage` and wall time) and the same
scalars to TensorBoard; `progress` prints a compact line for long runs.
In a multi-host run (sao_jax/distributed.py) every process computes the same
metrics and only process 0 writes or prints them.
"""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np

from sao_jax import distributed


def to_python(metrics: dict) -> dict:
  out = {}
  for k, v in metrics.items():
    v = np.asarray(v)
    out[k] = v.item() if v.size == 1 else v.tolist()
  return out


class MetricsWriter:

  def __init__(self, workdir: str, tensorboard: bool = True):
    self._jsonl = self._tb = None
    self._start = time.time()
    _PROGRESS_START.clear()  # a new run (or a resumed one) times its own stages
    if not distributed.is_primary():  # records are process 0's to write
      return
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: dict, stage: str) -> dict:
    scalars = to_python(metrics)
    record = {"stage": stage, "step": int(step), "time": round(time.time() - self._start, 2),
              **scalars}
    if self._jsonl is None:
      return record
    # Strict JSON: a non-finite value (an empty lag bucket's quantile is NaN)
    # is written as null, which every JSON reader takes; the record returned
    # keeps the float.
    line = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()}
    self._jsonl.write(json.dumps(line, allow_nan=False) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in scalars.items():
        # A non-finite value (an empty lag bucket) is no point on a curve.
        if isinstance(v, (int, float)) and math.isfinite(v):
          self._tb.add_scalar(f"{stage}/{k}", v, step)
    return record

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tb is not None:
      self._tb.close()


# (stage -> (step, time)) of each stage's first progress line in this process.
_PROGRESS_START: dict[str, tuple[int, float]] = {}


def _duration(seconds: float) -> str:
  seconds = int(round(seconds))
  return (f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else
          f"{seconds // 60}m{seconds % 60:02d}s")


def progress(stage: str, step: int, total: int, metrics: dict, keys: dict[str, str]) -> None:
  """One terminal line (process 0's): `keys` maps metric names to short labels.

  From a stage's second line on it also shows the rate (steps/s since its
  first line in this process, so a resumed run does not count restored
  steps) and the ETA of the stage at that rate.
  """
  if not distributed.is_primary():
    return
  parts = [f"[{stage}] {step}/{total}"]
  for k, label in keys.items():
    if k in metrics:
      v = metrics[k]
      parts.append(f"{label}={v:.4g}" if isinstance(v, float) else f"{label}={v}")
  now = time.time()
  first_step, first_time = _PROGRESS_START.setdefault(stage, (step, now))
  if step > first_step and now > first_time:
    rate = (step - first_step) / (now - first_time)
    parts.append(f"{rate:.3g} steps/s" if rate >= 0.1 else f"{1 / rate:.3g} s/step")
    parts.append(f"eta {_duration(max(total - step, 0) / rate)}")
  print("  ".join(parts), flush=True)
