"""The real trainer through injected faults (config `faults`, sao_jax/train/faults.py).

One workdir, three launches of launch/train.py on 8 simulated devices:

  1. faults that training must survive (environment errors and garbage,
     malformed trajectories, NaN batches, rollout-thread crashes), then a
     run of NaN batches from step 7 on: the run stops cleanly after two
     skipped updates in a row, with a one-line error;
  2. resumed from the last checkpoint with a rollout thread that dies at
     once and no restarts allowed: a clear error, checkpoint intact;
  3. resumed again without faults: finishes from the same checkpoint.
"""

import os

import numpy as np
import pytest
from runs import read_metrics
from runs import run as launch

from sao_jax.data.checkpoint import committed_checkpoints


def last_error_line(proc):
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  return lines[-1] if lines else ""


# Three launches on 8 simulated devices (~3-4 min): the default run has each fault
# lighter: test_nonfinite_updates.py, test_env_faults.py, test_bad_data.py, and
# test_trainer.py::test_killed_run_resumes_from_its_last_checkpoint.
@pytest.mark.slow
def test_trainer_survives_faults_and_stops_cleanly(tmp_path):
  workdir = str(tmp_path / "faults")
  ckpt_dir = os.path.join(workdir, "checkpoints")

  # 1. Survivable faults, then NaN batches from step 7 on.
  proc = launch(
    workdir,
    "--config.rl.steps=12",
    "--config.rl.max_rollout_restarts=50",
    "--config.rl.max_nonfinite_updates=2",
    "--config.faults.env_error_every=5",
    "--config.faults.env_garbage_every=7",
    "--config.faults.malformed_every=3",
    "--config.faults.nonfinite_every=4",
    "--config.faults.nonfinite_from_step=7",
    "--config.faults.rollout_crash_every=10",
  )
  assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
  error = last_error_line(proc)
  assert error.startswith("error: 2 consecutive RL steps had a non-finite"), error
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  rl = read_metrics(workdir, "rl")
  assert [r["step"] for r in rl] == list(range(1, 8))  # step 8 stopped the run
  skipped = [r["step"] for r in rl if r["policy/update_skipped"]]
  assert skipped == [4, 7]  # the scheduled NaN batch, then the first of the run
  assert rl[-1]["policy/updates_skipped_total"] == 2
  last = rl[-1]
  # Every corrupted trajectory was refused at the queue, and nothing else was.
  # (The rollout thread goes on while the metrics are read: a corruption can
  # be counted before its rejection is, never after.)
  assert last["faults/injected_malformed"] >= 3
  assert all(r["faults/injected_malformed_accepted"] == 0 for r in rl)
  assert all(r["queue/rejected"] <= r["faults/injected_malformed"] for r in rl)
  assert (
    sum(v for k, v in last.items() if k.startswith("queue/rejected_")) == last["queue/rejected"]
  )
  # Environment faults ended their episodes (counted) and training went on.
  assert last["rollout/env_fault_env_error"] >= 1 and last["rollout/env_fault_env_garbage"] >= 1
  # Every crash the trainer noticed was restarted. The newest crash may have
  # fired in the rollout thread after the trainer last looked at it (it looks
  # when the queue runs dry), so under load one restart can still be pending.
  crashes, restarts = last["faults/injected_rollout_crash"], last["rollout/restarts"]
  assert restarts >= 1 and crashes - 1 <= restarts <= crashes, (crashes, restarts)
  # Fault counts stay cumulative across rollout restarts (never go down).
  counted = [r["rollout/env_faults"] for r in rl]
  assert counted == sorted(counted)
  assert all(np.isfinite(r["policy/loss"]) for r in rl if not r["policy/update_skipped"])
  committed = committed_checkpoints(ckpt_dir)
  rl_ckpts = sorted(m["stage_step"] for m in committed.values() if m["stage"] == "rl")
  assert rl_ckpts[-1] == 6

  # 2. The rollout thread dies at once and may not restart: a clear error.
  proc = launch(
    workdir,
    "--config.rl.steps=12",
    "--config.rl.max_rollout_restarts=0",
    "--config.faults.rollout_crash_every=1",
  )
  assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "stage rl step 6" in proc.stdout
  error = last_error_line(proc)
  assert error.startswith("error: the rollout thread failed 1 times"), error
  assert "injected rollout thread crash" in error
  assert (
    max(m["stage_step"] for m in committed_checkpoints(ckpt_dir).values() if m["stage"] == "rl")
    == 6
  )

  # 3. Without faults it resumes from the same checkpoint and finishes.
  proc = launch(workdir, "--config.rl.steps=8")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "stage rl step 6" in proc.stdout
  assert [r["step"] for r in read_metrics(workdir, "rl")][-2:] == [7, 8]
  assert os.path.exists(os.path.join(workdir, "summary.json"))
