"""Metrics: a JSON-lines file, TensorBoard event files, and a terminal line.

`MetricsWriter.write(step, metrics)` appends one JSON object per call to
`<workdir>/metrics.jsonl` (with `step`, `stage` and wall time) and the same
scalars to TensorBoard; `progress` prints a compact line for long runs.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np


def to_python(metrics: dict) -> dict:
  out = {}
  for k, v in metrics.items():
    v = np.asarray(v)
    out[k] = v.item() if v.size == 1 else v.tolist()
  return out


class MetricsWriter:

  def __init__(self, workdir: str, tensorboard: bool = True):
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
    self._start = time.time()

  def write(self, step: int, metrics: dict, stage: str) -> dict:
    scalars = to_python(metrics)
    record = {"stage": stage, "step": int(step), "time": round(time.time() - self._start, 2),
              **scalars}
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in scalars.items():
        if isinstance(v, (int, float)):
          self._tb.add_scalar(f"{stage}/{k}", v, step)
    return record

  def close(self) -> None:
    self._jsonl.close()
    if self._tb is not None:
      self._tb.close()


def progress(stage: str, step: int, total: int, metrics: dict, keys: dict[str, str]) -> None:
  """One terminal line: `keys` maps metric names to short labels."""
  parts = [f"[{stage}] {step}/{total}"]
  for k, label in keys.items():
    if k in metrics:
      v = metrics[k]
      parts.append(f"{label}={v:.4g}" if isinstance(v, float) else f"{label}={v}")
  print("  ".join(parts), flush=True)
