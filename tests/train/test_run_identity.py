"""A fleet trainer trains only on its own run's params (sao_jax/data/identity.py).

The trainer's fleet source (`sources.make_source` in `rl.mode = "fleet"`,
the checkpoint weight path) on the tiny model: what a rollout samples
carries the run id and fingerprint that came with the weights it followed;
another run's trajectories, another model's params at the same version
number, records without an identity and a killed trainer's discarded future
are refused, counted, and the rest trained on; a resumed trainer keeps its
run id and the fingerprints it published.
"""

import os
import time
import types

import jax
import numpy as np
import runs

from sao_jax.config import sections
from sao_jax.data import identity, store
from sao_jax.envs.demonstrations import demonstration_trajectory
from sao_jax.envs.python_tool import PythonTool
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import policy, precision
from sao_jax.train import factories, sources
from sao_jax.transport import fleet

TOK, ENV = CharTokenizer(), PythonTool()
HANG_GUARD_S = 120


def config():
  c = runs.load_config_module("sao_tiny.py").get_config()
  for field, value in (
    ("rl.mode", "fleet"),
    ("rollout.max_len", 256),
    ("fleet.weights_path", "checkpoint"),
    ("fleet.poll_seconds", 0.01),
  ):
    section, name = field.split(".")
    c[section][name] = value
  return sections.load(c)


def trainer(workdir, step, params, saved=None):
  """The fleet source a trainer at `step` with `params` makes (resumed from
  `saved`, a checkpoint's source state), and its state."""
  c = config()
  state = types.SimpleNamespace(step=step, policy=params)
  run = types.SimpleNamespace(
    config=c,
    workdir=workdir,
    tok=TOK,
    routing_shape=None,
    model_cfg=factories.build_model_config(c),
    state=state,
    policy_params=lambda: state.policy,
    programs=types.SimpleNamespace(lora=None),  # a full-model run: versions are its params
  )
  return sources.make_source(run, saved), state


def train(src, state, params):
  """One actor update: the next version, published."""
  state.step, state.policy = state.step + 1, params
  src.publish(params, state.step)


def served(params):
  """The params as the trainer publishes them (the compute dtype)."""
  return precision.cast_for_serving(factories.build_model_config(config()), params)


def rollout_sees(root, version):
  """The weights meta of `version`, as a rollout's follower restores it,
  once the trainer's asynchronous save of it has committed."""
  deadline = time.time() + HANG_GUARD_S
  while True:
    versions = fleet.committed_checkpoints(fleet.weights_dir(root))
    if version in versions:
      return versions[version]
    assert time.time() < deadline, f"hang guard: version {version} never committed"
    time.sleep(0.01)


def sampled(i, version, meta):
  """Prompt `i`'s trajectory sampled at `version` by a rollout holding the
  version whose weights came with `meta`."""
  t = demonstration_trajectory(ENV, ENV.task(i), TOK)
  t.policy_version = np.where(t.action_mask, version, -1).astype(np.int32)
  t.rollout_logprobs = np.where(t.action_mask, -0.5, 0).astype(np.float32)
  ledger = identity.Ledger()
  ledger.note(version, meta)
  return ledger.stamp(t)


def write(root, rollout_id, seq, trajs):
  path = os.path.join(fleet.trajectories_dir(root), fleet.shard_name(rollout_id, seq))
  with store.TrajectoryWriter(path) as w:
    for t in trajs:
      w.write(t)


def test_fleet_trainer_refuses_other_runs_and_params_and_resumes_its_identity(tmp_path):
  workdir = str(tmp_path)
  root = os.path.join(workdir, "fleet")
  model_cfg = factories.build_model_config(config())
  params = policy.init_params(model_cfg, jax.random.key(0))
  src, state = trainer(workdir, 0, params)
  run_id = identity.run_id(workdir)
  v0 = rollout_sees(root, 0)
  assert v0["run_id"] == run_id and v0["fingerprint"] == identity.fingerprint(served(params))

  # Another model served at "version 0", another run's rollouts (the same
  # params, even), and a record without an identity (an old one, or an
  # endpoint serving params of its own).
  other_model = identity.fingerprint(served(policy.init_params(model_cfg, jax.random.key(1))))
  write(root, "r0", 0, [sampled(0, 0, v0), sampled(1, 0, v0)])
  write(
    root,
    "stranger",
    0,
    [
      sampled(10, 0, {"run_id": run_id, "fingerprint": other_model}),
      sampled(11, 0, dict(v0, run_id="another_run")),
      sampled(12, 0, None),
    ],
  )
  write(root, "r0", 1, [sampled(2, 0, v0)])
  taken = src.take(3)
  assert sorted(t.prompt_id for t in taken) == [0, 1, 2]
  assert all(t.run_id == run_id for t in taken)
  assert src.report().rejected == {"other_params": 1, "other_run": 1, "missing_run_id": 1}

  # Versions 1 (checkpointed with the source's state) and 2 (a future the
  # killed trainer discards) are published and sampled.
  p1 = jax.tree.map(lambda x: x * 0.5, params)
  train(src, state, p1)
  saved = src.state()
  train(src, state, jax.tree.map(lambda x: x * 0.25, params))
  dead_v2 = rollout_sees(root, 2)
  write(root, "r0", 2, [sampled(3, 1, rollout_sees(root, 1)), sampled(4, 2, dead_v2)])
  src.close(finished=False)

  # The trainer resumes at version 1, republishes it, and trains a new version 2.
  src, state = trainer(workdir, 1, p1, saved)
  assert identity.run_id(workdir) == run_id
  assert rollout_sees(root, 1)["run_id"] == run_id
  train(src, state, jax.tree.map(lambda x: x * 0.3, params))
  new_v2 = rollout_sees(root, 2)
  assert new_v2["fingerprint"] != dead_v2["fingerprint"]
  write(root, "r0", 3, [sampled(5, 0, v0), sampled(6, 2, new_v2)])
  assert sorted(t.prompt_id for t in src.take(3)) == [3, 5, 6]
  assert src.report().rejected == {"other_params": 1}  # the dead version 2's
  src.close(finished=True)
