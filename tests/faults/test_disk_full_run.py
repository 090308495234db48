"""The real trainer on a disk that fills mid-run, then resumed past a damaged checkpoint.

In process, on the 8 simulated devices, SFT of the tiny config checkpoints
at every step into a 32 MiB filesystem (full_disk.py), which is filled to
the last byte as soon as checkpoint 2 is complete. The next write, a
checkpoint's (or, in the slow variant, a metrics line's) stops the run with
one line (StopTraining, as launch/train.py prints it), checkpoints 1 and 2
intact. With space freed and checkpoint 2 damaged, the relaunch resumes
from checkpoint 1 bit-exact: the damaged one is skipped, set aside, logged
and counted in the metrics. (Each save costs seconds on 8 CPU devices: the
run saves as few as it can.)
"""

import json
import os

import jax
import numpy as np
import pytest
from full_disk import raise_when_full, small_disk  # noqa: F401
from runs import load_config_module
from runs import run as launch
from test_checkpoint_faults import _truncate_array_data

from sao_jax.data import files
from sao_jax.data.checkpoint import Checkpointer, committed_checkpoints
from sao_jax.train import run as run_lib
from sao_jax.train import trainer
from sao_jax.train.stopping import StopTraining


def _config(log_every: int):
  c = load_config_module("sao_tiny.py").get_config()
  c.sharding.mesh = {"data": 8}
  c.sft.steps, c.sft.batch_size = 5, 8
  c.checkpoint.every, c.checkpoint.keep, c.checkpoint.min_free_gb = 1, 2, 0.0
  c.log_every, c.tensorboard = log_every, False
  c.env.allow_unisolated = True  # SFT runs no model-written code
  return c


def _fill_after_checkpoint_2(monkeypatch, disk) -> dict:
  """Fills `disk` once checkpoint 2 is complete; {checkpoint: policy saved}."""
  saved, real_save = {}, Checkpointer.save

  def save(self, step, state, meta, force=False):
    real_save(self, step, state, meta, force)
    saved[step] = jax.device_get(state.policy)  # before the next step donates it
    if step == 2:
      self.wait()
      disk.fill()

  monkeypatch.setattr(Checkpointer, "save", save)
  return saved


@pytest.mark.filterwarnings(
  "ignore::pytest.PytestUnraisableExceptionWarning"
)  # orbax, after a failed save
@pytest.mark.parametrize(
  "write",
  [
    "checkpoint",
    pytest.param("metrics", marks=pytest.mark.slow),  # the same stop, from a metrics line
  ],
)
def test_full_disk_stops_in_one_line_and_resumes(
  write,
  small_disk,  # noqa: F811
  monkeypatch,
  capsys,
):
  workdir = os.path.join(small_disk.path, "run")
  ckpt_dir = os.path.join(workdir, "checkpoints")
  config = _config(log_every=1 if write == "metrics" else 100)
  saved = _fill_after_checkpoint_2(monkeypatch, small_disk)
  if write == "metrics":
    # A line appended to metrics.jsonl may still fit in its file's last
    # page of a full tmpfs: the metrics write meets the error injected.
    monkeypatch.setattr(files.Appender, "write", raise_when_full(small_disk, files.Appender.write))

  with pytest.raises(StopTraining) as e:
    trainer.train(config, workdir, until="value_pretrain")
  message = str(e.value)
  assert "\n" not in message and message.startswith("disk full"), message
  assert "No space left on device" in message, message
  if write == "checkpoint":  # saved at step 3, met at step 4's save
    assert "checkpoint 3 could not be written" in message, message
    assert "checkpoint 2 is the newest complete one" in message, message
  else:  # the metrics line of step 3
    assert "checkpoint 2 (stage sft step 2) is the newest complete one" in message, message
  committed = committed_checkpoints(ckpt_dir)
  assert sorted(committed) == [1, 2] and committed[2]["stage_step"] == 2

  # Space freed, checkpoint 2 damaged (its array data truncated): the
  # relaunch resumes from checkpoint 1, bit-exact.
  small_disk.free()
  monkeypatch.undo()
  _truncate_array_data(os.path.join(ckpt_dir, "2"))
  capsys.readouterr()
  run = run_lib.load(config, workdir, training=True)  # as trainer.train loads it
  try:
    assert (run.meta["stage"], run.meta["stage_step"]) == ("sft", 1)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(run.state.policy), saved[1])
    assert run.ckpt.latest_step() == 1
  finally:
    run.close()
  out = capsys.readouterr().out
  assert "[checkpoint] skipped damaged checkpoint 2 (" in out, out[-3000:]
  assert "Resumed from checkpoint 1 at stage sft step 1" in out, out[-3000:]
  assert os.path.isdir(os.path.join(ckpt_dir, "damaged-2"))
  assert sorted(committed_checkpoints(ckpt_dir)) == [1]
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    resumes = [r for r in map(json.loads, f) if r["stage"] == "resume"]
  assert [(r["checkpoint/damaged_skipped"], r["checkpoint/resumed_from"]) for r in resumes] == [
    (1, 1)
  ]


@pytest.mark.slow  # test_full_disk_stops_in_one_line_and_resumes is the same stop in process
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_launch_on_a_disk_that_fills_prints_one_line(small_disk):  # noqa: F811
  """launch/train.py on a disk with room for less than one checkpoint: exit
  status 1, the last line the error, no traceback (orbax's logs of the
  failure from its save threads are dropped: the error reports it once)."""
  if not small_disk.mounted:
    pytest.skip("needs a tmpfs (root and mount(8)): the disk must fill by itself")
  small_disk.fill(leave=2**20)
  workdir = os.path.join(small_disk.path, "run")
  proc = launch(workdir, "--config.checkpoint.min_free_gb=0")
  assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  assert lines[-1].startswith("error: disk full: checkpoint 1 could not be written"), lines[-1]
  assert lines[-1].endswith(
    "no checkpoint is complete; free space and relaunch to resume from it"
  ), lines[-1]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert not committed_checkpoints(os.path.join(workdir, "checkpoints"))
