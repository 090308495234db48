"""The rollout fleet: shards and weights over shared storage, and the real
trainer with two rollout processes, killed and restarted (sao_jax/transport/fleet.py).

The end-to-end test waits only on observable events (files appearing,
metrics lines, checkpoints committed), each behind a long hang guard; no
assertion depends on how fast this machine is.
"""

import collections
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import runs
from test_weight_channel import _poll_until

from sao_jax.data import identity, store
from sao_jax.data.checkpoint import committed_checkpoints
from sao_jax.envs.demonstrations import demonstration_trajectory
from sao_jax.envs.python_tool import PythonTool
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import policy
from sao_jax.train import configuration, factories, fleet_worker
from sao_jax.train.stopping import StopTraining
from sao_jax.transport import fleet, weight_transfer

TOK = CharTokenizer()
ENV = PythonTool()
ROOT = runs.ROOT
MAX_LEN = 256


def traj(i, version=0):
  """A valid trajectory with prompt id `i`, sampled at `version`."""
  t = demonstration_trajectory(ENV, ENV.task(i), TOK)
  t.policy_version = np.where(t.action_mask, version, -1).astype(np.int32)
  t.rollout_logprobs = np.where(t.action_mask, -0.5, 0).astype(np.float32)
  return t


def make_feed(root, version=10, state=None, log=None):
  return fleet.ShardFeed(
    root,
    TOK.vocab_size,
    MAX_LEN,
    current_version=lambda: version,
    state=state,
    poll_seconds=0.01,
    log=log or (lambda _: None),
  )


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
    "a-00000000.array_record",
    "b-00000000.array_record",
  ]
  assert feed.qsize() == 0
  # A SIGKILLed writer's successor (the kernel dropped the dead one's lock)
  # drops the dead temporary and continues the sequence after the last
  # renamed shard.
  a.lock.release()
  a2 = fleet.ShardWriter(root, "a", max_trajectories=3, max_seconds=1e9)
  assert a2.first_seq == 1 and not any(".tmp-" in n for n in os.listdir(a2.dir))
  a2.write(traj(7))
  a2.rotate_if_older(now=time.time() + 2e9)  # by age
  assert [t.prompt_id for t in feed.take(1)] == [7]
  assert feed.state() == {"consumed": {"a": 1, "b": 0}, "current": None}
  # What rollouts read for backpressure: a's 2 closed shards are both read.
  assert fleet.read_consumed(root) == {"a": 1, "b": 0}
  assert fleet.unread_shards(fleet.read_consumed(root), "a", a2.last_closed) == 0


def test_cursor_resumes_exactly_once(tmp_path):
  root = str(tmp_path)
  w = fleet.ShardWriter(root, "r0", max_trajectories=4, max_seconds=1e9)
  for i in range(12):
    w.write(traj(i))
  feed = make_feed(root)
  first = [t.prompt_id for t in feed.take(6)]  # a shard and a half
  state = json.loads(json.dumps(feed.state()))  # as it goes through checkpoint meta
  assert state == {
    "consumed": {"r0": 0},
    "current": {"shard": "r0-00000001.array_record", "offset": 2},
  }
  rest = [t.prompt_id for t in make_feed(root, state=state).take(6)]
  assert sorted(first + rest) == list(range(12)) and len(set(first + rest)) == 12


def test_processes_of_a_trainer_follow_the_shared_choice(tmp_path):
  """A multi-host trainer's hosts take process 0's choice of each next shard
  (here: one that is not this process's own first choice)."""
  root = str(tmp_path)
  for rid, start in (("a", 0), ("b", 100)):
    w = fleet.ShardWriter(root, rid, max_trajectories=2, max_seconds=1e9)
    for i in range(start, start + 2):
      w.write(traj(i))
  asked = []

  def share(name, compute):
    asked.append((name, compute()))
    return "b-00000000.array_record" if len(asked) == 1 else compute()

  feed = fleet.ShardFeed(
    root, TOK.vocab_size, MAX_LEN, current_version=lambda: 10, log=lambda _: None, share=share
  )
  assert [t.prompt_id for t in feed.take(4)] == [100, 101, 0, 1]
  assert asked == [
    ("fleet_next_shard", "a-00000000.array_record"),
    ("fleet_next_shard", "a-00000000.array_record"),
  ]


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
    raw._writer.write(b"not a record")
    raw.write(traj(4))
  feed = make_feed(root)
  got = feed.take(3)
  assert sorted(t.prompt_id for t in got) == [0, 3, 4]
  assert dict(feed.rejected) == {
    "token_out_of_vocab": 1,
    "version_from_future": 1,
    "corrupt_shard": 1,
    "not_npz": 1,
  }
  assert feed.qsize() == 0


