"""LoRA in training (config section `lora`): adapters only train, checkpoint and resume.

The default run checks the programs (shapes only) and one real SFT step of
the adapters; the slow test runs the real trainer end to end with LoRA on
and resumes it, then refuses a resume on another base.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from runs import launch, load_config_module, read_metrics
from test_trainer import CFG, demo_trajs

from sao_jax.algo import optim
from sao_jax.config import sections
from sao_jax.data import packing
from sao_jax.data.checkpoint import check_lora_base
from sao_jax.models import lora, policy, sharding
from sao_jax.train import factories
from sao_jax.train.train_step import Adapters, make_sft_step

ACTOR = lora.LoraConfig(4, 8.0, sections.LORA_ACTOR_TARGETS)


def _flat(tree):
  return {optim.param_path(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _programs(mesh_shape=None, **lora_fields):
  c = load_config_module("sao_tiny.py").get_config()
  c.lora.enabled = True
  c.lora.rank = 4
  c.rl.actor_frozen = (r"/moe/router$",)
  for k, v in lora_fields.items():
    c.lora[k] = v
  if mesh_shape:  # the pod's placement rules (configs/sao_moe.py) on 8 simulated devices
    from configs import sao_moe

    c.sharding.mesh, c.sharding.rules = mesh_shape, sao_moe.POD_RULES
  typed = sections.load(c)
  mesh = (
    sharding.make_mesh(mesh_shape, devices=jax.devices()[:8])
    if mesh_shape
    else sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  )
  model_cfg = factories.build_model_config(typed)
  return factories.build_programs(typed, model_cfg, factories.step_config(typed), mesh)


def test_each_adapter_is_laid_out_like_its_weight():
  """On fsdp x expert x tensor, no adapter is replicated where its weight is
  sharded: the experts' A and B split their expert axis as the experts do, A
  its input rows and B its output columns as the weight does; the Adam
  moments follow (sao_moe's replicated expert adapters held 3x full
  fine-tuning's state a chip)."""
  progs = _programs({"data": 1, "fsdp": 2, "expert": 2, "tensor": 2})
  base = _flat(progs.policy_shardings)
  state = progs.state_shardings
  for tree in (state.policy, state.critic):
    adapters = _flat(tree)
    assert adapters
    for name, sh in adapters.items():
      if not name.endswith(("/lora_a", "/lora_b")):
        continue
      w = base.get(name.rsplit("/", 1)[0])
      if w is None:  # the critic's value head's neighbours: its own trunk's paths
        continue
      spec = tuple(w.spec) + (None,) * 8
      got = tuple(sh.spec) + (None,) * 8
      moe = "/moe/" in name and "router" not in name
      lead = int(moe) + int(name.startswith("layers/"))  # the weight's batch axes
      assert got[:lead] == spec[:lead], (name, sh.spec, w.spec)
      if moe:  # the experts' axis, split as the experts are
        assert got[lead - 1] == "expert", (name, sh.spec, w.spec)
      if name.endswith("/lora_a"):  # [*batch, in, r]: its rows as the weight's
        assert got[lead] == spec[lead] and got[lead + 1] is None, (name, sh.spec, w.spec)
      else:  # [*batch, r, out]
        assert got[lead] is None, (name, sh.spec, w.spec)
  moments = [x for x in jax.tree.leaves(state.policy_opt) if hasattr(x, "spec")]
  assert any(any(a is not None for a in m.spec) for m in moments)


def test_the_state_holds_adapters_and_their_moments_only():
  """With lora on, the state (what a checkpoint holds) is the adapters: the
  actor's over attention and experts (no router: rl.actor_frozen wins), the
  critic's carrying the actor's targets plus its whole value head; Adam's
  moments are the adapters' size; the critic trains only its MoE adapters and
  value head (the carried attention adapters are frozen)."""
  p = _programs()
  s = p.abstract_state
  actor, critic = _flat(s.policy), _flat(s.critic)
  assert all(n.endswith(("/lora_a", "/lora_b")) for n in actor)
  assert not any("router" in n or "norm" in n or "embed" in n for n in actor)
  assert {"value_head", "value_bias"} <= set(critic)
  size = lambda t: sum(x.size for x in jax.tree.leaves(t))
  assert size(s.policy_opt) == 2 * size(s.policy) + 2  # mu, nu (+ two step counts)
  assert size(s.policy) < size(jax.eval_shape(p.policy_init)) / 4
  labels = _flat(
    optim.partition_labels(
      s.critic,
      factories._critic_rules(
        sections.load(_config_with_freeze()), sections.Lora(enabled=True), p.lora, s.critic
      ),
    )
  )
  assert labels["layer_0/attn/q/lora_a"] == optim.FREEZE
  assert labels["layer_0/moe/wo/lora_b"] == optim.TRAIN and labels["value_head"] == optim.TRAIN


def _config_with_freeze():
  c = load_config_module("sao_tiny.py").get_config()
  c.rl.freeze_critic_attention = True
  return c


def test_bad_lora_settings_are_refused_in_one_line():
  with pytest.raises(sections.ConfigError, match="lora.dropout"):
    sections.Lora(dropout=0.1)
  with pytest.raises(sections.ConfigError, match="lora targets"):
    _programs(actor_targets=(r"/mlp/no_such$",))


def test_an_sft_step_moves_the_adapters_and_never_the_base():
  """SFT on adapters over a frozen base: the base passed in comes back
  untouched (it is not even an output), the adapters' B leaves the zero
  start (after the warmup's lr-0 step), and the merged model moves."""
  base = policy.init_params(CFG, jax.random.key(0))
  adapters = lora.init_adapters(base, ACTOR, jax.random.key(1))
  tx = optim.make_optimizer(adapters, optim.warmup_cosine(1e-2, 1, 10))
  step = jax.jit(make_sft_step(CFG, tx, adapters=Adapters(ACTOR, ACTOR)))
  before = _flat(base)
  batch = packing.pack(demo_trajs(4), 4, (128,))
  ad, opt = adapters, tx.init(adapters)
  for _ in range(2):
    ad, opt, m = step(ad, opt, batch, (base, None))
    assert np.isfinite(float(m["sft/nll"]))
  assert all(np.array_equal(before[n], x) for n, x in _flat(base).items())
  assert float(jnp.abs(_flat(ad)["layer_0/attn/q/lora_b"]).max()) > 0
  merged = _flat(lora.merge(base, ad, ACTOR))
  assert not np.array_equal(merged["layer_0/attn/q"], before["layer_0/attn/q"])
  np.testing.assert_array_equal(merged["layer_0/moe/router"], before["layer_0/moe/router"])


def test_a_resume_on_another_base_is_refused():
  check_lora_base({"lora_base": "ab"}, 3, "ab", "/w")
  check_lora_base({}, 3, None, "/w")  # a full run's checkpoint written before LoRA existed
  with pytest.raises(sections.ConfigError, match="another base"):
    check_lora_base({"lora_base": "ab"}, 3, "cd", "/w")
  with pytest.raises(sections.ConfigError, match="full model's state"):
    check_lora_base({"lora_base": None}, 3, "cd", "/w")
  with pytest.raises(sections.ConfigError, match="LoRA adapters only"):
    check_lora_base({"lora_base": "ab"}, 3, None, "/w")


LORA = ("--config.lora.enabled=True", "--config.lora.rank=4")


@pytest.mark.slow
def test_a_lora_run_trains_resumes_and_refuses_another_base(tmp_path):
  """SFT -> value pretraining -> RL with adapters, on the real trainer: it
  finishes, its checkpoints hold the adapters only, a second launch resumes,
  and a launch with another seed (another random base) is refused."""
  workdir = str(tmp_path / "lora")
  out = launch(workdir, *LORA)
  summary = json.load(open(os.path.join(workdir, "summary.json"), encoding="utf-8"))
  assert summary["rl_steps"] == 6 and "[done]" in out
  rl = read_metrics(workdir, "rl")
  assert all(np.isfinite(r["policy/loss"]) for r in rl)
  assert all(np.isfinite(r["critic/value_loss"]) for r in rl)
  out2 = launch(workdir, *LORA, "--config.rl.steps=8")
  assert "Resumed from checkpoint" in out2
  out3 = launch(workdir, *LORA, "--config.seed=1", check=False)
  assert "LoRA adapters trained on another base" in out3


def _tiny_config(**fields):
  c = load_config_module("sao_tiny.py").get_config()
  c.tensorboard = False
  for dotted, v in fields.items():  # section__field, or a top-level field
    section, _, name = dotted.rpartition("__")
    (c[section] if section else c)[name] = v
  return c


def test_a_run_starts_from_another_runs_policy(tmp_path):
  """sft.init_from_run: a full run's checkpointed policy becomes, bit for bit,
  another full run's starting policy and a LoRA run's frozen base (its served
  params at step 0, the adapters' B being zero); a LoRA source, a source with
  no checkpoint and a second starting point are refused in one line."""
  from sao_jax.train import configuration
  from sao_jax.train import run as run_lib

  source_dir = str(tmp_path / "source")
  source = run_lib.open_workdir(run_lib.build(_tiny_config(seed=0)), source_dir)
  # Move the policy off its initialisation, so a fresh init could not pass.
  source.state = source.state.replace(
    policy=jax.tree.map(lambda x: x + 0.25 if x.dtype == jnp.float32 else x, source.state.policy)
  )
  source.save(force=True)
  source.close()
  want = _flat(source.state.policy)

  full = run_lib.build(_tiny_config(seed=1, sft__init_from_run=source_dir))
  got = _flat(full.state.policy)
  assert got.keys() == want.keys()
  assert all(np.array_equal(got[k], want[k]) for k in want)
  assert full.meta["init_from_run"] == f"{source_dir}@1"  # pinned: what a resume reads again
  adapted = run_lib.build(
    _tiny_config(seed=1, sft__init_from_run=source_dir, lora__enabled=True, lora__rank=4)
  )
  served = _flat(adapted.policy_params())
  assert all(np.array_equal(served[k], want[k]) for k in want)

  with pytest.raises(configuration.ConfigError, match="no complete checkpoint"):
    run_lib.build(_tiny_config(sft__init_from_run=str(tmp_path / "none")))
  with pytest.raises(configuration.ConfigError, match=r"no complete checkpoint 2 .*\[1\]"):
    run_lib.run_source(f"{source_dir}@2")
  lora_dir = str(tmp_path / "lora_source")
  lora_run = run_lib.open_workdir(adapted, lora_dir)
  lora_run.save(force=True)
  lora_run.close()
  with pytest.raises(configuration.ConfigError, match="trained LoRA adapters"):
    run_lib.build(_tiny_config(sft__init_from_run=lora_dir))
  with pytest.raises(configuration.ConfigError, match="one starting policy"):
    configuration.validate(_tiny_config(sft__init_from_run=source_dir, sft__init_from_hf="/x"))


class _Versions:
  """A channel's follower handing out the given (adapters, version, meta)."""

  def __init__(self, *versions):
    self._versions, self.version = list(versions), None

  def poll(self, final=False):
    del final
    got = self._versions.pop(0) if self._versions else None
    if got is not None:
      self.version = got[1]
    return got


def test_a_rollout_merges_adapter_versions_and_refuses_another_base():
  """fleet_worker.AdapterVersions: a version (the adapters) comes back
  merged by the function it was given; one trained on another base, or
  carrying no base, stops the rollout in one line; the rest is the inner
  follower's."""
  from sao_jax.train.fleet_worker import AdapterVersions
  from sao_jax.train.stopping import StopTraining

  cfg = lora.LoraConfig(2, 4.0, (r"/w$",))
  base = {"layer_0": {"w": jnp.linspace(-1.0, 1.0, 24).reshape(4, 6), "scale": jnp.ones(6)}}
  ad = jax.tree.map(lambda x: x + 0.25, lora.init_adapters(base, cfg, jax.random.key(1)))
  merge = jax.jit(lambda a: lora.merge(base, a, cfg))
  inner = _Versions(None, (ad, 1, {"lora_base": "f0"}), (ad, 2, {"lora_base": "f1"}), (ad, 3, {}))
  follower = AdapterVersions(inner, merge, "f0", "seed 0")
  assert follower.poll() is None
  served, version, meta = follower.poll()
  assert (version, meta, follower.version) == (1, {"lora_base": "f0"}, 1)
  w = base["layer_0"]["w"] + 2.0 * ad["layer_0"]["w"]["lora_a"] @ ad["layer_0"]["w"]["lora_b"]
  np.testing.assert_allclose(served["layer_0"]["w"], w, rtol=1e-6)
  np.testing.assert_array_equal(served["layer_0"]["scale"], base["layer_0"]["scale"])
  for theirs in ("f1", "None"):
    with pytest.raises(StopTraining) as e:
      follower.poll()
    assert str(e.value).startswith(f"LoRA weights version {2 if theirs == 'f1' else 3} ")
    assert f"trained on base {theirs}, this rollout built base f0 from seed 0" in str(e.value)
