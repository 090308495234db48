"""The rollout fleet: shards and weights over shared storage, and the real
trainer with two rollout processes, killed and restarted (sao_jax/fleet.py).

The end-to-end test waits only on observable events (files appearing,
metrics lines, checkpoints committed), each behind a long hang guard; no
assertion depends on how fast this machine is.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax import configuration, fleet
from sao_jax.checkpoint import committed_checkpoints
from sao_jax.data import store
from sao_jax.envs.demonstrations import demonstration_trajectory
from sao_jax.envs.python_tool import PythonTool
from sao_jax.envs.tokenizer import CharTokenizer

TOK = CharTokenizer()
ENV = PythonTool()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LEN = 256


def traj(i, version=0):
  """A valid trajectory with prompt id `i`, sampled at `version`."""
  t = demonstration_trajectory(ENV, ENV.task(i), TOK)
  t.policy_version = np.where(t.action_mask, version, -1).astype(np.int32)
  t.rollout_logprobs = np.where(t.action_mask, -0.5, 0).astype(np.float32)
  return t


def make_feed(root, version=10, state=None, log=None):
  return fleet.ShardFeed(root, TOK.vocab_size, MAX_LEN, current_version=lambda: version,
                         state=state, poll_seconds=0.01, log=log or (lambda _: None))


# --- unit tests of the pieces --------------------------------------------------------


def test_only_renamed_shards_are_read_in_completion_order(tmp_path):
  root = str(tmp_path)
  a = fleet.ShardWriter(root, "a", max_trajectories=3, max_seconds=1e9)
  b = fleet.ShardWriter(root, "b", max_trajectories=2, max_seconds=1e9)
  for i in range(3):
    a.write(traj(i))  # a-00000000 closes first
  for i in range(100, 102):
    b.write(traj(i))  # then b-00000000
  for i in range(3, 5):
    a.write(traj(i))  # open: a-00000001.tmp-<pid>, invisible
  names = sorted(os.listdir(fleet.trajectories_dir(root)))
  assert names[:2] == ["a-00000000.array_record", "a-00000001.array_record.tmp-%d" % os.getpid()]
  consumed = []
  feed = make_feed(root, log=consumed.append)
  assert feed.qsize() == 5  # closed shards only
  assert [t.prompt_id for t in feed.take(5)] == [0, 1, 2, 100, 101]
  assert [line.split()[2].rstrip(":") for line in consumed] == [
      "a-00000000.array_record", "b-00000000.array_record"]
  assert feed.qsize() == 0
  # A SIGKILLed writer's successor drops the dead temporary and continues
  # the sequence after the last renamed shard.
  a2 = fleet.ShardWriter(root, "a", max_trajectories=3, max_seconds=1e9)
  assert a2.first_seq == 1 and not any(".tmp-" in n for n in os.listdir(a2.dir))
  a2.write(traj(7))
  a2.rotate_if_older(now=time.time() + 2e9)  # by age
  assert [t.prompt_id for t in feed.take(1)] == [7]
  assert feed.state() == {"consumed": {"a": 1, "b": 0}, "current": None}


def test_cursor_resumes_exactly_once(tmp_path):
  root = str(tmp_path)
  w = fleet.ShardWriter(root, "r0", max_trajectories=4, max_seconds=1e9)
  for i in range(12):
    w.write(traj(i))
  feed = make_feed(root)
  first = [t.prompt_id for t in feed.take(6)]  # a shard and a half
  state = json.loads(json.dumps(feed.state()))  # as it goes through checkpoint meta
  assert state == {"consumed": {"r0": 0}, "current": {"shard": "r0-00000001.array_record",
                                                      "offset": 2}}
  rest = [t.prompt_id for t in make_feed(root, state=state).take(6)]
  assert sorted(first + rest) == list(range(12)) and len(set(first + rest)) == 12


def test_bad_shards_and_records_are_counted_not_trained(tmp_path):
  root = str(tmp_path)
  d = fleet.trajectories_dir(root)
  w = fleet.ShardWriter(root, "r0", max_trajectories=4, max_seconds=1e9)
  bad = traj(1)
  bad.tokens = bad.tokens.copy()
  bad.tokens[0] = TOK.vocab_size + 3
  future = traj(2, version=99)  # sampled by a version the trainer never had
  for t in (traj(0), bad, future, traj(3)):
    w.write(t)
  with open(os.path.join(d, fleet.shard_name("junk", 0)), "wb") as f:
    f.write(b"not an array record file" * 10)
  with store.TrajectoryWriter(os.path.join(d, fleet.shard_name("raw", 0))) as raw:
    raw._writer.write(b"not a record")  # pylint: disable=protected-access
    raw.write(traj(4))
  feed = make_feed(root)
  got = feed.take(3)
  assert sorted(t.prompt_id for t in got) == [0, 3, 4]
  assert dict(feed.rejected) == {"token_out_of_vocab": 1, "version_from_future": 1,
                                 "corrupt_shard": 1, "not_npz": 1}
  assert feed.qsize() == 0


def test_weights_only_complete_versions_and_discarded_futures(tmp_path):
  root = str(tmp_path)
  params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones((3,), jnp.bfloat16)}
  pub = fleet.WeightPublisher(root, keep=3, version=0)
  for v in range(3):
    pub.publish(jax.tree.map(lambda x, v=v: x + v, params), v, {"consumed": {"r0": v}})
  pub.close()
  wdir = fleet.weights_dir(root)
  # Half-written versions: orbax's temporary, and a directory with no commit.
  os.makedirs(os.path.join(wdir, "3.orbax-checkpoint-tmp-1234", "state"))
  os.makedirs(os.path.join(wdir, "4", "state"))
  follower = fleet.WeightFollower(root, jax.eval_shape(lambda: params))
  got, version, meta = follower.poll()
  assert version == 2 and meta["consumed"] == {"r0": 2}
  np.testing.assert_array_equal(got["w"], params["w"] + 2)
  assert got["b"].dtype == jnp.bfloat16
  assert follower.poll() is None  # nothing newer
  # A trainer that resumes at version 1 removes what it published after it,
  # and the follower follows it back.
  pub = fleet.WeightPublisher(root, keep=3, version=1)
  assert sorted(os.listdir(wdir)) == ["0", "1"]
  pub.close()
  got, version, _ = follower.poll()
  assert version == 1
  np.testing.assert_array_equal(got["w"], params["w"] + 1)
  follower.close()


def test_fleet_config_is_checked():
  sys.path.insert(0, os.path.join(ROOT, "configs"))
  import common  # pylint: disable=g-import-not-at-top
  for field, value, match in (("fleet.keep_versions", 1, "fleet.keep_versions = 1"),
                              ("fleet.poll_seconds", 0.0, "fleet.poll_seconds"),
                              ("rollout.samples_per_prompt", 2, "rl.mode = 'fleet'")):
    config = common.get_config()
    config.rl.mode = "fleet"
    section, name = field.split(".")
    config[section][name] = value
    with pytest.raises(configuration.ConfigError, match=match):
      configuration.validate(config, num_devices=8)
