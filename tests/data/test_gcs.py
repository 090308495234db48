"""gs:// workdirs against a local GCS emulator (tests/gcs_emulator.py).

The workdir's files (sao_jax/data/files.py), the trajectory store's publication
(a shard appears whole or not at all), the fleet's shards, cursor and
weight versions, orbax checkpoints through tensorstore's gcs driver, and
the workdir check's one-line errors. The end-to-end fleet run on a gs://
workdir (a trainer and a rollout process, the trainer killed and resumed
from its gs:// checkpoint) is `test_fleet_run_on_gs_survives_a_trainer_kill`.
"""

import json
import os
import signal
import subprocess
import threading
import time
import uuid

import gcs_emulator
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import runs
from test_fleet import TOK, make_feed, traj

from sao_jax.data import files, store
from sao_jax.data.checkpoint import COMMIT_FILE, Checkpointer, committed_checkpoints
from sao_jax.train import configuration, fleet_worker
from sao_jax.transport import fleet

pytestmark = gcs_emulator.needs_emulator


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
  e = gcs_emulator.start(str(tmp_path_factory.mktemp("gcs") / "emulator.log"))
  e.apply_here()
  yield e
  e.stop()


@pytest.fixture
def url(emu):
  """A fresh prefix of the emulator's bucket."""
  return emu.url(uuid.uuid4().hex[:12])


def test_workdir_files_publish_whole_and_list(url, tmp_path):
  files.write_json(files.join(url, "a", "x.json"), {"v": 1})
  assert files.read_json(files.join(url, "a", "x.json")) == {"v": 1}
  assert files.listdir(files.join(url, "a")) == ["x.json"]
  [(name, mtime)] = files.scan(files.join(url, "a"))
  assert name == "x.json" and abs(mtime - time.time()) < 600
  assert files.scan(files.join(url, "nothing")) == []
  with pytest.raises(FileNotFoundError):
    files.listdir(files.join(url, "nothing"))
  # A metrics-like file: a resumed writer continues the object.
  for lines in (["1\n", "2\n"], ["3\n"]):
    a = files.Appender(files.join(url, "m.jsonl"), sync_seconds=1e9)
    for line in lines:
      a.write(line)
    # The first write is uploaded at once, later ones by `sync_seconds` or at close.
    assert files.read_text(files.join(url, "m.jsonl")).endswith(lines[0])
    a.close()
  assert files.read_text(files.join(url, "m.jsonl")) == "1\n2\n3\n"
  # A file staged locally is invisible until published.
  dest = files.join(url, "a", "shard.bin")
  staging = files.staging_path(dest)
  assert not staging.startswith("gs:") and os.path.exists(staging)
  with open(staging, "wb") as f:
    f.write(b"abc")
  assert not files.exists(dest)
  files.publish(staging, dest)
  assert files.read_bytes(dest) == b"abc" and not os.path.exists(staging)
  files.rmtree(files.join(url, "a"))
  assert not files.exists(dest)


def test_workdir_check_accepts_a_bucket_and_names_what_is_wrong(url, tmp_path):
  configuration.check_workdir(url, min_free_gb=1e9)  # no free-space limit on a bucket
  with pytest.raises(
    configuration.ConfigError,
    match=r"^workdir 'gs://no-such-bucket/run': not writable: the bucket "
    r"'no-such-bucket' does not exist",
  ):
    configuration.check_workdir("gs://no-such-bucket/run", 0.0)
  with pytest.raises(
    configuration.ConfigError,
    match=r"^workdir 'nosuch://b/run': not writable: no client for nosuch://",
  ):
    configuration.check_workdir("nosuch://b/run", 0.0)
  configuration.check_workdir(str(tmp_path / "posix"), 0.0)  # POSIX as before
  with pytest.raises(configuration.ConfigError, match="GiB free"):
    configuration.check_workdir(str(tmp_path / "posix"), 1e9)


def test_a_rollout_on_a_missing_bucket_stops_in_one_line(emu):
  config = runs.load_config_module("sao_tiny.py").get_config()
  config.rl.mode = "fleet"
  with pytest.raises(
    configuration.ConfigError,
    match=r"^workdir 'gs://no-such-bucket/run/fleet': not writable: the "
    r"bucket 'no-such-bucket' does not exist",
  ):
    fleet_worker.run_rollout_worker(config, "gs://no-such-bucket/run", "r0", threading.Event())


