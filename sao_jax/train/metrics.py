"""Metrics: a JSON-lines file, TensorBoard, Weights & Biases, and a terminal line.

`MetricsWriter.write(step, metrics, stage)` appends one JSON object per call
to `<workdir>/metrics.jsonl` (with `step`, `stage` and wall time), the same
scalars to TensorBoard at `step`, and, with `logging.wandb`, to W&B.
`progress` prints a compact line for long runs. Contract:

  * metrics.jsonl keeps each key as the stage wrote it, beside the record's
    `stage` field; TensorBoard and W&B name it `metric_name(stage, key)`,
    the stage in front unless the key already starts with it, characters
    kept as they are ("pass@1" in every sink); `sink_scalars(record)` gives
    a record's names there:

| stage            | key in metrics.jsonl    | name in TensorBoard and W&B         |
|------------------|-------------------------|-------------------------------------|
| `sft`            | `sft/nll`               | `sft/nll`                           |
| `value_pretrain` | `critic/value_loss`     | `value_pretrain/critic/value_loss`  |
| `rl`             | `policy/loss`           | `rl/policy/loss`                    |
| `eval`           | `eval/heldout/pass@1`   | `eval/heldout/pass@1`               |
| `resume`         | `checkpoint/resumed_from` | `resume/checkpoint/resumed_from`  |

  * each stage is plotted against its own "<stage>/step" in W&B
    (`define_metric`), TensorBoard's step;
  * an undefined statistic (NaN) is logged by no sink as a number:
    metrics.jsonl writes null, TensorBoard and W&B get no point, the
    terminal line leaves it out;
  * W&B settings: a `logging.wandb_*` config field wins, then W&B's own
    environment variable, then this project's default
    (`wandb_init_args`); the run id kept in `<workdir>/wandb_run_id`
    continues the same W&B run on resume; an offline run reaches no
    network;
  * in a multi-host run only process 0 writes or prints; on an object-store
    workdir metrics.jsonl is uploaded whole after each record.

Why the names are kept so, and the sinks' details: docs/design/metrics.md.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time

import numpy as np

from sao_jax.data import files
from sao_jax.train import distributed


def to_python(metrics: dict) -> dict:
  out = {}
  for k, v in metrics.items():
    v = np.asarray(v)
    out[k] = v.item() if v.size == 1 else v.tolist()
  return out


def metric_name(stage: str, key: str) -> str:
  """The name of metric `key` of a `stage` record in every sink (module docstring)."""
  return key if key.startswith(f"{stage}/") else f"{stage}/{key}"


def sink_scalars(record: dict) -> dict:
  """A metrics.jsonl record's numbers under their TensorBoard / W&B names
  (`metric_name`): what `MetricsWriter.write` sent to those sinks at
  record["step"]. The bookkeeping fields (stage, step, time) and nulls are
  not metrics."""
  stage = record["stage"]
  return {
    metric_name(stage, k): v
    for k, v in record.items()
    if k not in ("stage", "step", "time")
    and isinstance(v, (int, float))
    and not isinstance(v, bool)
  }


def wandb_init_args(workdir: str, logging, environ=None) -> dict:
  """wandb.init's keyword arguments (but `config`): a `logging` field that is
  set wins, then W&B's environment variable, then this project's default;
  None leaves an argument to W&B (it reads its environment itself)."""
  environ = os.environ if environ is None else environ
  field = lambda name, env, default=None: (
    getattr(logging, name) if getattr(logging, name) is not None else environ.get(env, default)
  )
  id_file = files.join(workdir, "wandb_run_id")
  try:
    saved_id = files.read_text(id_file).strip()
  except FileNotFoundError:
    saved_id = None
  # W&B ids: lowercase letters and digits
  run_id = environ.get("WANDB_RUN_ID") or saved_id or secrets.token_hex(4)
  if run_id != saved_id:
    files.write_text(id_file, run_id + "\n")
  mode = field("wandb_mode", "WANDB_MODE")
  offline = mode in ("offline", "dryrun")
  return dict(
    project=field("wandb_project", "WANDB_PROJECT", "sao-jax"),
    entity=field("wandb_entity", "WANDB_ENTITY"),
    name=field(
      "wandb_run_name", "WANDB_NAME", os.path.basename(files.absolute(workdir).rstrip("/"))
    ),
    mode=mode,
    id=run_id,
    resume=None if "WANDB_RESUME" in environ else "allow",
    dir=None if files.is_url(workdir) or "WANDB_DIR" in environ else workdir,
    # No system metrics (any run), and offline no machine probes either.
    settings=dict(
      console="off", x_disable_stats=True, **({"x_disable_machine_info": True} if offline else {})
    ),
  )


class WandbSink:
  """One W&B run per workdir (module docstring); `logging` is sections.Logging."""

  def __init__(self, workdir: str, logging, config: dict | None = None):
    import wandb

    args = wandb_init_args(workdir, logging)
    if args["mode"] in ("offline", "dryrun"):
      # Read when W&B's service process starts: its error reports go nowhere.
      os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    self._wandb = wandb
    self.run = wandb.init(**dict(args, settings=wandb.Settings(**args["settings"])), config=config)
    self._stages: set[str] = set()

  def log(self, stage: str, step: int, scalars: dict) -> None:
    if stage not in self._stages:
      self.run.define_metric(f"{stage}/step")
      self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
      self._stages.add(stage)
    self.run.log({**{metric_name(stage, k): v for k, v in scalars.items()}, f"{stage}/step": step})

  def close(self) -> None:
    self.run.finish()
    # finish() can return before W&B's service has written the run file out;
    # teardown waits for it (a later run in this process starts a new one).
    self._wandb.teardown()


class MetricsWriter:
  def __init__(
    self, workdir: str, tensorboard: bool = True, wandb=None, config: dict | None = None
  ):
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
      from tensorboardX import FileWriter

      self._tb = FileWriter(files.join(workdir, "tensorboard"))
    if wandb is not None and wandb.wandb:
      self._wandb = WandbSink(workdir, wandb, config)

  def write(self, step: int, metrics: dict, stage: str) -> dict:
    scalars = to_python(metrics)
    record = {
      "stage": stage,
      "step": int(step),
      "time": round(time.time() - self._start, 2),
      **scalars,
    }
    if self._jsonl is None:
      return record
    # Strict JSON: a non-finite value (an empty lag bucket's quantile is NaN)
    # is written as null, which every JSON reader takes; the record returned
    # keeps the float.
    line = {
      k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()
    }
    self._jsonl.write(json.dumps(line, allow_nan=False) + "\n")
    # A non-finite value (an empty lag bucket) is no point on a curve.
    points = {k: v for k, v in scalars.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    if self._tb is not None and points:  # SummaryWriter.add_scalar: "pass_1"
      from tensorboardX.proto.summary_pb2 import Summary

      self._tb.add_summary(
        Summary(
          value=[
            Summary.Value(tag=metric_name(stage, k), simple_value=v) for k, v in points.items()
          ]
        ),
        int(step),
      )
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


def duration(seconds: float) -> str:
  """`seconds` as "1m05s" or "2h03m" (an ETA's format)."""
  seconds = int(round(seconds))
  return (
    f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 3600
    else f"{seconds // 60}m{seconds % 60:02d}s"
  )


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
    v = metrics.get(k)
    if v is not None and not (isinstance(v, float) and not math.isfinite(v)):
      parts.append(f"{label}={v:.4g}" if isinstance(v, float) else f"{label}={v}")
  now = time.time()
  first_step, first_time = _PROGRESS_START.setdefault(stage, (step, now))
  if step > first_step and now > first_time:
    rate = (step - first_step) / (now - first_time)
    parts.append(f"{rate:.3g} steps/s" if rate >= 0.1 else f"{1 / rate:.3g} s/step")
    parts.append(f"eta {duration(max(total - step, 0) / rate)}")
  print("  ".join(parts), flush=True)


class CountProgress:
  """Progress lines of a count towards a total, with its rate and ETA (process 0's).

  `start()` prints the count at 0 (so that a compile before the first item
  is not silence); `tick()` counts one item; a line is printed at the first
  item, then at most every `every_s` seconds, and at the last:

      [eval] heldout: 120/400 samples  3.1 samples/s  eta 1m30s

  The rate is items per second since the first item (a compile before it
  is not counted against the rate); `clock` is injectable for tests.
  """

  def __init__(
    self,
    label: str,
    total: int,
    unit: str = "samples",
    every_s: float = 10.0,
    clock=time.monotonic,
    out=None,
  ):
    self._label, self._total, self._unit, self._every = label, int(total), unit, every_s
    self._clock, self._out = clock, out
    self.count, self._first, self._last = 0, None, None

  def start(self) -> None:
    if distributed.is_primary():
      print(
        f"{self._label}: 0/{self._total} {self._unit}",
        flush=True,
        **({"file": self._out} if self._out else {}),
      )

  def tick(self, n: int = 1) -> None:
    self.count += n
    now = self._clock()
    if self._first is None:
      self._first = now
    due = self._last is None or now - self._last >= self._every or self.count >= self._total
    if due and distributed.is_primary():
      self._last = now
      print(self.line(now), flush=True, **({"file": self._out} if self._out else {}))

  def line(self, now: float) -> str:
    parts = [f"{self._label}: {self.count}/{self._total} {self._unit}"]
    elapsed = now - self._first
    if self.count > 1 and elapsed > 0:
      rate = (self.count - 1) / elapsed  # the first item starts the clock
      parts.append(
        f"{rate:.3g} {self._unit}/s"
        if rate >= 0.1
        else f"{1 / rate:.3g} s/{self._unit.rstrip('s')}"
      )
      if self.count < self._total:
        parts.append(f"eta {duration((self._total - self.count) / rate)}")
      else:
        parts.append(f"took {duration(elapsed)}")
    return "  ".join(parts)
