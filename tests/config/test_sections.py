"""Typed config sections: one declaration per field, checked on construction."""

import dataclasses

import pytest
from runs import load_config_module

from sao_jax.algo import advantages
from sao_jax.config import sections
from sao_jax.train import configuration


@pytest.mark.parametrize("name", sorted(sections.SECTIONS))
def test_every_field_is_documented_and_its_default_passes_its_check(name):
  cls = sections.SECTIONS[name]
  record = cls()  # the defaults construct: every check passes on them
  for f in dataclasses.fields(cls):
    assert f.metadata["doc"].strip(), f"{name}.{f.name} has no documentation"
    assert f.metadata["check"] is not None, f"{name}.{f.name} has no check"
  assert cls.from_config(cls.defaults()) == record


def test_common_config_is_built_from_the_sections():
  c = load_config_module("sao_tiny.py").get_config()
  typed = sections.load(c)
  for name, cls in sections.SECTIONS.items():
    assert set(c[name].keys()) == {f.name for f in dataclasses.fields(cls)}, name
    assert isinstance(getattr(typed, name), cls)
  assert typed.rollout.max_len == c.rollout.max_len and typed.rl.policy_loss == c.rl.policy_loss


@pytest.mark.parametrize(
  "section,changes,message",
  [
    (sections.Rollout, {"slots": 0}, r"^rollout.slots = 0: must be an integer >= 1$"),
    (sections.Rollout, {"slots": True}, r"rollout.slots = True: must be an integer"),
    (
      sections.Rollout,
      {"kv_cache": "ragged"},
      r"rollout.kv_cache = 'ragged': must be one of \('dense', 'paged'\)",
    ),
    (
      sections.Rollout,
      {"kv_cache": "paged", "page_size": 7, "max_len": 64},
      r"rollout.page_size = 7: must be a divisor of rollout.max_len \(64\)",
    ),
    (sections.Rollout, {"env_timeout": 0}, r"rollout.env_timeout = 0: must be None"),
    (sections.Rollout, {"temperature": float("nan")}, r"rollout.temperature = nan"),
    (sections.RL, {"eps_low": 2.0}, r"^rl.eps_low = 2.0: must be in \(0, 1\)$"),
    (sections.RL, {"advantage": "gae"}, r"rl.advantage = 'gae': must be one of \["),
    (sections.RL, {"critic_lam": 1.5}, r"rl.critic_lam = 1.5: must be None or in \[0, 1\]"),
    (
      sections.RL,
      {"advantage": "value", "critic_updates": 0},
      r"rl.critic_updates = 0: must be >= 1 with rl.advantage = 'value'",
    ),
    (sections.Data, {"buckets": (128, 64)}, r"data.buckets = \(128, 64\): must be a non-empty"),
    (sections.Fleet, {"keep_versions": 1}, r"fleet.keep_versions = 1: must be an integer >= 2"),
    (
      sections.Distributed,
      {"num_processes": 2, "process_id": 2},
      r"distributed.process_id = 2: must be < distributed.num_processes \(2\)",
    ),
  ],
)
def test_a_bad_field_fails_in_one_line_naming_it(section, changes, message):
  with pytest.raises(sections.ConfigError, match=message):
    section(**changes)
  with pytest.raises(sections.ConfigError, match=message):  # replace checks again
    section().replace(**changes)


def test_records_are_frozen():
  r = sections.Rollout()
  with pytest.raises(dataclasses.FrozenInstanceError):
    r.slots = 3
  assert r.replace(slots=3).slots == 3 and r.slots == 16


def test_a_missing_field_names_common_py():
  c = load_config_module("sao_tiny.py").get_config().to_dict()
  del c["rollout"]["decode_steps"]
  with pytest.raises(sections.ConfigError, match="rollout.decode_steps: missing; configs derive"):
    sections.load(c)


def test_registries_are_read_when_checked(monkeypatch):
  """A registered estimator is a valid rl.advantage without touching sections.py."""
  with pytest.raises(sections.ConfigError, match="rl.advantage = 'mine'"):
    sections.RL(advantage="mine")
  monkeypatch.setitem(advantages.ESTIMATORS, "mine", advantages.ESTIMATORS["group"])
  assert sections.RL(advantage="mine").advantage == "mine"


def test_validate_reports_section_errors_and_cross_section_rules():
  c = load_config_module("sao_tiny.py").get_config()
  c.rollout.env_workers = 0
  with pytest.raises(configuration.ConfigError, match=r"^rollout.env_workers = 0"):
    configuration.validate(c, num_devices=8)
  c = load_config_module("sao_tiny.py").get_config()
  c.rollout.max_turn_tokens = c.rollout.max_len
  with pytest.raises(
    configuration.ConfigError, match="rollout.max_turn_tokens .* < rollout.max_len"
  ):
    configuration.validate(c, num_devices=8)