def test_trajectory_store_publishes_a_shard_whole(url):
  path = files.join(url, "trajectories", "value_pretrain.array_record")
  with store.TrajectoryWriter(path) as w:
    for i in range(3):
      w.write(traj(i))
    assert not files.exists(path)  # nothing under the final name while open
  got, dropped = store.read_valid_trajectories([path], TOK.vocab_size, 256)
  assert len(got) == 3 and not dropped
  assert [int(t.prompt_id) for t in got] == [0, 1, 2]
  # An aborted writer publishes nothing; a missing shard is counted.
  with pytest.raises(RuntimeError):
    with store.TrajectoryWriter(files.join(url, "trajectories", "b.array_record")) as w:
      w.write(traj(5))
      raise RuntimeError("collection failed")
  _, dropped = store.read_valid_trajectories(
    [path, files.join(url, "trajectories", "b.array_record")], TOK.vocab_size, 256
  )
  assert dropped == {"missing_shard": 1}


def test_fleet_shards_and_cursor_over_gs(url):
  root = files.join(url, "fleet")
  a = fleet.ShardWriter(root, "a", max_trajectories=2, max_seconds=1e9)
  for i in range(5):
    a.write(traj(i))  # a-0, a-1 closed; a-2 open with one trajectory
  assert sorted(files.listdir(fleet.trajectories_dir(root))) == [
    fleet.shard_name("a", 0),
    fleet.shard_name("a", 1),
  ]
  feed = make_feed(root)
  got = feed.take(3)
  assert [int(t.prompt_id) for t in got] == [0, 1, 2]
  state = feed.state()
  assert state == {
    "consumed": {"a": 0},
    "current": {"shard": fleet.shard_name("a", 1), "offset": 1},
  }
  assert fleet.read_consumed(root) == {"a": 0}
  a.close()
  # A restarted trainer resumes at the cursor; a restarted writer continues
  # the sequence after the last published shard.
  feed2 = make_feed(root, state=state)
  assert [int(t.prompt_id) for t in feed2.take(2)] == [3, 4]
  b = fleet.ShardWriter(root, "a", max_trajectories=2, max_seconds=1e9)
  assert b.first_seq == 3
  fleet.mark_done(root, 7)
  assert fleet.is_done(root)
  fleet.clear_done(root)
  assert not fleet.is_done(root)


def test_checkpoints_and_weight_versions_over_gs(url):
  params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones((3,), jnp.bfloat16)}
  ckpt = Checkpointer(files.join(url, "checkpoints"), max_to_keep=2, name="run")
  for step in (1, 2, 3):
    ckpt.save(step, jax.tree.map(lambda x, s=step: x + s, params), {"stage": "rl", "s": step})
  ckpt.close()
  done = committed_checkpoints(files.join(url, "checkpoints"))
  assert sorted(done) == [2, 3] and done[3]["s"] == 3
  # A step written in place without orbax's commit file is not complete.
  files.write_json(files.join(url, "checkpoints", "4", "meta", "metadata"), {"s": 4})
  assert sorted(committed_checkpoints(files.join(url, "checkpoints"))) == [2, 3]
  again = Checkpointer(files.join(url, "checkpoints"), max_to_keep=2, name="run")
  state, meta = again.restore(jax.eval_shape(lambda: params))
  again.close()
  assert meta["s"] == 3
  np.testing.assert_array_equal(state["w"], params["w"] + 3)
  # The fleet's weights: complete versions only; a resumed trainer's
  # discarded future is removed.
  root = files.join(url, "fleet")
  pub = fleet.WeightPublisher(root, keep=3, version=0)
  for v in range(3):
    pub.publish(jax.tree.map(lambda x, v=v: x + v, params), v)
  pub.close()
  follower = fleet.WeightFollower(root, jax.eval_shape(lambda: params))
  got, version, _ = follower.poll()
  assert version == 2
  np.testing.assert_array_equal(got["w"], params["w"] + 2)
  assert got["b"].dtype == jnp.bfloat16
  fleet.WeightPublisher(root, keep=3, version=1).close()
  assert sorted(committed_checkpoints(fleet.weights_dir(root))) == [0, 1]
  assert follower.poll()[1] == 1
  follower.close()
  assert files.exists(files.join(fleet.weights_dir(root), "1", COMMIT_FILE))


# --- the real trainer and a rollout process on a gs:// workdir ----------------------

RL_STEPS = 4
# test_fleet's run (value pretraining off: its store on gs:// is
# test_trajectory_store_publishes_a_shard_whole), 4 RL steps.
RUN = tuple(f for f in __import__("test_fleet").RUN if not f.startswith("--config.rl.steps"))
HANG_GUARD_S = 600