def test_driver_counters_cross_the_shard_boundary(tmp_path):
  """Malformed tool calls and environment events are no trajectory's: each
  shard carries what they grew by while it was open, and the feed adds a
  shard's when it finishes it, once."""
  root = str(tmp_path)
  stats = {"tool_call_errors": collections.Counter(), "env_events": collections.Counter()}
  w = fleet.ShardWriter(root, "r0", max_trajectories=2, max_seconds=1e9, counters=lambda: stats)
  stats["tool_call_errors"].update({"bad_json": 2})
  w.write(traj(0))
  stats["env_events"].update({"verifier_timeout": 1})
  w.write(traj(1))  # closes r0-00000000 with both
  stats["tool_call_errors"].update({"bad_json": 1, "unknown_tool": 1})
  w.write(traj(2))
  w.write(traj(3))  # r0-00000001: only what grew since
  w.write(traj(4))
  w.write(traj(5))  # r0-00000002: nothing grew, no stats file
  d = fleet.trajectories_dir(root)
  with open(os.path.join(d, fleet.shard_name("r0", 1) + fleet.STATS_SUFFIX)) as f:
    assert json.load(f) == {"tool_call_errors": {"bad_json": 1, "unknown_tool": 1}}
  assert not os.path.exists(os.path.join(d, fleet.shard_name("r0", 2) + fleet.STATS_SUFFIX))
  logged = []
  feed = make_feed(root, log=logged.append)
  feed.take(3)  # r0-00000001 is not finished yet
  assert feed.tool_call_errors == {"bad_json": 2}
  assert feed.env_events == {"verifier_timeout": 1}
  feed.take(3)
  assert feed.tool_call_errors == {"bad_json": 3, "unknown_tool": 1}
  assert feed.env_events == {"verifier_timeout": 1}
  # A rollout restarted under the same id counts from zero again; a stats file
  # a killed predecessor wrote for a shard it never renamed is removed.
  orphan = os.path.join(d, fleet.shard_name("r0", 3) + fleet.STATS_SUFFIX)
  with open(orphan, "w") as f:
    json.dump({"env_events": {"ghost": 9}}, f)
  fresh = {
    "tool_call_errors": collections.Counter({"unclosed": 1}),
    "env_events": collections.Counter(),
  }
  w.lock.release()  # as a SIGKILL would
  w2 = fleet.ShardWriter(root, "r0", max_trajectories=1, max_seconds=1e9, counters=lambda: fresh)
  assert not os.path.exists(orphan)
  w2.write(traj(6))
  # A stats file that is not what a writer writes is logged and ignored.
  w3 = fleet.ShardWriter(root, "r1", max_trajectories=1, max_seconds=1e9)
  w3.write(traj(7))
  with open(os.path.join(d, fleet.shard_name("r1", 0) + fleet.STATS_SUFFIX), "w") as f:
    json.dump({"env_events": {"x": -5}}, f)
  feed.take(2)
  assert feed.tool_call_errors == {"bad_json": 3, "unknown_tool": 1, "unclosed": 1}
  assert feed.env_events == {"verifier_timeout": 1}
  assert any("ignored the counters of r1-00000000" in line for line in logged)


def test_weights_only_complete_versions_and_discarded_futures(tmp_path):
  root = str(tmp_path)
  params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones((3,), jnp.bfloat16)}
  pub = fleet.WeightPublisher(root, keep=3, version=0)
  for v in range(3):
    pub.publish(jax.tree.map(lambda x, v=v: x + v, params), v, {"note": v})
  pub.close()
  wdir = fleet.weights_dir(root)
  # Half-written versions: orbax's temporary, and a directory with no commit.
  os.makedirs(os.path.join(wdir, "3.orbax-checkpoint-tmp-1234", "state"))
  os.makedirs(os.path.join(wdir, "4", "state"))
  follower = fleet.WeightFollower(root, jax.eval_shape(lambda: params))
  got, version, meta = follower.poll()
  assert version == 2 and meta["note"] == 2
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
  # Resumed at 0 and trained again to 1: the same number, other params.
  pub = fleet.WeightPublisher(root, keep=3, version=0)
  pub.publish(jax.tree.map(lambda x: x - 7, params), 1)
  pub.close()
  got, version, _ = follower.poll()
  assert version == 1
  np.testing.assert_array_equal(got["w"], params["w"] - 7)
  follower.close()


def test_fleet_config_is_checked():
  for field, value, match in (
    ("fleet.keep_versions", 1, "fleet.keep_versions = 1"),
    ("fleet.poll_seconds", 0.0, "fleet.poll_seconds"),
    ("rollout.samples_per_prompt", 2, "rl.mode = 'fleet'"),
    # The direct weight path's fields (sao_jax/transport/weight_transfer.py).
    ("fleet.weights_path", "nfs", "fleet.weights_path"),
    ("fleet.pull_timeout_s", 0.1, "fleet.pull_timeout_s"),
    ("fleet.transfer_host", "trainer-0", "fleet.transfer_host"),
  ):
    config = runs.load_config_module("sao_tiny.py").get_config()
    config.rl.mode = "fleet"
    section, name = field.split(".")
    config[section][name] = value
    with pytest.raises(configuration.ConfigError, match=match):
      configuration.validate(config, num_devices=8)


