"""Multi-host training: 2 CPU processes (gloo) against 1 process, same 8 devices.

Two processes with 4 simulated CPU devices each join over a localhost
coordinator (sao_jax/train/distributed.py) and run the real trainer's SFT and
value-pretraining stages on one global mesh; a third process runs the same
stages with 8 devices of its own. The per-step losses must agree to 1e-5,
and what the two processes checkpointed together must restore, in both,
to the very arrays they saved.

The mesh is {data 2, fsdp 4} with the batch over ("fsdp", "data") and the
embedding over fsdp: each process then holds the non-contiguous rows
{0, 2, 4, 6} or {1, 3, 5, 7} of a batch and a shard of every embedding,
so the test fails if a process packs the wrong rows or if a collective is
missing. Value pretraining reads demonstrations from the trajectory store
instead of generating (no rollout engine), and evaluation is stubbed.

The workers are this file run as a script: `python test_multihost.py
WORKDIR NUM_PROCESSES PROCESS_ID PORT`.
"""

import json
import os
import sys

import numpy as np
import runs as run_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICES = 8
HANG_GUARD_S = 600  # a hang guard only: the whole test takes about a minute


# ------------------------------------------------------------------ worker
def _config(num_processes, process_id, port):
  from configs import sao_tiny

  c = sao_tiny.get_config()
  c.distributed.enabled = num_processes > 1
  c.distributed.coordinator_address = f"localhost:{port}" if num_processes > 1 else ""
  c.distributed.num_processes = num_processes if num_processes > 1 else 0
  c.distributed.process_id = process_id if num_processes > 1 else -1
  c.sharding.mesh = {"data": 2, "fsdp": 4}
  rules = dict(c.sharding.rules)
  rules.update(batch=("fsdp", "data"), embed="fsdp")
  c.sharding.rules = tuple(rules.items())
  c.tensorboard = False
  c.data.buckets = (256,)  # one width: one compile per step function
  c.log_every = 1
  c.sft.steps, c.sft.batch_size, c.sft.warmup = 3, 8, 1
  c.value_pretrain.steps = 3
  c.rl.batch_size, c.rl.steps = 8, 0  # in-process RL is refused on several processes
  c.checkpoint.every = 2
  c.checkpoint.min_free_gb = 0.0
  return c


def _fingerprint(tree):
  """Per-leaf sums in float64, read from each process's own shards' gather."""
  import jax
  import jax.numpy as jnp

  sums = jax.jit(lambda t: jax.tree.map(lambda x: jnp.sum(x.astype(jnp.float32)), t))(tree)
  return [float(np.asarray(s.addressable_data(0))) for s in jax.tree.leaves(sums)]


def worker(workdir, num_processes, process_id, port):
  """One process of a run: SFT and value pretraining, then a restore."""
  config = _config(num_processes, process_id, port)
  from absl import flags

  flags.FLAGS.mark_as_parsed()  # as absl.app does in launch/train.py
  from sao_jax.train import distributed

  distributed.initialize(config.distributed)
  import jax

  from sao_jax.data import store
  from sao_jax.data.checkpoint import Checkpointer, abstract_like
  from sao_jax.envs import demonstrations, registry
  from sao_jax.train import stages, trainer

  assert jax.process_count() == num_processes and jax.device_count() == DEVICES

  # The value-pretraining store, written once (by process 0) for all.
  shard = os.path.join(workdir, "trajectories", "value_pretrain.array_record")

  def write_store():
    env, tok = registry.make_env(config.env), registry.make_tokenizer(config.env)
    with store.TrajectoryWriter(shard) as writer:
      for i in range(24):
        t = demonstrations.demonstration_trajectory(env, env.task(i), tok)
        if i % 3 == 0:
          t.rewards[:] = 0.0  # failures too, so returns vary
        writer.write(t)
    return 24

  assert distributed.share_from_primary("write_store", write_store) == 24

  run = trainer.load_run(config, workdir)
  run.evaluate = lambda name, params: {"pass@1": 0.0}
  rows = distributed.process_rows(run.batch_sharding, 8).tolist()
  stages.sft(run)
  # Evaluation's gather: the whole policy on this process's first device.
  local = distributed.host_local_copy(run.state.policy, run.mesh)
  local_sums = [float(np.sum(np.asarray(x, np.float64))) for x in jax.tree.leaves(local)]
  run.meta["value_store_done"] = True
  stages.value_pretrain(run)
  saved = _fingerprint(run.state)
  run.close()
  # A fresh checkpointer on the workdir (what a resumed run restores with)
  # reads back what the processes saved together.
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
  state, meta = ckpt.restore(abstract_like(run.state))
  restored = _fingerprint(state)
  ckpt.close()
  out = {
    "rows": rows,
    "saved": saved,
    "restored": restored,
    "stage": meta["stage"],
    "policy_sums": _fingerprint(run.state.policy),
    "local_sums": local_sums,
  }
  with open(os.path.join(workdir, f"worker_{process_id}.json"), "w", encoding="utf-8") as f:
    json.dump(out, f)


# ------------------------------------------------------------------ tests
def _demos(n):
  from sao_jax.envs import demonstrations, python_tool, tokenizer

  env, tok = python_tool.PythonTool(), tokenizer.CharTokenizer()
  return [demonstrations.demonstration_trajectory(env, env.task(i), tok) for i in range(n)]


