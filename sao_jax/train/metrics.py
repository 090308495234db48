"""Metrics: a JSON-lines file, TensorBoard, Weights & Biases, and a terminal line.

`MetricsWriter.write(step, metrics)` appends one JSON object per call to
`<workdir>/metrics.jsonl` (with `step`, `stage` and wall time), the same
scalars to TensorBoard as "<stage>/<metric>" at `step`, and, with
`logging.wandb`, to W&B under the same names. A W&B run's step must only
grow, while each stage counts its own steps from 0, so every stage gets
its own step metric: "<stage>/<metric>" is plotted against "<stage>/step"
(`define_metric`), which is TensorBoard's step. The W&B run id is kept in
`<workdir>/wandb_run_id`, so a resumed run continues the same W&B run
(`resume="allow"`; offline runs of one id are merged by `wandb sync`).
`progress` prints a compact line for long runs.
In a multi-host run (sao_jax/train/distributed.py) every process computes the same
metrics and only process 0 writes or prints them.
On an object-store workdir (gs://) metrics.jsonl is uploaded whole after
each record (`files.Appender`), TensorBoard writes its event files there
itself (tensorboardX's GCS writer) and W&B keeps its local files in its
default directory.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time

import numpy as np

from sao_jax.train import distributed
from sao_jax.data import files


def to_python(metrics: dict) -> dict:
  out = {}
  for k, v in metrics.items():
    v = np.asarray(v)
    out[k] = v.item() if v.size == 1 else v.tolist()
  return out


class WandbSink:
  """One W&B run per workdir (module docstring); `logging` is sections.Logging."""

  def __init__(self, workdir: str, logging, config: dict | None = None):
    import wandb  # pylint: disable=g-import-not-at-top
    id_file = files.join(workdir, "wandb_run_id")
    try:
      run_id = files.read_text(id_file).strip()
    except FileNotFoundError:
      run_id = secrets.token_hex(4)  # W&B ids: lowercase letters and digits
      files.write_text(id_file, run_id + "\n")
    self._wandb = wandb
    self.run = wandb.init(
        project=logging.wandb_project, entity=logging.wandb_entity or None,
        name=logging.wandb_run_name or os.path.basename(files.absolute(workdir).rstrip("/")),
        mode=logging.wandb_mode, dir=None if files.is_url(workdir) else workdir, id=run_id, resume="allow", config=config,
        settings=wandb.Settings(console="off", x_disable_stats=True))
    self._stages: set[str] = set()

  def log(self, stage: str, step: int, scalars: dict) -> None:
    if stage not in self._stages:
      self.run.define_metric(f"{stage}/step")
      self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
      self._stages.add(stage)
    self.run.log({**{f"{stage}/{k}": v for k, v in scalars.items()}, f"{stage}/step": step})

  def close(self) -> None:
    self.run.finish()
    # finish() can return before W&B's service has written the run file out;
    # teardown waits for it (a later run in this process starts a new one).
    self._wandb.teardown()


class MetricsWriter:

  def __init__(self, workdir: str, tensorboard: bool = True, wandb=None,
               config: dict | None = None):
    """`wandb`: a sections.Logging with `wandb` on, or None; `config`: the run's
    config as plain data, recorded in the W&B run."""
    self._jsonl = self._tb = self._wandb = None
    self._start = time.time()
    _PROGRESS_START.clear()  # a new run (or a resumed one) times its own stages
    if not distributed.is_primary():  # records are process 0's to write
      return
    files.makedirs(workdir)
    self._jsonl = files.Appender(files.join(workdir, "metrics.jsonl"))
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._tb = SummaryWriter(files.join(workdir, "tensorboard"))
    if wandb is not None and wandb.wandb:
      self._wandb = WandbSink(workdir, wandb, config)

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
    # A non-finite value (an empty lag bucket) is no point on a curve.
    points = {k: v for k, v in scalars.items()
              if isinstance(v, (int, float)) and math.isfinite(v)}
    if self._tb is not None:
      for k, v in points.items():
        self._tb.add_scalar(f"{stage}/{k}", v, step)
    if self._wandb is not None:
      self._wandb.log(stage, int(step), points)
    return record

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.close()


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
