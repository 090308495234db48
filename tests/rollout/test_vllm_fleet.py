"""A fleet rollout host on the "vllm" backend (slow; needs `make vllm-env`).

`launch/train.py` in `rl.mode = "fleet"` beside one `launch/rollout.py` with
`rollout.backend = vllm`: the rollout pulls each version on the direct path
into `VllmEngine.abstract_params()`, exports it and reloads it into its vLLM
server in place, and writes shards the trainer trains on; every trajectory
carries the trainer's run identity (none is refused), the trainer finishes
its steps and the rollout exits when it is done. About 2.5 min on 2 cores.
The log-probs' exactness on this backend is tests/rollout/test_vllm_chain.py's
and test_vllm_backend.py's.
"""

import os
import re

import pytest
import runs

from sao_jax.rollout import vllm_backend

FLAGS = (
  "--config.rl.mode=fleet",
  "--config.model.overrides={'head_dim': 32}",
  "--config.rl.steps=4",
  "--config.fleet.shard_trajectories=4",
  "--config.fleet.shard_seconds=2.0",
  "--config.fleet.poll_seconds=0.2",
)


@pytest.mark.slow
@pytest.mark.skipif(
  not os.path.exists(vllm_backend.default_python()), reason="no vLLM environment (make vllm-env)"
)
def test_a_fleet_rollout_host_on_vllm_feeds_the_trainer(tmp_path):
  workdir = str(tmp_path / "run")
  trainer = runs.command("train.py", workdir, *FLAGS)
  rollout = runs.command(
    "rollout.py", workdir, *FLAGS, "--rollout_id=r0", "--config.rollout.backend=vllm"
  )
  runs.run_together(
    [("trainer", trainer, runs.child_env()), ("rollout", rollout, runs.child_env())],
    str(tmp_path),
    timeout=900,
  )
  with open(tmp_path / "trainer.log", encoding="utf-8") as f:
    trained = f.read()
  with open(tmp_path / "rollout.log", encoding="utf-8") as f:
    rolled = f.read()
  assert "[rl] 4/4" in trained
  consumed = [int(n) for n in re.findall(r"consumed r0-\d+\.array_record: (\d+) traj", trained)]
  refused = [int(n) for n in re.findall(r"trajectories, (\d+) rejected", trained)]
  assert sum(consumed) >= 4 * 8 and not any(refused)
  swaps = re.findall(r"weights version (\d+) -> (\d+)", rolled)
  assert len(swaps) >= 2 and "the trainer is done" in rolled
  rl = runs.read_metrics(workdir, "rl")
  assert max(r["policy_lag/max"] for r in rl) >= 1  # trained on a version the server swapped in