def test_the_factories_hand_the_section_whole(tmp_path):
  import jax

  from sao_jax.envs import registry
  from sao_jax.models import policy
  from sao_jax.train import factories

  c = load_config_module("sao_tiny.py").get_config()
  c.rollout.decode_steps = 3
  model_cfg = factories.build_model_config(c)
  params = policy.init_params(model_cfg, jax.random.key(0))
  engine = factories.make_engine(c, model_cfg, params, slots=4, temperature=0.5)
  assert engine.rollout == sections.rollout(c).replace(slots=4, temperature=0.5)
  assert engine.max_concurrent_decodes == 4 and engine.sampling.temperature == 0.5
  tok = registry.make_tokenizer(c.env)
  driver = factories.make_driver(c, engine, registry.make_env(c.env), tok, iter(()), None)
  assert driver.rollout is engine.rollout and driver.decode_steps == 3
  driver.stop()


@pytest.mark.parametrize(
  "text,axes",
  [
    ("expert:2,tensor:2", {"expert": 2, "tensor": 2}),
    (" data : -1 , tensor : 4 ", {"data": -1, "tensor": 4}),
    ("data:8", {"data": 8}),
  ],
)
def test_a_mesh_on_one_line_parses(text, axes):
  assert sections.parse_mesh(text) == axes
  assert sections.Rollout(mesh=text).mesh == text


@pytest.mark.parametrize(
  "text,why",
  [
    ("expert=2", "write AXIS:SIZE"),
    ("data:two", "not an integer"),
    ("data:0", "has size 0"),
    ("data:-1,tensor:-1", "at most one axis may be -1"),
    ("data:2,data:2", "appears twice"),
    (":2", "write AXIS:SIZE"),
    ("tensr:2", "'tensr' is not one of"),
  ],
)
def test_a_bad_mesh_is_refused_naming_the_field(text, why):
  with pytest.raises(sections.ConfigError, match=why):
    sections.parse_mesh(text)
  with pytest.raises(sections.ConfigError, match=rf"rollout\.mesh = '{text}': .*{why}"):
    sections.Rollout(mesh=text)


@pytest.mark.parametrize("buckets", [(), (8, 8), (16, 8), (0, 8), [8, 16], (8.0,)])
def test_prefill_buckets_are_an_increasing_tuple(buckets):
  with pytest.raises(sections.ConfigError, match="rollout.prefill_buckets"):
    sections.Rollout(prefill_buckets=buckets)


def test_the_engine_mesh_comes_from_the_rollout_section():
  """`factories.engine_mesh`: rollout.mesh over the host's first devices (or all
  with -1); else the trainer's mesh or data:-1 with sharded_engine; else none."""
  import jax

  from sao_jax.models import sharding
  from sao_jax.train import factories

  devices = jax.devices()
  assert len(devices) == 8  # tests/conftest.py: 8 simulated CPU devices
  r = sections.Rollout()
  assert factories.engine_mesh(r, devices) is None
  trainer = sharding.make_mesh({"data": 2, "fsdp": 4}, devices)
  sharded = r.replace(sharded_engine=True)
  assert factories.engine_mesh(sharded, devices, trainer_mesh=trainer) is trainer
  assert dict(factories.engine_mesh(sharded, devices).shape) == {"data": 8}
  # Evaluation and serving give no devices: one device, as before rollout.mesh.
  assert factories.engine_mesh(sharded) is None
  own = factories.engine_mesh(
    sharded.replace(mesh="expert:2,tensor:2"), devices, trainer_mesh=trainer
  )
  assert dict(own.shape) == {"expert": 2, "tensor": 2}
  assert list(own.devices.flat) == devices[:4]  # the host's first devices
  rest = factories.engine_mesh(r.replace(mesh="data:-1,tensor:2"), devices)
  assert dict(rest.shape) == {"data": 4, "tensor": 2}
  with pytest.raises(sections.ConfigError, match=r"rollout.mesh = 'data:16'.*needs 16"):
    factories.engine_mesh(r.replace(mesh="data:16"), devices)
  with pytest.raises(sections.ConfigError, match=r"rollout.mesh = 'data:-1,tensor:3'"):
    factories.engine_mesh(r.replace(mesh="data:-1,tensor:3"), devices)