def start(emu, tmp_path, name, script, workdir, *flags, devices):
  cmd = runs.command(
    script,
    workdir,
    f"--config.sharding.mesh={{'data': {devices}}}",
    *RUN,
    f"--config.rl.steps={RL_STEPS}",
    "--config.tensorboard=True",
    # Versions travel as orbax checkpoints in the bucket.
    "--config.fleet.weights_path=checkpoint",
    *flags,
    run_flags=(),
  )
  log = open(tmp_path / f"{name}.log", "w", encoding="utf-8")
  return subprocess.Popen(
    cmd, env=runs.child_env(devices, **emu.env), stdout=log, stderr=subprocess.STDOUT, cwd=runs.ROOT
  )


def rl_steps(workdir):
  try:
    text = files.read_text(files.join(workdir, "metrics.jsonl"))
  except FileNotFoundError:
    return []
  return [
    json.loads(line)["step"]
    for line in text.splitlines(keepends=True)
    if line.endswith("\n") and '"stage": "rl"' in line
  ]


# Slow: the default run kills a fleet's trainer and rollouts on local files
# (tests/transport/test_fleet.py) and runs a fleet over gs:// above.
@pytest.mark.slow
def test_fleet_run_on_gs_survives_a_trainer_kill(emu, tmp_path):
  workdir = emu.url(uuid.uuid4().hex[:12], "run")
  ckpts = files.join(workdir, "checkpoints")
  procs = {
    "trainer": start(emu, tmp_path, "trainer1", "train.py", workdir, devices=8),
    "r0": start(emu, tmp_path, "r0", "rollout.py", workdir, "--rollout_id=r0", devices=1),
  }

  files_of = {"trainer": "trainer1", "r0": "r0"}

  def log(name):
    return (tmp_path / f"{name}.log").read_text(encoding="utf-8")

  def wait_for(what, condition):
    runs.wait_for(
      what,
      condition,
      procs,
      HANG_GUARD_S,
      tail=lambda name: log(files_of[name])[-3000:] if name else "",
    )

  try:
    wait_for(
      "an RL checkpoint on gs://",
      lambda: any(
        m["stage"] == "rl" and m["stage_step"] >= 2 for m in committed_checkpoints(ckpts).values()
      ),
    )
    procs["trainer"].send_signal(signal.SIGKILL)
    procs["trainer"].wait()
    assert max(rl_steps(workdir), default=0) < RL_STEPS
    procs["trainer"] = start(emu, tmp_path, "trainer2", "train.py", workdir, devices=8)
    files_of["trainer"] = "trainer2"
    assert procs["trainer"].wait(timeout=HANG_GUARD_S) == 0, log("trainer2")[-3000:]
    assert procs["r0"].wait(timeout=HANG_GUARD_S) == 0, log("r0")[-3000:]
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.kill()
        p.wait()
  t2 = log("trainer2")
  assert "Resumed from checkpoint" in t2 and "stage rl step " in t2, t2[-3000:]
  assert int(t2.split("stage rl step ")[1].split()[0]) >= 2  # the RL checkpoint waited for
  assert f"shared storage {files.join(workdir, 'fleet')}; weights: checkpoints\n" in t2
  assert max(rl_steps(workdir)) == RL_STEPS
  assert files.read_json(files.join(workdir, "summary.json"))["evals"]
  # Everything lives in the bucket: shards, versions, the cursor, the events.
  root = files.join(workdir, "fleet")
  names = files.listdir(fleet.trajectories_dir(root))
  assert names and all(
    fleet.parse_shard_name(n) or n.endswith(fleet.STATS_SUFFIX) for n in names
  ), names
  assert fleet.read_consumed(root)["r0"] >= 0
  # The trainer's last version (RL_STEPS, less any update skipped for a
  # non-finite loss) is the newest complete one in the bucket, and the
  # rollout followed the restarted trainer to it.
  last = files.read_json(files.join(root, fleet.DONE))["version"]
  versions = committed_checkpoints(fleet.weights_dir(root))
  assert last >= RL_STEPS - 1 and max(versions) == last, (
    last,
    versions,
    files.listdir(fleet.weights_dir(root)),
    log("trainer2")[-3000:],
  )
  assert files.listdir(files.join(workdir, "tensorboard"))
  r0 = log("r0")
  assert f"last version {last}," in r0 and "pulling version" not in r0, r0[-2000:]
