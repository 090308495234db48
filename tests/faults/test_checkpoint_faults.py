"""Checkpoints through faults: SIGKILL during a save, a full disk, a damaged newest step.

In each the last complete checkpoint restores bit-exact; the trainer's side
of the full disk and of the damaged step is in test_disk_full_run.py.
"""

import errno
import glob
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from full_disk import small_disk  # noqa: F401

from sao_jax.data.checkpoint import Checkpointer, CheckpointWriteError, committed_checkpoints

# Step 1 is saved and waited for; step 2 (64 MiB, so the async save is
# still writing) is started, and the process kills itself without waiting.
_WRITER = textwrap.dedent("""
    import os, signal, sys
    import jax.numpy as jnp, numpy as np
    from sao_jax.data.checkpoint import Checkpointer
    ckpt = Checkpointer(sys.argv[1], max_to_keep=3)
    def state(seed, n):
      r = np.random.default_rng(seed)
      return {"w": jnp.asarray(r.standard_normal(n, np.float32)),
              "b": jnp.asarray(r.integers(0, 100, 7, np.int32))}
    ckpt.save(1, state(1, 1000), {"stage": "rl", "stage_step": 2})
    ckpt.wait()
    ckpt.save(2, state(2, 16 * 2**20), {"stage": "rl", "stage_step": 4})
    print("saving", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _state(seed, n):
  r = np.random.default_rng(seed)
  return {"w": r.standard_normal(n, np.float32), "b": r.integers(0, 100, 7, np.int32)}


def test_kill_during_save_restores_last_complete_bit_exact(tmp_path):
  directory = str(tmp_path / "ckpt")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  proc = subprocess.run(
    [sys.executable, "-c", _WRITER, directory],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=root,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert proc.returncode == -9 and "saving" in proc.stdout, proc.stderr[-2000:]
  committed = committed_checkpoints(directory)
  assert 1 in committed and committed[1]["stage_step"] == 2
  ckpt = Checkpointer(directory, max_to_keep=3)
  latest = ckpt.latest_step()
  assert latest in committed  # never a half-written step
  n = 1000 if latest == 1 else 16 * 2**20
  expect = _state(latest, n)
  abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in expect.items()}
  state, meta = ckpt.restore(abstract)
  assert meta == committed[latest]
  for k in expect:
    np.testing.assert_array_equal(np.asarray(state[k]), expect[k])
  # The run goes on: the next save over the killed one's leftovers completes.
  ckpt.save(
    3, {k: jax.numpy.asarray(v) for k, v in _state(3, 10).items()}, {"stage": "rl", "stage_step": 6}
  )
  ckpt.close()
  assert 3 in committed_checkpoints(directory)


def _abstract(state):
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in state.items()}


def _assert_restores(ckpt, step, expect):
  state, meta = ckpt.restore(_abstract(expect), step)
  assert meta["stage_step"] == 2 * step
  for k in expect:
    np.testing.assert_array_equal(np.asarray(state[k]), expect[k])


def test_full_disk_fails_the_save_and_keeps_the_last_checkpoint(small_disk):  # noqa: F811
  directory = os.path.join(small_disk.path, "ckpt")
  ckpt = Checkpointer(directory, max_to_keep=1)  # one kept: any early prune would show
  ckpt.save(1, _state(1, 1000), {"stage": "rl", "stage_step": 2})
  ckpt.wait()
  small_disk.fill()
  with pytest.raises(CheckpointWriteError) as e:
    ckpt.save(2, _state(2, 1000), {"stage": "rl", "stage_step": 4})
    ckpt.wait()  # the async part meets the full disk here, if the save did not
  message = str(e.value)
  assert e.value.errno == errno.ENOSPC and e.value.step == 2
  assert "\n" not in message and message.startswith("checkpoint 2 could not be written")
  assert "No space left on device" in message
  assert message.endswith("checkpoint 1 is the newest complete one"), message
  ckpt.close()  # the failure was raised once; closing does not raise it again
  assert list(committed_checkpoints(directory)) == [1]
  small_disk.free()
  ckpt = Checkpointer(directory, max_to_keep=1)
  assert ckpt.latest_step() == 1
  _assert_restores(ckpt, 1, _state(1, 1000))
  ckpt.save(2, _state(2, 1000), {"stage": "rl", "stage_step": 4})  # the run goes on
  ckpt.close()
  assert list(committed_checkpoints(directory)) == [2]


def _truncate_array_data(step_dir):
  data = [
    p
    for p in glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
    if os.path.getsize(p) > 4096
  ]
  assert data, "no array data file to truncate"
  for p in data:
    os.truncate(p, os.path.getsize(p) // 2)


DAMAGES = {
  "truncated_array_data": _truncate_array_data,
  "truncated_meta": lambda d: os.truncate(os.path.join(d, "meta", "metadata"), 5),
  "missing_meta": lambda d: os.remove(os.path.join(d, "meta", "metadata")),
  "missing_state": lambda d: shutil.rmtree(os.path.join(d, "state")),
  "empty_directory": lambda d: [shutil.rmtree(d), os.mkdir(d)],
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_resume_skips_a_damaged_newest_checkpoint(damage, tmp_path):
  directory = str(tmp_path / "ckpt")
  ckpt = Checkpointer(directory, max_to_keep=3)
  for step in (1, 2, 3):
    ckpt.save(step, _state(step, 5000), {"stage": "rl", "stage_step": 2 * step})
  ckpt.close()
  DAMAGES[damage](os.path.join(directory, "3"))
  ckpt = Checkpointer(directory, max_to_keep=3)
  # A tool reading the workdir skips it and moves nothing.
  step, _, _, [(bad, _, where)] = ckpt.restore_intact(_abstract(_state(2, 5000)), set_aside=False)
  assert (step, bad, where) == (2, 3, None) and os.path.isdir(os.path.join(directory, "3"))
  step, state, meta, skipped = ckpt.restore_intact(_abstract(_state(2, 5000)))
  assert step == 2 and meta["stage_step"] == 4
  for k, v in _state(2, 5000).items():
    np.testing.assert_array_equal(np.asarray(state[k]), v)
  [(bad, why, where)] = skipped
  assert bad == 3 and why and "\n" not in why
  # Set aside, not deleted; orbax sees step 2 as the latest and saves 3 anew.
  assert where == os.path.join(directory, "damaged-3") and os.path.isdir(where)
  assert ckpt.latest_step() == 2
  ckpt.save(3, _state(3, 5000), {"stage": "rl", "stage_step": 6})
  ckpt.close()
  assert sorted(committed_checkpoints(directory)) == [1, 2, 3]
  _assert_restores(Checkpointer(directory), 3, _state(3, 5000))


def test_a_config_that_fits_no_checkpoint_moves_nothing(tmp_path):
  """Every checkpoint failing alike is another config's shapes, not damage:
  the newest one's error, and nothing set aside."""
  directory = str(tmp_path / "ckpt")
  ckpt = Checkpointer(directory, max_to_keep=3)
  for step in (1, 2):
    ckpt.save(
      step,
      jax.tree.map(jax.numpy.asarray, _state(step, 100)),
      {"stage": "rl", "stage_step": 2 * step},
    )
  ckpt.close()
  ckpt = Checkpointer(directory, max_to_keep=3)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  other_shapes = {
    "w": jax.ShapeDtypeStruct((99,), np.float32, sharding=device),
    "b": jax.ShapeDtypeStruct((7,), np.int32, sharding=device),
  }
  with pytest.raises(ValueError, match="not compatible"):
    ckpt.restore_intact(other_shapes)
  assert sorted(os.listdir(directory)) == ["1", "2"] and ckpt.latest_step() == 2