def test_rollout_worker_in_process(tmp_path):
  """The rollout worker of launch/rollout.py, in a thread: it waits for the
  first weights, writes valid shards, follows a new version and returns
  when the trainer marks RL done, its open shard renamed."""
  config = runs.load_config_module("sao_tiny.py").get_config()
  for field, value in (
    ("rl.mode", "fleet"),
    ("rollout.slots", 4),
    ("rollout.max_len", 128),
    ("rollout.max_turn_tokens", 16),
    ("fleet.shard_trajectories", 2),
    ("fleet.shard_seconds", 1.0),
    ("fleet.poll_seconds", 0.05),
  ):
    section, name = field.split(".")
    config[section][name] = value
  config.lock()
  workdir = str(tmp_path)
  root = fleet.root_of(config, workdir)
  lines, out = [], {}

  def work():
    try:
      out["counts"] = fleet_worker.run_rollout_worker(config, workdir, "w0", stop, lines.append)
    except BaseException as e:  # noqa: BLE001
      out["error"] = e

  def wait_for(what, condition):
    deadline = time.time() + HANG_GUARD_S
    while not condition():
      assert worker.is_alive(), (what, out.get("error"), lines)
      assert time.time() < deadline, f"hang guard: no {what}; {lines}"
      time.sleep(0.05)

  stop = threading.Event()
  worker = threading.Thread(target=work, daemon=True)
  worker.start()
  try:
    wait_for("the wait line", lambda: lines)
    assert lines == [f"[rollout w0] waiting for weights under {root}"]
    params = policy.init_params(factories.build_model_config(config), jax.random.key(0))
    # Each version goes out with the trainer's run id and its fingerprint.
    published = identity.Published("trainer_run")
    for version, p in enumerate([params, jax.tree.map(lambda x: x * 0.5, params)]):
      published.note(version, identity.fingerprint(p))
      pub = fleet.WeightPublisher(root, keep=3, version=version)
      pub.publish(p, version, published.identity(version).meta())
      pub.close()
      if version == 0:
        wait_for("a shard", lambda: shards(root, "w0"))
    wait_for("version 1", lambda: "[rollout w0] weights version 0 -> 1" in lines)
    fleet.mark_done(root, 1)
    worker.join(HANG_GUARD_S)
  finally:
    stop.set()
    worker.join(HANG_GUARD_S)
  assert not worker.is_alive() and "error" not in out, (out, lines)
  counts = out["counts"]
  assert counts["version"] == 1 and counts["trajectories"] >= 1
  assert lines[1] == "[rollout w0] generating at version 0, shards from w0-00000000.array_record"
  assert lines[-2:] == [
    "[rollout w0] the trainer is done",
    f"[rollout w0] exiting: {counts['trajectories']} trajectories, shards "
    f"up to {counts['last_shard']}, last version 1, "
    f"{counts['generated_tokens']} tokens",
  ]
  names = shards(root, "w0")
  assert names == [fleet.shard_name("w0", i) for i in range(counts["last_shard"] + 1)]
  assert not any(".tmp-" in n for n in os.listdir(fleet.trajectories_dir(root)))
  # The trainer's feed checks whose params sampled each trajectory: all its own.
  feed = fleet.ShardFeed(
    root, TOK.vocab_size, 128, current_version=lambda: 1, log=lambda _: None, identity=published
  )
  got = feed.take(counts["trajectories"])
  assert not feed.rejected and feed.qsize() == 0
  assert {t.run_id for t in got} == {"trainer_run"}
  assert all(
    t.fingerprints
    == {v: published.identity(v).fingerprint for v in set(t.policy_version[t.action_mask].tolist())}
    for t in got
  )
  # Sampled tokens of episodes still open at the end were never written.
  assert 0 < sum(int(t.action_mask.sum()) for t in got) <= counts["generated_tokens"]
  assert {int(v) for t in got for v in t.policy_version[t.action_mask]} <= {0, 1}


# --- LoRA: a version is the adapters -------------------------------------------------


def _lora_config(**fields):
  """sao_tiny with LoRA in fleet mode, its trainer on the pod's rules over
  data x fsdp x expert (8 simulated devices): a layout no rollout has."""
  from configs import sao_moe

  c = runs.load_config_module("sao_tiny.py").get_config()
  c.sharding.mesh = {"data": 2, "fsdp": 2, "expert": 2, "tensor": 1}
  c.sharding.rules = sao_moe.POD_RULES
  settings = {
    "rl.mode": "fleet",
    "lora.enabled": True,
    "lora.rank": 4,
    "fleet.poll_seconds": 0.02,
    "fleet.transfer_host": "127.0.0.1",
    "fleet.transfer_sockets": 1,
    "fleet.checkpoint_every": 2,
    **fields,
  }
  for field, value in settings.items():
    if "." in field:
      section, name = field.split(".")
      c[section][name] = value
    else:
      c[field] = value
  return c