def test_make_engine_lays_the_engine_on_the_sections_mesh_with_its_buckets():
  import jax

  from sao_jax.models import policy
  from sao_jax.train import factories

  c = load_config_module("sao_tiny.py").get_config()
  c.rollout.mesh = "data:2"
  c.rollout.prefill_buckets = (4, 32, 1024)
  model_cfg = factories.build_model_config(c)
  params = policy.init_params(model_cfg, jax.random.key(0))
  engine = factories.make_engine(c, model_cfg, params, slots=4)
  assert dict(engine.mesh.shape) == {"data": 2}
  assert engine.page_groups == 2  # the slots split over the engine's own mesh
  assert engine.prefill_buckets == (4, 32, c.rollout.max_len)  # max_len closes the list
  assert {d for x in jax.tree.leaves(engine.params) for d in x.devices()} == set(jax.devices()[:2])


@pytest.mark.parametrize(
  "section,field,value,why",
  [
    ("model", "preset", "huge", r"model.preset = 'huge': must be one of \["),
    ("model", "overrides", {"num_layerz": 3}, r"model.overrides = .*not \['num_layerz'\]"),
    ("model", "compute_dtype", "float8", r"model.compute_dtype = 'float8'"),
    ("env", "name", "", r"env.name = '': must be a non-empty string"),
    ("env", "tool_latency_s", -1.0, r"env.tool_latency_s = -1.0"),
    ("sharding", "mesh", {"data": 0}, r"sharding.mesh = .*size >= 1"),
    ("sharding", "mesh", {"data": -1, "fsdp": -1}, r"at most one size"),
    ("sharding", "rules", (("batch",),), r"sharding.rules = .*pairs"),
  ],
)
def test_model_env_and_sharding_check_themselves(section, field, value, why):
  c = load_config_module("sao_tiny.py").get_config()
  with c.unlocked():
    c[section][field] = value
  with pytest.raises(sections.ConfigError, match=why):
    sections.load(c)
  with pytest.raises(sections.ConfigError, match=why):
    configuration.validate(c, num_devices=8)


@pytest.mark.parametrize(
  "field,value,why",
  [
    ("name", "no_such_env", r"no_such_env"),
    ("chat_format", "chatml", r"env.chat_format = 'chatml': must be one of"),
    ("sandbox", {"cpu_secs": 1}, r"env.sandbox = .*SandboxLimits fields"),
    ("tokenizer", "gpt2", r"env.tokenizer = 'gpt2'"),
  ],
)
def test_env_names_are_checked_by_the_envs_layer(field, value, why):
  """The env section checks its fields' types; the names it holds are the
  registry's to check (the config layer sits below envs), before any stage."""
  from sao_jax.envs import registry

  c = load_config_module("sao_tiny.py").get_config()
  with c.unlocked():
    c.env[field] = value
  env = sections.load(c).env  # a well-typed section
  with pytest.raises(sections.ConfigError, match=why):
    registry.check_env_section(env)
  with pytest.raises(sections.ConfigError, match=why):
    configuration.validate(c, num_devices=8)


def test_dict_fields_are_fresh_for_each_record():
  a, b = sections.Model(), sections.Model()
  assert a.overrides == {} and a.overrides is not b.overrides
  assert hash(a) == hash(b)  # dict fields stay out of the hash
  assert sections.Env().sandbox == {"cpu_seconds": 1, "wall_seconds": 3.0}


@pytest.mark.parametrize(
  "mesh,devices,processes,ok",
  [
    ("expert:2,tensor:2", 8, 1, True),
    ("data:-1,tensor:2", 8, 1, True),
    ("data:16", 8, 1, False),
    ("data:-1,tensor:3", 8, 1, False),
    ("expert:2,tensor:2", 128, 32, True),  # a v5p-256 run: 4 chips a host
    ("data:8", 128, 32, False),
  ],
)
def test_validate_refuses_an_engine_mesh_larger_than_a_host(mesh, devices, processes, ok):
  c = load_config_module("sao_tiny.py").get_config()
  c.rollout.mesh = mesh
  c.rl.mode, c.rl.steps = "fleet", 1  # a multi-process run needs the fleet
  c.sharding.mesh = {"data": -1}
  if ok:
    configuration.validate(c, num_devices=devices, num_processes=processes)
  else:
    with pytest.raises(sections.ConfigError, match=r"rollout.mesh = .*devices of one host"):
      configuration.validate(c, num_devices=devices, num_processes=processes)


def test_compile_checks_the_engine_mesh_against_the_rollout_slice():
  c = load_config_module("sao_tiny.py").get_config()
  c.rollout.mesh = "data:8"
  configuration.validate(c, num_devices=4, host_devices=8)  # a rollout slice of 8
  with pytest.raises(sections.ConfigError, match="devices of one host"):
    configuration.validate(c, num_devices=4)
