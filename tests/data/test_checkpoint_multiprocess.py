"""Two checkpointers saving at once in a 2-process job (gloo on CPU).

A fleet trainer holds two orbax managers: the run's checkpoints and the
published weights. On several processes each save ends in barriers over
the coordination service whose keys name the step directory
("async_write_complete.<step>") or nothing at all, not the manager's
directory. A run checkpoint and a weight version with the same number in
flight together then meet at one barrier key, and the coordination service
fails the second waiter ("Barrier ... is already ongoing"); a 2-trainer
pod hit it at RL step 6, where run checkpoint 6 (every 2 steps, after 3
from SFT and value pretraining) and weight version 6 are written together. Each `Checkpointer` names its barriers by its own `name`;
this test saves the same step numbers in two of them at once, in both
processes, and restores what was saved.

The workers are this file run as a script:
`python test_checkpoint_multiprocess.py WORKDIR PROCESS_ID PORT`.
"""

import json
import os
import sys

import runs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HANG_GUARD_S = 180  # a hang guard only: the test takes seconds (a collision hangs it)
STEPS = (1, 2, 3)


def worker(workdir, process_id, port):
  from absl import flags

  flags.FLAGS.mark_as_parsed()
  import ml_collections

  from sao_jax.train import distributed

  distributed.initialize(
    ml_collections.ConfigDict(
      dict(
        enabled=True,
        coordinator_address=f"localhost:{port}",
        num_processes=2,
        process_id=process_id,
      )
    )
  )
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec

  from sao_jax.data.checkpoint import Checkpointer, abstract_like

  assert jax.process_count() == 2
  mesh = jax.make_mesh((jax.device_count(),), ("d",))
  sharding = NamedSharding(mesh, PartitionSpec("d"))
  run = Checkpointer(os.path.join(workdir, "run", "checkpoints"), name="run")
  weights = Checkpointer(os.path.join(workdir, "fleet", "weights"), name="weights")
  restored = {}
  for step in STEPS:
    for k, ckpt in enumerate((run, weights)):
      x = jax.device_put(jnp.arange(8.0) + 100 * k + step, sharding)
      ckpt.save(step, {"x": x}, {"step": step, "k": k}, force=True)
  for k, ckpt in enumerate((run, weights)):
    ckpt.wait()
    state, meta = ckpt.restore(abstract_like({"x": x}), STEPS[-1])
    got = np.asarray(
      jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, PartitionSpec()))(
        state["x"]
      ).addressable_data(0)
    )
    restored[str(k)] = {"x": got.tolist(), "meta": meta}
    ckpt.close()
  with open(os.path.join(workdir, f"worker_{process_id}.json"), "w", encoding="utf-8") as f:
    json.dump(restored, f)


def test_two_checkpointers_save_the_same_steps_at_once(tmp_path):
  port = runs.free_port()
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
    XLA_FLAGS="--xla_force_host_platform_device_count=2",
  )
  runs.run_together(
    [
      (
        f"worker_{pid}",
        [sys.executable, os.path.abspath(__file__), str(tmp_path), str(pid), str(port)],
        env,
      )
      for pid in range(2)
    ],
    tmp_path,
    HANG_GUARD_S,
  )
  for pid in range(2):
    with open(tmp_path / f"worker_{pid}.json", encoding="utf-8") as f:
      r = json.load(f)
    for k in range(2):
      assert r[str(k)]["meta"] == {"step": STEPS[-1], "k": k}
      assert r[str(k)]["x"] == [float(i + 100 * k + STEPS[-1]) for i in range(8)]


if __name__ == "__main__":
  worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