def _adapters_at(run, version):
  """The run's adapters moved to a version of their own (every leaf, B too)."""
  move = lambda x: (
    x
    + (0.01 * (version + 1))
    * jnp.sin(jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape) + version)
  )
  shardings = run.programs.state_shardings.policy
  return jax.jit(lambda t: jax.tree.map(move, t), out_shardings=shardings)(run.state.policy)


@pytest.mark.slow  # ~35 s for both channels: the trainer's run and the rollout's programs
@pytest.mark.parametrize("weights_path", ["checkpoint", "direct"])
def test_lora_versions_are_the_adapters_merged_on_the_rollouts_own_base(tmp_path, weights_path):
  """With LoRA a version that crosses the fleet is the adapters alone
  (float32, the trainer's state); the rollout builds its base from the
  config on its own mesh, checks it against the trainer's fingerprint, and
  merges: after a chain of versions what it serves is the trainer's merged
  params cast for serving, bit for bit. A rollout whose base differs
  (another seed) refuses in one line."""
  from sao_jax.models import lora, precision
  from sao_jax.train import run as run_lib
  from sao_jax.train import sources

  config = _lora_config(**{"fleet.weights_path": weights_path})
  trainer = run_lib.build(config)
  root = str(tmp_path)
  publisher = sources.weight_publisher(trainer, root, 0)
  rollout = fleet_worker.rollout_config(config)
  lines = []
  make = lambda c, rid: fleet_worker._make_follower(
    c, factories.build_model_config(c), TOK, root, rid, lines.append
  )
  follower = make(rollout, "w0")
  cast = jax.jit(functools.partial(precision.cast_for_serving, trainer.model_cfg))
  try:
    assert follower.base_fingerprint == trainer.meta["lora_base"]
    assert lines == [
      f"[rollout w0] LoRA base {trainer.meta['lora_base']} from seed {config.seed}; "
      "versions are its adapters"
    ]
    for version in range(4):
      trainer.state = trainer.state.replace(policy=_adapters_at(trainer, version))
      publisher.publish(sources.published_policy(trainer), version)
      served, _, meta = _poll_until(follower, version)
      assert meta["lora_base"] == trainer.meta["lora_base"]
      want = jax.tree_util.tree_flatten_with_path(cast(trainer.policy_params()))[0]
      got = jax.tree.leaves(served)
      assert len(got) == len(want)
      for (path, w), g in zip(want, got):
        assert g.dtype == w.dtype, path
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=str(path))
    # What crossed: the adapter tree (float32), not the params.
    if weights_path == "direct":
      manifest = json.loads(
        (tmp_path / "transfer" / weight_transfer.manifest_name(3, 0)).read_text()
      )
      assert sum(p["nbytes"] for p in manifest["pieces"]) == lora.count(trainer.state.policy) * 4
      assert "delta" not in manifest  # whole adapter versions
    another_seed = _lora_config(**{"fleet.weights_path": weights_path, "seed": config.seed + 1})
    other = make(fleet_worker.rollout_config(another_seed), "w1")
    with pytest.raises(StopTraining) as e:
      _poll_until(other, 3)
    assert "trained on base" in str(e.value) and "\n" not in str(e.value)
    assert f"seed {config.seed + 1}" in str(e.value)
    other.close()
  finally:
    follower.close()
    publisher.close(finished=True)


@pytest.mark.slow  # ~3 min on 2 cores
def test_a_lora_trainer_and_a_rollout_process_on_adapter_versions(tmp_path):
  """launch/train.py with LoRA in fleet mode beside one launch/rollout.py on
  a mesh of its own (1 device against the trainer's 8), on the direct path:
  every version after SFT crosses as the adapters, the rollout builds its
  base, swaps merged versions in and writes shards the trainer trains on,
  every trajectory stamped with the version it used (none refused)."""
  flags = (
    "--config.rl.mode=fleet",
    "--config.lora.enabled=True",
    "--config.lora.rank=4",
    "--config.rl.steps=4",
    "--config.fleet.shard_trajectories=4",
    "--config.fleet.shard_seconds=2.0",
    "--config.fleet.poll_seconds=0.2",
    "--config.fleet.transfer_host=127.0.0.1",
  )
  workdir = str(tmp_path / "run")
  runs.run_together(
    [
      ("trainer", runs.command("train.py", workdir, *flags), runs.child_env()),
      (
        "rollout",
        runs.command("rollout.py", workdir, *flags, "--rollout_id=r0"),
        runs.child_env(devices=1),
      ),
    ],
    str(tmp_path),
    timeout=900,
  )
  trained = (tmp_path / "trainer.log").read_text()
  rolled = (tmp_path / "rollout.log").read_text()
  assert "[rl] 4/4" in trained
  refused = [int(n) for n in re.findall(r"trajectories, (\d+) rejected", trained)]
  assert refused and not any(refused)  # every shard's trajectories were this run's own
  assert [r["queue/rejected"] for r in runs.read_metrics(workdir, "rl")] == [0] * 4
  assert len(re.findall(r"weights version (\d+) -> (\d+)", rolled)) >= 2
  assert "the trainer is done" in rolled and "refused" not in rolled
  # Each version carries the base's fingerprint, which the rollout checked.
  weights = fleet.weights_dir(os.path.join(workdir, "fleet"))
  metas = committed_checkpoints(weights)
  assert metas and all(len(m["lora_base"]) == 16 for m in metas.values())