def test_host_rows_are_rows_of_the_whole_batch():
  """A host's rows are those rows of the batch packed whole (same layout and L)."""
  from sao_jax.data import packing

  trajs = _demos(12)  # 12 trajectories in 8 rows: some rows hold two
  full = packing.pack(trajs, 8, (64, 128, 256))
  for rows in ([1, 3, 5, 7], [4, 5, 6, 7], [2]):
    part = packing.pack(trajs, 8, (64, 128, 256), row_ids=rows)
    for key in packing.FIELDS:
      np.testing.assert_array_equal(part[key], full[key][rows], err_msg=key)


def test_single_process_batch_is_the_device_put_batch():
  import jax

  from sao_jax.data import packing
  from sao_jax.models import sharding
  from sao_jax.train import distributed

  mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("fsdp", "data"), None))
  assert distributed.process_rows(spec, 8).tolist() == list(range(8))
  trajs = _demos(8)
  full = packing.pack(trajs, 8, (64, 128, 256))
  for batch in (
    distributed.pack_batch(trajs, 8, (64, 128, 256), spec),
    distributed.global_batch(full, spec, 8),
  ):
    for key in packing.FIELDS:
      assert batch[key].sharding == spec
      np.testing.assert_array_equal(np.asarray(batch[key]), full[key], err_msg=key)


def test_config_checks():
  import pytest

  from sao_jax.train import configuration, distributed

  c = _config(1, 0, 0)
  c.rl.steps = 5
  configuration.validate(c, num_devices=DEVICES, num_processes=1)
  # The in-process rollout's order differs between hosts: refused, not wrong.
  with pytest.raises(
    configuration.ConfigError, match=r"^rl.mode = 'async' with 2 processes.*fleet"
  ):
    configuration.validate(c, num_devices=DEVICES, num_processes=2)
  c.rl.steps = 0
  configuration.validate(c, num_devices=DEVICES, num_processes=2)
  c.distributed.num_processes, c.distributed.process_id = 2, 2
  with pytest.raises(configuration.ConfigError, match=r"^distributed.process_id = 2: must be < "):
    distributed.initialize(c.distributed)
  c.distributed.process_id = -2
  with pytest.raises(configuration.ConfigError, match=r"^distributed.process_id = -2"):
    configuration.validate(c, num_devices=DEVICES, num_processes=1)
  c.distributed.process_id = 0
  assert distributed.initialize(c.distributed) is False  # enabled is off: a no-op


def _job(name, workdir, num_processes, process_id, port):
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
    XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES // num_processes}",
  )
  return (
    f"{name}_{process_id}",
    [
      sys.executable,
      os.path.abspath(__file__),
      workdir,
      str(num_processes),
      str(process_id),
      str(port),
    ],
    env,
  )


def _losses(workdir):
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    for line in f:
      r = json.loads(line)
      key = (r["stage"], r["step"])
      assert key not in out, f"{key} logged twice: only process 0 writes metrics"
      out[key] = r.get("sft/nll", r.get("critic/value_loss"))
  return out


def test_two_processes_match_one(tmp_path):
  runs = {"multi": (2, str(tmp_path / "multi")), "single": (1, str(tmp_path / "single"))}
  jobs = []
  for name, (n, workdir) in runs.items():
    os.makedirs(workdir)
    port = run_lib.free_port()
    jobs += [_job(name, workdir, n, pid, port) for pid in range(n)]
  run_lib.run_together(jobs, tmp_path, HANG_GUARD_S)

  multi, single = _losses(runs["multi"][1]), _losses(runs["single"][1])
  expected = [("sft", s) for s in (1, 2, 3)] + [("value_pretrain", s) for s in (1, 2, 3)]
  assert sorted(multi) == sorted(single) == sorted(expected)
  for key in expected:
    np.testing.assert_allclose(multi[key], single[key], rtol=1e-5, atol=1e-5, err_msg=str(key))
  assert multi[("sft", 3)] < multi[("sft", 1)]  # it trained

  w = [
    json.load(open(os.path.join(runs["multi"][1], f"worker_{i}.json"), encoding="utf-8"))
    for i in range(2)
  ]
  ref = json.load(open(os.path.join(runs["single"][1], "worker_0.json"), encoding="utf-8"))
  # Batch over ("fsdp", "data"): process 0 holds the even rows, process 1 the odd.
  assert w[0]["rows"] == [0, 2, 4, 6] and w[1]["rows"] == [1, 3, 5, 7]
  assert ref["rows"] == list(range(8))
  for r in w:
    # The checkpoint both processes wrote restores, in each, to what was saved.
    assert r["stage"] == "rl"
    assert r["restored"] == r["saved"]
    np.testing.assert_allclose(r["policy_sums"], ref["policy_sums"], rtol=1e-4, atol=1e-5)
    # Each process's gathered copy is the whole policy.
    np.testing.assert_allclose(r["local_sums"], w[0]["local_sums"], rtol=0, atol=0)
  np.testing.assert_allclose(w[0]["local_sums"], ref["local_sums"], rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
  worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
