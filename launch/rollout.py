"""A fleet rollout process: generation apart from the trainer (rl.mode = "fleet").

    python launch/rollout.py --config=configs/sao_tiny.py --workdir=workdirs/run \\
        --rollout_id=r0 --config.rl.mode=fleet

Same config and workdir (or --config.fleet.root) as the trainer. It waits
for the trainer's first published weights, then runs the engine and driver
of the in-process mode (trainer.make_engine / make_driver) on its own
devices, writes finished trajectories into atomic shards of the trajectory
store, follows newer weight versions as they are published, and exits when
the trainer marks RL done. SIGTERM / SIGINT: stop, rename the open shard,
exit 0. SIGKILL loses only the open shard; start it again with the same
--rollout_id and it continues its shard sequence. See sao_jax/fleet.py.
"""

import faulthandler
import signal
import sys
import threading
import zlib

import jax
from absl import flags, logging
from ml_collections import config_flags

from sao_jax import configuration, fleet, sharding, trainer
from sao_jax.data import prompts as prompt_data
from sao_jax.envs import registry
from sao_jax.faults import FaultInjector
from sao_jax.models import policy

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The trainer's run directory.")
_ROLLOUT_ID = flags.DEFINE_string("rollout_id", None,
                                  "This process's name in shard names (letters, digits, _).")
flags.mark_flags_as_required(["config", "workdir", "rollout_id"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  config, rid = _CONFIG.value, _ROLLOUT_ID.value
  with config.unlocked():  # the trainer's mesh is not ours: this process's devices
    config.sharding.mesh = {"data": -1}
  configuration.validate(config)
  f = config.fleet
  root = fleet.root_of(config, _WORKDIR.value)
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  # `kill -USR1 <pid>`: every thread's stack on stderr, to see where a
  # rollout host waits.
  faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)

  tok = registry.make_tokenizer(config.env)
  faults = FaultInjector.from_config(config.get("faults"))
  env = faults.wrap_env(registry.make_env(config.env))
  model_cfg = trainer.build_model_config(config, tok)
  # Each shard carries what the driver's counters grew by while it was open
  # (`driver` is bound below, before anything is written).
  writer = fleet.ShardWriter(
      root, rid, f.shard_trajectories, f.shard_seconds,
      counters=lambda: {k: getattr(driver.stats, k) for k in fleet.SHARD_COUNTERS})
  # Each process (and each restart of it) draws its own prompt order and samples.
  seed = zlib.crc32(f"{config.seed}/{rid}/{writer.first_seq}".encode())
  follower = fleet.WeightFollower(
      root, jax.eval_shape(lambda: policy.init_params(model_cfg, jax.random.key(0))))

  print(f"[rollout {rid}] waiting for weights under {root}", flush=True)
  first = None
  while first is None and not stop.is_set() and not fleet.is_done(root):
    first = follower.poll()
    if first is None:
      stop.wait(f.poll_seconds)
  if first is None:
    why = "the trainer is done" if fleet.is_done(root) else "stopped"
    print(f"[rollout {rid}] {why} before any weights were published", flush=True)
    return
  params, version, _ = first
  engine = trainer.make_engine(config, model_cfg, params, version, seed=seed,
                               mesh=sharding.make_mesh({"data": -1}, jax.local_devices()))
  follower.retarget(engine.abstract_params())  # later versions restore into its layout

  def emit(t):
    # Backpressure: wait while the trainer is behind on this process's shards.
    while (not stop.is_set() and fleet.unread_shards(fleet.read_consumed(root), rid,
                                                      writer.last_closed) >= f.max_unread_shards):
      stop.wait(f.poll_seconds)
    writer.write(t)

  driver = trainer.make_driver(
      config, engine, env, tok,
      prompt_data.train_prompts(config.data.num_train_tasks, seed),
      faults.wrap_emit(emit, tok.vocab_size))
  driver.start()
  print(f"[rollout {rid}] generating at version {version}, shards from "
        f"{fleet.shard_name(rid, writer.first_seq)}", flush=True)
  try:
    while not stop.wait(f.poll_seconds):
      driver.check()  # a dead driver thread ends the process with its error
      # DONE is written after the last version is complete: poll once more.
      done = fleet.is_done(root)
      held = follower.version
      got = follower.poll()
      if got is not None:
        driver.update_params(got[0], got[1])
        print(f"[rollout {rid}] weights version {held} -> {got[1]}", flush=True)
      writer.rotate_if_older()
      if done:
        print(f"[rollout {rid}] the trainer is done", flush=True)
        break
  finally:
    stop.set()  # releases an emit waiting on backpressure
    driver.stop()
    writer.close()
    follower.close()
    print(f"[rollout {rid}] exiting: {writer.trajectories} trajectories, shards up to "
          f"{writer.last_closed}, last version {follower.version}, "
          f"{driver.stats.generated_tokens} tokens", flush=True)


if __name__ == "__main__":
  configuration.run(main)