# --- one writer per rollout id, and a feed a stray file cannot steer ---------------


def _ids(trajs):
  return sorted(int(t.prompt_id) for t in trajs)


def _no_wait(waited):
  raise AssertionError("the feed ran out of shards: some shard was skipped")


def _stray(root, rollout_id, seq, prompt_id):
  """A well-formed shard no writer of `rollout_id` wrote, e.g. a copy from
  another run."""
  path = os.path.join(fleet.trajectories_dir(root), fleet.shard_name(rollout_id, seq))
  with store.TrajectoryWriter(path) as w:
    w.write(traj(prompt_id))


def test_a_second_writer_of_a_live_rollout_id_is_refused(tmp_path):
  root = str(tmp_path)
  first = fleet.ShardWriter(root, "r0", max_trajectories=2, max_seconds=1e9)
  for i in range(3):
    first.write(traj(i))  # r0-00000000 closed, r0-00000001 open
  with pytest.raises(fleet.RolloutIdInUse) as refused:
    fleet.ShardWriter(root, "r0", max_trajectories=2, max_seconds=1e9)
  message = str(refused.value)
  assert "\n" not in message and message.startswith(
    f"rollout id 'r0' is in use: pid {os.getpid()} on {socket.gethostname()} holds "
    f"{os.path.join(fleet.rollouts_dir(root), 'r0.lock')} since "
  )
  # The refused start touched nothing: the first writer's open shard lives on.
  for i in range(3, 8):
    first.write(traj(i))
  first.close()
  assert _ids(make_feed(root).take(8, on_wait=_no_wait)) == list(range(8))
  fleet.ShardWriter(root, "r0", max_trajectories=2, max_seconds=1e9).close()  # released


def test_the_rollout_worker_refuses_a_live_rollout_id_at_start_up(tmp_path):
  config = runs.load_config_module("sao_tiny.py").get_config()
  config.rl.mode = "fleet"
  config.lock()
  workdir = str(tmp_path)
  held = fleet.ShardWriter(fleet.root_of(config, workdir), "w0", 2, 1e9)
  lines = []
  stop = threading.Event()
  stop.set()  # a worker that started anyway returns at once instead of waiting for weights
  with pytest.raises(configuration.StopTraining, match="^rollout id 'w0' is in use: pid "):
    fleet_worker.run_rollout_worker(config, workdir, "w0", stop, lines.append)
  assert not lines  # refused before anything else
  held.close()


def test_a_killed_writers_lock_does_not_block_its_restart(tmp_path):
  root = str(tmp_path)
  code = (
    "import sys; from sao_jax.transport import fleet; "
    "w = fleet.ShardWriter(sys.argv[1], 'r0', 2, 1e9); print('held', flush=True); "
    "sys.stdin.read()"
  )
  holder = subprocess.Popen(
    [sys.executable, "-c", code, root],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
    cwd=ROOT,
    env=runs.child_env(1, PYTHONPATH=ROOT),
  )
  try:
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(fleet.RolloutIdInUse, match=f"pid {holder.pid} "):
      fleet.ShardWriter(root, "r0", 2, 1e9)
  finally:
    holder.kill()
    holder.wait()
  fleet.ShardWriter(root, "r0", 2, 1e9).close()  # the kernel dropped the dead one's lock


class FakeObjects:
  """An object store's create-only write, read, overwrite and delete."""

  def __init__(self):
    self.objects, self.broken = {}, False

  def read(self, path):
    return self.objects.get(path)

  def create(self, path, data):
    if path in self.objects:
      return False
    self.objects[path] = data
    return True

  def write(self, path, data):
    if self.broken:
      raise OSError("503 from the store")
    self.objects[path] = data

  def delete(self, path):
    self.objects.pop(path, None)


class FakeClock:
  """A monotonic clock that moves only when slept on; `during_sleep` runs
  at each sleep (another process's renewals)."""

  def __init__(self):
    self.now, self.during_sleep = 0.0, lambda: None

  def __call__(self):
    return self.now

  def sleep(self, seconds):
    self.now += seconds
    self.during_sleep()


def test_an_object_store_lease_refuses_a_live_holder_and_passes_from_a_dead_one():
  objects, clock, lines = FakeObjects(), FakeClock(), []

  def lease(rollout_id="r0"):
    return fleet.RolloutLease(
      "gs://b/fleet/trajectories",
      rollout_id,
      ttl_s=60.0,
      store=objects,
      clock=clock,
      sleep=clock.sleep,
      log=lines.append,
      thread=False,
    )

  path = "gs://b/fleet/trajectories/r0.lease"
  a = lease()
  assert json.loads(objects.read(path))["token"] == a.token
  # A live holder renews within the wait: refused, well before ttl_s.
  clock.during_sleep = a.renew
  with pytest.raises(fleet.RolloutIdInUse, match=f"^rollout id 'r0' is in use: pid {os.getpid()} "):
    lease()
  assert 0 < clock.now < 60 and "waiting up to 60 s" in lines[-1]
  # A holder that stopped renewing (stalled, or dead on another host) is
  # taken over after ttl_s without a beat; it finds out at its next renewal.
  clock.during_sleep = lambda: None
  start = clock.now
  b = lease()
  assert clock.now - start >= 60 and json.loads(objects.read(path))["token"] == b.token
  a.renew()
  with pytest.raises(fleet.RolloutIdInUse, match="taken over by pid"):
    a.check()
  b.check()
  # A holder on this host whose process is gone: taken over at once.
  dead = subprocess.Popen(["true"])
  dead.wait()
  record = json.loads(objects.read(path))
  objects.write(path, json.dumps(dict(record, pid=dead.pid, token="x")).encode())
  start = clock.now
  c = lease()
  assert clock.now == start and json.loads(objects.read(path))["token"] == c.token
  # A holder that cannot renew for 2/3 of ttl_s gives the lease up.
  objects.broken = True
  clock.now += 30
  c.renew()
  c.check()  # within 2/3 of ttl_s: retried
  clock.now += 11
  c.renew()
  with pytest.raises(fleet.RolloutIdInUse, match="could not be renewed for 41 s"):
    c.check()
  # Released, the lease is gone and the next process takes it at once.
  objects.broken = False
  d = lease("r1")
  d.release()
  assert objects.read("gs://b/fleet/trajectories/r1.lease") is None
  start = clock.now
  lease("r1").release()
  assert clock.now == start


def test_a_stray_shard_neither_hides_nor_steers_the_live_writers(tmp_path):
  """A well-formed shard no writer wrote, with a high number (and one that
  takes the live writer's next name), is read like any shard; the writer's
  later shards are all read, the watermark moves only through what was read,
  and a restarted writer continues after it, not after the stray."""
  root = str(tmp_path)
  logged = []
  w = fleet.ShardWriter(root, "r0", max_trajectories=2, max_seconds=1e9)
  w.write(traj(0))
  w.write(traj(1))  # r0-00000000
  feed = make_feed(root, log=logged.append)
  assert _ids(feed.take(2, on_wait=_no_wait)) == [0, 1]
  _stray(root, "r0", 900, 900)
  _stray(root, "r0", 2, 902)
  assert _ids(feed.take(2, on_wait=_no_wait)) == [900, 902]  # read ahead of the sequence
  for i in range(2, 8):
    w.write(traj(i))  # r0-00000001, then r0-00000003 (the stray has 2), r0-00000004
  assert _ids(feed.take(6, on_wait=_no_wait)) == list(range(2, 8))
  assert w.last_closed == 4 and w.names_taken == 1
  assert any("reading r0-00000002.array_record ahead of r0's sequence" in x for x in logged)
  assert feed.state() == {"consumed": {"r0": 4}, "current": None, "ahead": {"r0": [900]}}
  assert fleet.read_consumed(root) == {"r0": 4}
  assert fleet.unread_shards(fleet.read_consumed(root), "r0", w.last_closed) == 0
  assert not feed.rejected
  w.close()
  w2 = fleet.ShardWriter(root, "r0", max_trajectories=1, max_seconds=1e9)
  assert w2.first_seq == 5
  w2.write(traj(8))
  # A trainer resumed from this cursor reads on from it, the stray not again.
  resumed = make_feed(root, state=json.loads(json.dumps(feed.state())))
  assert _ids(resumed.take(1, on_wait=_no_wait)) == [8]
  assert resumed.state()["consumed"] == {"r0": 5}


def test_what_the_feed_skips_is_counted_once_with_its_reason(tmp_path, monkeypatch):
  monkeypatch.setattr(fleet, "MAX_AHEAD", 2)
  root = str(tmp_path)
  d = fleet.trajectories_dir(root)
  logged = []
  feed = make_feed(root, log=logged.append)
  for seq in (0, 2, 3, 4):  # r1-00000001 never came
    _stray(root, "r1", seq, seq)
  for name in ("r1-123.array_record", "r1-000000009.array_record", "notes.txt"):
    with open(os.path.join(d, name), "w") as f:
      f.write("x")
  assert feed.qsize() == 4 and feed.qsize() == 4
  assert dict(feed.rejected) == {"bad_shard_name": 3}
  # Read beyond the gap: with MAX_AHEAD = 2 shards read past it, it is given up.
  assert _ids(feed.take(4, on_wait=_no_wait)) == [0, 2, 3, 4]
  assert feed.state() == {"consumed": {"r1": 4}, "current": None}
  assert any("gave up r1's shards 1..1" in x for x in logged)
  # The missing shard turns up after all: below the watermark, skipped and counted.
  _stray(root, "r1", 1, 1)
  assert feed.qsize() == 0 and feed.qsize() == 0
  assert dict(feed.rejected) == {"bad_shard_name": 3, "sequence_gap": 1, "out_of_order_shard": 1}
  assert sum("(out_of_order_shard)" in x for x in logged) == 1
  assert sum("(bad_shard_name)" in x for x in logged) == 3
  # Writers' own files are no strays: temporaries and stats files.
  w = fleet.ShardWriter(root, "r2", max_trajectories=1, max_seconds=1e9)
  w.write(traj(5))
  with open(os.path.join(d, fleet.shard_name("r2", 0) + fleet.STATS_SUFFIX), "w") as f:
    json.dump({"env_events": {"x": 1}}, f)
  with open(os.path.join(d, fleet.shard_name("r2", 1) + ".tmp-1"), "w") as f:
    f.write("x")
  assert _ids(feed.take(1, on_wait=_no_wait)) == [5]
  assert dict(feed.rejected) == {"bad_shard_name": 3, "sequence_gap": 1, "out_of_order_shard": 1}
  w.close()


# --- the real trainer and two rollout processes ------------------------------------

RL_STEPS = 16
RUN = (
  "--config.rl.mode=fleet",
  "--config.sft.steps=2",
  "--config.sft.batch_size=8",
  "--config.value_pretrain.steps=0",
  f"--config.rl.steps={RL_STEPS}",
  "--config.rl.batch_size=8",
  "--config.rollout.slots=8",
  "--config.rollout.max_len=128",
  "--config.eval.num_tasks=1",
  "--config.eval.slots=1",
  "--config.log_every=1",
  "--config.checkpoint.every=2",
  "--config.tensorboard=False",
  "--config.fleet.shard_trajectories=4",
  "--config.fleet.shard_seconds=2.0",
  "--config.fleet.poll_seconds=0.2",
  "--config.fleet.max_unread_shards=2",
)
HANG_GUARD_S = 600


def start(tmp_path, name, script, workdir, *flags, devices):
  """A launch/<script> child process on `devices` simulated CPU devices, its
  output in <tmp_path>/<name>.log; the compile cache of tests/conftest.py
  reaches it through the environment."""
  cmd = runs.command(
    script, workdir, f"--config.sharding.mesh={{'data': {devices}}}", *flags, run_flags=RUN
  )
  log = open(tmp_path / f"{name}.log", "w", encoding="utf-8")
  return subprocess.Popen(
    cmd, env=runs.child_env(devices), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
  )


def log_of(tmp_path, name):
  return (tmp_path / f"{name}.log").read_text(encoding="utf-8")


def wait_for(what, condition, procs):
  """Polls `condition` until true; fails if a process dies or the guard runs out."""
  runs.wait_for(what, condition, procs, HANG_GUARD_S)


def rl_steps(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    lines = [json.loads(line) for line in f if line.endswith("\n")]
  return [r["step"] for r in lines if r["stage"] == "rl"]


def shards(root, rollout_id):
  return sorted(
    n
    for n in os.listdir(fleet.trajectories_dir(root))
    if (fleet.parse_shard_name(n) or ("",))[0] == rollout_id
  )


def consumed(log):
  names = [
    line.split()[2].rstrip(":") for line in log.splitlines() if line.startswith("[fleet] consumed ")
  ]
  assert len(names) == len(set(names)), "a shard consumed twice by one trainer"
  return set(names)


# The same kills through the pod launcher, Ray and a fleet are in the default run:
# tests/pod/test_pod_ray.py::test_pod_job_survives_a_dead_rollout_host_and_a_dead_trainer.
@pytest.mark.slow
def test_trainer_and_two_rollouts_survive_kills(tmp_path):
  workdir = str(tmp_path / "run")
  root = os.path.join(workdir, "fleet")
  os.makedirs(fleet.trajectories_dir(root))
  procs = {"trainer": start(tmp_path, "trainer1", "train.py", workdir, devices=8)}
  for rid in ("r0", "r1"):
    procs[rid] = start(tmp_path, rid, "rollout.py", workdir, f"--rollout_id={rid}", devices=1)
  try:
    # 1. SIGKILL a rollout once it has renamed shards and RL is training.
    # r1 is frozen (SIGSTOP) until the trainer restart: then the trainer's
    # pace is the restarted r0's, and RL is far from done when it is killed.
    wait_for(
      "RL steps and shards of r0",
      lambda: len(rl_steps(workdir)) >= 1 and len(shards(root, "r0")) >= 2,
      procs,
    )
    procs["r1"].send_signal(signal.SIGSTOP)
    procs["r0"].send_signal(signal.SIGKILL)
    procs["r0"].wait()
    before_kill = shards(root, "r0")  # every shard renamed before the kill
    step_at_kill = max(rl_steps(workdir))
    procs["r0"] = start(
      tmp_path, "r0_restarted", "rollout.py", workdir, "--rollout_id=r0", devices=1
    )

    # 2. Training goes on; SIGKILL the trainer once a later RL checkpoint is complete.
    def trained_on_after_kill():
      committed = [
        m["stage_step"]
        for m in committed_checkpoints(os.path.join(workdir, "checkpoints")).values()
        if m["stage"] == "rl"
      ]
      return (
        committed
        and max(committed) >= step_at_kill + 2
        and len(shards(root, "r0")) > len(before_kill)
      )

    wait_for("an RL checkpoint after the rollout kill", trained_on_after_kill, procs)
    procs["trainer"].send_signal(signal.SIGKILL)
    procs["trainer"].wait()
    procs["r1"].send_signal(signal.SIGCONT)
    t1_steps = rl_steps(workdir)
    restarted_at = time.time()
    procs["trainer"] = start(tmp_path, "trainer2", "train.py", workdir, devices=8)
    # (Rollouts exit when it marks RL done, before its final evaluation.)
    assert procs["trainer"].wait(timeout=HANG_GUARD_S) == 0, log_of(tmp_path, "trainer2")[-3000:]
    # 3. The rollouts see DONE and exit cleanly, their open shards renamed.
    for rid in ("r0", "r1"):
      assert procs[rid].wait(timeout=HANG_GUARD_S) == 0, log_of(tmp_path, rid)[-3000:]
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.kill()
        p.wait()

  t1, t2 = log_of(tmp_path, "trainer1"), log_of(tmp_path, "trainer2")
  assert "[fleet] trainer at version" in t1 and max(t1_steps) < RL_STEPS
  assert "Resumed from checkpoint" in t2 and "stage rl" in t2
  resumed_at = int(t2.split("stage rl step ")[1].split()[0])
  assert resumed_at >= step_at_kill + 2
  # Training did not stop at the rollout kill, and finished after the restart.
  assert max(rl_steps(workdir)) == RL_STEPS and os.path.exists(
    os.path.join(workdir, "summary.json")
  )
  # The restarted rollout continued r0's sequence; nothing renamed before
  # the kill was lost: each such shard was consumed (once per trainer life).
  assert f"shards from r0-{len(before_kill):08d}" in log_of(tmp_path, "r0_restarted")
  assert set(before_kill) <= consumed(t1) | consumed(t2)
  final = committed_checkpoints(os.path.join(workdir, "checkpoints"))
  cursor = final[max(final)]["source"]
  assert cursor["consumed"]["r0"] >= fleet.parse_shard_name(before_kill[-1])[1]
  # The rollouts followed the restarted trainer to its last version (the
  # killed trainer never got there), and shards written after its restart
  # hold versions beyond its resume point.
  for name in ("r0_restarted", "r1"):
    assert f"last version {RL_STEPS}," in log_of(tmp_path, name), log_of(tmp_path, name)[-2000:]
  later = [
    os.path.join(fleet.trajectories_dir(root), n)
    for n in shards(root, "r0") + shards(root, "r1")
    if os.path.getmtime(os.path.join(fleet.trajectories_dir(root), n)) > restarted_at
  ]
  trajs, _ = store.read_valid_trajectories(later, TOK.vocab_size, 128)
  assert "[fleet] consumed" in t2
  assert max(int(t.policy_version.max()) for t in trajs) > resumed_at
  # They carry the run's id, the one kept in the workdir across the restart
  # (sao_jax/data/identity.py), and fingerprints of the versions they used
  # (all of them, but for a version number an episode saw published twice).
  assert {t.run_id for t in trajs} == {identity.run_id(workdir)}
  assert all(
    set(t.fingerprints) <= set(t.policy_version[t.action_mask].tolist()) for t in trajs
  ) and any(t.fingerprints for t in trajs)
  assert not any(".tmp-" in n for n in os.listdir(fleet.trajectories_dir(root)))
